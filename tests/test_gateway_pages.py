"""`GET /rollouts/{id}` pages its calls: bounded pages, indices and rewards where they belong."""

from __future__ import annotations

import uuid

import httpx
from conftest import Proc
from test_gateway_errors import assert_openai_error
from test_gateway_proxy import MESSAGES, MODEL


def call(gateway: Proc, rid: str, **extra) -> None:
    response = httpx.post(
        f"{gateway.url}/rollouts/{rid}/v1/chat/completions",
        timeout=30,
        json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **extra},
    )
    assert response.status_code == 200, response.text


def page(gateway: Proc, rid: str, **params) -> dict:
    response = httpx.get(f"{gateway.url}/rollouts/{rid}", params=params, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_calls_come_in_pages(gateway: Proc, redis_client):
    rid = uuid.uuid4().hex
    for i in range(7):
        call(gateway, rid, user=f"call-{i}")
    answer = httpx.post(f"{gateway.url}/rollouts/{rid}/calls/4/reward", json={"reward": 0.5})
    assert answer.status_code == 200, answer.text
    pages, offset = [], 0
    while offset is not None:
        body = page(gateway, rid, offset=offset, limit=3)
        pages.append([(c["index"], c["request"]["user"], c["reward"]) for c in body["calls"]])
        offset = body["next_offset"]
    assert pages == [
        [(0, "call-0", None), (1, "call-1", None), (2, "call-2", None)],
        [(3, "call-3", None), (4, "call-4", 0.5), (5, "call-5", None)],
        [(6, "call-6", None)],
    ]
    whole = page(gateway, rid)  # the default page holds a short rollout whole
    assert [c["index"] for c in whole["calls"]] == list(range(7)) and whole["next_offset"] is None
    assert whole["status"] == "open" and page(gateway, rid, offset=50)["calls"] == []
    for bad in ({"limit": 0}, {"limit": 1001}, {"offset": -1}, {"limit": "many"}):
        error = assert_openai_error(httpx.get(f"{gateway.url}/rollouts/{rid}", params=bad), 422)
        assert error["code"] == "validation_error"


def test_a_page_of_large_calls(gateway: Proc, redis_client):
    rid = uuid.uuid4().hex
    for i in range(3):  # ~1.5 MiB of calls: decoded and serialized off the event loop
        call(gateway, rid, user=f"big-{i}", metadata_blob="x" * 500_000)
    body = page(gateway, rid, offset=1, limit=5)
    assert [c["index"] for c in body["calls"]] == [1, 2] and body["next_offset"] is None
    assert all(len(c["request"]["metadata_blob"]) == 500_000 for c in body["calls"])
