"""OpenAI's Responses API on the agent surface (`gateway.responses`), judged by the `openai` SDK's own types
and by the upstream: the answer is the upstream's chat completion translated, the record is that chat call
with every token's id and log-prob exactly (streamed too, which vLLM's own `/v1/responses` cannot give), and
in front of real vLLM the prompt is the one vLLM's `/v1/responses` renders and the answer equals its own."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest
from conftest import Proc, recorded_calls, upstream_chat

MODEL = "fake-model"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
LOGPROBS = ["message.output_text.logprobs"]


def client(gateway: Proc, rollout_id: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rollout_id}/v1", api_key="unused", max_retries=0)


def test_an_answer_is_the_upstreams_chat_answer_translated_and_recorded_exactly(upstream, redis_client):
    gateway, server = upstream
    rid = uuid.uuid4().hex
    answer = client(gateway, rid).responses.create(
        model=MODEL,
        instructions="Be brief.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "What is 2+3?"}]}],
        max_output_tokens=12,
        temperature=0,
        include=LOGPROBS,
    )
    direct = upstream_chat(
        server,
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "What is 2+3?"}]},
            ],
            "max_tokens": 12,
            "temperature": 0,
        },
    )
    choice = direct["choices"][0]
    assert isinstance(answer, openai.types.responses.Response)
    assert answer.id.startswith("resp_") and answer.model == MODEL and answer.instructions == "Be brief."
    assert answer.output_text == choice["message"]["content"]
    [message] = answer.output
    assert message.type == "message" and message.id.startswith("msg_")
    assert answer.status == {"stop": "completed", "length": "incomplete"}[choice["finish_reason"]]
    assert answer.usage.input_tokens == direct["usage"]["prompt_tokens"]
    assert answer.usage.output_tokens == direct["usage"]["completion_tokens"]
    # the log-probs the agent asked for: every generated token's, as vLLM's non-streamed answer has them
    assert [lp.logprob for lp in message.content[0].logprobs] == pytest.approx(
        [t["logprob"] for t in choice["logprobs"]["content"]], abs=1e-5
    )
    [record] = recorded_calls(gateway, rid)
    assert record["agent_api"] == "openai.responses" and record["endpoint"] == "chat.completions"
    assert record["prompt_token_ids"] == direct["prompt_token_ids"]
    assert record["completion_token_ids"] == choice["token_ids"]
    assert record["completion_logprobs"] == pytest.approx(
        [t["logprob"] for t in choice["logprobs"]["content"]], abs=1e-5
    )


def test_a_stream_is_the_responses_event_sequence_and_records_every_tokens_logprob(
    gateway: Proc, redis_client
):
    rid = uuid.uuid4().hex
    request = {"model": MODEL, "input": "Say something.", "max_output_tokens": 200, "temperature": 0}
    unary = client(gateway, rid).responses.create(**request)
    with client(gateway, rid).responses.stream(**request, include=LOGPROBS) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas) :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{unary.status}",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == unary.output_text == "".join(d.delta for d in deltas)
    assert final.usage.output_tokens == unary.usage.output_tokens
    assert events[0].response.id == final.id and final.id != unary.id
    first, second = recorded_calls(gateway, rid)
    assert second["stream"] and second["agent_api"] == "openai.responses"
    assert second["prompt_token_ids"] == first["prompt_token_ids"]
    assert second["completion_token_ids"] == first["completion_token_ids"]
    assert len(second["completion_logprobs"]) == len(second["completion_token_ids"]) > 0
    assert second["completion_logprobs"] == pytest.approx(first["completion_logprobs"], abs=1e-5)
    # the deltas carry the log-probs of their chunk's tokens (the end-of-sequence token's makes no text)
    streamed = [lp.logprob for d in deltas for lp in d.logprobs]
    assert streamed == pytest.approx(second["completion_logprobs"][: len(streamed)], abs=1e-5)


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_call_and_its_output_go_through_as_chat_tool_calls(
    gateway: Proc, redis_client, stream: bool
):
    """The fake writes a hermes tool call when tools are offered: a function_call item (its arguments'
    deltas when streamed); the agent sends it back with a function_call_output item, which reaches the
    upstream as the assistant's tool call and a `tool` message answering its id."""
    rid = uuid.uuid4().hex
    agent = client(gateway, rid)
    ask = {"model": MODEL, "tools": [WEATHER], "max_output_tokens": 200, "temperature": 0}
    history: list = [{"role": "user", "content": "Weather in Paris?"}]
    if stream:
        with agent.responses.stream(input=history, **ask) as events:
            kinds = [e.type for e in events]
            first = events.get_final_response()
        assert "response.function_call_arguments.delta" in kinds
        assert kinds[-3:] == [
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
    else:
        first = agent.responses.create(input=history, **ask)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments).keys() == {"city"}
    history += [
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"},
    ]
    second = agent.responses.create(input=history, **ask)
    assert second.output_text and second.output[0].type == "message"
    first_record, second_record = recorded_calls(gateway, rid)
    assert first_record["response"]["message"]["tool_calls"][0]["id"] == call.call_id
    sent = second_record["request"]["messages"]
    assert sent[1] == {
        "role": "assistant",
        "tool_calls": [
            {
                "id": call.call_id,
                "function": {"name": "get_weather", "arguments": call.arguments},
                "type": "function",
            }
        ],
    }
    assert sent[2] == {"role": "tool", "content": "Sunny", "tool_call_id": call.call_id}
    # in vLLM's FunctionDefinition's key order, which the template renders
    [tool] = second_record["request"]["tools"]
    assert tool["type"] == "function" and list(tool["function"].items()) == [
        ("name", "get_weather"),
        ("description", WEATHER["description"]),
        ("parameters", WEATHER["parameters"]),
    ]
    for record in (first_record, second_record):
        assert len(record["completion_logprobs"]) == len(record["completion_token_ids"]) > 0


@pytest.mark.parametrize("stream", [False, True])
def test_namespaced_and_custom_tools_are_shown_as_vllm_shows_them_and_named_back(
    gateway: Proc, redis_client, stream: bool
):
    """Codex's tools as vLLM renders them: a namespace's functions as `<namespace>__<name>` (a call is named
    back with its namespace), a custom tool as a function of one string, a server tool (`web_search`) not
    shown to the model (the gateway runs none) and echoed as sent."""
    rid = uuid.uuid4().hex
    tools = [
        {"type": "web_search", "external_web_access": False},
        {
            "type": "namespace",
            "name": "agents",
            "description": "Sub-agents.",
            "tools": [
                {
                    "type": "function",
                    "name": "spawn",
                    "parameters": {"type": "object", "properties": {"task": {"type": "string"}}},
                }
            ],
        },
        {"type": "custom", "name": "apply_patch", "description": "Patches a file."},
    ]
    body = {
        "model": MODEL,
        "input": "Go.",
        "tools": tools,
        "tool_choice": {"type": "function", "name": "spawn"},
        "max_output_tokens": 200,
        "stream": stream,
    }
    answer = httpx.post(f"{gateway.url}/rollouts/{rid}/v1/responses", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    if stream:
        events = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: ")]
        response = events[-1]["response"]
        added = next(e for e in events if e["type"] == "response.output_item.added")
        assert added["item"]["name"] == "spawn" and added["item"]["namespace"] == "agents"
    else:
        response = answer.json()
    openai.types.responses.Response.model_validate(response)
    [call] = response["output"]
    assert call["type"] == "function_call" and call["name"] == "spawn" and call["namespace"] == "agents"
    assert response["tools"][0] == tools[0]
    [record] = recorded_calls(gateway, rid)
    shown = record["request"]["tools"]
    assert [t["function"]["name"] for t in shown] == ["agents__spawn", "apply_patch"]
    assert shown[1]["function"]["parameters"]["required"] == ["input"]
    assert record["request"]["tool_choice"] == {"type": "function", "function": {"name": "agents__spawn"}}
    assert record["response"]["message"]["tool_calls"][0]["function"]["name"] == "agents__spawn"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,x"}]}]},
            400,
            "input.0.content.0",
        ),
        ({"input": "hi", "previous_response_id": "resp_1"}, 404, "response_id"),
        ({"input": "hi", "enable_response_messages": True}, 400, "enable_response_messages"),
        (
            {"input": [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "x"}]},
            400,
            "input",
        ),
        ({"input": [{"type": "file_search_call", "id": "fs_1"}]}, 400, "input"),
        ({"input": 3}, 400, "input"),
        ({"input": "hi", "tool_choice": "required"}, 400, "tool_choice"),
        ({"input": "hi", "tools": [{"type": "web_search"}], "tool_choice": "required"}, 400, "tool_choice"),
        ({"input": "hi", "background": True}, 400, "background"),
        ({"input": "hi", "text": {"format": {"type": "grammar"}}}, 400, "text.format"),
        ({"input": "hi", "text": "x", "structured_outputs": {"json": {}}}, 400, "text"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]},
            400,
            "input.0.content.0",
        ),
        ({"input": "hi", "tools": [{"type": "function"}]}, 400, "tools.0"),
        (
            {"input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]},
            400,
            "tool_choice",
        ),
    ],
)
def test_what_the_gateway_cannot_serve_exactly_is_a_clear_error_and_records_nothing(
    gateway: Proc, redis_client, body: dict, status: int, param: str
):
    rid = uuid.uuid4().hex
    answer = httpx.post(
        f"{gateway.url}/rollouts/{rid}/v1/responses", json={"model": MODEL, **body}, timeout=10
    )
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert (
        error["param"] == param
        and error["message"]
        and error["type"] in ("invalid_request_error", "not_found_error")
    )
    assert recorded_calls(gateway, rid) == []


@pytest.mark.slow
def test_the_prompt_is_the_one_real_vllms_responses_api_renders_and_the_answer_equals_its_own(
    vllm: Proc, vllm_gateway: Proc, redis_client
):
    """Real vLLM 0.32: the same greedy Responses request to its own `/v1/responses` (asking for the
    rendered prompt's ids with `enable_response_messages`) and through the gateway: the recorded prompt ids
    are the ones vLLM rendered (instructions, developer and user messages with content parts, a function
    call, its output, tools), the output items and usage are the same, and streamed, the same events in the
    same order with the same text."""
    base = vllm.url
    rid = uuid.uuid4().hex
    request = {
        "model": MODEL,
        "instructions": "You add numbers.",
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "Be exact."}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "2+3="}, {"type": "input_text", "text": "?"}],
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
        ],
        "tools": [WEATHER, {"type": "web_search"}],
        "max_output_tokens": 16,
        "temperature": 0,
    }
    theirs = httpx.post(f"{base}/responses", json={**request, "enable_response_messages": True}, timeout=120)
    assert theirs.status_code == 200, theirs.text
    theirs = theirs.json()
    ours = httpx.post(f"{vllm_gateway.url}/rollouts/{rid}/v1/responses", json=request, timeout=120)
    assert ours.status_code == 200, ours.text
    ours = ours.json()
    [record] = recorded_calls(vllm_gateway, rid)
    assert record["prompt_token_ids"] == theirs["input_messages"][0]["tokens"]
    assert record["completion_token_ids"] == theirs["output_messages"][0]["tokens"]

    def shape(response: dict) -> dict:
        # the last item's status is vLLM 0.33's rule (the response's status when the token budget cut
        # it), which 0.32 did not have yet (always "completed")
        items = [
            {k: v for k, v in item.items() if k not in ("id", "call_id", "status")}
            for item in response["output"]
        ]
        return {"output": items, "usage": response["usage"], "status": response["status"]}

    assert shape(ours) == shape(theirs)
    assert ours["output"][-1]["status"] == ours["status"]
    for key in (
        "model",
        "instructions",
        "tool_choice",
        "temperature",
        "top_p",
        "parallel_tool_calls",
        "text",
    ):
        assert ours[key] == theirs[key], key

    def events(url: str) -> list[tuple[str, str]]:
        with httpx.stream("POST", url, json={**request, "stream": True}, timeout=120) as answer:
            lines = [line for line in answer.iter_lines() if line.startswith("data: ")]
        out = []
        for line in lines:
            event = json.loads(line[6:])
            out.append((event["type"], event.get("delta") or ""))
        return out

    mine, vllms = events(f"{vllm_gateway.url}/rollouts/{rid}/v1/responses"), events(f"{base}/responses")
    # vLLM cuts a stream's chunks by timing: compare the text joined, and the events around it
    assert "".join(d for n, d in mine if n.endswith(".delta")) == "".join(
        d for n, d in vllms if n.endswith(".delta")
    )
    # the terminal event: vLLM 0.33's response.incomplete when the budget ran out (0.32 said completed)
    assert [n for n, _ in mine[:-1] if not n.endswith(".delta")] == [
        n for n, _ in vllms[:-1] if not n.endswith(".delta")
    ]
    assert mine[-1][0] == f"response.{ours['status']}" and vllms[-1][0] == "response.completed"
    streamed = recorded_calls(vllm_gateway, rid)[-1]
    assert streamed["completion_token_ids"] == record["completion_token_ids"]
    assert len(streamed["completion_logprobs"]) == len(streamed["completion_token_ids"]) > 0


def test_the_echo_is_vllms_when_it_constrains_the_answer_to_a_tool_call(gateway: Proc, redis_client):
    """vLLM (hermes, strict tool calling: its default) constrains a required or named tool choice to a tool
    call and then echoes `text` as null; otherwise the request's `text` comes back as sent."""
    text = {"format": {"type": "text"}, "verbosity": None}
    for ask, echoed in (
        ({"tools": [WEATHER], "tool_choice": "required"}, None),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}, None),
        ({"tools": [WEATHER], "parallel_tool_calls": False}, text),  # constrained only without text.format
        ({"tools": [{**WEATHER, "strict": True}]}, None),
        ({"tools": [WEATHER]}, text),
        ({}, text),
    ):
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 200, "text": text, **ask}
        answer = httpx.post(f"{gateway.url}/rollouts/{uuid.uuid4().hex}/v1/responses", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.json()["text"] == echoed, ask


@pytest.mark.parametrize("stream", [False, True])
def test_a_custom_tool_call_comes_back_as_its_freeform_input(gateway: Proc, redis_client, stream: bool):
    """A custom tool (Codex's freeform apply_patch) is shown as a function of one string; the model's call
    comes back as a custom_tool_call with that string as its input, streamed as input deltas that join to
    it (each a prefix's extension: the string decoded as far as it is complete)."""
    tool = {"type": "custom", "name": "apply_patch", "description": "Patches a file."}
    body = {
        "model": MODEL,
        "input": "Patch it.",
        "tools": [tool],
        "tool_choice": {"type": "custom", "name": "apply_patch"},
        "max_output_tokens": 200,
        "stream": stream,
    }
    rid = uuid.uuid4().hex
    answer = httpx.post(f"{gateway.url}/rollouts/{rid}/v1/responses", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    [record] = recorded_calls(gateway, rid)
    [sampled] = record["response"]["message"]["tool_calls"]
    payload = json.loads(sampled["function"]["arguments"])["input"]
    if stream:
        events = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: ")]
        deltas = [e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta"]
        [done] = [e for e in events if e["type"] == "response.custom_tool_call_input.done"]
        assert deltas and "".join(deltas) == done["input"] == payload
        response = events[-1]["response"]
    else:
        response = answer.json()
    openai.types.responses.Response.model_validate(response)
    [call] = response["output"]
    assert call["type"] == "custom_tool_call" and call["name"] == "apply_patch" and call["input"] == payload
    assert call["id"].startswith("ctc_") and call["call_id"] == sampled["id"]
