"""JSON that Python accepts but that cannot be stored or echoed gets a clear 4xx, nothing recorded: deep
nesting in a completion request and in a rollout's metadata, lone UTF-16 surrogates, oversized metadata."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid

import httpx
import redis
from conftest import Proc
from test_gateway_errors import assert_openai_error
from test_gateway_proxy import MESSAGES, MODEL

from rlgate._net import LoopbackServer, read_request


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_a_completion_request_nested_too_deeply_is_400_and_not_sent(gateway: Proc, redis_client: redis.Redis):
    rid = uuid.uuid4().hex
    for depth in (300, 5000):
        body = f'{{"model": "{MODEL}", "messages": {json.dumps(MESSAGES)}, "extra": {nested(depth)}}}'
        response = httpx.post(
            f"{gateway.url}/rollouts/{rid}/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
        )
        assert assert_openai_error(response, 400)["code"] == "invalid_json", depth
    assert not redis_client.exists(f"rlgate:rollout:{{{rid}}}")


def test_a_field_the_gateway_reads_itself_is_validated_as_vllm_would_before_forwarding(
    upstream: tuple[Proc, Proc], redis_client: redis.Redis
):
    """`"stream": [null, null]` was read as false by the gateway while the upstream streamed (a 502); such
    values are 400s naming the field, not sent, nothing recorded, as vLLM's own models refuse them (the
    same bodies sent to real vLLM or rlgate serve directly are 400s too). Lax values vLLM takes still pass."""
    gateway, server = upstream
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "seed": 1}
    cases = [
        ("chat/completions", {**chat, "stream": [None, None]}, "stream"),
        ("chat/completions", {**chat, "stream": {"x": 1}}, "stream"),
        ("chat/completions", {**chat, "return_token_ids": "maybe"}, "return_token_ids"),
        ("chat/completions", {**chat, "logprobs": 2}, "logprobs"),
        ("chat/completions", {**chat, "model": ["a"]}, "model"),
        ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "echo": [1]}, "echo"),
        ("responses", {"model": MODEL, "input": "hi", "stream": "sometimes"}, "stream"),
    ]
    for path, body, param in cases:
        rid = uuid.uuid4().hex
        error = assert_openai_error(httpx.post(f"{gateway.url}/rollouts/{rid}/v1/{path}", json=body), 400)
        assert error["param"] == param and error["code"] == "invalid_value", (body, error)
        assert not redis_client.exists(f"rlgate:rollout:{{{rid}}}")
        if server.engine != "fake":  # the fake does not validate these fields
            assert httpx.post(f"{server.url}/{path}", json=body, timeout=30).status_code == 400, body
    for lax in ("true", 1, "no", 0, None):  # pydantic's lax booleans pass, as in vLLM
        rid = uuid.uuid4().hex
        response = httpx.post(
            f"{gateway.url}/rollouts/{rid}/v1/chat/completions", json={**chat, "stream": lax}, timeout=30
        )
        assert response.status_code == 200, (lax, response.text)


def test_rollout_metadata_that_cannot_be_stored_is_422(gateway: Proc, redis_client: redis.Redis):
    cases = {
        "deep": f'{{"metadata": {{"x": {nested(300)}}}}}',
        "very deep": f'{{"metadata": {{"x": {nested(5000)}}}}}',
        "lone surrogate": '{"metadata": {"x": "\\udb55"}}',
        "large": '{"metadata": {"x": "' + "a" * (70 * 1024) + '"}}',
    }
    for name, body in cases.items():
        rid = f"meta-{name.replace(' ', '-')}"
        response = httpx.post(
            f"{gateway.url}/rollouts",
            content=body.replace('{"metadata"', f'{{"rollout_id": "{rid}", "metadata"', 1),
            headers={"content-type": "application/json"},
        )
        assert response.status_code in (400, 422), (name, response.status_code, response.text[:300])
        assert_openai_error(response, response.status_code)
        assert len(response.content) < 2000  # the input is not echoed back
        assert not redis_client.exists(f"rlgate:rollout:{{{rid}}}"), name
    ok = httpx.post(f"{gateway.url}/rollouts", json={"rollout_id": "meta-ok", "metadata": {"x": [[1]]}})
    assert ok.status_code == 201


def test_the_request_is_stored_once_per_call_not_once_per_choice(gateway: Proc, redis_client: redis.Redis):
    """n=8 with a 256 KiB unused field once wrote the request eight times (n=32 and 2 MiB: 87 MB). Every
    reader still sees each choice's request: the whole rollout, a page that starts after choice 0, and
    the learner's view."""
    import asyncio

    from conftest import REDIS_URL

    from rlgate.episodes import EpisodeStore

    rid = uuid.uuid4().hex
    padding = "x" * (256 * 1024)
    body = {"model": MODEL, "messages": MESSAGES, "n": 8, "max_tokens": 4, "temperature": 0.7, "pad": padding}
    assert (
        httpx.post(f"{gateway.url}/rollouts/{rid}/v1/chat/completions", json=body, timeout=30).status_code
        == 200
    )
    stored = sum(len(item) for item in redis_client.lrange(f"rlgate:rollout:{{{rid}}}:calls", 0, -1))
    assert len(padding) < stored < 2 * len(padding)  # once, not 8 times
    calls = httpx.get(f"{gateway.url}/rollouts/{rid}").json()["calls"]
    assert [c["choice_index"] for c in calls] == list(range(8))
    assert all(c["request"]["pad"] == padding and c["request"]["temperature"] == 0.7 for c in calls)
    page = httpx.get(f"{gateway.url}/rollouts/{rid}", params={"offset": 5, "limit": 2}).json()["calls"]
    assert [c["index"] for c in page] == [5, 6] and all(c["request"]["pad"] == padding for c in page)

    async def read():
        store = EpisodeStore.from_url(REDIS_URL)
        try:
            return await store.get_calls(rid, -3), await store.get_rollout_view(rid)
        finally:
            await store.aclose()

    tail, view = asyncio.run(read())
    assert [c.choice_index for c in tail] == [5, 6, 7] and all(c.request["pad"] == padding for c in tail)
    assert all(c.request["temperature"] == 0.7 for c in view.calls)


def test_the_operator_surface_refuses_large_bodies_before_reading_them(
    gateway: Proc, redis_client: redis.Redis
):
    big = b'{"rollout_id": "big", "metadata": {"x": "' + b"a" * (2 * 1024 * 1024) + b'"}}'
    response = httpx.post(
        f"{gateway.url}/rollouts", content=big, headers={"content-type": "application/json"}
    )
    assert assert_openai_error(response, 413)["code"] == "payload_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"reward": 1.0, "pad": "'
        for _ in range(40):
            yield b"a" * 65536
        yield b'"}'

    streamed = httpx.post(
        f"{gateway.url}/rollouts/big/reward", content=chunks(), headers={"content-type": "application/json"}
    )
    assert assert_openai_error(streamed, 413)["code"] == "payload_too_large"
    assert not redis_client.exists("rlgate:rollout:{big}")
    small = httpx.post(f"{gateway.url}/rollouts", json={"rollout_id": "small", "metadata": {"k": "v"}})
    assert small.status_code == 201


def test_a_calls_record_and_a_rollouts_calls_are_bounded(
    fake_vllm: Proc, tmp_path, redis_client: redis.Redis
):
    """`max_record_bytes` bounds what one call may write to Redis: a request above it never reaches the
    upstream; an answer that takes the record above it is dropped, the call kept as failed (small), and the
    agent told 413 (a stream: an error event in place of its end). `max_calls_per_rollout` bounds how many
    records one rollout holds: above it, 409 and nothing written."""
    from conftest import start_gateway
    from test_gateway_auth import CountingUpstream

    counting = CountingUpstream(fake_vllm.url)
    proc = start_gateway(
        tmp_path, counting.url, max_record_bytes="16384", max_calls_per_rollout="5", max_n="64"
    )
    try:
        rid = uuid.uuid4().hex
        url = f"{proc.url}/rollouts/{rid}/v1/chat/completions"
        big = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "pad": "x" * 20_000}
        error = assert_openai_error(httpx.post(url, json=big), 413)
        assert error["code"] == "record_too_large" and "max_record_bytes" in error["message"]
        assert counting.posts == 0 and not redis_client.exists(f"rlgate:rollout:{{{rid}}}")

        many = {"model": MODEL, "messages": MESSAGES, "n": 64, "max_tokens": 64, "temperature": 1.0}
        error = assert_openai_error(httpx.post(url, json=many, timeout=30), 413)
        assert error["code"] == "record_too_large" and counting.posts == 1
        with httpx.stream("POST", url, json={**many, "stream": True}, timeout=30) as stream:
            lines = [line for line in stream.iter_lines() if line.startswith("data:")]
        # the record could not be kept: the agent sees an error last, never the stream's end
        assert "max_record_bytes" in lines[-1] and "data: [DONE]" not in lines
        assert (
            httpx.post(url, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4}).status_code == 200
        )
        calls = httpx.get(f"{proc.url}/rollouts/{rid}").json()["calls"]
        assert [c["error"] and c["error"]["code"] for c in calls] == [
            "record_too_large",
            "record_too_large",
            None,
        ]
        assert calls[0]["response"] is None and calls[0]["request"]["n"] == 64
        stored = sum(len(item) for item in redis_client.lrange(f"rlgate:rollout:{{{rid}}}:calls", 0, -1))
        assert stored < 3 * 16384

        two = {"model": MODEL, "messages": MESSAGES, "n": 2, "max_tokens": 4, "temperature": 1.0}
        assert httpx.post(url, json=two).status_code == 200  # 5 records held: the limit
        for body in (two, {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}):
            assert assert_openai_error(httpx.post(url, json=body), 409)["code"] == "rollout_full"
        assert redis_client.llen(f"rlgate:rollout:{{{rid}}}:calls") == 5
        new = uuid.uuid4().hex
        other = f"{proc.url}/rollouts/{new}/v1/chat/completions"
        assert httpx.post(other, json={**two, "n": 6}).status_code == 409
        assert not redis_client.exists(f"rlgate:rollout:{{{new}}}")  # a new rollout is not created
        assert httpx.post(other, json=two).status_code == 200
    finally:
        proc.kill()
        counting.close()


def test_a_call_whose_answer_could_outgrow_the_bounds_is_400_before_the_upstream_is_called(
    fake_vllm: Proc, tmp_path, redis_client: redis.Redis
):
    """`n: 128, max_tokens: 1000000` once reached the upstream, whose 13 MB answer took the gateway from 75 MB
    to 1.9 GB. n, the token bound per choice and their product are checked first (defaults: 16, 65,536 and
    262,144): 400 limit_exceeded naming the field and the setting, nothing sent, nothing recorded. A value
    vLLM would not read as an integer is its 400 too; lax integers vLLM takes pass."""
    from conftest import start_gateway
    from test_gateway_auth import CountingUpstream

    counting = CountingUpstream(fake_vllm.url)
    proc = start_gateway(tmp_path, counting.url)
    chat = {"model": MODEL, "messages": MESSAGES}
    cases = [
        ("chat/completions", {**chat, "n": 128, "max_tokens": 4}, "n", "RLGATE_MAX_N"),
        ("chat/completions", {**chat, "max_tokens": 1_000_000}, "max_tokens", "RLGATE_MAX_TOKENS_PER_CHOICE"),
        ("chat/completions", {**chat, "max_completion_tokens": "70000"}, "max_completion_tokens", "CHOICE"),
        ("chat/completions", {**chat, "max_tokens": 4, "min_tokens": 100_000}, "min_tokens", "CHOICE"),
        (
            "chat/completions",
            {**chat, "n": 16, "max_tokens": 65_536},
            "max_tokens",
            "RLGATE_MAX_TOKENS_PER_CALL",
        ),
        ("completions", {"model": MODEL, "prompt": "hi", "n": 17}, "n", "RLGATE_MAX_N"),
        ("completions", {"model": MODEL, "prompt": "hi", "n": 8, "max_tokens": 40_000}, "max_tokens", "CALL"),
        # a batch of prompts gets n choices each: 5,000 x 64 tokens; 20,000 x 16 (the default bound)
        ("completions", {"model": MODEL, "prompt": ["x"] * 5000, "max_tokens": 64}, "max_tokens", "CALL"),
        ("completions", {"model": MODEL, "prompt": [[1, 2]] * 20_000}, "max_tokens", "CALL"),
        ("completions", {"model": MODEL, "prompt": [[1, 2]] * 20_000, "min_tokens": 1}, "max_tokens", "CALL"),
        (
            "responses",
            {"model": MODEL, "input": "hi", "max_output_tokens": 10**9},
            "max_output_tokens",
            "CHOICE",
        ),
    ]
    try:
        for path, body, param, setting in cases:
            rid = uuid.uuid4().hex
            response = httpx.post(f"{proc.url}/rollouts/{rid}/v1/{path}", json=body, timeout=30)
            error = assert_openai_error(response, 400)
            assert error["code"] == "limit_exceeded" and error["param"] == param, (body, error)
            assert setting in error["message"], error
            assert not redis_client.exists(f"rlgate:rollout:{{{rid}}}")
        for bad in ("many", 2.5, [2]):  # not an integer to vLLM either
            response = httpx.post(f"{proc.url}/v1/chat/completions", json={**chat, "n": bad, "max_tokens": 2})
            assert assert_openai_error(response, 400)["param"] == "n", bad
        assert counting.posts == 0
        for n, max_tokens in ((16, 2), (2, 3)):  # within the bounds
            body = {**chat, "n": n, "max_tokens": max_tokens, "temperature": 1.0}
            assert httpx.post(f"{proc.url}/v1/chat/completions", json=body, timeout=30).status_code == 200
        batch = {"model": MODEL, "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2, "temperature": 1.0}
        answer = httpx.post(f"{proc.url}/v1/completions", json=batch, timeout=30)
        assert answer.status_code == 200 and len(answer.json()["choices"]) == 6
        assert counting.posts == 3
    finally:
        proc.kill()
        counting.close()


class EndlessUpstream(LoopbackServer):
    """An upstream that never stops answering (what vLLM does for `ignore_eos` with a huge max_tokens, or a
    broken server): a chat completion body of unbounded length, chunked or with a Content-Length it never
    reaches, or an SSE stream with no end. Counts the bytes it wrote before the gateway hung up."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.sent = 0
        self.closed = threading.Event()
        super().__init__()

    def serve(self, conn: socket.socket) -> None:
        request = read_request(conn)
        if request is None:
            return
        if request[0].startswith(b"GET"):
            body = b'{"object":"list","data":[{"id":"%s","object":"model"}]}' % MODEL.encode()
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n%s" % (len(body), body)
            )
            return
        piece = b'{"token":"x","logprob":-0.5,"bytes":[120],"top_logprobs":[]},' * 1000
        try:
            if self.mode == "sse":
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                )
                event = (
                    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
                    b'"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}\n\n'
                )
                frame = b"%x\r\n%s\r\n" % (len(event) * 200, event * 200)
                while True:
                    conn.sendall(frame)
                    self.sent += len(frame)
            elif self.mode == "announced":  # a Content-Length of 1 GiB, then bytes slowly
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1073741824\r\n\r\n"
                )
                while True:
                    conn.sendall(piece)
                    self.sent += len(piece)
                    time.sleep(0.05)
            else:  # chunked, without end (an error answer: "error" mode)
                status = b"500 Internal Server Error" if self.mode == "error" else b"200 OK"
                conn.sendall(
                    b"HTTP/1.1 %s\r\ncontent-type: application/json\r\n" % status
                    + b"transfer-encoding: chunked\r\n\r\n"
                )
                frame = b"%x\r\n%s\r\n" % (len(piece), piece)
                while True:
                    conn.sendall(frame)
                    self.sent += len(frame)
        except OSError:  # the gateway hung up
            self.closed.set()


def test_an_answer_is_read_only_up_to_its_limit_then_cut_off(tmp_path, redis_client: redis.Redis):
    """The gateway read a whole answer before checking its size (3.4 GB of memory for one call). Now it
    stops reading at max_answer_bytes: an announced Content-Length above it is refused at the headers, a
    body or stream that grows past it is cut there (its connection closed: vLLM aborts the request); the
    agent gets 413 record_too_large (a stream: an error event last; an endless error answer to a stream:
    413 before the stream starts), the call is recorded as failed and small."""
    from conftest import start_gateway

    limit = 1 << 20
    for mode, stream in (("chunked", False), ("announced", False), ("sse", True), ("error", True)):
        upstream = EndlessUpstream(mode)
        proc = start_gateway(tmp_path, upstream.url, max_answer_bytes=str(limit), upstream_timeout_s="60")
        try:
            rid = uuid.uuid4().hex
            url = f"{proc.url}/rollouts/{rid}/v1/chat/completions"
            body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "stream": stream}
            t0 = time.monotonic()
            if mode == "sse":
                with httpx.stream("POST", url, json=body, timeout=60) as response:
                    assert response.status_code == 200
                    lines = [line for line in response.iter_lines() if line.startswith("data:")]
                error = json.loads(lines[-2].removeprefix("data: "))["error"]
                assert error["code"] == 413 and "max_answer_bytes" in error["message"], lines[-2:]
                assert lines[-1] == "data: [DONE]"
            else:
                response = httpx.post(url, json=body, timeout=60)
                assert assert_openai_error(response, 413)["code"] == "record_too_large", mode
            assert time.monotonic() - t0 < 20, mode
            assert upstream.closed.wait(10), mode  # the gateway hung up
            # at most what the socket buffers held more (tens of MiB at most, not the endless rest)
            assert upstream.sent < limit + (48 << 20), (mode, upstream.sent)
            calls = httpx.get(f"{proc.url}/rollouts/{rid}").json()["calls"]
            assert [c["error"]["code"] for c in calls] == ["record_too_large"], mode
            assert calls[0]["response"] is None and calls[0]["completion_token_ids"] is None
            stored = sum(len(item) for item in redis_client.lrange(f"rlgate:rollout:{{{rid}}}:calls", 0, -1))
            assert stored < 8192, mode
            ok = httpx.get(f"{proc.url}/healthz").json()  # the gateway itself is fine
            assert ok["status"] in ("ok", "degraded"), ok
        finally:
            proc.kill()
            upstream.close()


def test_a_rollout_holds_at_most_max_rollout_bytes_its_attempts_and_events_included(
    fake_vllm: Proc, tmp_path, redis_client: redis.Redis
):
    """max_calls_per_rollout x max_record_bytes was the only bound of one rollout (32 GiB by default).
    Now the record script counts the bytes a rollout holds, its attempts' calls and its events included,
    and refuses (409 rollout_full, naming max_rollout_bytes, nothing written, no attempt created) what
    would take it above max_rollout_bytes."""
    from conftest import start_gateway

    budget = 100_000
    proc = start_gateway(tmp_path, fake_vllm.url, max_rollout_bytes=str(budget))
    padded = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "pad": "x" * 30_000}
    try:
        rid = uuid.uuid4().hex
        url = f"{proc.url}/rollouts/{rid}/v1/chat/completions"
        assert [httpx.post(url, json=padded).status_code for _ in range(3)] == [200, 200, 200]
        error = assert_openai_error(httpx.post(url, json=padded), 409)
        assert error["code"] == "rollout_full" and "max_rollout_bytes" in error["message"], error
        assert redis_client.llen(f"rlgate:rollout:{{{rid}}}:calls") == 3
        small = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
        assert httpx.post(url, json=small).status_code == 200  # what still fits is taken

        # Agent Lightning's attempts and events count toward their rollout's budget
        agl = uuid.uuid4().hex
        assert httpx.post(f"{proc.url}/rollouts", json={"rollout_id": agl, "task_id": "t"}).status_code == 201

        def attempt(n: int) -> httpx.Response:
            return httpx.post(
                f"{proc.url}/proxy/rollout/{agl}/attempt/{n}/mode/train/openai/v1/chat/completions",
                json=padded,
            )

        def event() -> httpx.Response:
            return httpx.post(
                f"{proc.url}/api/rollouts/{agl}/attempt/0/events",
                json={"event_type": "note", "data": {"text": "y" * 15_000}},
            )

        assert attempt(1).status_code == 200 and attempt(2).status_code == 200
        statuses = [event().status_code for _ in range(4)]
        assert statuses[0] == 200 and statuses[-1] == 409, statuses
        assert attempt(1).status_code == 409
        error = assert_openai_error(attempt(3), 409)
        assert error["code"] == "rollout_full" and "max_rollout_bytes" in error["message"]
        assert not redis_client.exists(f"rlgate:rollout:{{{agl}}}~3")  # no attempt made
        held = int(redis_client.hget(f"rlgate:rollout:{{{agl}}}", "bytes"))
        stored = sum(
            len(item)
            for key in (f"rlgate:rollout:{{{agl}}}~1:calls", f"rlgate:rollout:{{{agl}}}~2:calls")
            for item in redis_client.lrange(key, 0, -1)
        ) + sum(len(item) for item in redis_client.lrange(f"rlgate:rollout:{{{agl}}}:events", 0, -1))
        assert stored == held <= budget, (stored, held)
        assert httpx.get(f"{proc.url}/rollouts/{agl}").status_code == 200  # the counter is not shown
    finally:
        proc.kill()
