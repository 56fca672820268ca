"""RLGATE_RECORD_TOKEN_TEXT: the records keep each sampled token's text exactly as the server named it in
its log-probs (chat `content[].token`, completions `tokens`, Responses `logprobs[].token`), for every form
of call, against the fake vLLM and `rlgate serve` (a real tokenizer); without the setting they keep none.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
from conftest import Proc, start_gateway
from test_gateway_proxy import MESSAGES, MODEL, new_id, post, rollout, sse_chunks


@pytest.fixture(scope="module", params=["fake_vllm", "rlgate_serve"])
def text_upstream(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[tuple[Proc, Proc]]:
    upstream = request.getfixturevalue(request.param)
    proc = start_gateway(tmp_path_factory.mktemp("text_gateway"), upstream.url, record_token_text="true")
    yield proc, upstream
    proc.kill(signal.SIGTERM)


def test_every_form_of_call_keeps_the_servers_token_text(text_upstream: tuple[Proc, Proc], redis_client):
    gateway, upstream = text_upstream
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
    assert [c["completion_tokens"] for c in calls] == [chat_tokens, chat_tokens, text_tokens, text_tokens]
    for call in calls:
        assert len(call["completion_tokens"]) == len(call["completion_token_ids"])
    if "\ufffd" not in "".join(chat_tokens + text_tokens):  # the tiny model's random bytes split characters
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
        expected = [
            e["token"]
            for item in direct["output"]
            if item["type"] == "message"
            for part in item["content"]
            for e in part.get("logprobs") or ()
        ]
        post(f"{proc.url}/rollouts/{rid}/v1/responses", body)
        (call,) = rollout(proc, rid)["calls"]
        assert expected and call["completion_tokens"] == expected
    finally:
        proc.kill(signal.SIGTERM)

    # without the setting (the default) the records keep no token text
    rid = new_id()
    post(f"{gateway.url}/rollouts/{rid}/v1/responses", body)
    post(f"{gateway.url}/rollouts/{rid}/v1/chat/completions", {"model": MODEL, "messages": MESSAGES})
    assert [c["completion_tokens"] for c in rollout(gateway, rid)["calls"]] == [None, None]
