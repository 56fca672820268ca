"""RLGATE_RECORD_TOKEN_TEXT: the records keep each sampled token's text exactly as the server named it in
its log-probs (chat `content[].token`, completions `tokens`, Responses `logprobs[].token`), for every form
of call, against the fake vLLM and `rlgate serve` (a real tokenizer); without the setting they keep none.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
from conftest import Proc, output_text_logprobs, start_gateway
from test_gateway_proxy import MESSAGES, MODEL, new_id, post, rollout, sse_chunks


@pytest.fixture(scope="module", params=["fake_vllm", "rlgate_serve"])
def text_upstream(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[tuple[Proc, Proc, str]]:
    upstream = request.getfixturevalue(request.param)
    proc = start_gateway(tmp_path_factory.mktemp("text_gateway"), upstream.url, record_token_text="true")
    yield proc, upstream, request.param
    proc.kill(signal.SIGTERM)


def test_every_form_of_call_keeps_the_servers_token_text(text_upstream: tuple[Proc, Proc, str], redis_client):
    gateway, upstream, name = text_upstream
    rid = new_id()
    base = f"{gateway.url}/rollouts/{rid}/v1"
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "seed": 3, "temperature": 1.0}
    completion = {"model": MODEL, "prompt": "The sum of 2 and 3 is", "max_tokens": 10, "seed": 4}

    # what the server itself says of each sampled token (the oracle), asked directly
    direct_chat = post(f"{upstream.url}/chat/completions", {**chat, "logprobs": True}).json()
    direct_text = post(f"{upstream.url}/completions", {**completion, "logprobs": 0}).json()
    chat_tokens = [e["token"] for e in direct_chat["choices"][0]["logprobs"]["content"]]
    text_tokens = direct_text["choices"][0]["logprobs"]["tokens"]
    assert chat_tokens and text_tokens

    answer = post(f"{base}/chat/completions", chat).json()
    assert answer["choices"][0]["logprobs"] is None  # the agent still gets what it asked for
    sse_chunks(f"{base}/chat/completions", {**chat, "stream": True})
    post(f"{base}/completions", completion)
    sse_chunks(f"{base}/completions", {**completion, "stream": True})

    calls = rollout(gateway, rid)["calls"]
    assert [c["completion_token_texts"] for c in calls] == [
        chat_tokens,
        chat_tokens,
        text_tokens,
        text_tokens,
    ]
    for call in calls:
        assert len(call["completion_token_texts"]) == len(call["completion_token_ids"])
    if name == "fake_vllm":  # (the tiny model's random bytes split characters between tokens)
        assert "".join(chat_tokens) == direct_chat["choices"][0]["message"]["content"]
        assert "".join(text_tokens) == direct_text["choices"][0]["text"]


def test_responses_keep_the_token_text_of_their_output(
    gateway: Proc, fake_vllm: Proc, tmp_path, redis_client
):
    proc = start_gateway(tmp_path, fake_vllm.url, record_token_text="true")
    try:
        rid = new_id()
        body = {"model": MODEL, "input": "Say hello.", "max_output_tokens": 64}
        direct = post(
            f"{fake_vllm.url}/responses", {**body, "include": ["message.output_text.logprobs"]}
        ).json()
        expected = [e["token"] for e in output_text_logprobs(direct)]
        post(f"{proc.url}/rollouts/{rid}/v1/responses", body)
        (call,) = rollout(proc, rid)["calls"]
        assert expected and call["completion_token_texts"] == expected
    finally:
        proc.kill(signal.SIGTERM)

    # without the setting (the default) the records keep no token text
    rid = new_id()
    post(f"{gateway.url}/rollouts/{rid}/v1/responses", body)
    post(f"{gateway.url}/rollouts/{rid}/v1/chat/completions", {"model": MODEL, "messages": MESSAGES})
    assert [c["completion_token_texts"] for c in rollout(gateway, rid)["calls"]] == [None, None]


def test_a_record_too_large_with_the_text_is_kept_without_it(fake_vllm: Proc, tmp_path, redis_client):
    """The text is for display: a call whose record fits RLGATE_MAX_RECORD_BYTES only without it is
    recorded without it, never failed for it."""
    from rlgate.episodes import CallRecord

    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 64, "seed": 11, "temperature": 1.0}
    sizes = []
    for limit in (None, "set below"):
        settings = {"record_token_text": "true"}
        if limit is not None:
            settings["max_record_bytes"] = str((sizes[0] + sizes[1]) // 2)
        proc = start_gateway(tmp_path, fake_vllm.url, **settings)
        try:
            rid = new_id()
            answer = post(f"{proc.url}/rollouts/{rid}/v1/chat/completions", body)
            assert answer.status_code == 200, answer.text
            raw = redis_client.lindex(f"rlgate:rollout:{{{rid}}}:calls", 0)
            record = CallRecord.model_validate_json(raw)
        finally:
            proc.kill(signal.SIGTERM)
        if limit is None:
            assert record.completion_token_texts
            without = record.model_copy(update={"completion_token_texts": None})
            sizes = [len(raw), len(without.model_dump_json())]
            assert sizes[0] - sizes[1] > 100  # the margin the limit sits in
        else:
            assert record.completion_token_texts is None and record.error is None
            assert record.completion_token_ids and record.completion_logprobs
