"""Anthropic's Messages API on the agent surface (`gateway.messages`), judged by the `anthropic` SDK's own
types and by the upstream: the answer is the upstream's chat completion translated, the record is that chat
call with the upstream's ids and log-probs exactly, and in front of real vLLM the answer equals what vLLM's
own `/v1/messages` answers for the same greedy request."""

from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import pytest
from conftest import Proc, gateway_fixture, recorded_calls, upstream_chat

MODEL = "fake-model"
TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
SECRET = "messages-test-secret"
OPERATOR = {"Authorization": "Bearer messages-test-operator"}


def client(gateway: Proc, rollout_id: str, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"{gateway.url}/rollouts/{rollout_id}", api_key=key, max_retries=0)


def test_an_answer_is_the_upstreams_chat_answer_translated_and_recorded_exactly(upstream, redis_client):
    gateway, server = upstream
    rid = uuid.uuid4().hex
    message = client(gateway, rid).messages.create(
        model=MODEL,
        max_tokens=12,
        extra_body={
            "temperature": 0
        },  # the SDK (2.x) no longer names the sampling fields: sent as vLLM takes them
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": " Really."}],
        messages=[{"role": "user", "content": "What is 2+3?"}],
    )
    direct = upstream_chat(
        server,
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "Be brief. Really."},
                {"role": "user", "content": "What is 2+3?"},
            ],
            "max_tokens": 12,
            "max_completion_tokens": 12,
            "temperature": 0,
        },
    )
    choice = direct["choices"][0]
    assert isinstance(message, anthropic.types.Message)
    assert message.id == message.id and message.role == "assistant" and message.model == MODEL
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == choice["message"]["content"]
    assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[choice["finish_reason"]]
    assert message.usage.input_tokens == direct["usage"]["prompt_tokens"]
    assert message.usage.output_tokens == direct["usage"]["completion_tokens"]
    [record] = recorded_calls(gateway, rid)
    assert record["agent_api"] == "anthropic.messages" and record["endpoint"] == "chat.completions"
    assert record["request"]["messages"][0] == {"role": "system", "content": "Be brief. Really."}
    assert record["prompt_token_ids"] == direct["prompt_token_ids"]
    assert record["completion_token_ids"] == choice["token_ids"]
    expected = [t["logprob"] for t in choice["logprobs"]["content"]]
    assert record["completion_logprobs"] == pytest.approx(expected, abs=1e-5)
    assert record["response"]["message"]["content"] == message.content[0].text


def test_a_stream_is_anthropics_event_sequence_and_is_recorded_with_every_token(upstream, redis_client):
    gateway, _server = upstream
    rid = uuid.uuid4().hex
    request = {
        "model": MODEL,
        "max_tokens": 12,
        "extra_body": {"temperature": 0},
        "messages": [{"role": "user", "content": "Say something."}],
    }
    unary = client(gateway, rid).messages.create(**request)
    with client(gateway, rid).messages.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type not in ("text", "input_json")]  # the SDK's own helper events
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1:-2] == ["content_block_start"] + ["content_block_delta"] * (len(kinds) - 5) + [
        "content_block_stop"
    ]
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in unary.content]
    assert final.stop_reason == unary.stop_reason
    assert final.usage.output_tokens == unary.usage.output_tokens
    assert final.usage.input_tokens == unary.usage.input_tokens
    first, second = recorded_calls(gateway, rid)
    assert second["stream"] and second["agent_api"] == "anthropic.messages"
    assert second["prompt_token_ids"] == first["prompt_token_ids"]
    assert second["completion_token_ids"] == first["completion_token_ids"]
    assert second["completion_logprobs"] == pytest.approx(first["completion_logprobs"], abs=1e-5)
    assert len(second["completion_logprobs"]) == len(second["completion_token_ids"]) > 0


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_and_its_result_go_through_as_chat_tool_calls(gateway: Proc, redis_client, stream: bool):
    """The fake writes a hermes tool call when tools are offered: a tool_use block (input_json_delta when
    streamed), then the agent's tool_result is a `tool` message answering that call's id."""
    rid = uuid.uuid4().hex
    agent = client(gateway, rid)
    ask = {"model": MODEL, "max_tokens": 200, "tools": TOOLS}
    history: list[dict] = [{"role": "user", "content": "Weather in Paris?"}]
    if stream:
        with agent.messages.stream(messages=history, **ask) as events:
            deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
            first = events.get_final_message()
    else:
        first = agent.messages.create(messages=history, **ask)
    [use] = first.content
    assert use.type == "tool_use" and use.name == "get_weather" and isinstance(use.input, dict)
    assert first.stop_reason == "tool_use"
    if stream:
        assert json.loads("".join(deltas)) == use.input
    history += [
        {"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": use.id,
                    "content": [{"type": "text", "text": "Sunny"}],
                },
                {"type": "text", "text": "And so?"},
            ],
        },
    ]
    second = agent.messages.create(messages=history, **{**ask, "tools": TOOLS})
    assert second.content
    one, two = recorded_calls(gateway, rid)
    assert one["response"]["message"]["tool_calls"][0]["id"] == use.id
    sent = two["request"]["messages"]
    # vLLM's order: the tool results of a user message come before its text
    assert sent[1] == {
        "role": "assistant",
        "tool_calls": [
            {
                "id": use.id,
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps(use.input)},
            }
        ],
    }
    assert sent[2] == {"role": "tool", "tool_call_id": use.id, "content": "Sunny"}
    assert sent[3] == {"role": "user", "content": "And so?"}
    assert two["request"]["tools"][0]["function"]["parameters"] == TOOLS[0]["input_schema"]
    assert all(len(c["completion_logprobs"]) == len(c["completion_token_ids"]) > 0 for c in (one, two))


def test_count_tokens_is_the_prompt_the_chat_call_would_have(upstream, redis_client):
    gateway, server = upstream
    rid = uuid.uuid4().hex
    body = {"model": MODEL, "system": "Be brief.", "messages": [{"role": "user", "content": "Count me."}]}
    counted = client(gateway, rid).messages.count_tokens(**body)
    answer = client(gateway, rid).messages.create(max_tokens=1, **body)
    assert counted.input_tokens == answer.usage.input_tokens > 0
    assert len(recorded_calls(gateway, rid)) == 1  # counting records nothing


@pytest.mark.parametrize(
    ("content", "where"),
    [
        (
            [{"type": "image", "source": {"type": "url", "url": "http://example.com/a.png"}}],
            "messages.0.content.0",
        ),
        (
            [{"type": "document", "source": {"type": "text", "data": "x", "media_type": "text/plain"}}],
            "messages.0",
        ),
        ([{"type": "redacted_thinking", "data": "x"}], "messages.0.content.0"),
        (
            [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}],
            "content.0",
        ),
    ],
)
def test_content_the_policy_cannot_be_trained_on_is_a_400_and_nothing_is_recorded(
    gateway: Proc, redis_client, content: list, where: str
):
    rid = uuid.uuid4().hex
    with pytest.raises(anthropic.BadRequestError) as caught:
        client(gateway, rid).messages.create(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": content}]
        )
    body = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert where in body["error"]["message"] and "not supported" in body["error"]["message"]
    assert recorded_calls(gateway, rid) == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"max_tokens": 0, "messages": []}, "max_tokens"),
        ({"max_tokens": 5, "messages": "hi"}, "messages"),
        ({"max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, "role"),
        (
            {
                "max_tokens": 5,
                "messages": [],
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "server tools",
        ),
        ({"max_tokens": 5, "messages": [], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"max_tokens": 5, "messages": [], "tool_choice": {"type": ["auto"]}}, "tool_choice.type"),
        ({"max_tokens": 5, "messages": [], "output_config": {"format": {"type": "json"}}}, "output_config"),
        ({"max_tokens": 5, "messages": [], "stream": [None]}, "stream"),
        (
            {"max_tokens": 2000, "messages": [], "thinking": {"type": "enabled", "budget_tokens": 10}},
            "budget",
        ),
    ],
)
def test_bad_requests_are_400_in_anthropics_shape(gateway: Proc, redis_client, body: dict, param: str):
    rid = uuid.uuid4().hex
    answer = httpx.post(
        f"{gateway.url}/rollouts/{rid}/v1/messages?beta=true", json={"model": MODEL, **body}, timeout=10
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert param in error["error"]["message"]
    assert recorded_calls(gateway, rid) == []


keyed_gateway = gateway_fixture(
    "messages_keys",
    rollout_key_secret=SECRET,
    require_rollout_keys="true",
    operator_token=OPERATOR["Authorization"].removeprefix("Bearer "),
)


def test_the_rollouts_environment_opens_the_messages_api_with_x_api_key(keyed_gateway: Proc, redis_client):
    created = httpx.post(f"{keyed_gateway.url}/rollouts", json={"task_id": "t"}, headers=OPERATOR).json()
    env = created["agent_env"]
    assert env["ANTHROPIC_BASE_URL"] == created["base_url"].removesuffix("/v1")
    assert env["ANTHROPIC_API_KEY"] == created["api_key"]
    agent = anthropic.Anthropic(base_url=env["ANTHROPIC_BASE_URL"], api_key=env["ANTHROPIC_API_KEY"])
    answer = agent.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert answer.content[0].text
    assert len(records(keyed_gateway, created["rollout_id"])) == 1
    # another rollout's key, or none: Anthropic's authentication and permission errors
    other = httpx.post(f"{keyed_gateway.url}/rollouts", json={}, headers=OPERATOR).json()
    with pytest.raises(anthropic.PermissionDeniedError) as denied:
        anthropic.Anthropic(
            base_url=env["ANTHROPIC_BASE_URL"], api_key=other["api_key"], max_retries=0
        ).messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert denied.value.body["error"]["type"] == "permission_error"
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic.Anthropic(
            base_url=env["ANTHROPIC_BASE_URL"], api_key="nope", max_retries=0
        ).messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["error"]["type"] == "authentication_error"
    assert len(records(keyed_gateway, created["rollout_id"])) == 1


def records(gateway: Proc, rollout_id: str) -> list[dict]:
    return httpx.get(f"{gateway.url}/rollouts/{rollout_id}", headers=OPERATOR, timeout=10).json()["calls"]


def test_an_upstream_error_is_anthropics_error_and_is_recorded(gateway: Proc, redis_client):
    rid = uuid.uuid4().hex
    with pytest.raises(anthropic.InternalServerError) as caught:
        client(gateway, rid).messages.create(
            model=MODEL,
            max_tokens=5,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"vllm_xargs": {"fake_status": 503}},
        )
    assert caught.value.status_code == 503 and caught.value.body["error"]["type"] == "overloaded_error"
    [record] = recorded_calls(gateway, rid)
    assert record["error"]["status"] == 503
    # mid-stream: the open block is closed, then Anthropic's error event, and nothing after it
    with httpx.stream(
        "POST",
        f"{gateway.url}/rollouts/{rid}/v1/messages",
        json={
            "model": MODEL,
            "max_tokens": 30,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
            "vllm_xargs": {"fake_fail_after": 2},
        },
        timeout=10,
    ) as answer:
        names = [line[7:] for line in answer.iter_lines() if line.startswith("event: ")]
    assert names[0] == "message_start" and names[-2:] == ["content_block_stop", "error"]
    assert "message_stop" not in names
    assert recorded_calls(gateway, rid)[-1]["error"] is not None


@pytest.mark.slow
def test_the_answer_equals_real_vllms_own_messages_api(vllm: Proc, vllm_gateway: Proc, redis_client):
    """For the same greedy request, the gateway's Messages answer (through vLLM's chat completions) equals
    what vLLM 0.32's own `/v1/messages` answers: content, stop reason and usage; streamed, the same events
    in the same order with the same text."""
    base = vllm.url.removesuffix("/v1")
    rid = uuid.uuid4().hex
    request = {
        "model": MODEL,
        "max_tokens": 16,
        "system": "You add numbers.",
        "messages": [{"role": "user", "content": "2+3="}],
    }
    greedy = {"temperature": 0}
    ours = client(vllm_gateway, rid).messages.create(**request, extra_body=greedy)
    theirs = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0).messages.create(
        **request, extra_body=greedy
    )
    assert [b.model_dump() for b in ours.content] == [b.model_dump() for b in theirs.content]
    assert ours.stop_reason == theirs.stop_reason and ours.usage == theirs.usage
    assert ours.model == theirs.model

    def events(url: str) -> list[tuple[str, str]]:
        with httpx.stream("POST", url, json={**request, **greedy, "stream": True}, timeout=60) as answer:
            lines = list(answer.iter_lines())
        out = []
        for name, data in zip(lines[0::3], lines[1::3], strict=False):
            event = json.loads(data.removeprefix("data: "))
            delta = event.get("delta", {})
            out.append((name.removeprefix("event: "), delta.get("text") or delta.get("stop_reason") or ""))
        return out

    mine, vllms = events(f"{vllm_gateway.url}/rollouts/{rid}/v1/messages"), events(f"{base}/v1/messages")
    # vLLM cuts a stream's chunks by timing: compare the text joined, and the events around it
    assert "".join(t for n, t in mine if n == "content_block_delta") == "".join(
        t for n, t in vllms if n == "content_block_delta"
    )
    assert [e for e in mine if e[0] != "content_block_delta"] == [
        e for e in vllms if e[0] != "content_block_delta"
    ]
    first, second = recorded_calls(vllm_gateway, rid)
    assert second["completion_token_ids"] == first["completion_token_ids"]
    assert len(second["completion_logprobs"]) == len(second["completion_token_ids"]) > 0
