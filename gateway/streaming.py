"""Server-sent events: splitting the upstream byte stream into events, stripping injected fields from
chunks, and assembling the complete call from the deltas."""

from __future__ import annotations

from typing import Any

from episodes import CallError, CallResponse, Endpoint
from gateway.capture import Injected, Transition, sampled_logprobs, strip_response

DONE = b"data: [DONE]"
# Events of a `responses` stream after which the response is complete.
RESPONSES_FINAL = frozenset({"response.completed", "response.failed", "response.incomplete"})


def split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Complete SSE events (each without its blank-line terminator) and the unfinished rest."""
    if b"\r\n" in buffer:
        buffer = buffer.replace(b"\r\n", b"\n")
    parts = buffer.split(b"\n\n")
    return parts[:-1], parts[-1]


def event_data(event: bytes) -> bytes | None:
    """The payload of an event's `data:` line(s), or None for comments and data-less events."""
    if event.startswith(b"data: ") and b"\n" not in event:  # vLLM's chat and completions events
        return event[6:]
    data = None
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            value = line[5:]
            if value.startswith(b" "):
                value = value[1:]
            data = value if data is None else data + b"\n" + value
    return data


def strip_chunk(endpoint: Endpoint, chunk: dict[str, Any], injected: Injected) -> bool:
    """Null injected fields of a stream chunk in place, as plain vLLM sends them (present, `null`, exactly
    as in non-streaming answers).

    Returns False for a chunk plain vLLM would not have sent at all: with neither `logprobs` nor
    `return_token_ids` requested, vLLM skips tokens its tool parser holds back, but with either on it
    sends them as `delta: {}` without a finish reason (docs/vllm-wire-format.md, section 4).
    """
    strip_response(endpoint, chunk, injected)
    choices = chunk.get("choices") or ()
    if (endpoint == "chat.completions" and injected.token_ids and injected.logprobs and len(choices) == 1
            and choices[0].get("delta") == {} and choices[0].get("finish_reason") is None):
        return False
    return True


class _Choice:
    __slots__ = ("role", "content", "reasoning", "text", "tool_calls", "token_ids", "logprobs",
                 "finish_reason", "stop_reason", "prompt_token_ids")

    def __init__(self) -> None:
        self.role: str | None = None
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.text: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.token_ids: list[int] | None = None
        self.logprobs: list[float] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.prompt_token_ids: list[int] | None = None


class StreamAssembler:
    """Rebuilds the complete call from a chat or completions stream's chunks, choice by choice."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.id: str | None = None
        self.prompt_token_ids: list[int] | None = None
        self.usage: dict[str, Any] | None = None
        self.error: CallError | None = None
        self.final: dict[str, Any] | None = None  # responses: the complete response object
        self._choices: dict[int, _Choice] = {}

    def feed(self, chunk: dict[str, Any]) -> None:
        error = chunk.get("error")
        if error is not None:
            self.error = stream_error(error)
            return
        if self.endpoint == "responses":
            response = chunk.get("response")
            if isinstance(response, dict):
                self.final = response
                if chunk.get("type") == "response.failed":
                    self.error = stream_error({"type": "response_failed", **(response.get("error") or {})})
            return
        if self.id is None:
            self.id = chunk.get("id")
        prompt_token_ids = chunk.get("prompt_token_ids")
        if prompt_token_ids is not None:
            self.prompt_token_ids = prompt_token_ids
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for c in chunk.get("choices") or ():
            index = c.get("index", 0)
            state = self._choices.get(index)
            if state is None:
                state = self._choices[index] = _Choice()
            if self.endpoint == "chat.completions":
                self._feed_delta(state, c.get("delta") or {})
            else:
                if c.get("text"):
                    state.text.append(c["text"])
                if c.get("prompt_token_ids") is not None:
                    state.prompt_token_ids = c["prompt_token_ids"]
            token_ids = c.get("token_ids")
            if token_ids is not None:
                state.token_ids = token_ids if state.token_ids is None else state.token_ids + token_ids
            logprobs = sampled_logprobs(self.endpoint, c.get("logprobs"))
            if logprobs is not None:
                state.logprobs = logprobs if state.logprobs is None else state.logprobs + logprobs
            if c.get("finish_reason") is not None:
                state.finish_reason = c["finish_reason"]
            if c.get("stop_reason") is not None:
                state.stop_reason = c["stop_reason"]

    @staticmethod
    def _feed_delta(state: _Choice, delta: dict[str, Any]) -> None:
        if delta.get("role"):
            state.role = delta["role"]
        if delta.get("content"):
            state.content.append(delta["content"])
        reasoning = delta.get("reasoning") or delta.get("reasoning_content")
        if reasoning:
            state.reasoning.append(reasoning)
        for call in delta.get("tool_calls") or ():
            slot = state.tool_calls.get(call.get("index", 0))
            if slot is None:
                slot = state.tool_calls[call.get("index", 0)] = {
                    "id": None, "type": "function", "function": {"name": None, "arguments": ""}}
            if call.get("id"):
                slot["id"] = call["id"]
            if call.get("type"):
                slot["type"] = call["type"]
            function = call.get("function") or {}
            if function.get("name"):
                slot["function"]["name"] = function["name"]
            if function.get("arguments"):
                slot["function"]["arguments"] += function["arguments"]

    def transitions(self) -> list[Transition]:
        """The complete calls, one per choice in index order (one for `responses`)."""
        if self.endpoint == "responses":
            final = self.final or {}
            return [Transition(0, CallResponse(
                id=final.get("id"), output=final.get("output"), finish_reason=final.get("status"),
                usage=final.get("usage")), None, None, None)]
        out = []
        for index in sorted(self._choices):
            state = self._choices[index]
            if self.endpoint == "chat.completions":
                message: dict[str, Any] = {
                    "role": state.role or "assistant",
                    "content": "".join(state.content) if state.content else None,
                }
                if state.tool_calls:  # as vLLM's non-streaming message, which drops an empty list
                    message["tool_calls"] = [state.tool_calls[i] for i in sorted(state.tool_calls)]
                if state.reasoning:
                    message["reasoning"] = "".join(state.reasoning)
                response = CallResponse(id=self.id, message=message, finish_reason=state.finish_reason,
                                        stop_reason=state.stop_reason, usage=self.usage)
                prompt_ids = self.prompt_token_ids
            else:
                response = CallResponse(id=self.id, text="".join(state.text), finish_reason=state.finish_reason,
                                        stop_reason=state.stop_reason, usage=self.usage)
                prompt_ids = state.prompt_token_ids
            out.append(Transition(index, response, prompt_ids, state.token_ids, state.logprobs))
        return out


def stream_error(error: Any) -> CallError:
    """A `CallError` from an error object sent inside a stream."""
    if not isinstance(error, dict):
        return CallError(status=500, type="upstream_error", message=str(error))
    code = error.get("code")
    status = code if isinstance(code, int) and 400 <= code < 600 else 500
    return CallError(status=status, type=str(error.get("type") or "upstream_error"),
                     message=str(error.get("message") or ""), code=code)
