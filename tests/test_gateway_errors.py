"""Bad input gets a 4xx in the OpenAI error shape and changes nothing; upstream errors keep their status
and are recorded as failed calls."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest
from conftest import Proc, free_port, start_gateway
from fake_vllm import MAX_MODEL_LEN
from test_gateway_proxy import MESSAGES, MODEL, rollout


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


def refusals(url: str, bodies: tuple[bytes, ...], status: int) -> list[dict]:
    """POST each raw JSON `body` to `url`: each answered `status` in the OpenAI error shape; their errors."""
    return [
        assert_openai_error(
            httpx.post(url, content=body, headers={"content-type": "application/json"}), status
        )
        for body in bodies
    ]


def test_malformed_json_is_400_and_records_nothing(gateway: Proc, redis_client):
    rid = uuid.uuid4().hex
    for payload in (b"{not json", b"[1, 2]", b""):
        response = httpx.post(
            f"{gateway.url}/rollouts/{rid}/v1/chat/completions",
            content=payload,
            headers={"content-type": "application/json"},
        )
        assert assert_openai_error(response, 400)["code"] == "invalid_json"
    assert httpx.get(f"{gateway.url}/rollouts/{rid}").status_code == 404
    assert redis_client.keys("*rollout*") == []


def test_unknown_paths_and_methods(gateway: Proc):
    assert_openai_error(httpx.post(f"{gateway.url}/v1/embeddings", json={}), 404)
    assert_openai_error(httpx.get(f"{gateway.url}/nothing/here"), 404)
    assert_openai_error(httpx.get(f"{gateway.url}/rollouts/{uuid.uuid4().hex}"), 404)
    error = assert_openai_error(httpx.get(f"{gateway.url}/v1/chat/completions"), 405)
    assert error["code"] == "method_not_allowed"


def test_invalid_rollout_ids_are_400(gateway: Proc, redis_client):
    body = {"model": MODEL, "messages": MESSAGES}
    for bad in ("has{brace}", "a" * 200, "sp ace"):
        response = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, headers={"X-Rollout-Id": bad})
        assert assert_openai_error(response, 400)["code"] == "invalid_id"
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json=body,
        headers={"X-Rollout-Id": "ok", "X-Task-Id": "bad{task}"},
    )
    assert_openai_error(response, 400)
    # an agent name is kept in every record and in the rollout's listing row: bounded
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json=body,
        headers={"X-Rollout-Id": "ok", "X-Agent-Name": "a" * 257},
    )
    error = assert_openai_error(response, 400)
    assert (error["code"], error["param"]) == ("invalid_agent_name", "X-Agent-Name")
    assert redis_client.keys("*rollout*") == []
    assert_openai_error(httpx.post(f"{gateway.url}/rollouts", json={"rollout_id": "a/b"}), 400)
    error = assert_openai_error(httpx.post(f"{gateway.url}/rollouts", json={"metadata": "not a dict"}), 422)
    assert error["param"] == "metadata"


def test_upstream_errors_keep_status_and_are_recorded(gateway: Proc, fake_vllm: Proc, redis_client):
    rid = uuid.uuid4().hex
    client = openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rid}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    direct = httpx.post(
        f"{fake_vllm.url}/chat/completions", json={"model": "no-such-model", "messages": MESSAGES}
    )
    assert not_found.value.response.json() == direct.json()
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_MODEL_LEN + 1)
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"fake_status": 500})
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, max_tokens=MAX_MODEL_LEN + 1
        )
    calls = rollout(gateway, rid)["calls"]
    assert [c["error"]["status"] for c in calls] == [404, 400, 500, 400]
    assert all(c["completion_token_ids"] is None and c["response"] is None for c in calls)


def test_error_in_the_middle_of_a_stream(gateway: Proc, redis_client):
    rid = uuid.uuid4().hex
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 32, "stream": True, "fake_fail_after": 2}
    lines = []
    with httpx.stream("POST", f"{gateway.url}/rollouts/{rid}/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
    payloads = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
    assert "error" in payloads[-1]
    [call] = rollout(gateway, rid)["calls"]
    assert call["error"]["message"] == payloads[-1]["error"]["message"]
    assert call["response"]["message"]["content"]  # the part that did arrive is kept
    client = openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rid}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIError):
        list(
            client.chat.completions.create(
                model=MODEL, messages=MESSAGES, stream=True, extra_body={"fake_fail_after": 1}
            )
        )


def test_a_stream_with_malformed_log_probs_is_a_recorded_error(gateway: Proc, redis_client):
    rid = uuid.uuid4().hex
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "stream": True, "fake_bad_logprobs": True}
    with httpx.stream("POST", f"{gateway.url}/rollouts/{rid}/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
    assert "data: [DONE]" in lines and "error" in json.loads(lines[-2][6:])  # vLLM's way: error, then [DONE]
    [call] = rollout(gateway, rid)["calls"]
    assert call["error"]["status"] == 502 and "unreadable stream" in call["error"]["message"]
    assert call["completion_token_ids"] is None  # nothing of a garbled stream is trained on


def test_strict_gateway_body_limit_and_required_rollout(fake_vllm: Proc, tmp_path, redis_client):
    proc = start_gateway(tmp_path, fake_vllm.url, require_rollout_id="true", max_body_bytes="2000")
    try:
        body = {"model": MODEL, "messages": MESSAGES}
        error = assert_openai_error(httpx.post(f"{proc.url}/v1/chat/completions", json=body), 400)
        assert error["code"] == "missing_rollout_id"
        big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}
        error = assert_openai_error(
            httpx.post(f"{proc.url}/rollouts/r-big/v1/chat/completions", json=big), 413
        )
        assert error["code"] == "payload_too_large"
        ok = httpx.post(f"{proc.url}/rollouts/r-ok/v1/chat/completions", json={**body, "max_tokens": 4})
        assert ok.status_code == 200
        assert redis_client.exists("rlgate:rollout:{r-ok}") and not redis_client.exists(
            "rlgate:rollout:{r-big}"
        )
    finally:
        proc.kill()


def test_unreachable_upstream_is_502_and_recorded(tmp_path, redis_client):
    proc = start_gateway(tmp_path, f"http://127.0.0.1:{free_port()}/v1", wait_healthy=False)
    try:
        health = httpx.get(f"{proc.url}/healthz")
        assert health.status_code == 503 and health.json()["redis"] == "ok"
        response = httpx.post(
            f"{proc.url}/rollouts/r-down/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES}
        )
        assert assert_openai_error(response, 502)["type"] == "upstream_error"
        [call] = rollout(proc, "r-down")["calls"]
        assert call["error"]["status"] == 502
    finally:
        proc.kill()


def test_secrets_never_reach_logs(fake_vllm: Proc, tmp_path, redis_client):
    secret = "sk-test-" + uuid.uuid4().hex
    proc = start_gateway(tmp_path, fake_vllm.url, upstream_api_key=secret)
    try:
        client = openai.OpenAI(base_url=f"{proc.url}/rollouts/r-secret/v1", api_key="agent-" + secret)
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        httpx.get(f"{proc.url}/metrics")
    finally:
        proc.kill()
    log = proc.log()
    assert '"event":"call"' in log and "r-secret" in log
    assert secret not in log


def test_upstream_dying_mid_stream_is_an_error_for_the_agent(gateway: Proc, redis_client):
    rid = uuid.uuid4().hex
    client = openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rid}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIError):
        list(
            client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=32, stream=True, extra_body={"fake_drop_after": 3}
            )
        )
    with pytest.raises(openai.APIError):
        list(
            client.completions.create(
                model=MODEL, prompt="Count:", max_tokens=32, stream=True, extra_body={"fake_drop_after": 3}
            )
        )
    calls = rollout(gateway, rid)["calls"]
    assert [c["error"]["status"] for c in calls] == [502, 502]
    assert calls[0]["response"]["message"]["content"]  # what did arrive is kept for inspection


def test_client_hanging_up_is_recorded_as_failed(gateway: Proc, redis_client):
    import time

    rid = uuid.uuid4().hex
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 64, "stream": True, "fake_chunk_delay_ms": 40}
    with httpx.stream("POST", f"{gateway.url}/rollouts/{rid}/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        next(lines), next(lines)  # read a little, then hang up
    deadline = time.monotonic() + 10
    while True:
        stored = httpx.get(f"{gateway.url}/rollouts/{rid}")
        if stored.status_code == 200:
            break
        assert time.monotonic() < deadline, "the hung-up call was never recorded"
        time.sleep(0.05)
    [call] = stored.json()["calls"]
    assert call["error"]["status"] == 499 and call["error"]["type"] == "client_disconnected"
    # the gateway stopped reading long before vLLM would have finished 64 tokens at 40 ms each
    assert call["latency_ms"] < 64 * 40 / 2


def test_unusual_but_valid_requests(gateway: Proc, fake_vllm: Proc, redis_client):
    rid = uuid.uuid4().hex
    url = f"{gateway.url}/rollouts/{rid}/v1"
    # "stream": "true" is a stream for vLLM (lax booleans), so it is one for the gateway too
    with httpx.stream(
        "POST",
        f"{url}/chat/completions",
        json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "stream": "true"},
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert "data: [DONE]" in list(r.iter_lines())
    # echo + logprobs: forwarded untouched and recorded without token ids (echo changes what they mean)
    body = {"model": MODEL, "prompt": "Echo me", "max_tokens": 4, "echo": True, "logprobs": 1}
    via = httpx.post(f"{url}/completions", json=body)
    direct = httpx.post(f"{fake_vllm.url}/completions", json=body)
    assert via.status_code == 200
    from test_gateway_proxy import normalize

    assert normalize(via.json()) == normalize(direct.json())
    # a compressing upstream (or proxy in between) is asked for identity encoding
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "fake_compress": True}
    assert httpx.post(f"{url}/chat/completions", json=body).status_code == 200
    # a non-string model is a 400 naming it, as vLLM's request model answers (not sent, not recorded)
    error = assert_openai_error(
        httpx.post(f"{url}/chat/completions", json={"model": 123, "messages": MESSAGES}), 400
    )
    assert error["param"] == "model"
    calls = rollout(gateway, rid)["calls"]
    assert [c["stream"] for c in calls] == [True, False, False]
    assert calls[1]["prompt_token_ids"] is None and calls[1]["completion_token_ids"] is None
    assert calls[2]["completion_token_ids"]


def test_echoed_prompt_logprobs_are_not_taken_for_completion_logprobs():
    from gateway.capture import sampled_logprobs

    # vLLM's echo: the prompt's tokens come first, the very first with a null log-prob
    assert sampled_logprobs("completions", {"token_logprobs": [None, -0.5, -0.25]}) is None
    assert sampled_logprobs("completions", {"token_logprobs": [-0.5, -0.25]}) == [-0.5, -0.25]
    assert sampled_logprobs("chat.completions", {"content": [{"logprob": -1.0}]}) == [-1.0]
    assert sampled_logprobs("chat.completions", None) is None
