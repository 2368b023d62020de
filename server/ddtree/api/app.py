"""The OpenAI-compatible HTTP API: the FastAPI app, its routes, the API key and the error handlers.

Shaped like vLLM's and SGLang's OpenAI servers so their clients and benchmarks work unchanged: one engine, one
served model. A request flows protocol.py (parse) -> prepare.py (validate, build engine work) -> serving.py (run
through the scheduler, format the reply); state.py holds what they share.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ddtree import __version__
from ddtree.api.prepare import (
    Prepared,
    chat_prompt_ids,
    check_model,
    check_token_ids,
    choice_params,
    prepare_chat,
    prepare_completion,
)
from ddtree.api.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    validation_error,
)
from ddtree.api.scheduler import Draining, QueueFull
from ddtree.api.scheduler import Request as EngineRequest
from ddtree.api.serving import Call, LogprobFormatter, choice_outputs, complete_reply, stream_reply
from ddtree.api.state import ServerConfig, ServerState

log = logging.getLogger("ddtree.server")





# --------------------------------------------------------------------------------------------------------
# The app


class _ApiKeyMiddleware:
    """Bearer-token check on /v1 and the tokenizer utilities (plain ASGI, so streaming and disconnects pass
    through untouched); probes, /metrics and /version stay open."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(("/v1", "/tokenize", "/detokenize")):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "Invalid or missing API key: send `Authorization: Bearer <key>`.",
                                 code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(load_engine: Callable[[], Any], config: ServerConfig | None = None,
               on_load_error: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The ASGI app. The engine loads in a thread at startup: /health answers at once, /ready when loaded."""
    state = ServerState(config or ServerConfig())

    def load() -> None:
        try:
            state.load(load_engine)
        except BaseException as exc:
            state.load_error = str(exc)
            log.error("could not load the model: %s", exc)
            if on_load_error is not None:
                on_load_error(exc)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        threading.Thread(target=load, name="ddtree-load", daemon=True).start()
        yield
        state.draining = True
        if state.scheduler is not None:
            await asyncio.to_thread(state.scheduler.shutdown, state.config.drain_timeout)

    app = FastAPI(title="ddtree", version=__version__, lifespan=lifespan)
    app.state.ddtree = state
    if state.config.api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=state.config.api_key)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

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
        """Liveness: the process is up (the model may still be loading)."""
        return Response(status_code=200)

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

    async def serve(http: Request, kind: Literal["chat", "completion"], body, prepared: Prepared) -> Response:
        scheduler = state.require_ready()
        requests = [EngineRequest(prepared.prompt_ids, choice_params(prepared.params, i), stop=prepared.stop,
                                  include_stop_str=body.include_stop_str_in_output,
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
        call = Call(kind, requests, body, prepared, state.model_name, LogprobFormatter(state.engine.decode))
        outputs = choice_outputs(scheduler, http, requests)
        if body.stream:
            return StreamingResponse(stream_reply(call, outputs), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await complete_reply(call, outputs)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Response:
        state.require_ready()
        return await serve(http, "chat", body, prepare_chat(state, body))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request) -> Response:
        state.require_ready()
        return await serve(http, "completion", body, prepare_completion(state, body))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        """The prompt ids /v1/completions (prompt) or /v1/chat/completions (messages) would decode from."""
        state.require_ready()
        check_model(state, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("Send exactly one of prompt and messages.", "prompt")
        if body.messages is not None:
            ids = chat_prompt_ids(state, body)[0]
        elif state.engine.tokenizer is None:
            raise bad_request("This model has no tokenizer.", "prompt")
        else:
            ids = state.engine.encode(body.prompt)
        return {"count": len(ids), "max_model_len": state.engine.max_context, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        state.require_ready()
        check_model(state, body.model)
        check_token_ids(body.tokens, state.engine.vocab_size, "tokens", "tokens")
        return {"prompt": state.engine.decode(body.tokens)}

    return app
