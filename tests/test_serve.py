"""`rlgate serve` (rlgate/inference/server.py) as a real process on the tiny model, driven by the openai SDK and
raw httpx: vLLM 0.33's wire format field by field (docs/vllm-wire-format.md), log-probs against a direct
forward pass, seeded determinism, stop strings, streaming, errors, and hermes tool-call parsing."""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from conftest import Proc, start_rlgate_serve
from test_gateway_proxy import MESSAGES, TOOLS

from rlgate.inference.engine import SamplingParams, processed_logits
from rlgate.inference.tiny_model import build_tiny_model
from rlgate.inference.tools import hermes_stream_deltas, parse_hermes

MODEL = "tiny"
EOS, TOOL_CALL = 258, 259
# vLLM's key order: a chat or completions answer starts with these keys, its own come next, then these
ANSWER_HEAD = ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage"]
ANSWER_TAIL = ["kv_transfer_params", "ec_transfer_params", "metrics"]
# and each choice: its index, then "message", "text" or "delta", then these, then its endpoint's own keys
CHOICE_KEYS = ["logprobs", "finish_reason", "stop_reason", "token_ids"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("serve") / "tiny", seed=0)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = start_rlgate_serve(model_dir, tmp_path_factory.mktemp("serve_log"), MODEL)
    yield proc
    proc.kill(signal.SIGTERM)


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    return tokenizer, model


def post(server: Proc, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def chat(server: Proc, **fields) -> dict:
    response = post(server, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def stream(server: Proc, path: str, body: dict) -> list:
    chunks = []
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
        for line in response.iter_lines():
            if line:
                assert line.startswith("data: ")
                data = line[len("data: ") :]
                chunks.append(data if data == "[DONE]" else json.loads(data))
    return chunks


def prompt_ids(tokenizer, messages: list, tools: list | None = None) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text)


def direct_logprobs(model, prompt: list[int], completion: list[int], params: SamplingParams) -> list[float]:
    """log p(token) of each completion token from one unpadded forward pass (as tests/test_engine.py)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion[:-1]])).logits[0]
    return [
        float(torch.log_softmax(processed_logits(logits[len(prompt) - 1 + i], params), -1)[token])
        for i, token in enumerate(completion)
    ]


def valid_utf8(ids: list[int]) -> bool:
    try:
        bytes(t for t in ids if t < 256).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return all(t < 256 or t == EOS for t in ids)


# ---------------------------------------------------------------------------------------------------------
# chat, non-streaming


def test_chat_fields_are_vllms(server: Proc):
    body = chat(server, max_tokens=6, seed=1)
    assert list(body) == [*ANSWER_HEAD, "prompt_logprobs", "prompt_token_ids", "prompt_text", *ANSWER_TAIL]
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}", body["id"])
    assert body["object"] == "chat.completion" and body["model"] == MODEL and isinstance(body["created"], int)
    for key in ("service_tier", "prompt_logprobs", "prompt_token_ids", "prompt_text", *ANSWER_TAIL):
        assert body[key] is None, key
    [choice] = body["choices"]
    assert list(choice) == ["index", "message", *CHOICE_KEYS, "routed_experts", "weight_versions"]
    assert choice["index"] == 0 and choice["logprobs"] is None and choice["token_ids"] is None
    assert choice["message"] == {
        "role": "assistant",
        "content": choice["message"]["content"],
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }
    assert list(choice["message"]) == [
        "role",
        "content",
        "refusal",
        "annotations",
        "audio",
        "function_call",
        "reasoning",
    ]
    assert isinstance(choice["message"]["content"], str)
    usage = body["usage"]
    assert list(usage) == [
        "prompt_tokens",
        "total_tokens",
        "completion_tokens",
        "prompt_tokens_details",
        "completion_tokens_details",
    ]
    full = chat(server, max_tokens=6, seed=1, return_token_ids=True)
    assert usage["completion_tokens"] == len(full["choices"][0]["token_ids"]) <= 6
    assert usage["prompt_tokens"] == len(full["prompt_token_ids"])
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert choice["finish_reason"] == ("length" if usage["completion_tokens"] == 6 else "stop")


def test_return_token_ids_round_trip(server: Proc, hf):
    tokenizer, _ = hf
    body = chat(server, max_tokens=8, return_token_ids=True)
    assert body["prompt_token_ids"] == prompt_ids(tokenizer, MESSAGES)
    tokenized = post(server, "/tokenize", {"model": MODEL, "messages": MESSAGES}).json()
    assert tokenized == {
        "count": len(body["prompt_token_ids"]),
        "max_model_len": 2048,
        "tokens": body["prompt_token_ids"],
        "token_strs": None,
    }
    # ASCII-only tokens make the text valid UTF-8, so it must round-trip exactly
    ascii_only = {str(t): -100.0 for t in range(128, 261) if t != EOS}
    for seed in range(3):
        body = chat(server, max_tokens=10, seed=seed, return_token_ids=True, logit_bias=ascii_only)
        ids, content = body["choices"][0]["token_ids"], body["choices"][0]["message"]["content"]
        assert valid_utf8(ids) and len(ids) == body["usage"]["completion_tokens"]
        text = post(server, "/detokenize", {"model": MODEL, "tokens": ids}).json()["prompt"]
        assert text == content + ("<|im_end|>" if ids[-1] == EOS else "")
        assert text.removesuffix("<|im_end|>") == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.7},
        {"temperature": 1.3, "top_k": 7, "top_p": 0.8, "logit_bias": {"97": 3.0, "32": -2.0}},
        {"temperature": 0},
    ],
)
def test_logprobs_match_a_direct_forward_pass(server: Proc, hf, sampling: dict):
    tokenizer, model = hf
    body = chat(
        server, max_tokens=8, seed=5, logprobs=True, top_logprobs=3, return_token_ids=True, **sampling
    )
    [choice] = body["choices"]
    ids, content = choice["token_ids"], choice["logprobs"]["content"]
    assert len(content) == len(ids) > 0
    params = SamplingParams(
        temperature=sampling["temperature"],
        top_k=sampling.get("top_k", 0),
        top_p=sampling.get("top_p", 1.0),
        logit_bias={int(k): v for k, v in sampling.get("logit_bias", {}).items()},
    )
    expected = direct_logprobs(model, body["prompt_token_ids"], ids, params)
    assert [entry["logprob"] for entry in content] == pytest.approx(expected, abs=2e-4)
    for token_id, entry in zip(ids, content, strict=True):
        assert list(entry) == ["token", "logprob", "bytes", "top_logprobs"]
        assert entry["token"] == tokenizer.decode([token_id])
        assert entry["bytes"] == list(entry["token"].encode())
        top = entry["top_logprobs"]
        assert 1 <= len(top) <= 3 and top[0] == {k: entry[k] for k in ("token", "logprob", "bytes")}


def test_seeded_determinism_and_n(server: Proc):
    one = chat(server, max_tokens=12, seed=42, return_token_ids=True)
    again = chat(server, max_tokens=12, seed=42, return_token_ids=True)
    assert one["choices"][0]["token_ids"] == again["choices"][0]["token_ids"]
    other = chat(server, max_tokens=12, seed=43, return_token_ids=True)
    assert other["choices"][0]["token_ids"] != one["choices"][0]["token_ids"]
    two = chat(server, max_tokens=12, seed=42, n=2, return_token_ids=True)
    assert [c["index"] for c in two["choices"]] == [0, 1]
    # choice i samples with seed + i, as vLLM's parallel sampling does
    assert two["choices"][0]["token_ids"] == one["choices"][0]["token_ids"]
    assert two["choices"][1]["token_ids"] == other["choices"][0]["token_ids"]
    assert two["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in two["choices"])


def test_logit_bias_forces_eos_and_tokens(server: Proc):
    body = chat(server, max_tokens=5, logit_bias={str(EOS): 100}, return_token_ids=True, logprobs=True)
    [choice] = body["choices"]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None
    assert choice["message"]["content"] == "" and choice["token_ids"] == [EOS]
    assert choice["logprobs"]["content"][0]["token"] == "<|im_end|>"
    assert choice["logprobs"]["content"][0]["logprob"] == pytest.approx(0.0, abs=1e-6)
    assert body["usage"]["completion_tokens"] == 1
    forced = chat(server, max_tokens=4, logit_bias={"120": 100}, return_token_ids=True)
    assert (
        forced["choices"][0]["message"]["content"] == "xxxx"
        and forced["choices"][0]["finish_reason"] == "length"
    )


def test_stop_strings_cut_text_and_tokens(server: Proc):
    ascii_letters = {str(t): -100.0 for t in range(261) if not 97 <= t <= 122}  # only a-z: no EOS either
    base = {
        "max_tokens": 20,
        "seed": 7,
        "return_token_ids": True,
        "logprobs": True,
        "logit_bias": ascii_letters,
    }
    full = chat(server, **base)["choices"][0]
    text, ids = full["message"]["content"], full["token_ids"]
    assert len(text) == len(ids) == 20  # one letter per token
    stop = text[5:7]
    pos = text.find(stop)
    cut = chat(server, **base, stop=["not-there", stop])["choices"][0]
    assert cut["message"]["content"] == text[:pos]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    assert cut["token_ids"] == ids[: pos + len(stop)]  # up to and including the token that completed it
    assert len(cut["logprobs"]["content"]) == len(cut["token_ids"])


def test_openai_sdk_chat(server: Proc):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    completion = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=5,
        seed=3,
        n=2,
        presence_penalty=0,
        frequency_penalty=0,  # neutral: accepted
        extra_body={"return_token_ids": True},
    )
    assert len(completion.choices) == 2 and completion.usage.completion_tokens <= 10
    assert completion.model_extra["prompt_token_ids"][0] == 257  # <|im_start|>
    assert all(len(c.model_extra["token_ids"]) >= 1 for c in completion.choices)
    assert [m.id for m in client.models.list().data] == [MODEL]


# ---------------------------------------------------------------------------------------------------------
# completions


def test_completions_non_streaming(server: Proc, hf):
    tokenizer, model = hf
    response = post(
        server,
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": "Hello",
            "seed": 2,
            "logprobs": 2,
            "return_token_ids": True,
            "temperature": 0.9,
        },
    )
    body = response.json()
    assert list(body) == [*ANSWER_HEAD, *ANSWER_TAIL]
    assert re.fullmatch(r"cmpl-[0-9a-f]{16}", body["id"]) and body["object"] == "text_completion"
    [choice] = body["choices"]
    assert list(choice) == [
        "index",
        "text",
        *CHOICE_KEYS,
        "prompt_logprobs",
        "prompt_token_ids",
        "routed_experts",
        "weight_versions",
    ]
    assert choice["prompt_token_ids"] == tokenizer.encode("Hello")
    ids = choice["token_ids"]
    assert len(ids) == body["usage"]["completion_tokens"] and (len(ids) == 16 or ids[-1] == EOS)  # default 16
    lp = choice["logprobs"]
    assert list(lp) == ["text_offset", "token_logprobs", "tokens", "top_logprobs"]
    assert lp["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    expected = direct_logprobs(model, choice["prompt_token_ids"], ids, SamplingParams(temperature=0.9))
    assert lp["token_logprobs"] == pytest.approx(expected, abs=2e-4)
    for token, token_lp, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert 1 <= len(top) <= 3
        if token != "\ufffd":  # tokens decoding to the same string share one key (so in vLLM too)
            assert top[token] == pytest.approx(token_lp)

    # token-id prompts, several prompts: choices are prompt-major, each with its own prompt ids
    many = post(
        server,
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": [[72, 105], [104, 101, 121]],
            "n": 2,
            "max_tokens": 3,
            "return_token_ids": True,
        },
    ).json()
    assert [c["index"] for c in many["choices"]] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in many["choices"]] == [[72, 105]] * 2 + [[104, 101, 121]] * 2
    assert many["usage"]["prompt_tokens"] == 5
    plain = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}).json()[
        "choices"
    ][0]
    assert plain["logprobs"] is None and plain["token_ids"] is None and plain["prompt_token_ids"] is None


# ---------------------------------------------------------------------------------------------------------
# streaming


def test_chat_stream_matches_non_streaming(server: Proc):
    base = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 10,
        "seed": 11,
        "n": 2,
        "return_token_ids": True,
    }
    full = chat(server, **{k: v for k, v in base.items() if k not in ("model", "messages")})
    chunks = stream(
        server, "/v1/chat/completions", {**base, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert chunks[-1] == "[DONE]"
    frames = chunks[:-1]
    assert len({f["id"] for f in frames}) == 1 and all(f["object"] == "chat.completion.chunk" for f in frames)
    roles = frames[:2]
    for i, frame in enumerate(roles):
        assert frame["choices"] == [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
        assert frame["prompt_token_ids"] == full["prompt_token_ids"] and frame["prompt_text"] is None
    usage = frames[-1]
    assert usage["choices"] == [] and usage["usage"] == {
        k: full["usage"][k] for k in ("prompt_tokens", "total_tokens", "completion_tokens")
    }
    for i, choice in enumerate(full["choices"]):
        mine = [f["choices"][0] for f in frames[2:-1] if f["choices"][0]["index"] == i]
        assert "".join(c["delta"].get("content") or "" for c in mine) == choice["message"]["content"]
        assert [t for c in mine for t in c["token_ids"]] == choice["token_ids"]
        assert all(c["finish_reason"] is None for c in mine[:-1])
        assert mine[-1]["finish_reason"] == choice["finish_reason"] and "stop_reason" in mine[-1]
        assert list(mine[-1]) == ["index", "delta", *CHOICE_KEYS, "weight_versions"]


def test_chat_stream_plain_and_eos_finish(server: Proc):
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 3,
        "stream": True,
        "logit_bias": {str(EOS): 100},
    }
    frames = stream(server, "/v1/chat/completions", body)
    assert frames[-1] == "[DONE]" and len(frames) == 3
    role, final = frames[0], frames[1]
    assert role["prompt_token_ids"] is None
    assert final["choices"] == [
        {
            "index": 0,
            "delta": {},
            "logprobs": None,
            "finish_reason": "stop",
            "stop_reason": None,
            "token_ids": None,
            "weight_versions": None,
        }
    ]
    assert final["system_fingerprint"] == role.get("system_fingerprint", final["system_fingerprint"])
    assert "kv_transfer_params" in final and final["kv_transfer_params"] is None


def test_completions_stream_matches_non_streaming(server: Proc):
    base = {
        "model": MODEL,
        "prompt": "Once",
        "max_tokens": 8,
        "seed": 4,
        "logprobs": 1,
        "return_token_ids": True,
    }
    full = post(server, "/v1/completions", base).json()["choices"][0]
    frames = stream(server, "/v1/completions", {**base, "stream": True})
    assert frames[-1] == "[DONE]"
    choices = [f["choices"][0] for f in frames[:-1]]
    assert "".join(c["text"] for c in choices) == full["text"]
    assert [t for c in choices for t in c["token_ids"]] == full["token_ids"]
    assert choices[0]["prompt_token_ids"] == full["prompt_token_ids"]
    assert all(c["prompt_token_ids"] is None for c in choices[1:])
    assert [o for c in choices for o in c["logprobs"]["text_offset"]] == full["logprobs"]["text_offset"]
    assert choices[-1]["finish_reason"] == full["finish_reason"] and "system_fingerprint" in frames[-2]


# ---------------------------------------------------------------------------------------------------------
# tools


def test_hermes_parser():
    text = 'Let me compute.<tool_call>\n{"name": "calculator", "arguments": {"expression": "17+25"}}\n</tool_call>'
    content, [call] = parse_hermes(text)
    assert content == "Let me compute." and call.name == "calculator"
    assert json.loads(call.arguments) == {"expression": "17+25"}
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", call.id)
    assert call.to_wire()["type"] == "function"
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"x": "é"}}'
    content, calls = parse_hermes(two)
    assert content is None and [c.name for c in calls] == ["a", "b"] and calls[1].arguments == '{"x": "é"}'
    assert parse_hermes("plain text") == ("plain text", [])
    broken = '<tool_call>{"name": "a", "argu'
    assert parse_hermes(broken) == (broken, [])


def tool_call_pieces(text: str) -> list[str]:
    """The text each token adds: one character per byte token, the tags as single tokens, then EOS."""
    pieces = []
    for part in re.split(r"(</?tool_call>)", text):
        pieces += [part] if part.startswith("<") and part.endswith("tool_call>") else list(part)
    return [*pieces, ""]


@pytest.mark.parametrize(
    "text",
    [
        'Sure.<tool_call>\n{"name": "calculator", "arguments": {"expression": "17+25"}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
    ],
)
def test_hermes_stream_deltas_match_the_vllm_fixture(text: str):
    import types

    import fake_vllm

    pieces = tool_call_pieces(text)
    content, [call] = parse_hermes(text)
    mine = hermes_stream_deltas(pieces)
    [stream_id] = [c["id"] for d in mine if d for c in d.get("tool_calls", []) if "id" in c]
    reference = fake_vllm.hermes_deltas(types.SimpleNamespace(text=text, pieces=pieces), stream_id)
    assert mine == reference
    streamed = [d for d in mine if d]
    assert "".join(d["content"] or "" for d in streamed) == (content or "")
    calls = [c for d in streamed for c in d.get("tool_calls", [])]
    assert calls[0] == {"id": stream_id, "type": "function", "index": 0, "function": {"name": call.name}}
    assert json.loads("".join(c["function"]["arguments"] for c in calls[1:])) == json.loads(call.arguments)


def test_hermes_stream_deltas_two_calls():
    text = (
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {"y": [2]}}</tool_call>'
    )
    content, calls = parse_hermes(text)
    assert content is None and len(calls) == 2
    deltas = [c for d in hermes_stream_deltas(tool_call_pieces(text)) if d for c in d.get("tool_calls", [])]
    for j, call in enumerate(calls):
        mine = [c for c in deltas if c["index"] == j]
        assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", mine[0]["id"]) and mine[0]["function"] == {
            "name": call.name
        }
        assert json.loads("".join(c["function"]["arguments"] for c in mine[1:])) == json.loads(call.arguments)


def test_tools_reach_the_template_and_unparsable_calls_stay_content(server: Proc, hf):
    tokenizer, _ = hf
    body = chat(server, max_tokens=3, tools=TOOLS, logit_bias={str(TOOL_CALL): 100}, return_token_ids=True)
    assert body["prompt_token_ids"] == prompt_ids(tokenizer, MESSAGES, TOOLS)
    [choice] = body["choices"]
    assert choice["token_ids"] == [TOOL_CALL] * 3
    assert choice["message"]["content"] == "<tool_call>" * 3 and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "length"


# ---------------------------------------------------------------------------------------------------------
# the rest


def test_models_health_tokenize(server: Proc, model_dir: Path):
    models = httpx.get(f"{server.url}/v1/models").json()
    [card] = models["data"]
    assert models["object"] == "list" and card["id"] == MODEL and card["root"] == str(model_dir)
    assert card["owned_by"] == "vllm" and card["max_model_len"] == 2048 and card["parent"] is None
    assert card["permission"][0]["object"] == "model_permission"
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 and health.content == b""
    assert post(server, "/tokenize", {"prompt": "hé"}).json()["tokens"] == [104, 195, 169]
    assert post(server, "/detokenize", {"tokens": [104, 195, 169]}).json() == {"prompt": "hé"}


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "nope", "messages": MESSAGES}, 404, "model"),
        ({"model": MODEL, "messages": MESSAGES, "max_tokens": 5000}, 400, "max_tokens"),
        ({"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 5000}, 400, "max_completion_tokens"),
        ({"model": MODEL, "messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
        ({"model": MODEL, "messages": MESSAGES, "n": 0}, 400, "body.n"),
        ({"model": MODEL}, 400, "body.messages"),
        ({"model": MODEL, "messages": MESSAGES, "logit_bias": {"9999": 1}}, 400, "logit_bias"),
        ({"model": MODEL, "messages": MESSAGES, "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ],
)
def test_errors(server: Proc, body: dict, status: int, param: str):
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == status
    error = response.json()["error"]
    assert list(error) == ["message", "type", "param", "code"]
    assert error["code"] == status and error["param"] == param
    if status == 404:
        assert error == {
            "message": f"The model `nope` does not exist. Valid aliases: {MODEL}.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }


def test_tiny_temperatures_and_top_k_are_vllms(server: Proc):
    """vLLM raises 0 < temperature < 0.01 to 0.01 (T=1e-45 used to overflow z / T and fail the request and
    every request batched with it); top_k -1 means off, below -1 is a 400 worded as vLLM's SamplingParams."""
    import concurrent.futures

    body = {"max_tokens": 6, "seed": 3, "return_token_ids": True}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # batched together with normal requests
        tiny, *others = pool.map(
            lambda t: post(
                server,
                "/v1/chat/completions",
                {"model": MODEL, "messages": MESSAGES, **body, "temperature": t},
            ),
            [1e-45, 1.0, 0.7, 1e-3],
        )
    assert [r.status_code for r in (tiny, *others)] == [200] * 4, tiny.text
    floor = chat(server, **body, temperature=0.01)["choices"][0]["token_ids"]
    assert tiny.json()["choices"][0]["token_ids"] == floor == others[2].json()["choices"][0]["token_ids"]
    assert (
        chat(server, **body, top_k=-1)["choices"][0]["token_ids"]
        == chat(server, **body)["choices"][0]["token_ids"]
    )
    for path, fields in (
        ("/v1/chat/completions", {"messages": MESSAGES}),
        ("/v1/completions", {"prompt": "x"}),
    ):
        response = post(server, path, {"model": MODEL, **fields, "top_k": -2})
        assert response.status_code == 400
        assert response.json() == {
            "error": {
                "message": "top_k must be 0 (disable), or at least 1, got -2.",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
        }


def test_malformed_json(server: Proc):
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=b'{"model": ',
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert (
        error["type"] == "Bad Request" and error["param"] == "body.10" and "json_invalid" in error["message"]
    )
    wrong_type = httpx.post(
        f"{server.url}/v1/completions", content=b"hi", headers={"content-type": "text/plain"}
    )
    assert wrong_type.status_code == 400


def test_concurrent_requests_are_served(server: Proc):
    import concurrent.futures

    def one(seed: int) -> list[int]:
        return chat(server, max_tokens=6, seed=seed, return_token_ids=True)["choices"][0]["token_ids"]

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(one, range(8)))
    assert time.monotonic() - started < 60
    assert together == [one(seed) for seed in range(8)]  # a row does not depend on its batch


# ---------------------------------------------------------------------------------------------------------
# behind the gateway


def test_gateway_records_the_servers_token_ids(server: Proc, tmp_path: Path, redis_client):
    from conftest import start_gateway

    gateway = start_gateway(tmp_path, f"{server.url}/v1")
    try:
        client = openai.OpenAI(base_url=f"{gateway.url}/tasks/t-1/rollouts/serve-run-1/v1", api_key="unused")
        completion = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, seed=9)
        assert (
            completion.model_extra.get("prompt_token_ids") is None
        )  # the injected fields are stripped again
        stored = httpx.get(f"{gateway.url}/rollouts/serve-run-1", timeout=10).json()
    finally:
        gateway.kill(signal.SIGTERM)
    direct = chat(server, max_tokens=6, seed=9, return_token_ids=True, logprobs=True)
    [call] = stored["calls"]
    assert call["prompt_token_ids"] == direct["prompt_token_ids"]
    assert call["completion_token_ids"] == direct["choices"][0]["token_ids"]
    assert call["completion_logprobs"] == pytest.approx(
        [c["logprob"] for c in direct["choices"][0]["logprobs"]["content"]], abs=1e-5
    )
    assert completion.choices[0].message.content == direct["choices"][0]["message"]["content"]


def test_generation_config_sampling_defaults(model_dir: Path, tmp_path: Path, hf):
    """As vLLM, a generation_config.json temperature applies to requests that leave it out (in-process app)."""
    import shutil

    from fastapi.testclient import TestClient

    from rlgate.inference.server import build_app

    greedy_dir = tmp_path / "greedy"
    shutil.copytree(model_dir, greedy_dir)
    config = json.loads((greedy_dir / "generation_config.json").read_text())
    (greedy_dir / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0}))
    body = {
        "model": "greedy",
        "messages": MESSAGES,
        "max_tokens": 8,
        "return_token_ids": True,
        "logprobs": True,
    }
    with TestClient(
        build_app(greedy_dir, served_model_name="greedy", logprobs_mode="processed_logprobs")
    ) as client:
        first, second = (client.post("/v1/chat/completions", json=body).json() for _ in range(2))
        hot = client.post("/v1/chat/completions", json={**body, "temperature": 1.0, "seed": 1}).json()
    ids = first["choices"][0]["token_ids"]
    assert ids == second["choices"][0]["token_ids"]  # unseeded, yet the same: greedy
    expected = direct_logprobs(hf[1], first["prompt_token_ids"], ids, SamplingParams(temperature=0))
    assert [c["logprob"] for c in first["choices"][0]["logprobs"]["content"]] == pytest.approx(
        expected, abs=2e-4
    )
    hot_ids = hot["choices"][0]["token_ids"]
    assert [c["logprob"] for c in hot["choices"][0]["logprobs"]["content"]] == pytest.approx(
        direct_logprobs(hf[1], first["prompt_token_ids"], hot_ids, SamplingParams(temperature=1.0)), abs=2e-4
    )


def test_completions_echo_usage_stats_and_long_prompts(server: Proc):
    base = {"model": MODEL, "prompt": "Echo", "max_tokens": 3, "seed": 6}
    plain = post(server, "/v1/completions", base).json()["choices"][0]["text"]
    echoed = post(server, "/v1/completions", {**base, "echo": True}).json()["choices"][0]["text"]
    assert echoed == "Echo" + plain
    with_ids = post(server, "/v1/completions", {**base, "echo": True, "return_token_ids": True}).json()
    assert with_ids["choices"][0]["text"] == plain  # vLLM drops the echoed prompt under return_token_ids
    frames = stream(
        server,
        "/v1/completions",
        {**base, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )
    tokens = [f for f in frames[:-1] if f["choices"]]
    assert [f["usage"]["completion_tokens"] for f in tokens] == list(range(1, len(tokens) + 1))
    assert all("system_fingerprint" not in f for f in tokens)  # it rides on the usage chunk instead
    assert frames[-2]["choices"] == [] and frames[-2]["usage"]["completion_tokens"] == len(tokens)
    too_long = post(server, "/v1/completions", {"model": MODEL, "prompt": [65] * 2048, "max_tokens": 1})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "input_tokens"
    clamped = post(
        server,
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": [65] * 2046,
            "max_tokens": 50,
            "seed": 0,
            "logit_bias": {str(EOS): -100, "256": -100},
            "return_token_ids": True,
        },
    )
    assert (
        clamped.status_code == 200 and len(clamped.json()["choices"][0]["token_ids"]) == 2
    )  # clamped, as vLLM


def test_api_key_guards_v1_as_vllms(model_dir: Path, tmp_path: Path):
    """`--api-key` as vLLM's (its AuthenticationMiddleware): every /v1 path needs `Authorization: Bearer KEY`
    (else 401 `{"error": "Unauthorized"}`, even for a route that does not exist, so a caller without the key
    learns nothing about the gates); paths outside /v1 (/health, /tokenize) stay open, as in vLLM. vLLM's
    VLLM_API_KEY is read when no --api-key is."""
    proc = start_rlgate_serve(model_dir, tmp_path, MODEL, api_key="sekrit", lora=True)
    try:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "sekrit"},
            {"Authorization": "Basic sekrit"},
        ):
            for method, path in (
                ("GET", "/v1/models"),
                ("POST", "/v1/chat/completions"),
                ("POST", "/v1/load_lora_adapter"),
                ("POST", "/v1/nothing"),
            ):
                answer = httpx.request(method, f"{proc.url}{path}", json=body, headers=headers, timeout=60)
                assert (answer.status_code, answer.json()) == (401, {"error": "Unauthorized"}), (
                    headers,
                    path,
                )
        key = {"Authorization": "Bearer sekrit"}
        assert httpx.get(f"{proc.url}/v1/models", headers=key).status_code == 200
        assert (
            httpx.post(f"{proc.url}/v1/chat/completions", json=body, headers=key, timeout=60).status_code
            == 200
        )
        assert httpx.get(f"{proc.url}/health").status_code == 200
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="sekrit")
        assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2).choices
    finally:
        proc.kill(signal.SIGTERM)
    proc = start_rlgate_serve(model_dir, tmp_path, MODEL, env={"VLLM_API_KEY": "from-env"})
    try:
        assert httpx.get(f"{proc.url}/v1/models").status_code == 401
        assert (
            httpx.get(f"{proc.url}/v1/models", headers={"Authorization": "bearer from-env"}).status_code
            == 200
        )
    finally:
        proc.kill(signal.SIGTERM)
