"""JSON that Python accepts but that cannot be stored or echoed gets a clear 4xx, nothing recorded: deep
nesting in a completion request and in a rollout's metadata, lone UTF-16 surrogates, oversized metadata."""

from __future__ import annotations

import json
import uuid

import httpx
import redis
from conftest import Proc
from test_gateway_errors import assert_openai_error
from test_gateway_proxy import MESSAGES, MODEL


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

    from episodes import EpisodeStore

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
    proc = start_gateway(tmp_path, counting.url, max_record_bytes="16384", max_calls_per_rollout="5")
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
        assert "data: [DONE]" not in lines and "max_record_bytes" in lines[-1]
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
