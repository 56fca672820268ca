"""The gateway's upstream HTTP client (`gateway._http`) against a raw HTTP server over real TCP sockets:
keep-alive reuse, chunked and close-delimited bodies, streaming as it arrives, flow control, the pool
limit, retries of requests whose idle connection the server had closed, deadlines and broken answers."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import uvloop

from gateway._http import Client, HTTPError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes], Awaitable[bool]]


class Server:
    """Reads requests one at a time; `handler(reader, writer, body)` answers and returns whether the
    connection stays open."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.active = 0
        self.max_active = 0
        self.requests: list[bytes] = []
        self.disconnects = 0

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                self.active += 1
                self.max_active = max(self.max_active, self.active)
                try:
                    keep = await self.handler(reader, writer, body)
                except ConnectionError:
                    return
                finally:
                    self.active -= 1
                if not keep:
                    return
        finally:
            self.disconnects += 1
            writer.close()


@asynccontextmanager
async def serving(handler: Handler, **options: Any) -> AsyncIterator[tuple[Server, Client]]:
    """A `Server` answering with `handler` and a `Client` of it (with `options`), closed after."""
    async with Server(handler) as server:
        client = Client(server.url, **options)
        try:
            yield server, client
        finally:
            await client.aclose()


def on_uvloop(test: Callable[[], Awaitable[None]]) -> Callable[[], None]:
    """Runs an async test on uvloop, the gateway's event loop."""

    @functools.wraps(test)
    def run() -> None:
        uvloop.run(test())

    return run


def fixed(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body


def answer(data: bytes, keep: bool = True, delay: float = 0.0) -> Handler:
    """A handler that answers every request with `data` (after `delay`), then keeps the connection or not."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> bool:
        if delay:
            await asyncio.sleep(delay)
        writer.write(data)
        await writer.drain()
        return keep

    return handler


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> bool:
    writer.write(fixed(b"echo:" + body))
    await writer.drain()
    return True


@on_uvloop
async def test_keep_alive_reuses_one_connection_and_sends_one_well_formed_request():
    async with serving(echo, headers={"Authorization": "Bearer k"}) as (server, client):
        for i in range(5):
            async with client.request("POST", "/chat/completions", b'{"i": %d}' % i) as response:
                assert response.status == 200
                assert await response.read() == b'echo:{"i": %d}' % i
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer k\r\n" in first and b"\r\nContent-Length: 8\r\n" in first
    assert b"\r\nHost: 127.0.0.1:" in first


@on_uvloop
async def test_chunked_stream_arrives_before_the_answer_ends():
    release = asyncio.Event()

    async def stream(reader, writer, body):
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        writer.write(b"7\r\ndata: 1\r\n")
        await writer.drain()
        await release.wait()
        writer.write(b"7\r\ndata: 2\r\n0\r\n\r\n")
        await writer.drain()
        return True

    async with serving(stream) as (server, client):
        async with client.request("POST", "/completions", b"{}") as response:
            assert response.headers["content-type"] == "text/event-stream"
            chunks = response.chunks()
            assert await chunks.__anext__() == b"data: 1"  # while the server still holds the rest
            release.set()
            assert [c async for c in chunks] == [b"data: 2"]
        assert client.idle_connections == 1  # read to its end: back in the pool


@on_uvloop
async def test_connection_close_and_close_delimited_bodies():
    async with Server(
        answer(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end", keep=False)
    ) as server:
        client = Client(server.url)
        for _ in range(2):
            async with client.request("GET", "/models") as response:
                assert await response.read() == b"until the end"
        await client.aclose()
    assert server.connections == 2  # `Connection: close` is never reused


@on_uvloop
async def test_an_idle_connection_the_server_closed_is_replaced_and_the_request_sent_once():
    # closes the connection after each answer, the way an idle keep-alive expires
    async with serving(answer(fixed(b"ok"), keep=False)) as (server, client):
        async with client.request("POST", "/completions", b"{}") as response:
            assert await response.read() == b"ok"
        await asyncio.sleep(0.05)  # the close reaches the client, which drops the connection
        async with client.request("POST", "/completions", b"{}") as response:
            assert await response.read() == b"ok"
    assert server.connections == 2 and len(server.requests) == 2


@on_uvloop
async def test_a_reused_connection_closed_without_an_answer_is_retried_once_on_a_new_one():
    served = 0

    async def drop_second(reader, writer, body):
        nonlocal served
        served += 1
        if served == 2:
            return False  # read the request, close without answering (as if it expired at that moment)
        writer.write(fixed(b"ok"))
        await writer.drain()
        return True

    async with serving(drop_second) as (server, client):
        for _ in range(2):
            async with client.request("POST", "/completions", b"{}") as response:
                assert await response.read() == b"ok"
    assert served == 3 and server.connections == 2


@on_uvloop
async def test_a_fresh_connection_closed_without_an_answer_is_an_error():
    async def drop(reader, writer, body):
        return False

    async with serving(drop) as (server, client):
        with pytest.raises(HTTPError, match="closed the connection"):
            async with client.request("POST", "/completions", b"{}"):
                pass
        assert client.open_connections == 0
    assert len(server.requests) == 1  # never sent twice


@on_uvloop
async def test_deadline_covers_headers_and_body_and_frees_the_connection():
    async def hang(reader, writer, body):
        if body == b"headers":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
            await writer.drain()
        await asyncio.sleep(10)
        return True

    async with serving(hang, timeout_s=0.2) as (server, client):
        loop = asyncio.get_running_loop()
        t = loop.time()
        with pytest.raises(TimeoutError):
            async with client.request("POST", "/completions", b"nothing"):
                pass
        assert 0.15 < loop.time() - t < 1.0
        with pytest.raises(TimeoutError):
            async with client.request("POST", "/completions", b"headers") as response:
                assert response.status == 200
                await response.read()
        assert client.open_connections == 0 and client.idle_connections == 0


@on_uvloop
async def test_pool_limit_queues_requests_and_every_one_is_answered():
    async def slow(reader, writer, body):
        await asyncio.sleep(0.02)
        writer.write(fixed(body))
        await writer.drain()
        return True

    async with serving(slow, limit=2) as (server, client):

        async def one(i: int) -> bytes:
            async with client.request("POST", "/completions", str(i).encode()) as response:
                return await response.read()

        assert await asyncio.gather(*(one(i) for i in range(10))) == [str(i).encode() for i in range(10)]
        assert client.open_connections <= 2
    assert server.max_active == 2 and server.connections == 2


@on_uvloop
async def test_a_response_left_unread_closes_its_connection():
    async def endless(reader, writer, body):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(200):
            writer.write(b"5\r\nchunk\r\n")
            await writer.drain()
            await asyncio.sleep(0.005)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    async with serving(endless) as (server, client):
        async with client.request("POST", "/completions", b"{}") as response:
            async for _ in response.chunks():
                break  # the consumer leaves (an agent hung up)
        assert client.open_connections == 0 and client.idle_connections == 0
        await asyncio.sleep(0.1)
        assert server.disconnects == 1  # the server sees the hang-up and can abort the request


@on_uvloop
async def test_a_slow_consumer_pauses_reading_and_gets_every_byte():
    payload = bytes(range(256)) * 4096 * 4  # 4 MiB

    async with serving(answer(fixed(payload))) as (server, client):
        received = bytearray()
        paused = False
        async with client.request("GET", "/big") as response:
            async for data in response.chunks():
                received += data
                await asyncio.sleep(0.01)
                paused = paused or response._conn.reading_paused  # the socket filled our buffer meanwhile
        assert bytes(received) == payload
        assert paused


@on_uvloop
async def test_broken_answers_are_errors():
    garbage = answer(b"this is not HTTP\r\n\r\n")
    short = answer(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this", keep=False)
    for handler, match in ((garbage, "malformed"), (short, "closed the connection")):
        async with serving(handler) as (server, client):
            with pytest.raises(HTTPError, match=match):
                async with client.request("POST", "/completions", b"{}") as response:
                    await response.read()


@on_uvloop
async def test_nothing_listening_is_an_error():
    async with Server(echo) as server:
        url = server.url
    client = Client(url, connect_timeout_s=1.0)
    with pytest.raises(HTTPError, match="cannot connect"):
        async with client.request("GET", "/models"):
            pass
    assert client.open_connections == 0
    await client.aclose()


@on_uvloop
async def test_a_large_body_read_whole_never_stalls():
    payload = b"x" * (3 << 20)  # far above the read-pausing mark, read with read()

    async with serving(answer(fixed(payload)), timeout_s=5) as (server, client):
        async with client.request("POST", "/chat/completions", b"{}") as response:
            assert await response.read() == payload


@on_uvloop
async def test_the_deadline_covers_waiting_for_a_connection():
    async with serving(answer(fixed(b"ok"), delay=1.0), limit=1) as (server, client):
        holder = asyncio.create_task(_get(client))
        await asyncio.sleep(0.1)
        loop = asyncio.get_running_loop()
        t = loop.time()
        with pytest.raises(TimeoutError):
            async with client.request("GET", "/x", timeout_s=0.3):
                pass
        assert loop.time() - t < 0.8  # not until the holder is done
        assert await holder == b"ok"
        assert await _get(client) == b"ok"  # and the pool is whole


@on_uvloop
async def test_a_connection_closed_before_its_release_is_not_handed_on():
    async with serving(answer(fixed(b"ok"), delay=0.05), limit=1) as (server, client):

        async def holder():
            async with client.request("GET", "/x") as response:
                body = await response.read()
                response._conn.transport.close()  # the connection dies as the request ends
                return body

        first = asyncio.create_task(holder())
        await asyncio.sleep(0.01)
        waiting = asyncio.create_task(_get(client))
        assert await first == b"ok"
        assert await asyncio.wait_for(waiting, 5) == b"ok"
        assert client.open_connections == 1


@on_uvloop
async def test_a_cancelled_waiter_passes_its_turn_on():
    async with serving(answer(fixed(b"ok"), delay=0.2), limit=1) as (server, client):
        first = asyncio.create_task(_get(client))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(_get(client))
        third = asyncio.create_task(_get(client))
        await asyncio.sleep(0.05)
        first.cancel()  # its connection is closed: the slot goes to `second`, which is cancelled too
        await asyncio.sleep(0)
        second.cancel()
        assert await asyncio.wait_for(third, 5) == b"ok"


async def _get(client: Client) -> bytes:
    async with client.request("GET", "/x") as response:
        return await response.read()


@pytest.mark.parametrize(
    ("environment", "url", "named"),
    [
        ({}, "http://vllm:8000/v1", None),
        ({"http_proxy": "http://p:3128"}, "http://vllm:8000/v1", "http_proxy"),
        ({"HTTP_PROXY": "http://p:3128"}, "http://vllm:8000/v1", "HTTP_PROXY"),
        ({"HTTPS_PROXY": "http://p:3128"}, "http://vllm:8000/v1", None),  # another scheme's
        ({"HTTPS_PROXY": "http://p:3128"}, "https://api.example.com/v1", "HTTPS_PROXY"),
        ({"ALL_PROXY": "http://p:3128"}, "http://vllm:8000/v1", "ALL_PROXY"),
        ({"HTTP_PROXY": "http://p:3128", "NO_PROXY": "vllm"}, "http://vllm:8000/v1", None),
        ({"HTTP_PROXY": "http://p:3128", "NO_PROXY": "vllm:8000"}, "http://vllm:8000/v1", None),
        ({"HTTP_PROXY": "http://p:3128", "NO_PROXY": "*"}, "http://vllm:8000/v1", None),
        ({"HTTP_PROXY": "http://p:3128", "NO_PROXY": ".internal"}, "http://gpu.internal:8000/v1", None),
    ],
)
def test_the_client_names_a_proxy_that_would_apply_to_its_origin(monkeypatch, environment, url, named):
    """The client never goes through a proxy; `ignored_proxy` names the variable that would have sent its
    origin through one (the gateway says so at start), as urllib reads them, NO_PROXY included."""
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert Client(url).ignored_proxy == named
