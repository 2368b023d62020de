"""bench-serve's HTTP client against a scripted HTTP/1.1 server on loopback: bodies chunked, sized and to the end of
the connection; kept-alive connections reused; a pooled connection the server closed replaced; a stream timed out."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest
from ddtree.bench.http_client import Client, HTTPError
from ddtree.bench.serve_load import stream_request


def chunked(*pieces: bytes) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    return b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n" + body


def sized(status: int, body: bytes, close: bool = False) -> bytes:
    head = f"HTTP/1.1 {status} X\r\ncontent-length: {len(body)}\r\n" + ("connection: close\r\n" if close else "")
    return head.encode() + b"\r\n" + body


def sse(*events: dict | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


class Scripted:
    """Replies in order, one per request on any connection; `after(reply_index)` may close the connection."""

    def __init__(self, replies: list[bytes], close_after: Callable[[int], bool] = lambda i: False,
                 delay: float = 0.0) -> None:
        self.replies, self.close_after, self.delay = replies, close_after, delay
        self.requests: list[tuple[bytes, bytes]] = []  # (request line and headers, body)
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length")), 0)
                self.requests.append((head, await reader.readexactly(length)))
                index = len(self.requests) - 1
                await asyncio.sleep(self.delay)
                writer.write(self.replies[index])
                await writer.drain()
                if self.close_after(index):
                    break
        except asyncio.IncompleteReadError:
            pass
        writer.close()

    def run(self, test: Callable[[str], object]) -> object:
        async def main():
            server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            async with server:
                return await test(f"http://127.0.0.1:{port}")
        return asyncio.run(main())


def test_streams_read_line_by_line_on_one_kept_alive_connection():
    """Two streamed requests, chunks cut mid-line: the same events come out, both over one connection, and the
    request carries its JSON body, the path under the base URL and the caller's headers."""
    stream = sse({"choices": [{"text": "a"}]}, {"choices": [{"text": "b c"}]}, "[DONE]")
    pieces = [stream[:7], stream[7:40], stream[40:]]
    server = Scripted([chunked(*pieces), chunked(*pieces)])

    async def test(url):
        async with Client(url + "/prefix") as client:
            out = []
            for _ in range(2):
                async with client.request("POST", "/v1/completions", {"prompt": "hi"}, {"X-Key": "k"}) as reply:
                    assert reply.status == 200
                    out.append([line async for line in reply.lines()])
            return out

    first, second = server.run(test)
    assert first == second == stream.decode().split("\n")[:-1]
    assert server.connections == 1
    head, body = server.requests[0]
    assert head.startswith(b"POST /prefix/v1/completions HTTP/1.1\r\n") and b"X-Key: k\r\n" in head
    assert json.loads(body) == {"prompt": "hi"}


def test_sized_bodies_and_a_connection_the_server_closes():
    """A sized reply reads whole; after `connection: close` the next request opens a new connection."""
    server = Scripted([sized(404, b'{"error": "no"}', close=True), sized(200, b"ok")], close_after=lambda i: i == 0)

    async def test(url):
        async with Client(url) as client:
            return [await client.get("/a"), await client.get("/b")]

    assert server.run(test) == [(404, b'{"error": "no"}'), (200, b"ok")]
    assert server.connections == 2


def test_a_pooled_connection_closed_while_idle_is_replaced_once():
    """The server drops a kept-alive connection after its reply (as one does after its keep-alive timeout): the
    next request, which finds it in the pool, goes out again on a new connection and succeeds."""
    server = Scripted([sized(200, b"one"), sized(200, b"two")], close_after=lambda i: True)

    async def test(url):
        async with Client(url) as client:
            first = await client.get("/")
            await asyncio.sleep(0.05)  # the server's close reaches the client
            return first, await client.get("/")

    assert server.run(test) == ((200, b"one"), (200, b"two"))
    assert server.connections == 2


def test_a_body_cut_short_and_a_reply_that_is_not_http_are_errors():
    server = Scripted([b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc", b"SSH-2.0-x\r\n\r\n"],
                      close_after=lambda i: True)

    async def test(url):
        errors = []
        for _ in range(2):
            async with Client(url) as client:
                try:
                    await client.get("/")
                except HTTPError as exc:
                    errors.append(str(exc))
        return errors

    assert server.run(test) == ["the connection closed before the body's end",
                                "not an HTTP/1.x reply: b'SSH-2.0-x\\r\\n'"]


@pytest.mark.parametrize("delay", [0.0, 0.5])
def test_stream_request_counts_text_chunks_and_fails_an_error_event_or_a_timeout(delay):
    """Other servers: no usage chunk (the text chunks are counted instead); an error event mid-stream (a drain that
    ran out, say) fails the request with the server's message; a reply slower than the timeout fails it too."""
    server = Scripted([chunked(sse({"choices": [{"text": "a"}]}, {"choices": [{"text": ""}]},
                                   {"choices": [{"text": "b c"}]}, "[DONE]")),
                       chunked(sse({"choices": [{"text": "a"}]}, {"error": {"message": "The server shut down"}},
                                   "[DONE]"))], delay=delay)

    async def test(url):
        async with Client(url) as client:
            return [await stream_request(client, "/v1/completions", {}, {}, timeout=0.25) for _ in range(2)]

    counted, failed = server.run(test)
    if delay:
        assert (counted.ok, counted.error) == (False, "no reply within 0.25 s")
        return
    assert counted.ok and counted.output_tokens == 2 and counted.prompt_tokens is None and len(counted.itl) == 1
    assert 0 < counted.ttft <= counted.e2e
    assert not failed.ok and failed.error == "error event: The server shut down"


def test_only_http_urls():
    with pytest.raises(ValueError, match="not an http:// or https:// URL: ftp://x"):
        Client("ftp://x")
