"""What every HTTP request passes before a route: the API key, the body size limit and the in-flight count the
drain waits on. Plain ASGI (not Starlette's BaseHTTPMiddleware), so streaming and disconnects pass through
untouched.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ddtree.api.protocol import APIError
from ddtree.api.state import ServerState

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Paths that do work for a client (and so need the key and count as in flight); probes, /metrics and /version
# stay open, as a kubelet and a Prometheus scraper have no key.
API_PATHS = ("/v1/", "/tokenize", "/detokenize")
DOCS_PATHS = ("/docs", "/redoc", "/openapi.json")


class ApiKey:
    """`Authorization: Bearer KEY` on the API and the docs (which describe it), the scheme matched without
    regard to case (RFC 9110); a 401 says how to authenticate (`WWW-Authenticate: Bearer`)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(API_PATHS + DOCS_PATHS):
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.strip().partition(b" ")
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)):
                error = APIError(401, "Invalid or missing API key: send `Authorization: Bearer <key>`.",
                                 code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuse request bodies over `max_bytes` with a 413 before reading them (by Content-Length) or as soon as
    a chunked upload passes the limit: a client cannot make the server buffer or parse more than that."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> APIError:
        return APIError(413, f"The request body is larger than this server accepts ({self.max_bytes} bytes, "
                        "--max-request-bytes).", code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._too_large().response()(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await self._too_large().response()(scope, receive, send)


class _TooLarge(Exception):
    """A chunked body passed the limit while a route was reading it."""


class InFlight:
    """Counts the API requests being served, from the first byte of the body to the last of the reply, in
    `state.in_flight`: the drain waits for it to reach zero before the server stops listening."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(API_PATHS):
            await self.app(scope, receive, send)
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1
