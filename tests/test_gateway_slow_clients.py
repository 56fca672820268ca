"""Slow and malicious clients against the gateway as a real process: hundreds of sockets that send half a
request line, half their headers, a body that never ends, or nothing, on the agent and the control port,
are each closed once their deadline is past, while an agent's calls keep getting 200; oversized headers are
refused; above the connection cap, waiting sockets make room and requests in service are never cut."""

from __future__ import annotations

import os
import resource
import selectors
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
from conftest import Proc, free_port, gateway_fixture, start_gateway
from test_gateway_proxy import MESSAGES, MODEL

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 2.0
MARGIN_S = 15.0  # a loaded machine may close late
EARLY = 0.5  # and a little early: the server's clock is read once per turn of its event loop
PATH = "/rollouts/{}/v1/chat/completions"
HEADERS = b"Host: gw\r\nContent-Type: application/json\r\n"

# what each kind of slow socket sends before it stalls (to a route that reads a body), and the deadline
# that must close it
SLOW = {
    "nothing": (b"", HEADER_TIMEOUT_S),
    "half a request line": (b"POST {path}", HEADER_TIMEOUT_S),
    "half the headers": (b"POST {path} HTTP/1.1\r\n" + HEADERS + b"Content-Le", HEADER_TIMEOUT_S),
    "a body that never ends": (
        b"POST {path} HTTP/1.1\r\n" + HEADERS + b"Content-Length: 1000\r\n\r\n" + b'{"model": "fake-',
        BODY_TIMEOUT_S,
    ),
}
AGENT_PATH, CONTROL_PATH = PATH.format("slow").encode(), b"/rollouts"


@pytest.fixture(scope="module", autouse=True)
def open_files() -> Iterator[None]:
    """Room for a few hundred sockets in this process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4096 if hard == resource.RLIM_INFINITY else min(4096, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture(scope="module")
def deadlines_gateway(
    fake_vllm: Proc, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Proc, str]]:
    """(gateway, control URL): short deadlines, default header limit and cap, a control port."""
    control_port = free_port()
    proc = start_gateway(
        tmp_path_factory.mktemp("slow_gateway"),
        fake_vllm.url,
        control_port=str(control_port),
        header_timeout_s=str(HEADER_TIMEOUT_S),
        body_timeout_s=str(BODY_TIMEOUT_S),
        body_min_bytes_per_s="4096",
    )
    yield proc, f"http://127.0.0.1:{control_port}"
    proc.kill(signal.SIGTERM)


def chat(client: httpx.Client, base: str) -> httpx.Response:
    return client.post(
        f"{base}{PATH.format(uuid.uuid4().hex)}",
        timeout=30,
        json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4},
    )


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def full_request(rid: str, extra_headers: bytes = b"") -> bytes:
    """A whole chat call, in bytes."""
    body = (
        b'{"model": "%s", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}' % MODEL.encode()
    )
    return (
        b"POST "
        + PATH.format(rid).encode()
        + b" HTTP/1.1\r\n"
        + HEADERS
        + extra_headers
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )


def read_response(sock: socket.socket, buffer: bytes = b"") -> tuple[bytes, bytes]:
    """(status line, what follows the response) of one response with a Content-Length."""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {buffer!r}"
        buffer += chunk
    head, rest = buffer.split(b"\r\n\r\n", 1)
    length = int(
        next(
            line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
        )
    )
    while len(rest) < length:
        rest += sock.recv(65536)
    return head.split(b"\r\n")[0], rest[length:]


def answer_until_closed(sock: socket.socket) -> tuple[float, bytes]:
    """(seconds until the server closed, what it sent meanwhile)."""
    start, answer = time.monotonic(), b""
    while chunk := sock.recv(65536):
        answer += chunk
    return time.monotonic() - start, answer


class SlowSockets:
    """Raw sockets that stall, watched until the server closes them."""

    def __init__(self) -> None:
        self.selector = selectors.DefaultSelector()
        self.open: dict[socket.socket, tuple[str, float, float]] = {}  # sock: (kind, sent at, deadline)
        self.closed: list[tuple[str, float, float, bytes]] = []  # (kind, seconds open, deadline, answer)
        self.answers: dict[socket.socket, bytes] = {}

    def add(self, port: int, kind: str, path: bytes = AGENT_PATH) -> socket.socket:
        data, deadline = SLOW[kind]
        data = data.replace(b"{path}", path)
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(data)
        sock.setblocking(False)
        self.selector.register(sock, selectors.EVENT_READ)
        self.open[sock] = (kind, time.monotonic(), deadline)
        self.answers[sock] = b""
        return sock

    def poll(self, timeout: float) -> None:
        for key, _ in self.selector.select(timeout):
            sock = key.fileobj
            try:
                data = sock.recv(65536)
            except (ConnectionResetError, BlockingIOError) as exc:
                if isinstance(exc, BlockingIOError):
                    continue
                data = b""
            if data:
                self.answers[sock] += data
                continue
            kind, sent, deadline = self.open.pop(sock)
            self.closed.append((kind, time.monotonic() - sent, deadline, self.answers.pop(sock)))
            self.selector.unregister(sock)
            sock.close()

    def wait_all_closed(self, within: float) -> None:
        end = time.monotonic() + within
        while self.open and time.monotonic() < end:
            self.poll(0.05)

    def close(self) -> None:
        for sock in list(self.open):
            self.selector.unregister(sock)
            sock.close()
        self.selector.close()


class Agent(threading.Thread):
    """An agent calling the gateway in a loop, on a kept-alive connection and on new ones."""

    def __init__(self, base: str) -> None:
        super().__init__(daemon=True)
        self.base, self.statuses, self.stop = base, [], threading.Event()

    def run(self) -> None:
        kept = httpx.Client()
        while not self.stop.is_set():
            try:
                self.statuses.append(chat(kept, self.base).status_code)
                with httpx.Client() as fresh:
                    self.statuses.append(chat(fresh, self.base).status_code)
            except httpx.HTTPError as exc:
                self.statuses.append(repr(exc))
            time.sleep(0.02)
        kept.close()


def test_slow_sockets_are_closed_at_their_deadline_while_agents_are_served(
    deadlines_gateway: tuple[Proc, str],
):
    gateway, control = deadlines_gateway
    slow = SlowSockets()
    agent = Agent(gateway.url)
    agent.start()
    try:
        for _ in range(60):  # 240 on the agent port, 40 on the control port
            for kind in SLOW:
                slow.add(port_of(gateway.url), kind)
        for _ in range(10):
            for kind in SLOW:
                slow.add(port_of(control), kind, CONTROL_PATH)
        slow.wait_all_closed(within=BODY_TIMEOUT_S + MARGIN_S)
        agent.stop.set()
        agent.join(30)
        # control still serves after its flood
        assert httpx.get(f"{control}/healthz", timeout=10).status_code == 200
    finally:
        agent.stop.set()
        slow.close()
    assert not slow.open, (
        f"{len(slow.open)} slow sockets still open: {sorted({k for k, *_ in slow.open.values()})}"
    )
    assert len(slow.closed) == 280
    for kind, seconds, deadline, answer in slow.closed:
        assert deadline * EARLY <= seconds <= deadline + MARGIN_S, (kind, seconds)
        if kind == "nothing":
            assert answer == b"", answer  # nothing begun: closed without an answer
        else:
            assert answer.startswith(b"HTTP/1.1 408 "), (kind, answer[:80])
    assert len(agent.statuses) >= 10 and set(agent.statuses) == {200}, agent.statuses


def test_an_upload_above_the_minimum_rate_outlasts_the_body_deadline(deadlines_gateway: tuple[Proc, str]):
    """40 KiB at ~10 KiB/s takes ~4 s, twice the body deadline: served. Below the minimum rate: closed."""
    gateway, _ = deadlines_gateway
    body = (
        b'{"model": "%s", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "pad": "'
        % MODEL.encode()
        + b"x" * 40_000
        + b'"}'
    )
    head = (
        b"POST "
        + PATH.format(uuid.uuid4().hex).encode()
        + b" HTTP/1.1\r\n"
        + HEADERS
        + b"Content-Length: %d\r\n\r\n" % len(body)
    )
    with socket.create_connection(("127.0.0.1", port_of(gateway.url)), timeout=20) as sock:
        sock.sendall(head)
        start = time.monotonic()
        for i in range(0, len(body), 1024):
            sock.sendall(body[i : i + 1024])
            time.sleep(0.1)
        assert time.monotonic() - start > 2 * BODY_TIMEOUT_S - 0.5
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]

    with socket.create_connection(("127.0.0.1", port_of(gateway.url)), timeout=20) as sock:
        sock.sendall(head)
        start = time.monotonic()
        answer = b""
        with pytest.raises((BrokenPipeError, ConnectionResetError)):  # 1 KiB/s: cut off at the deadline
            for i in range(0, len(body), 100):
                sock.sendall(body[i : i + 100])
                time.sleep(0.1)
                if time.monotonic() - start > BODY_TIMEOUT_S + MARGIN_S:
                    break
        assert time.monotonic() - start < BODY_TIMEOUT_S + MARGIN_S


def test_a_kept_alive_connection_owes_headers_from_the_first_byte_of_its_next_request(
    deadlines_gateway: tuple[Proc, str],
):
    """Idle between requests is the keep-alive's business (75 s), not the header deadline's; a next request
    begun and stalled, or stray blank lines, are. Two pipelined requests are both answered."""
    gateway, _ = deadlines_gateway
    port = port_of(gateway.url)
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(full_request(uuid.uuid4().hex) * 2)
        status, rest = read_response(sock)
        assert status.startswith(b"HTTP/1.1 200 "), status
        status, rest = read_response(sock, rest)
        assert status.startswith(b"HTTP/1.1 200 ") and rest == b"", status
        time.sleep(HEADER_TIMEOUT_S * 2)  # idle past the header deadline: still open
        sock.sendall(full_request(uuid.uuid4().hex))
        status, _ = read_response(sock)
        assert status.startswith(b"HTTP/1.1 200 "), status
        sock.sendall(full_request(uuid.uuid4().hex)[:40])  # the next request begun, then stalled
        seconds, answer = answer_until_closed(sock)
        assert HEADER_TIMEOUT_S * EARLY <= seconds <= HEADER_TIMEOUT_S + MARGIN_S
        assert answer.startswith(b"HTTP/1.1 408 "), answer
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(full_request(uuid.uuid4().hex))
        assert read_response(sock)[0].startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"\r\n")  # a blank line, which the parser skips: a request is still owed
        seconds, answer = answer_until_closed(sock)
        assert HEADER_TIMEOUT_S * EARLY <= seconds <= HEADER_TIMEOUT_S + MARGIN_S
        assert answer.startswith(b"HTTP/1.1 408 "), answer


def send_headers(port: int, pad: int) -> bytes:
    """A chat call with one `x-pad` header of `pad` bytes: the answer's first bytes, or b"" if cut off."""
    request = full_request(uuid.uuid4().hex, b"x-pad: " + b"a" * pad + b"\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        try:
            sock.sendall(request)
            return sock.recv(65536)
        except (BrokenPipeError, ConnectionResetError):
            return b""


def test_oversized_headers_are_refused(deadlines_gateway: tuple[Proc, str]):
    gateway, control = deadlines_gateway
    assert send_headers(port_of(gateway.url), 40_000).startswith(b"HTTP/1.1 200 ")  # under the 64 KiB default
    for port in (port_of(gateway.url), port_of(control)):
        answer = send_headers(port, 100_000)
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        answer = send_headers(port, 8 * 1024 * 1024)
        assert answer == b"" or answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert chat(httpx.Client(), gateway.url).status_code == 200


# at most 8 connections, long deadlines: only the cap closes anything
capped_gateway = gateway_fixture(
    "capped_gateway", max_connections="8", header_timeout_s="120", body_timeout_s="120"
)


def open_files_of(proc: Proc) -> int:
    return len(os.listdir(f"/proc/{proc.process.pid}/fd"))


def test_above_the_cap_waiting_sockets_make_room_for_agents(capped_gateway: Proc):
    port = port_of(capped_gateway.url)
    before = open_files_of(capped_gateway)
    slow = SlowSockets()
    try:
        for i in range(100):
            slow.add(port, ("nothing", "half a request line", "half the headers")[i % 3])
        slow.wait_all_closed(within=2)  # the 92 oldest are closed to make room: not all
        assert len(slow.closed) >= 90, len(slow.closed)
        assert open_files_of(capped_gateway) <= before + 8 + 2
        oldest_open = min(sent for _, sent, _ in slow.open.values())
        assert all(seconds < time.monotonic() - oldest_open for _, seconds, *_ in slow.closed)  # oldest first
        for _ in range(10):  # new connections: each takes a waiting socket's place
            with httpx.Client() as client:
                assert chat(client, capped_gateway.url).status_code == 200
        with httpx.Client() as client:
            statuses = [chat(client, capped_gateway.url).status_code for _ in range(10)]
        assert statuses == [200] * 10
    finally:
        slow.close()


def test_requests_in_service_are_never_closed_for_room(capped_gateway: Proc):
    """Eight streams in service fill the cap: a ninth connection is closed at once, the streams finish."""
    port = port_of(capped_gateway.url)
    results: list[object] = []
    started = threading.Barrier(9)

    def stream() -> None:
        body = {
            "model": MODEL,
            "messages": MESSAGES,
            "max_tokens": 16,
            "stream": True,
            "fake_chunk_delay_ms": 150,
        }
        try:
            with httpx.stream(
                "POST", f"{capped_gateway.url}{PATH.format(uuid.uuid4().hex)}", json=body, timeout=30
            ) as response:
                started.wait(10)
                results.append((response.status_code, b"".join(response.iter_bytes()).count(b"data:")))
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            results.append(repr(exc))

    threads = [threading.Thread(target=stream) for _ in range(8)]
    for thread in threads:
        thread.start()
    started.wait(10)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n")
        start = time.monotonic()
        try:
            answer = sock.recv(65536)
        except ConnectionResetError:
            answer = b""
        assert answer == b"" and time.monotonic() - start < 5, answer[:200]
    for thread in threads:
        thread.join(30)
    assert len(results) == 8 and all(r[0] == 200 and r[1] > 10 for r in results), results  # type: ignore[index]  # a repr (an error) fails it
    assert chat(httpx.Client(), capped_gateway.url).status_code == 200
