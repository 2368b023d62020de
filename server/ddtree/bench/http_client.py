"""bench-serve's HTTP client: HTTP/1.1 over asyncio streams, with a pool of kept-alive connections.

bench-serve times each request on the client, from just before it is sent, so the client's own work counts in
every TTFT. A general-purpose client's per-request machinery (request and response objects, pool locks, decoders)
cost about a millisecond of a lone request's ~2.5 ms on a 2-core CPU against this one (benchmarks/RESULTS.md);
`vllm bench serve` uses a lean client for the same reason. This one does only what a load generator needs: GET
and POST with a JSON body, the status, and the body whole or line by line as it arrives (chunked or sized), over
http:// or https://. It needs nothing beyond the standard library, so bench-serve runs wherever ddtree is installed.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit


class HTTPError(Exception):
    """A reply this client cannot read (not HTTP/1.x, a broken chunk, a body cut short)."""


# What a request may fail with on the way: a refused or reset socket, a reply that is not HTTP or has a line over
# the reader's limit (ValueError), a peer that closes mid-body.
HTTP_ERRORS = (OSError, asyncio.IncompleteReadError, ValueError, HTTPError)


class Response:
    """A reply's status and headers; its body is read once, whole (`read`) or line by line (`lines`)."""

    def __init__(self, status: int, headers: dict[str, str], reader: asyncio.StreamReader) -> None:
        self.status, self.headers, self._reader = status, headers, reader
        self.chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        length = headers.get("content-length")
        self._left = int(length) if length is not None and not self.chunked else None  # None: chunked or to EOF
        self.complete = False  # the whole body has been read (the connection may serve another request)

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives, chunk by chunk."""
        reader = self._reader
        if self.chunked:
            while True:
                size_line = await reader.readline()
                try:
                    size = int(size_line.split(b";", 1)[0], 16)
                except ValueError:
                    raise HTTPError(f"a broken chunk header: {size_line[:40]!r}") from None
                if size == 0:
                    while (await reader.readline()) not in (b"\r\n", b"\n", b""):  # trailers, then the blank line
                        pass
                    break
                piece = await reader.readexactly(size + 2)
                yield piece[:-2]
        elif self._left is not None:
            while self._left > 0:
                piece = await reader.read(min(self._left, 1 << 16))
                if not piece:
                    raise HTTPError("the connection closed before the body's end")
                self._left -= len(piece)
                yield piece
        else:  # no length: the body runs to the end of the connection
            while piece := await reader.read(1 << 16):
                yield piece
        self.complete = True

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.pieces()])

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines as they arrive, without their line ends."""
        pending = b""
        async for piece in self.pieces():
            pending += piece
            *whole, pending = pending.split(b"\n")
            for line in whole:
                yield line.rstrip(b"\r").decode("utf-8", "replace")
        if pending:
            yield pending.rstrip(b"\r").decode("utf-8", "replace")


class Client:
    """Requests to one server (`base_url`'s scheme, host and port), each on a connection from the pool of idle
    ones or a new one; a connection goes back to the pool once its reply has been read to the end."""

    def __init__(self, base_url: str, connect_timeout: float = 10.0) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http:// or https:// URL: {base_url}")
        self.host, self.tls = parts.hostname, parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        self.authority = parts.netloc.rsplit("@", 1)[-1]
        self.prefix = parts.path.rstrip("/")
        self.connect_timeout = connect_timeout
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for _, writer in idle:
            writer.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @asynccontextmanager
    async def request(self, method: str, path: str, body: dict | None = None,
                      headers: dict[str, str] | None = None) -> AsyncIterator[Response]:
        """Send one request and give its reply (status and headers read; the body is the caller's to read). A
        pooled connection the server has since closed is replaced by a new one, once."""
        payload = b"" if body is None else json.dumps(body).encode()
        head = [f"{method} {self.prefix}{path} HTTP/1.1", f"Host: {self.authority}", "Accept: */*"]
        if body is not None:
            head += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
        head += [f"{name}: {value}" for name, value in (headers or {}).items()]
        message = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + payload
        while True:
            reused = bool(self._idle)
            reader, writer = self._idle.pop() if reused else await self._connect()
            try:
                writer.write(message)
                status, reply_headers = await _read_head(reader)
            except BaseException as exc:  # a failure, or cancelled (a timeout): this connection is done
                writer.close()
                if reused and isinstance(exc, HTTP_ERRORS):  # the server closed it while it sat idle: again
                    continue
                raise
            break
        response = Response(status, reply_headers, reader)
        try:
            yield response
        finally:
            keep = response.complete and reply_headers.get("connection", "").lower() != "close"
            if keep:
                self._idle.append((reader, writer))
            else:
                writer.close()

    async def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        async with self.request("GET", path, headers=headers) as response:
            return response.status, await response.read()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        context = ssl.create_default_context() if self.tls else None
        return await asyncio.wait_for(asyncio.open_connection(self.host, self.port, ssl=context,
                                                              limit=1 << 20), self.connect_timeout)


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status line and headers of a reply (header names lower-cased)."""
    line = await reader.readline()
    if not line:
        raise HTTPError("the server closed the connection without a reply")
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise HTTPError(f"not an HTTP/1.x reply: {line[:60]!r}")
    status = int(parts[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n"):
        if not line:
            raise HTTPError("the connection closed inside the reply's headers")
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if status == 100:  # "Continue": the real reply follows
        return await _read_head(reader)
    return status, headers
