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
        response = httpx.post(f"{gateway.url}/rollouts/{rid}/v1/chat/completions", content=body,
                              headers={"content-type": "application/json"})
        assert assert_openai_error(response, 400)["code"] == "invalid_json", depth
    assert not redis_client.exists(f"rlgate:rollout:{{{rid}}}")


def test_rollout_metadata_that_cannot_be_stored_is_422(gateway: Proc, redis_client: redis.Redis):
    cases = {
        "deep": f'{{"metadata": {{"x": {nested(300)}}}}}',
        "very deep": f'{{"metadata": {{"x": {nested(5000)}}}}}',
        "lone surrogate": '{"metadata": {"x": "\\udb55"}}',
        "large": '{"metadata": {"x": "' + "a" * (70 * 1024) + '"}}',
    }
    for name, body in cases.items():
        rid = f"meta-{name.replace(' ', '-')}"
        response = httpx.post(f"{gateway.url}/rollouts", content=body.replace('{"metadata"', f'{{"rollout_id": "{rid}", "metadata"', 1),
                              headers={"content-type": "application/json"})
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
    assert httpx.post(f"{gateway.url}/rollouts/{rid}/v1/chat/completions", json=body, timeout=30).status_code == 200
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


def test_the_operator_surface_refuses_large_bodies_before_reading_them(gateway: Proc, redis_client: redis.Redis):
    big = b'{"rollout_id": "big", "metadata": {"x": "' + b"a" * (2 * 1024 * 1024) + b'"}}'
    response = httpx.post(f"{gateway.url}/rollouts", content=big, headers={"content-type": "application/json"})
    assert assert_openai_error(response, 413)["code"] == "payload_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"reward": 1.0, "pad": "'
        for _ in range(40):
            yield b"a" * 65536
        yield b'"}'

    streamed = httpx.post(f"{gateway.url}/rollouts/big/reward", content=chunks(),
                          headers={"content-type": "application/json"})
    assert assert_openai_error(streamed, 413)["code"] == "payload_too_large"
    assert not redis_client.exists("rlgate:rollout:{big}")
    small = httpx.post(f"{gateway.url}/rollouts", json={"rollout_id": "small", "metadata": {"k": "v"}})
    assert small.status_code == 201
