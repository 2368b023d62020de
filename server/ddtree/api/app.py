"""The OpenAI-compatible HTTP API: the FastAPI app, its routes and the error handlers.

Shaped like vLLM's and SGLang's OpenAI servers so their clients and benchmarks work unchanged: one engine, one
served model. A request passes middleware.py (API key, body limit, in-flight count), then flows protocol.py
(parse) -> prepare.py (validate, build engine work; both in a worker pool, off the event loop) -> serving.py
(run through the scheduler, format the reply); state.py holds what they share.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from ddtree import __version__
from ddtree.api.config import ServerConfig
from ddtree.api.middleware import ApiKey, BodyLimit, InFlight
from ddtree.api.prepare import (
    Prepared,
    chat_request,
    choice_params,
    completion_request,
    detokenize_reply,
    tokenize_reply,
)
from ddtree.api.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
)
from ddtree.api.scheduler import Draining, QueueFull, Scheduler
from ddtree.api.scheduler import Request as EngineRequest
from ddtree.api.serving import Call, LogprobFormatter, choice_outputs, complete_reply, stream_reply
from ddtree.api.state import ServerState

log = logging.getLogger("ddtree.server")

BODIES = (ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest)


def _json_body(model: type) -> dict[str, Any]:
    """The OpenAPI request body of a route that parses its own JSON (off the event loop)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


async def _raw_json(http: Request) -> bytes:
    """The body of a JSON request, unparsed (it is parsed in the worker pool); the content type is checked as
    FastAPI checks it: none, application/json or application/*+json."""
    kind = http.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind and kind != "application/json" and not (kind.startswith("application/") and kind.endswith("+json")):
        raise bad_request("The request body must be a JSON object (sent with Content-Type: application/json).")
    return await http.body()


def create_app(load_engine: Callable[[], Any], config: ServerConfig | None = None,
               on_load_error: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The ASGI app. The engine loads in a thread at startup: /health answers at once, /ready when loaded."""
    state = ServerState(config or ServerConfig())

    def load(loop: asyncio.AbstractEventLoop) -> None:
        try:
            state.load(load_engine, loop)
        except BaseException as exc:
            state.load_error = str(exc)
            log.error("could not load the model: %s", exc)
            if on_load_error is not None:
                on_load_error(exc)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=load, args=(asyncio.get_running_loop(),), name="ddtree-load", daemon=True).start()
        yield
        await state.drain()  # at once when `ddtree serve` already drained on SIGTERM
        await asyncio.to_thread(state.close)

    docs = state.config.docs
    app = FastAPI(title="ddtree", version=__version__, lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)
    app.state.ddtree = state
    app.add_middleware(BodyLimit, max_bytes=state.config.max_request_bytes)
    if state.config.api_key:
        app.add_middleware(ApiKey, api_key=state.config.api_key)
    app.add_middleware(InFlight, state=state)

    def openapi() -> dict[str, Any]:
        """FastAPI's schema plus the request bodies the routes parse themselves."""
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            _, defs = models_json_schema([(m, "validation") for m in BODIES],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
        return app.openapi_schema

    app.openapi = openapi

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind, code=exc.status_code).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return APIError(500, f"Internal server error: {exc}", type="internal_error").response()

    @app.get("/health")
    async def health() -> Response:
        """Liveness: the process is up (the model may still be loading, or the server draining), and so is its
        engine process: without it the server can never serve again, so it asks to be restarted."""
        return Response(status_code=503 if state.engine_failed else 200)

    @app.get("/ready")
    async def ready() -> Response:
        """Readiness: the model is loaded and the server is not draining."""
        state.require_ready()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.metrics is None:
            raise APIError(503, "The model is still loading.", type="service_unavailable")
        return Response(state.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict:
        state.require_ready()
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "ddtree", "max_model_len": state.engine.max_context}]}

    async def serve(http: Request, scheduler: Scheduler, kind: Literal["chat", "completion"], body,
                    prepared: Prepared) -> Response:
        """Queue a prepared request's choices (all or none) and reply, whole or streamed. Requests that were
        already in flight when a drain began are still served: only new ones were refused (require_ready)."""
        requests = [EngineRequest(prepared.prompt_ids, choice_params(prepared.params, i), stop=prepared.stop,
                                  include_stop_str=body.include_stop_str_in_output, cache_salt=body.cache_salt,
                                  client=body.user or (http.client.host if http.client else ""))
                    for i in range(body.n)]
        try:
            for request in requests:
                scheduler.submit(request)
        except (QueueFull, Draining) as exc:
            for request in requests:  # all n choices or none
                scheduler.cancel(request)
            if isinstance(exc, Draining):
                raise APIError(503, "The server is shutting down.", type="service_unavailable") from None
            raise APIError(429, "The server is at capacity; retry later.", type="rate_limit_error",
                           headers={"Retry-After": str(exc.retry_after)}) from None
        call = Call(kind, requests, body, prepared, state.model_name, LogprobFormatter(state.engine.decode),
                    scheduler.metrics)
        outputs = choice_outputs(scheduler, http, requests)
        if body.stream:
            return StreamingResponse(stream_reply(call, outputs), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await complete_reply(call, outputs)

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest))
    async def chat_completions(http: Request) -> Response:
        scheduler = state.require_ready()
        body, prepared = await state.prepare(chat_request, await _raw_json(http))
        return await serve(http, scheduler, "chat", body, prepared)

    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest))
    async def completions(http: Request) -> Response:
        scheduler = state.require_ready()
        body, prepared = await state.prepare(completion_request, await _raw_json(http))
        return await serve(http, scheduler, "completion", body, prepared)

    @app.post("/tokenize", openapi_extra=_json_body(TokenizeRequest))
    async def tokenize(http: Request) -> Response:
        """The prompt ids /v1/completions (prompt) or /v1/chat/completions (messages) would decode from."""
        state.require_ready()
        return await state.prepare(tokenize_reply, await _raw_json(http))

    @app.post("/detokenize", openapi_extra=_json_body(DetokenizeRequest))
    async def detokenize(http: Request) -> Response:
        state.require_ready()
        return await state.prepare(detokenize_reply, await _raw_json(http))

    return app
