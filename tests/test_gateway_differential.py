"""Differential: for every combination of options, the agent gets byte-for-byte (ids aside) what the
upstream sends a plain request, and the records hold exactly what the upstream sends when asked for token
ids and log-probs. Streams are also cut into small TCP writes, so events arrive split across reads (by the
fake). Every case runs twice: in front of the fake vLLM and in front of `rlgate serve` on the tiny model
(seeded, so the same request gives the same answer). A subset runs a third time in front of real vLLM
(its CPU build, without its prefix cache so that equal seeded requests compute alike): its streams compared
by what they say (vLLM cuts chunks by timing), its log-probs within 1e-6 (a few float32 ulps)."""

from __future__ import annotations

import itertools
import json
import math
import uuid
from typing import Any

import httpx
import pytest
from conftest import Proc, output_text_logprobs
from test_gateway_proxy import MESSAGES, MODEL, TOOLS, normalize, rollout

# what the agent asks for itself: nothing, log-probs, token ids, both, or top_logprobs without logprobs (400)
ASKS = {
    "plain": {},
    "logprobs": {"logprobs": True, "top_logprobs": 2},
    "token_ids": {"return_token_ids": True},
    "both": {"logprobs": True, "return_token_ids": True},
    "top_without_logprobs": {"top_logprobs": 2},
}
COMPLETION_ASKS = {"plain": {}, "logprobs": {"logprobs": 2}, "token_ids": {"return_token_ids": True}}

CHAT_CASES = [
    (stream, n, tools, ask, usage)
    for stream, n, tools, ask, usage in itertools.product(
        (False, True), (1, 2), (False, True), ASKS, (False, True)
    )
    if stream or not usage
]
COMPLETION_CASES = [
    (stream, n, prompts, ask)
    for stream, n, prompts, ask in itertools.product((False, True), (1, 2), (1, 2), COMPLETION_ASKS)
]


def answer(url: str, body: dict) -> tuple[int, Any]:
    if not body.get("stream"):
        response = httpx.post(url, json=body, timeout=30)
        return response.status_code, response.json()
    with httpx.stream("POST", url, json=body, timeout=30) as response:
        if response.status_code != 200:
            return response.status_code, json.loads(response.read())
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    return 200, [e if e == "[DONE]" else json.loads(e) for e in events]


def expected_records(endpoint: str, full: Any, stream: bool) -> dict[int, dict]:
    """Per choice index: prompt ids, completion ids and log-probs from the upstream's full answer."""
    chat = endpoint == "chat.completions"
    chunks = [c for c in full if isinstance(c, dict)] if stream else [full]
    # chat: the prompt ids are top-level (on each choice's role chunk in streams); completions: per choice
    chat_prompt = next((c["prompt_token_ids"] for c in chunks if c.get("prompt_token_ids")), None)
    out: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk.get("choices") or ():
            slot = out.setdefault(
                choice["index"], {"prompt": chat_prompt if chat else None, "ids": [], "logprobs": []}
            )
            if not chat and choice.get("prompt_token_ids"):
                slot["prompt"] = choice["prompt_token_ids"]
            slot["ids"] += choice.get("token_ids") or []
            logprobs = choice.get("logprobs")
            if logprobs:
                slot["logprobs"] += (
                    [e["logprob"] for e in logprobs["content"]] if chat else logprobs["token_logprobs"]
                )
    return out


# Real vLLM without its prefix cache gives the same tokens for the same seeded request, but a log-prob can
# differ from one request to the next in float32's last bit (its CPU kernels' sums, the batch the choices
# were decoded in): its numbers are compared within this (relative) margin, everything else exactly.
VLLM_TOLERANCE = 1e-6


def tolerance(server: Proc) -> float:
    return VLLM_TOLERANCE if server.engine == "vllm" else 0.0


def assert_same(got: Any, want: Any, tol: float) -> None:
    """got == want, floats within `tol` of each other (relative; 0: exactly); pytest's diff otherwise."""

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, float) and isinstance(b, float):
            return a == b or (math.isfinite(a) and math.isfinite(b) and abs(a - b) <= tol * max(1.0, abs(b)))
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        return a == b

    if not same(got, want):
        assert got == want


def merged(events: list[Any]) -> dict[str, Any]:
    """A chat or completions stream as what it says, whatever its chunk boundaries: real vLLM sends the
    tokens made between two turns of its output loop in one chunk, so the same seeded request streams the
    same tokens cut differently (docs/vllm-wire-format.md). Per choice: the text, the tool calls' names,
    types and arguments, the log-prob entries, token ids, roles, finish and stop reasons; and the last
    usage, the `[DONE]`, and the shapes of the chunks (object, model, the keys of chunks, choices and
    deltas), so a field dropped or added on the way shows."""
    out: dict[str, Any] = {"choices": {}, "usage": None, "done": events[-1:] == ["[DONE]"], "shapes": set()}
    for event in events:
        if not isinstance(event, dict):
            continue
        if event.get("usage"):
            out["usage"] = event["usage"]
        # what every chunk says besides its tokens: object, model, keys, and per choice its keys and role
        out["shapes"].add((event.get("object"), event.get("model"), tuple(event)))
        for choice in event.get("choices") or ():
            slot = out["choices"].setdefault(
                choice["index"],
                {
                    "text": "",
                    "tools": {},
                    "logprobs": [],
                    "ids": [],
                    "finish": None,
                    "stop": None,
                    "roles": [],
                },
            )
            delta = choice.get("delta") or {}
            out["shapes"].add((tuple(choice), tuple(delta)))
            if "role" in delta:
                slot["roles"].append(delta["role"])
            slot["stop"] = choice.get("stop_reason", slot["stop"])
            slot["text"] += delta.get("content") or choice.get("text") or ""
            for call in delta.get("tool_calls") or ():
                tool = slot["tools"].setdefault(
                    call["index"], {"name": "", "arguments": "", "type": call.get("type")}
                )
                tool["name"] += (call.get("function") or {}).get("name") or ""
                tool["arguments"] += (call.get("function") or {}).get("arguments") or ""
            logprobs = choice.get("logprobs") or {}
            if "content" in logprobs:
                slot["logprobs"] += logprobs["content"] or []
            elif logprobs:
                for key in ("tokens", "token_logprobs", "top_logprobs"):
                    slot.setdefault(key, []).extend(logprobs.get(key) or [])
            slot["ids"] += choice.get("token_ids") or []
            slot["finish"] = choice.get("finish_reason") or slot["finish"]
            if choice.get("prompt_token_ids"):
                slot["prompt"] = choice["prompt_token_ids"]
        if event.get("prompt_token_ids"):
            out["prompt"] = event["prompt_token_ids"]
    return out


def same_answer(server: Proc, via: Any, direct: Any) -> None:
    """The agent got what a plain request gets: byte for byte (ids aside) from the fake and `rlgate serve`;
    from real vLLM the same streamed content however its chunks were cut, numbers within its margin."""
    if server.engine == "vllm" and isinstance(direct, list):
        assert_same(merged(normalize(via)), merged(normalize(direct)), VLLM_TOLERANCE)
    else:
        assert_same(normalize(via), normalize(direct), tolerance(server))


def check(gateway: Proc, server: Proc, endpoint: str, body: dict, full_extra: dict) -> None:
    path = "/chat/completions" if endpoint == "chat.completions" else "/completions"
    rid = uuid.uuid4().hex
    status, via = answer(f"{gateway.url}/rollouts/{rid}/v1{path}", body)
    direct_status, direct = answer(f"{server.url}{path}", body)
    assert status == direct_status
    same_answer(server, via, direct)
    calls = rollout(gateway, rid)["calls"]
    if status != 200:
        assert [c["error"]["status"] for c in calls] == [status]
        return
    _, full = answer(f"{server.url}{path}", {**body, **full_extra})
    expected = expected_records(endpoint, full, bool(body.get("stream")))
    assert [c["choice_index"] for c in calls] == sorted(expected)
    for call in calls:
        want = expected[call["choice_index"]]
        assert call["prompt_token_ids"] == want["prompt"]
        assert call["completion_token_ids"] == want["ids"]
        assert_same(call["completion_logprobs"], want["logprobs"], tolerance(server))
        assert len(call["completion_logprobs"]) == len(call["completion_token_ids"]) > 0


@pytest.mark.parametrize("stream,n,tools,ask,usage", CHAT_CASES)
def test_chat(upstream: tuple[Proc, Proc], redis_client, stream, n, tools, ask, usage):
    gateway, server = upstream
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 48,
        "n": n,
        "seed": 11,
        "stream": stream,
        **ASKS[ask],
    }
    if tools:
        body["tools"] = TOOLS
    if usage:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    if stream:
        body["fake_write_size"] = 7  # events arrive split across reads
    top = ASKS[ask].get("top_logprobs", 0)
    check(
        gateway,
        server,
        "chat.completions",
        body,
        {"return_token_ids": True, "logprobs": True, "top_logprobs": top},
    )


@pytest.mark.parametrize("stream,n,prompts,ask", COMPLETION_CASES)
def test_completions(upstream: tuple[Proc, Proc], redis_client, stream, n, prompts, ask):
    gateway, server = upstream
    prompt = "Two plus two is" if prompts == 1 else ["Two plus two is", "The sky is"]
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 12,
        "n": n,
        "seed": 5,
        "stream": stream,
        **COMPLETION_ASKS[ask],
    }
    if stream:
        body["fake_write_size"] = 5
    check(
        gateway,
        server,
        "completions",
        body,
        {"return_token_ids": True, "logprobs": COMPLETION_ASKS[ask].get("logprobs", 0)},
    )


# The Responses API, served as the chat completion vLLM's /v1/responses renders: what the agent asks for
# itself (log-probs through `include`, sampling fields) reaches the upstream as vLLM's own Responses serving
# would apply it, and the answer is the one a direct request gets. (`enable_response_messages` is a 400
# through the gateway: tests/test_responses_api.py.)
RESPONSES_ASKS = {
    "plain": {},
    "logprobs": {"include": ["message.output_text.logprobs"], "top_logprobs": 2},
    "sampling": {"temperature": 0.7, "top_p": 0.9, "stop": ["zz"]},
}
RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
RESPONSES_CASES = list(itertools.product((False, True), (False, True), RESPONSES_ASKS))


def normalize_responses(obj: Any) -> Any:
    """Ids, timestamps and tool-call ids differ between two runs of the same request."""
    if isinstance(obj, dict):
        return {
            k: normalize_responses(v)
            for k, v in obj.items()
            if k not in ("id", "created_at", "item_id", "call_id")
        }
    if isinstance(obj, list):
        return [normalize_responses(v) for v in obj]
    return obj


def merged_responses(answer: Any) -> Any:
    """A Responses stream from real vLLM as what it says: consecutive text (and tool-argument) deltas of
    one part joined (their chunks are cut by timing, as in `merged`), sequence numbers and the deltas'
    log-probs dropped with them, and the prefix cache's share of the usage dropped."""

    def drop_cache(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {
                k: drop_cache(v) for k, v in obj.items() if k not in ("cached_tokens", "cache_write_tokens")
            }
        if isinstance(obj, list):
            return [drop_cache(v) for v in obj]
        return obj

    answer = drop_cache(normalize_responses(answer))
    if not isinstance(answer, list):
        return answer
    events: list[dict] = []
    for event in answer:
        event = {k: v for k, v in event.items() if k != "sequence_number"}
        last = events[-1] if events else {}
        part = ("output_index", "content_index")
        deltas = ("response.output_text.delta", "response.function_call_arguments.delta")
        if (
            event.get("type") in deltas
            and event.get("type") == last.get("type")
            and all(event.get(k) == last.get(k) for k in part)
        ):
            last["delta"] += event["delta"]
        else:
            events.append(event)
        if event.get("type") == "response.output_text.delta":
            # vLLM 0.32 keeps the log-probs of only some of the tokens a merged delta holds, so they
            # depend on the cut too (docs/vllm-wire-format.md), and so do the ones the stream's final
            # items and `response.completed` carry
            events[-1].pop("logprobs", None)
        for part in _text_parts(event):
            part.pop("logprobs", None)
    return events


def _text_parts(event: dict) -> list[dict]:
    """The output_text parts a stream event carries (in its item, its part, or its whole response)."""
    items = [event.get("item") or {}] + list((event.get("response") or {}).get("output") or ())
    parts = [p for item in items for p in item.get("content") or () if isinstance(p, dict)]
    return parts + ([event["part"]] if isinstance(event.get("part"), dict) else [])


@pytest.fixture
def responses_server(serve_gateway: Proc, rlgate_serve: Proc) -> tuple[Proc, Proc]:
    """`rlgate serve`, whose `/v1/responses` renders and answers as vLLM's (tests/test_vllm_oracle.py), with
    its gateway: the fake's `/v1/responses` writes text only, whatever the tools."""
    return serve_gateway, rlgate_serve


@pytest.mark.parametrize("stream,tools,ask", RESPONSES_CASES)
def test_responses(responses_server: tuple[Proc, Proc], redis_client, stream, tools, ask):
    gateway, server = responses_server
    body: dict[str, Any] = {
        "model": MODEL,
        "input": "What is the weather in Paris?",
        "instructions": "Be terse.",
        "max_output_tokens": 48,
        "seed": 3,
        "stream": stream,
        **RESPONSES_ASKS[ask],
    }
    if tools:
        body["tools"] = RESPONSES_TOOLS
    rid = uuid.uuid4().hex
    status, via = answer(f"{gateway.url}/rollouts/{rid}/v1/responses", body)
    direct_status, direct = answer(f"{server.url}/responses", body)
    assert status == direct_status == 200
    if server.engine == "vllm":  # real vLLM is 0.32; the gateway answers in 0.33's shape
        direct = as_vllm_033(direct)
    if server.engine == "vllm" and stream:  # its deltas are cut by timing
        assert_same(merged_responses(via), merged_responses(direct), VLLM_TOLERANCE)
    else:
        assert_same(normalize_responses(via), normalize_responses(direct), tolerance(server))
    _, full = answer(
        f"{server.url}/responses",
        {**body, "enable_response_messages": True, "include": ["message.output_text.logprobs"]},
    )
    final = full[-1]["response"] if stream else full
    [call] = rollout(gateway, rid)["calls"]
    # served as the chat completion vLLM's /v1/responses renders: the same prompt and completion ids
    assert call["agent_api"] == "openai.responses" and call["endpoint"] == "chat.completions"
    assert call["prompt_token_ids"] == final["input_messages"][0]["tokens"]
    assert call["completion_token_ids"] == final["output_messages"][0]["tokens"]
    text_logprobs = [e["logprob"] for e in output_text_logprobs(final)]
    # every generated token's log-prob, streamed or not, tool calls too: vLLM's own /v1/responses has them
    # only for a non-streamed answer with text (then they are the same), none for tool calls only, and in
    # streams none for tokens without text (tool-call markup, EOS)
    assert len(call["completion_logprobs"]) == len(call["completion_token_ids"]) > 0
    if not stream and len(text_logprobs) == len(call["completion_token_ids"]):
        assert_same(call["completion_logprobs"], text_logprobs, tolerance(server))
    seen = via[-1]["response"] if stream else via  # the record's chat answer is what the agent saw
    text = "".join(
        part["text"] for item in seen["output"] if item["type"] == "message" for part in item["content"]
    )
    assert (call["response"]["message"]["content"] or "").strip() == text.strip()
    names = [item["name"] for item in seen["output"] if item["type"] == "function_call"]
    assert [c["function"]["name"] for c in call["response"]["message"].get("tool_calls") or ()] == names


VLLM_033_FIELDS = ("prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "safety_identifier")


def as_vllm_033(answer: Any) -> Any:
    """vLLM 0.32's answer in 0.33's shape: a response object has 0.33's four new fields (null here), the last
    output item of an incomplete response is incomplete (0.32: completed), and a stream ends with
    response.incomplete (0.32: response.completed)."""

    def fix(response: dict) -> None:
        for key in VLLM_033_FIELDS:
            response.setdefault(key, None)
        if response.get("status") == "incomplete" and response.get("output"):
            response["output"][-1]["status"] = "incomplete"

    if isinstance(answer, dict):
        fix(answer)
        return answer
    for event in answer:
        if isinstance(event.get("response"), dict):
            fix(event["response"])
    final = answer[-1]
    if final.get("type") == "response.completed" and final["response"]["status"] == "incomplete":
        final["type"] = "response.incomplete"
        fix(final["response"])
        done = [e for e in answer if e.get("type") == "response.output_item.done"]
        if done:
            done[-1]["item"]["status"] = "incomplete"
    return answer


# Real vLLM (the session's, without its prefix cache): the same checks on a subset of the cases above (every
# stream, choice-count, tools and usage combination; the asks that change what the gateway adds), to keep
# CI's time.
VLLM_CHAT_CASES = [case for case in CHAT_CASES if case[3] in ("plain", "both")]
VLLM_COMPLETION_CASES = [case for case in COMPLETION_CASES if case[3] in ("plain", "logprobs")]


@pytest.mark.parametrize("stream,n,tools,ask,usage", VLLM_CHAT_CASES)
def test_chat_on_real_vllm(vllm_gateway: Proc, vllm: Proc, redis_client, stream, n, tools, ask, usage):
    test_chat((vllm_gateway, vllm), redis_client, stream, n, tools, ask, usage)


@pytest.mark.parametrize("stream,n,prompts,ask", VLLM_COMPLETION_CASES)
def test_completions_on_real_vllm(vllm_gateway: Proc, vllm: Proc, redis_client, stream, n, prompts, ask):
    test_completions((vllm_gateway, vllm), redis_client, stream, n, prompts, ask)


@pytest.mark.parametrize("stream,tools,ask", RESPONSES_CASES)
def test_responses_on_real_vllm(vllm_gateway: Proc, vllm: Proc, redis_client, stream, tools, ask):
    test_responses((vllm_gateway, vllm), redis_client, stream, tools, ask)
