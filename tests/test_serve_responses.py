"""`POST /v1/responses` of `rlgate serve` (rlgate/inference/responses.py) as a real process: vLLM 0.33's body and
event stream field by field (docs/vllm-wire-format.md section 7), token ids and log-probs against the
tokenizer and a direct forward pass, `--logprobs-mode`, hermes function calls with the tiny model taught to
call the calculator (tests/tool_model.py), errors, and the real OpenAI SDK and OpenAI Agents SDK as clients.
tests/test_vllm_oracle.py judges the same bodies and events with vLLM's own models."""

from __future__ import annotations

import asyncio
import json
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from conftest import Proc, start_rlgate_serve
from test_gateway_proxy import TOOLS
from test_serve import direct_logprobs, hf, model_dir, prompt_ids, server  # noqa: F401 (the tiny model's fixtures)

from rlgate.inference.engine import SamplingParams

MODEL = "tiny"
EOS = 258
LOGPROBS = "message.output_text.logprobs"
RESPONSE_KEYS = [
    "id",
    "created_at",
    "incomplete_details",
    "instructions",
    "metadata",
    "model",
    "object",
    "output",
    "parallel_tool_calls",
    "temperature",
    "tool_choice",
    "tools",
    "top_p",
    "background",
    "max_output_tokens",
    "max_tool_calls",
    "previous_response_id",
    "prompt",
    "prompt_cache_options",
    "prompt_cache_key",
    "prompt_cache_retention",
    "reasoning",
    "safety_identifier",
    "service_tier",
    "status",
    "text",
    "top_logprobs",
    "truncation",
    "usage",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "kv_transfer_params",
    "ec_transfer_params",
    "input_messages",
    "output_messages",
]
CALCULATOR = {"type": "function", **TOOLS[0]["function"], "strict": False}  # the chat tests' tool, flat
# input items: a call of the calculator (call_1, expression "1") and its output ("1")
CALCULATOR_CALL = [
    {
        "type": "function_call",
        "call_id": "call_1",
        "name": "calculator",
        "arguments": '{"expression": "1"}',
        "id": "fc_1",
        "status": "completed",
    },
    {"type": "function_call_output", "call_id": "call_1", "output": "1"},
]


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """`rlgate serve` on the tiny model taught to call the calculator for one question."""
    from tool_model import cached_tool_calling_model

    tmp = tmp_path_factory.mktemp("responses_tools")
    proc = start_rlgate_serve(cached_tool_calling_model(), tmp, MODEL)
    yield proc
    proc.kill(signal.SIGTERM)


def create(server: Proc, **fields) -> dict:
    response = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, **fields}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def events(server: Proc, **fields) -> list[dict]:
    """The stream's events, checking vLLM's framing: `event: TYPE\\ndata: JSON\\n\\n`, no [DONE]."""
    with httpx.stream(
        "POST", f"{server.url}/v1/responses", json={"model": MODEL, **fields, "stream": True}, timeout=60
    ) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
        raw = response.read().decode()
    assert "[DONE]" not in raw and raw.endswith("\n\n")
    found = []
    for block in raw[:-2].split("\n\n"):
        match = re.fullmatch(r"event: (\S+)\ndata: (.*)", block)
        assert match, block
        event = json.loads(match.group(2))
        assert event["type"] == match.group(1)
        found.append(event)
    assert [e["sequence_number"] for e in found] == list(range(len(found)))
    return found


def no_eos(**fields) -> dict:
    """A generation cut by max_output_tokens, whatever the seed: EOS can never be sampled."""
    return {"logit_bias": {str(EOS): -100}, **fields}


# ---------------------------------------------------------------------------------------------------------
# non-streaming


def test_response_fields_are_vllms(server: Proc):
    body = create(server, input="What is 17 + 25?", max_output_tokens=5, seed=1, **no_eos())
    assert list(body) == RESPONSE_KEYS
    assert re.fullmatch(r"resp_[0-9a-f]{16}", body["id"]) and body["object"] == "response"
    assert body["model"] == MODEL and body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    # effective sampling values, vLLM's defaults for what the request left out
    assert (body["temperature"], body["top_p"], body["max_output_tokens"]) == (1.0, 1.0, 5)
    assert body["tool_choice"] == "none" and body["tools"] == [] and body["parallel_tool_calls"] is True
    assert body["top_logprobs"] is None and body["input_messages"] is None and body["output_messages"] is None
    assert (body["service_tier"], body["truncation"], body["background"]) == ("auto", "disabled", False)
    [item] = body["output"]
    assert list(item) == ["id", "content", "role", "status", "type", "phase"]
    assert re.fullmatch(r"msg_[0-9a-f]{16}", item["id"])
    assert (item["role"], item["status"], item["type"], item["phase"]) == (
        "assistant",
        "incomplete",
        "message",
        None,
    )
    [part] = item["content"]
    assert part == {"annotations": [], "text": part["text"], "type": "output_text", "logprobs": None}
    assert body["usage"]["output_tokens"] == 5
    assert body["usage"]["total_tokens"] == body["usage"]["input_tokens"] + 5
    assert body["usage"]["input_tokens_details"] == {
        "cached_tokens": 0,
        "cache_write_tokens": 0,
        "input_tokens_per_turn": [],
        "cached_tokens_per_turn": [],
    }
    echoed = create(
        server,
        input="Hi",
        max_output_tokens=3,
        temperature=0.5,
        top_p=0.8,
        seed=2,
        instructions="Be brief.",
        metadata={"k": "v"},
        user="u",
        store=True,
        unknown_field=[1],
    )
    assert (echoed["temperature"], echoed["top_p"], echoed["instructions"]) == (0.5, 0.8, "Be brief.")
    assert (echoed["metadata"], echoed["user"]) == ({"k": "v"}, "u")
    # without max_output_tokens: all of the context the prompt leaves (EOS forced, so it stops at once)
    unbounded = create(server, input="Hi", seed=3, enable_response_messages=True, logit_bias={str(EOS): 100})
    max_model_len = httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"]
    assert unbounded["max_output_tokens"] == max_model_len - len(unbounded["input_messages"][0]["tokens"])
    assert unbounded["output"] == [] and unbounded["output_messages"][0]["tokens"] == [EOS]


def test_response_messages_carry_the_prompt_and_every_generated_token(server: Proc, hf):
    tokenizer, model = hf
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 17 + 25?"},
    ]
    body = create(
        server,
        input="What is 17 + 25?",
        instructions="You are terse.",
        max_output_tokens=6,
        seed=4,
        enable_response_messages=True,
        include=[LOGPROBS],
        top_logprobs=2,
    )
    [inp], [out] = body["input_messages"], body["output_messages"]
    assert inp["type"] == out["type"] == "raw_message_tokens"
    assert inp["tokens"] == prompt_ids(tokenizer, messages)
    assert inp["message"] == tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert out["tokens"] and body["usage"]["output_tokens"] == len(out["tokens"])
    assert out["message"] == tokenizer.decode(out["tokens"], skip_special_tokens=True)
    [item] = body["output"]
    lps = item["content"][0]["logprobs"]
    assert len(lps) == len(out["tokens"])  # every generated token, EOS included
    assert body["top_logprobs"] == 2
    for entry, token in zip(lps, out["tokens"], strict=True):
        assert list(entry) == ["token", "bytes", "logprob", "top_logprobs"]
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["logprob"] == entry["logprob"]
        assert all(list(t) == ["token", "bytes", "logprob"] for t in entry["top_logprobs"])
        assert entry["token"] == tokenizer.decode([token])
    want = direct_logprobs(model, inp["tokens"], out["tokens"], SamplingParams(max_tokens=6))
    assert [e["logprob"] for e in lps] == pytest.approx(want, abs=1e-4)


def test_logprobs_come_only_with_the_include(server: Proc):
    plain = create(server, input="Hi", max_output_tokens=3, seed=5, top_logprobs=3, include=[])
    assert plain["top_logprobs"] is None and plain["output"][0]["content"][0]["logprobs"] is None
    zero = create(server, input="Hi", max_output_tokens=3, seed=5, include=[LOGPROBS])
    assert zero["top_logprobs"] == 0
    assert all(e["top_logprobs"] == [] for e in zero["output"][0]["content"][0]["logprobs"])
    assert zero["output"][0]["content"][0]["text"] == plain["output"][0]["content"][0]["text"]  # same seed


def test_logprobs_follow_the_servers_logprobs_mode(server: Proc, model_dir: Path, hf, tmp_path: Path):
    """processed_logprobs (this module's server): of the distribution sampled from, here temperature 0.5;
    raw_logprobs (vLLM's default): of the model's own distribution."""
    tokenizer, model = hf
    raw_server = start_rlgate_serve(model_dir, tmp_path, MODEL, logprobs_mode=None)
    try:
        fields = dict(
            input="Hi",
            max_output_tokens=4,
            seed=6,
            temperature=0.5,
            include=[LOGPROBS],
            enable_response_messages=True,
        )
        processed, raw = create(server, **fields), create(raw_server, **fields)
    finally:
        raw_server.kill(signal.SIGTERM)
    prompt, tokens = processed["input_messages"][0]["tokens"], processed["output_messages"][0]["tokens"]
    assert raw["output_messages"][0]["tokens"] == tokens  # the same sample; only what is reported differs
    for body, params in (
        (processed, SamplingParams(max_tokens=4, temperature=0.5)),
        (raw, SamplingParams(max_tokens=4)),
    ):
        got = [e["logprob"] for e in body["output"][0]["content"][0]["logprobs"]]
        assert got == pytest.approx(direct_logprobs(model, prompt, tokens, params), abs=1e-4)
    assert [e["logprob"] for e in processed["output"][0]["content"][0]["logprobs"]] != pytest.approx(
        [e["logprob"] for e in raw["output"][0]["content"][0]["logprobs"]], abs=1e-3
    )


def test_input_items_render_as_vllm_renders_them(server: Proc, hf):
    """Messages, an assistant output message, a function call joining no assistant message and its output:
    the chat messages vLLM's construct_input_messages makes, through the same chat template."""
    tokenizer, _ = hf
    items = [
        {"role": "user", "content": "Weather?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        *CALCULATOR_CALL,
        {"role": "user", "content": [{"type": "input_text", "text": "And?"}]},
    ]
    body = create(
        server, input=items, tools=[CALCULATOR], max_output_tokens=2, seed=7, enable_response_messages=True
    )
    chat_tools = [{"type": "function", "function": {k: v for k, v in CALCULATOR.items() if k != "type"}}]
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "1"}'},
                }
            ],
        },
        {"role": "tool", "content": "1", "tool_call_id": "call_1"},
        {"role": "user", "content": "And?"},
    ]
    assert body["input_messages"][0]["tokens"] == prompt_ids(tokenizer, messages, chat_tools)
    assert body["tool_choice"] == "auto"
    assert body["tools"] == [
        {
            "name": "calculator",
            "parameters": CALCULATOR["parameters"],
            "strict": False,
            "type": "function",
            "allowed_callers": None,
            "async": None,
            "defer_loading": None,
            "description": CALCULATOR["description"],
            "output_schema": None,
        }
    ]


# ---------------------------------------------------------------------------------------------------------
# streaming


def test_stream_events_are_vllms_and_end_with_the_full_response(server: Proc):
    fields = dict(
        input="What is 17 + 25?",
        max_output_tokens=6,
        seed=8,
        include=[LOGPROBS],
        top_logprobs=1,
        enable_response_messages=True,
        **no_eos(),
    )
    found = events(server, **fields)
    plain = create(server, **fields)
    assert [e["type"] for e in found] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * (len(found) - 8),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    created, in_progress, final = found[0]["response"], found[1]["response"], found[-1]["response"]
    assert created == in_progress and created["status"] == "in_progress" and created["output"] == []
    assert (
        created["usage"] is None and created["input_messages"] is None and created["output_messages"] is None
    )
    assert list(found[0]) == ["response", "sequence_number", "type"]
    assert final["created_at"] == created["created_at"] and final["id"] == created["id"]
    assert list(final) == RESPONSE_KEYS and final["status"] == "incomplete"
    # the same seed gives the same sample: the stream's final response is the non-streamed one (ids aside)
    assert (
        final["output_messages"] == plain["output_messages"]
        and final["input_messages"] == plain["input_messages"]
    )
    assert final["usage"] == plain["usage"]
    deltas = [e for e in found if e["type"] == "response.output_text.delta"]
    text = plain["output"][0]["content"][0]["text"]
    assert "".join(d["delta"] for d in deltas) == text
    assert found[-4] == {
        "content_index": 0,
        "item_id": found[2]["item"]["id"],
        "logprobs": [],
        "output_index": 0,
        "sequence_number": len(found) - 4,
        "text": text,
        "type": "response.output_text.done",
    }
    for (
        delta
    ) in deltas:  # one token per delta here (ASCII-free bytes may hold a delta back: then it is missing)
        assert all(list(lp) == ["token", "logprob", "top_logprobs"] for lp in delta["logprobs"])
        assert all(list(t) == ["token", "logprob"] for lp in delta["logprobs"] for t in lp["top_logprobs"])
    part = found[-3]["part"]
    streamed = [lp for d in deltas for lp in d["logprobs"]]
    assert [(p["token"], p["logprob"]) for p in part["logprobs"]] == [
        (p["token"], p["logprob"]) for p in streamed
    ]
    assert found[-2]["item"]["status"] == "incomplete" and found[-2]["item"]["content"] == [part]
    assert final["output"] == [found[-2]["item"]]
    # the non-streamed logprobs cover every token; the streamed ones those that produced text
    assert len(plain["output"][0]["content"][0]["logprobs"]) == 6 >= len(streamed) > 0


def test_stream_without_include_has_no_logprobs(server: Proc):
    found = events(server, input="Hi", max_output_tokens=4, seed=9, **no_eos())
    deltas = [e for e in found if e["type"] == "response.output_text.delta"]
    assert deltas and all(d["logprobs"] == [] for d in deltas)
    assert found[-3]["part"]["logprobs"] is None and found[-1]["response"]["top_logprobs"] is None
    assert found[-1]["response"]["output_messages"] is None


# ---------------------------------------------------------------------------------------------------------
# function calls (the tiny model taught to call the calculator, greedy). The first of these builds that
# model (400 supervised steps: about a minute on a quiet 2-core machine, several on a busy one), within its
# own timeout

QUESTION = "What is 17 + 25? Use the calculator."


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_function_call_items(tool_server: Proc):
    body = create(
        tool_server,
        input=QUESTION,
        tools=[CALCULATOR],
        temperature=0,
        include=[LOGPROBS],
        enable_response_messages=True,
        max_output_tokens=200,
    )
    assert body["status"] == "completed"
    [call] = body["output"]  # no text before the call: no message item, and with it no log-probs (as vLLM)
    assert list(call) == [
        "arguments",
        "call_id",
        "name",
        "type",
        "id",
        "async",
        "caller",
        "namespace",
        "status",
    ]
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", call["call_id"]) and re.fullmatch(
        r"fc_[0-9a-f]{16}", call["id"]
    )
    assert (call["name"], json.loads(call["arguments"]), call["status"]) == (
        "calculator",
        {"expression": "17 + 25"},
        "completed",
    )
    out = body["output_messages"][0]
    assert (
        out["message"].startswith("<tool_call>") and out["tokens"][-1] == EOS
    )  # markup and EOS are recorded
    kept = create(
        tool_server,
        input=QUESTION,
        tools=[CALCULATOR],
        temperature=0,
        tool_choice="none",
        max_output_tokens=200,
    )
    [message] = kept["output"]  # tool_choice "none": the markup stays text
    assert message["type"] == "message" and message["content"][0]["text"].startswith("<tool_call>")
    cut = create(tool_server, input=QUESTION, tools=[CALCULATOR], temperature=0, max_output_tokens=5)
    assert cut["status"] == "incomplete" and cut["output"][-1]["status"] == "incomplete"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_function_call_stream(tool_server: Proc):
    found = events(tool_server, input=QUESTION, tools=[CALCULATOR], temperature=0, max_output_tokens=200)
    types = [e["type"] for e in found]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(types[3:-3]) == {"response.function_call_arguments.delta"}
    added, done, item_done = found[2]["item"], found[-3], found[-2]["item"]
    assert added["type"] == "function_call" and added["status"] == "in_progress" and added["arguments"] == ""
    arguments = "".join(e["delta"] for e in found[3:-3])
    assert json.loads(arguments) == {"expression": "17 + 25"}
    assert list(done) == ["arguments", "item_id", "output_index", "sequence_number", "type", "name"]
    assert (done["arguments"], done["name"], done["item_id"]) == (arguments, "calculator", added["id"])
    assert item_done == {**added, "arguments": arguments, "status": "completed"}
    assert found[-1]["response"]["output"] == [item_done]


# ---------------------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    ("fields", "status", "param"),
    [
        ({"previous_response_id": "resp_0"}, 404, "response_id"),
        ({"prompt": {"id": "p"}}, 400, "prompt"),
        ({"background": True}, 400, "background"),
        ({"tool_choice": "required"}, 400, "tool_choice"),
        ({"tools": [CALCULATOR], "tool_choice": {"type": "function", "name": "other"}}, 400, "tool_choice"),
        ({"include": ["nope"]}, 400, "body.include.0"),
        ({"model": "other"}, 404, "model"),
        ({"max_output_tokens": 5000}, 400, "max_output_tokens"),
        ({"tools": [{"type": "web_search"}]}, 400, "tools"),
    ],
)
def test_errors(server: Proc, fields: dict, status: int, param: str):
    response = httpx.post(
        f"{server.url}/v1/responses", json={"model": MODEL, "input": "x", **fields}, timeout=60
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (status, param)
    if status == 404 and param == "response_id":
        assert error == {
            "message": "Response with id 'resp_0' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }


def test_stored_responses_do_not_exist(server: Proc):
    for method, path in (("GET", "/v1/responses/resp_1"), ("POST", "/v1/responses/resp_1/cancel")):
        response = httpx.request(method, f"{server.url}{path}", timeout=30)
        assert response.status_code == 404 and response.json()["error"]["param"] == "response_id"


# ---------------------------------------------------------------------------------------------------------
# the OpenAI SDK and the OpenAI Agents SDK


def test_openai_sdk_responses(server: Proc):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")
    response = client.responses.create(
        model=MODEL,
        input="Hi",
        max_output_tokens=4,
        include=[LOGPROBS],
        extra_body={"enable_response_messages": True, "seed": 10},
    )
    assert response.status in ("completed", "incomplete") and response.output_text
    assert response.output[0].content[0].logprobs[0].bytes is not None
    assert response.model_extra["output_messages"][0]["tokens"]
    stream = client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=4, stream=True, extra_body={"seed": 10}
    )
    seen = list(stream)
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    assert seen[0].type == "response.created" and seen[-1].type in (
        "response.completed",
        "response.incomplete",
    )
    assert (
        "".join(e.delta for e in seen if e.type == "response.output_text.delta")
        == seen[-1].response.output_text
    )
    assert seen[-1].response.output_text == response.output_text  # same seed, same sample


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_openai_agents_sdk_runs_a_function_tool(tool_server: Proc):
    agents = pytest.importorskip("agents")
    calls = []

    @agents.function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        calls.append(expression)
        return "42"

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=f"{tool_server.url}/v1", api_key="x")
    agent = agents.Agent(
        name="calc",
        instructions="You are a helpful assistant.",
        tools=[calculator],
        model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=agents.ModelSettings(temperature=0, max_tokens=200),
    )
    result = asyncio.run(agents.Runner.run(agent, QUESTION))
    assert calls == ["17 + 25"]
    assert result.final_output == "The answer is 42."
    assert len(result.raw_responses) == 2
