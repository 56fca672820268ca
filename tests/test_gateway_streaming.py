"""The stream relay on its own, on streams a real fake-vLLM process sent: however the bytes are cut into
blocks (as TCP delivers them), the agent gets the same events and the record is the same."""

from __future__ import annotations

import random

import httpx
import orjson
from conftest import Proc
from test_gateway_proxy import MESSAGES, MODEL, TOOLS

from gateway import capture
from gateway.streaming import StreamRelay, split_events


def _stream(fake_vllm: Proc, **extra) -> bytes:
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 24,
        "stream": True,
        "n": 2,
        "stream_options": {"include_usage": True},
        **extra,
    }
    body, injected = capture.inject("chat.completions", body)
    response = httpx.post(f"{fake_vllm.url}/chat/completions", json=body, timeout=30)
    assert response.status_code == 200
    return response.content


def _relay(data: bytes, cuts: list[int]) -> tuple[bytes, bytes | None, list]:
    relay = StreamRelay("chat.completions", capture.Injected(token_ids=True, logprobs=True))
    out, last = [], 0
    for cut in [*cuts, len(data)]:
        out.append(relay.relay(data[last:cut]))
        last = cut
    return b"".join(out), relay.held, relay.assembler.transitions()


def test_any_cutting_of_the_stream_gives_the_same_events_and_record(fake_vllm: Proc):
    rng = random.Random(7)
    for extra in ({}, {"tools": TOOLS}):
        data = _stream(fake_vllm, **extra)
        whole, held, transitions = _relay(data, [])
        assert held == b"data: [DONE]"
        assert [t.choice_index for t in transitions] == [0, 1]
        assert all(
            t.completion_token_ids and len(t.completion_logprobs) == len(t.completion_token_ids)
            for t in transitions
        )
        events = whole.split(b"\n\n")[:-1]
        assert events and all(b'"token_ids":null' in e or b'"token_ids"' not in e for e in events)
        for trial in range(30):
            cuts = sorted(rng.sample(range(1, len(data)), rng.randint(1, 60)))
            assert _relay(data, cuts) == (whole, held, transitions), (extra, trial)
        assert _relay(data, list(range(1, len(data)))) == (whole, held, transitions)  # byte by byte
        # the same stream with CRLF line ends, as some servers send SSE
        assert _relay(data.replace(b"\n", b"\r\n"), [len(data) // 3]) == (whole, held, transitions)


def test_multi_line_events_comments_and_unfinished_rest():
    chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
    data = (
        b": a comment\n\n"
        + b"event: message\ndata: "
        + orjson.dumps(chunk)
        + b"\n\n"
        + b'data: [DONE]\n\ndata: {"unfinished'
    )
    events, rest = split_events(data)
    assert events == [b": a comment", b"event: message\ndata: " + orjson.dumps(chunk), b"data: [DONE]"]
    assert rest == b'data: {"unfinished'
    relay = StreamRelay("chat.completions", capture.Injected())
    out = relay.relay(data)
    assert out == b": a comment\n\nevent: message\ndata: " + orjson.dumps(chunk) + b"\n\n"
    assert relay.held == b"data: [DONE]"
    [transition] = relay.assembler.transitions()
    assert transition.response.message["content"] == "hi"
