"""The gateway as a real process in front of a fake vLLM process, driven by the official openai SDK.

For every form of call: the agent gets exactly what vLLM would have sent it (the injected token ids and
log-probs stripped), and Redis holds the exact token ids and log-probs vLLM returned.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import openai
from conftest import Proc

MODEL = "fake-model"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 17 + 25?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


def new_id() -> str:
    return uuid.uuid4().hex


def normalize(obj: Any) -> Any:
    """Drop what differs between two runs of the same request: ids and timestamps."""
    if isinstance(obj, dict):
        return {k: normalize(v) for k, v in obj.items() if k not in ("id", "created", "created_at")}
    if isinstance(obj, list):
        return [normalize(v) for v in obj]
    return obj


def post(url: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(url, json=body, headers=headers, timeout=30)


def sse_chunks(url: str, body: dict, headers: dict | None = None) -> tuple[list[Any], list[str]]:
    """(parsed data payloads, raw data lines) of a stream."""
    chunks, lines = [], []
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            lines.append(line)
            data = line[len("data: ") :]
            chunks.append(data if data == "[DONE]" else json.loads(data))
    return chunks, lines


def rollout(gateway: Proc, rollout_id: str) -> dict:
    response = httpx.get(f"{gateway.url}/rollouts/{rollout_id}", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


# ---------------------------------------------------------------------------------------------------------
# chat.completions


def test_chat_non_streaming_path_form(upstream: tuple[Proc, Proc], redis_client):
    gateway, fake_vllm = upstream
    rid = new_id()
    client = openai.OpenAI(base_url=f"{gateway.url}/tasks/task-1/rollouts/{rid}/v1", api_key="unused")
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, seed=3
    )
    completion = raw.parse()
    assert raw.headers["x-rollout-id"] == rid

    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "seed": 3}
    plain = post(f"{fake_vllm.url}/chat/completions", body).json()
    full = post(
        f"{fake_vllm.url}/chat/completions", {**body, "return_token_ids": True, "logprobs": True}
    ).json()
    # the agent saw what vLLM sends a plain request
    assert normalize(raw.http_response.json()) == normalize(plain)
    assert plain["prompt_token_ids"] is None and plain["choices"][0]["logprobs"] is None
    assert completion.choices[0].message.content == full["choices"][0]["message"]["content"]

    stored = rollout(gateway, rid)
    assert stored["task_id"] == "task-1" and stored["status"] == "open"
    [call] = stored["calls"]
    assert call["index"] == 0 and call["endpoint"] == "chat.completions" and call["policy_version"] == 0
    assert call["prompt_token_ids"] == full["prompt_token_ids"]
    assert call["completion_token_ids"] == full["choices"][0]["token_ids"]
    assert call["completion_logprobs"] == [c["logprob"] for c in full["choices"][0]["logprobs"]["content"]]
    assert len(call["completion_logprobs"]) == len(call["completion_token_ids"]) > 0
    assert call["request"] == body  # as the agent sent it, without the injected fields
    assert call["response"]["message"]["content"] == completion.choices[0].message.content
    assert call["response"]["finish_reason"] == completion.choices[0].finish_reason
    assert call["response"]["usage"]["completion_tokens"] == len(call["completion_token_ids"])
    assert call["error"] is None and call["latency_ms"] > 0


def test_chat_keeps_fields_the_agent_asked_for(upstream: tuple[Proc, Proc], redis_client):
    gateway, fake_vllm = upstream
    rid = new_id()
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 6,
        "logprobs": True,
        "top_logprobs": 2,
        "return_token_ids": True,
        "seed": 2,
    }
    via = post(f"{gateway.url}/rollouts/{rid}/v1/chat/completions", body).json()
    direct = post(f"{fake_vllm.url}/chat/completions", body).json()
    assert normalize(via) == normalize(direct)
    assert via["prompt_token_ids"] and via["choices"][0]["logprobs"]["content"][0]["top_logprobs"]


def test_chat_streaming_header_form(upstream: tuple[Proc, Proc], redis_client):
    gateway, fake_vllm = upstream
    rid = new_id()
    headers = {"X-Rollout-Id": rid, "X-Task-Id": "task-2", "X-Agent-Name": "solver"}
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 16,
        "stream": True,
        "seed": 4,
        "stream_options": {"include_usage": True},
    }
    via, via_lines = sse_chunks(f"{gateway.url}/v1/chat/completions", body, headers)
    plain, _ = sse_chunks(f"{fake_vllm.url}/chat/completions", body)
    full, _ = sse_chunks(
        f"{fake_vllm.url}/chat/completions", {**body, "return_token_ids": True, "logprobs": True}
    )
    assert via[-1] == "[DONE]" and via_lines[-1] == "data: [DONE]"
    assert normalize(via) == normalize(plain)
    assert all(
        c.get("prompt_token_ids") is None and all(ch.get("token_ids") is None for ch in c["choices"])
        for c in via[:-1]
    )

    # the SDK streams through the gateway like through vLLM
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", default_headers=headers)
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=16, stream=True, seed=4
        )
        if c.choices
    )

    stored = rollout(gateway, rid)
    assert stored["task_id"] == "task-2"
    assert [c["index"] for c in stored["calls"]] == [0, 1]
    for call in stored["calls"]:
        assert call["agent_name"] == "solver" and call["stream"] is True
        assert call["prompt_token_ids"] == next(
            c["prompt_token_ids"] for c in full if isinstance(c, dict) and c.get("prompt_token_ids")
        )
        assert call["completion_token_ids"] == [
            t for c in full[:-1] for ch in c["choices"] for t in ch.get("token_ids") or ()
        ]
        assert call["completion_logprobs"] == [
            e["logprob"]
            for c in full[:-1]
            for ch in c["choices"]
            if ch.get("logprobs")
            for e in ch["logprobs"]["content"]
        ]
        assert call["response"]["message"]["content"] == text
        assert call["ttfb_ms"] is not None and call["ttfb_ms"] <= call["latency_ms"]
    assert stored["calls"][0]["response"]["usage"]["completion_tokens"] == len(
        stored["calls"][0]["completion_token_ids"]
    )


def test_chat_tool_calls_non_streaming_and_streaming(gateway: Proc, fake_vllm: Proc, redis_client):
    rid = new_id()
    client = openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rid}/v1", api_key="unused")
    completion = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=64)
    [tool_call] = completion.choices[0].message.tool_calls
    assert completion.choices[0].finish_reason == "tool_calls"
    assert tool_call.function.name == "calculator"
    json.loads(tool_call.function.arguments)

    streamed: dict[int, dict] = {}
    for chunk in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=64, stream=True
    ):
        for delta_call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            slot = streamed.setdefault(delta_call.index, {"name": "", "arguments": ""})
            slot["name"] += delta_call.function.name or ""
            slot["arguments"] += delta_call.function.arguments or ""
    assert streamed[0] == {"name": "calculator", "arguments": tool_call.function.arguments}

    # byte for byte what vLLM streams a plain request: the chunks that exist only because of the injected
    # fields (tokens the hermes parser holds back) are dropped again
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 64, "stream": True}
    via, _ = sse_chunks(f"{gateway.url}/rollouts/{rid}/v1/chat/completions", body)
    plain, _ = sse_chunks(f"{fake_vllm.url}/chat/completions", body)
    full, _ = sse_chunks(f"{fake_vllm.url}/chat/completions", {**body, "return_token_ids": True})
    assert normalize(via) == normalize(plain) and len(full) > len(plain)

    # the tool's answer goes back, and the model answers in text
    followup = MESSAGES + [
        completion.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": tool_call.id, "content": "42"},
    ]
    answer = client.chat.completions.create(model=MODEL, messages=followup, tools=TOOLS, max_tokens=16)
    assert answer.choices[0].message.content

    calls = rollout(gateway, rid)["calls"]
    assert len(calls) == 4
    calls = calls[:2] + calls[3:]
    for call in calls[:2]:
        [stored_call] = call["response"]["message"]["tool_calls"]
        assert stored_call["function"] == {"name": "calculator", "arguments": tool_call.function.arguments}
        assert call["response"]["finish_reason"] == "tool_calls"
        assert call["request"]["tools"] == TOOLS
        assert call["completion_token_ids"]
    assert calls[2]["request"]["messages"][-1]["role"] == "tool"
    assert calls[1]["completion_token_ids"] == calls[0]["completion_token_ids"]


def test_n_greater_than_one_records_each_choice(upstream: tuple[Proc, Proc], redis_client):
    gateway, fake_vllm = upstream
    rid = new_id()
    client = openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rid}/v1", api_key="unused")
    completion = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=10, seed=5)
    assert len(completion.choices) == 2
    list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, n=2, max_tokens=10, seed=5, stream=True
        )
    )
    calls = rollout(gateway, rid)["calls"]
    assert [(c["index"], c["choice_index"], c["stream"]) for c in calls] == [
        (0, 0, False),
        (1, 1, False),
        (2, 0, True),
        (3, 1, True),
    ]
    assert calls[0]["prompt_token_ids"] == calls[1]["prompt_token_ids"]
    for i in range(2):
        assert calls[i]["response"]["message"]["content"] == completion.choices[i].message.content
        assert calls[i + 2]["completion_token_ids"] == calls[i]["completion_token_ids"]


def test_rollout_created_by_post_rollouts(gateway: Proc, redis_client):
    response = httpx.post(f"{gateway.url}/rollouts", json={"task_id": "task-3", "metadata": {"seed": 7}})
    assert response.status_code == 201
    created = response.json()
    assert created["base_url"] == f"{gateway.url}/tasks/task-3/rollouts/{created['rollout_id']}/v1"
    assert created["status"] == "open" and created["metadata"] == {"seed": 7}
    client = openai.OpenAI(base_url=created["base_url"], api_key="unused")
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    stored = rollout(gateway, created["rollout_id"])
    assert stored["metadata"] == {"seed": 7} and len(stored["calls"]) == 1
    # the same id again is a conflict and changes nothing
    again = httpx.post(f"{gateway.url}/rollouts", json={"rollout_id": created["rollout_id"]})
    assert again.status_code == 409 and again.json()["error"]["code"] == "rollout_exists"
    untasked = httpx.post(f"{gateway.url}/rollouts", json={}).json()
    assert untasked["base_url"] == f"{gateway.url}/rollouts/{untasked['rollout_id']}/v1"


def test_call_without_rollout_id_gets_a_new_one(gateway: Proc, redis_client):
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused")
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    rid = raw.headers["x-rollout-id"]
    assert len(rid) == 32
    stored = rollout(gateway, rid)
    assert stored["task_id"] is None and len(stored["calls"]) == 1


# ---------------------------------------------------------------------------------------------------------
# completions, responses, models


def test_completions_non_streaming_and_streaming(upstream: tuple[Proc, Proc], redis_client):
    gateway, fake_vllm = upstream
    rid = new_id()
    url = f"{gateway.url}/rollouts/{rid}/v1/completions"
    body = {"model": MODEL, "prompt": "The sum of 2 and 3 is", "max_tokens": 8, "seed": 6}
    via = post(url, body).json()
    plain = post(f"{fake_vllm.url}/completions", body).json()
    full = post(f"{fake_vllm.url}/completions", {**body, "return_token_ids": True, "logprobs": 0}).json()
    assert normalize(via) == normalize(plain)

    stream_body = {**body, "stream": True}
    via_chunks, _ = sse_chunks(url, stream_body)
    plain_chunks, _ = sse_chunks(f"{fake_vllm.url}/completions", stream_body)
    assert normalize(via_chunks) == normalize(plain_chunks)

    client = openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rid}/v1", api_key="unused")
    sdk = client.completions.create(model=MODEL, prompt=body["prompt"], max_tokens=8, seed=6)
    assert sdk.choices[0].text == full["choices"][0]["text"]

    calls = rollout(gateway, rid)["calls"]
    assert len(calls) == 3
    for call in calls:
        assert call["endpoint"] == "completions"
        assert call["prompt_token_ids"] == full["choices"][0]["prompt_token_ids"]
        assert call["completion_token_ids"] == full["choices"][0]["token_ids"]
        assert call["completion_logprobs"] == full["choices"][0]["logprobs"]["token_logprobs"]
        assert call["response"]["text"] == full["choices"][0]["text"]


def test_responses_recorded(gateway: Proc, fake_vllm: Proc, redis_client):
    rid = new_id()
    client = openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rid}/v1", api_key="unused")
    response = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=256)
    assert response.output_text
    events = list(
        client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=256, stream=True)
    )
    assert events[-1].type == "response.completed"
    calls = rollout(gateway, rid)["calls"]
    # served as chat completions (gateway.responses; tests/test_responses_api.py): recorded as chat calls
    assert [(c["endpoint"], c["agent_api"]) for c in calls] == [("chat.completions", "openai.responses")] * 2
    assert calls[0]["request"]["messages"] == [{"role": "user", "content": "Say hello."}]
    assert calls[0]["response"]["message"]["content"] == response.output_text
    assert calls[1]["response"]["message"]["content"] == events[-1].response.output_text
    assert calls[0]["response"]["finish_reason"] == "stop"
    assert calls[1]["stream"] and calls[1]["error"] is None
    for call in calls:
        assert len(call["completion_logprobs"]) == len(call["completion_token_ids"]) > 0


def test_models_forwarded(upstream: tuple[Proc, Proc]):
    gateway, fake_vllm = upstream
    via = httpx.get(f"{gateway.url}/rollouts/r-models/v1/models").json()
    direct = httpx.get(f"{fake_vllm.url}/models").json()
    assert normalize(via) == normalize(direct)
    assert [m.id for m in openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x").models.list()] == [MODEL]
