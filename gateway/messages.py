"""Anthropic's Messages API on the agent surface, served by the policy's chat completions.

A harness that speaks the Messages API (Claude Code, the `anthropic` SDK) calls `POST .../v1/messages`;
the gateway translates the request to a chat completion the way vLLM's own `/v1/messages` does
(`vllm/entrypoints/anthropic/serving.py`, 0.33.0), sends that upstream with token ids and log-probs, records
it as a chat call (`CallRecord.agent_api` says the agent spoke Messages), and answers in Anthropic's shape:
a message, or Anthropic's stream of events. So an agent gets what vLLM's `/v1/messages` would answer, and
the learner trains the call like any chat call.

Where this differs from vLLM 0.33's translation, on purpose (docs/agents.md):
- content the learner cannot train on exactly is a 400, never dropped or passed on: images, documents,
  redacted thinking, server tools (vLLM passes images on and drops redacted thinking);
- body errors are in Anthropic's error shape (vLLM answers its validation errors in OpenAI's);
- `thinking: {"type": "disabled"}` is not turned into a `reasoning_effort`, and a system message inside
  `messages` stays where it is: vLLM probes its chat template for both (whether it takes
  `reasoning_effort: "none"`, whether system messages must come first), and the gateway has no template.
Everything else is vLLM's translation exactly (tests/test_vllm_oracle.py compares the two on vLLM's code).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import orjson

from gateway import capture
from gateway.capture import InvalidField as Invalid
from gateway.streaming import StreamAssembler, TranslatedRelay

# HTTP status -> Anthropic error type (vLLM's table, `anthropic/protocol.py`, and Anthropic's own docs)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
SUPPORTED_BLOCKS = ("text", "tool_use", "tool_result", "thinking")
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
VLLM_EXTRAS = ("cache_salt", "vllm_xargs", "chat_template_kwargs")


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str) -> bytes:
    """Anthropic's error shape: `{"type": "error", "error": {"type", "message"}}`."""
    return orjson.dumps({"type": "error", "error": {"type": error_type(status), "message": message}})


def error_event(status: int, message: str) -> bytes:
    """The error event that ends an Anthropic stream (no message_delta or message_stop follow it)."""
    return b"event: error\ndata: " + error_body(status, message)


# ---------------------------------------------------------------------------------------------------------
# Request: Messages -> chat completion


def to_chat(body: dict[str, Any], count_only: bool = False) -> dict[str, Any]:
    """The chat completion request vLLM's `/v1/messages` makes of `body` (raise `Invalid`); with
    `count_only` (count_tokens), `max_tokens` is not needed and no sampling fields are set."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise Invalid("model", "model: a non-empty string is required")
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list):
        raise Invalid("messages", "messages: a list of messages is required")
    messages = _system(body.get("system"))
    for i, message in enumerate(raw_messages):
        messages.extend(_message(message, f"messages.{i}"))
    chat: dict[str, Any] = {"model": model, "messages": messages}
    if not count_only:
        max_tokens = body.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise Invalid("max_tokens", "max_tokens: a positive integer is required")
        chat["max_tokens"] = chat["max_completion_tokens"] = max_tokens
        stop = body.get("stop_sequences")
        if stop is not None:
            if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
                raise Invalid("stop_sequences", "stop_sequences: a list of strings")
            chat["stop"] = stop
        for name in ("temperature", "top_p", "top_k"):
            value = body.get(name)
            if value is not None:
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise Invalid(name, f"{name}: a number")
                chat[name] = value
        chat.update(capture.chat_stream(body.get("stream")))
    for name in VLLM_EXTRAS:  # vLLM's own fields, passed on as its /v1/messages passes them
        if body.get(name) is not None:
            chat[name] = body[name]
    _output_config(body.get("output_config"), chat)
    _thinking(body.get("thinking"), chat)
    _tools(body.get("tools"), body.get("tool_choice"), chat)
    return chat


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise Invalid(where, f"{where}.text: a string is required")
    return text


def _system(system: Any) -> list[dict[str, Any]]:
    """The leading system message: the string, or the text blocks joined (vLLM joins them with "")."""
    if system is None:
        return []
    text = _system_text(system, "system", top=True)
    return [{"role": "system", "content": text}] if text else []


def _system_text(system: Any, where: str, top: bool = False) -> str:
    """A system prompt's text: a string, or its text blocks joined with "" (Claude Code's per-request
    `x-anthropic-billing-header` block left out, as vLLM leaves it out: it would defeat the prefix cache)."""
    if isinstance(system, str):
        return "" if not top and system.startswith("x-anthropic-billing-header") else system
    if not isinstance(system, list):
        raise Invalid(where, f"{where}: a string or a list of text blocks")
    parts = []
    for i, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise Invalid(f"{where}.{i}", f"{where}.{i}: only text blocks are supported in a system prompt")
        part = _text(block, f"{where}.{i}")
        if not part.startswith("x-anthropic-billing-header"):
            parts.append(part)
    return "".join(parts)


def _message(message: Any, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results first (each a `tool` message), then the message."""
    if not isinstance(message, dict):
        raise Invalid(where, f"{where}: a message object is required")
    role = message.get("role")
    if role not in ("user", "assistant", "system"):
        raise Invalid(f"{where}.role", f"{where}.role: 'user' or 'assistant'")
    content = message.get("content")
    if role == "system":  # vLLM's extension: its text alone, kept in place (empty: left out)
        text = _system_text(content, f"{where}.content")
        return [{"role": "system", "content": text}] if text else []
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise Invalid(f"{where}.content", f"{where}.content: a string or a list of content blocks")
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    reasoning: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        at = f"{where}.content.{i}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in SUPPORTED_BLOCKS:
            raise Invalid(
                at,
                f"{at}: content blocks of type {kind!r} are not supported by this gateway (it serves "
                f"{', '.join(SUPPORTED_BLOCKS)}: what the policy can be trained on exactly)",
            )
        assert isinstance(block, dict)
        if kind == "text":
            text = _text(block, at)
            if text:
                texts.append(text)
        elif kind == "thinking":
            thinking = block.get("thinking")
            if not isinstance(thinking, str):
                raise Invalid(at, f"{at}.thinking: a string is required")
            reasoning.append(thinking)
        elif kind == "tool_use":
            name, arguments = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise Invalid(at, f"{at}: a tool_use block needs a name (string) and an input (object)")
            call_id = block.get("id")
            tool_calls.append(
                {
                    "id": call_id if isinstance(call_id, str) and call_id else f"call_{int(time.time())}",
                    "type": "function",
                    # Python's json.dumps, as vLLM writes them: the template sees the same text
                    "function": {"name": name, "arguments": json.dumps(arguments)},
                }
            )
        elif role == "assistant":  # a tool result inside an assistant message: text, as vLLM makes it
            result = block.get("content")
            texts.append(f"Tool result: {result if result else ''}")
        else:
            out.append(_tool_result(block, at))
    chat: dict[str, Any] = {"role": role}
    if reasoning:
        chat["reasoning"] = "".join(reasoning)
    if tool_calls:
        chat["tool_calls"] = tool_calls
    if len(texts) == 1:
        chat["content"] = texts[0]
    elif texts:
        chat["content"] = [{"type": "text", "text": t} for t in texts]
    if role != "user" or "content" in chat:  # a user message of tool results alone adds none
        out.append(chat)
    return out


def _tool_result(block: dict[str, Any], at: str) -> dict[str, Any]:
    content = block.get("content", "")
    if isinstance(content, list):
        parts = []
        for j, item in enumerate(content):
            if not isinstance(item, dict) or item.get("type") != "text":
                kind = item.get("type") if isinstance(item, dict) else None
                raise Invalid(
                    f"{at}.content.{j}",
                    f"{at}.content.{j}: tool results of type {kind!r} are not supported (text only)",
                )
            parts.append(_text(item, f"{at}.content.{j}"))
        content = "\n".join(parts)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise Invalid(at, f"{at}.content: a string or a list of text blocks")
    tool_use_id = block.get("tool_use_id")
    return {
        "role": "tool",
        "tool_call_id": tool_use_id if isinstance(tool_use_id, str) else "",
        "content": content,
    }


def _output_config(config: Any, chat: dict[str, Any]) -> None:
    """Structured output (`format`: a JSON schema the answer must follow) and `effort`, as vLLM maps them."""
    if (config := capture.optional_object(config, "output_config")) is None:
        return
    output_format = config.get("format")
    if output_format is not None:
        schema = output_format.get("schema") if isinstance(output_format, dict) else None
        if not isinstance(schema, dict) or output_format.get("type") != "json_schema":
            raise Invalid(
                "output_config.format", "output_config.format: {'type': 'json_schema', 'schema': {...}}"
            )
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "json_schema", "schema": schema},
        }
    effort = config.get("effort")
    if effort is not None:
        if effort not in ("low", "medium", "high", "xhigh", "max"):
            raise Invalid("output_config.effort", "output_config.effort: low, medium, high, xhigh or max")
        chat["reasoning_effort"] = effort


def _thinking(thinking: Any, chat: dict[str, Any]) -> None:
    if thinking is None:
        return
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1024:
            raise Invalid("thinking.budget_tokens", "thinking.budget_tokens: an integer of at least 1024")
        if "max_tokens" in chat and budget >= chat["max_tokens"]:
            raise Invalid("thinking.budget_tokens", "thinking.budget_tokens must be less than max_tokens")
        chat["thinking_token_budget"] = budget
    elif kind not in ("disabled", "adaptive"):
        raise Invalid("thinking.type", "thinking.type: 'enabled', 'disabled' or 'adaptive'")


def _tools(tools: Any, tool_choice: Any, chat: dict[str, Any]) -> None:
    if tool_choice is not None:
        kind = tool_choice.get("type") if isinstance(tool_choice, dict) else None
        if kind == "tool":
            name = tool_choice.get("name")
            if not isinstance(name, str) or not name:
                raise Invalid("tool_choice.name", "tool_choice.name: required with type 'tool'")
            chat["tool_choice"] = {"type": "function", "function": {"name": name}}
        elif isinstance(kind, str) and kind in TOOL_CHOICES:
            chat["tool_choice"] = TOOL_CHOICES[kind]
        else:
            raise Invalid("tool_choice.type", "tool_choice.type: 'auto', 'any', 'tool' or 'none'")
        chat["parallel_tool_calls"] = not tool_choice.get("disable_parallel_tool_use", False)
    if tools is None:
        return
    if not isinstance(tools, list):
        raise Invalid("tools", "tools: a list of tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise Invalid(
                f"tools.{i}",
                f"tools.{i}: server tools ({kind!r}) are not supported: the gateway serves tools the agent "
                "runs itself (a name and an input_schema)",
            )
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name or not isinstance(schema, dict):
            raise Invalid(f"tools.{i}", f"tools.{i}: a tool needs a name and an input_schema object")
        function: dict[str, Any] = {"name": name}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        # vLLM sets a missing type last: the template renders the schema's keys in their order
        function["parameters"] = schema if "type" in schema else {**schema, "type": "object"}
        if tool.get("defer_loading") is not None:
            function["defer_loading"] = tool["defer_loading"]
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    if out:
        chat["tools"] = out
        chat.setdefault("tool_choice", "auto")


# ---------------------------------------------------------------------------------------------------------
# Answer: chat completion -> message


def stop_reason(
    finish_reason: str | None, stop: Any, tool_used: bool, tool_complete: bool
) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a chat choice, as vLLM maps them: max_tokens always wins; a matched
    stop string wins unless the tool calls are complete (a call it cut short must not run); a tool call
    (named tool choice reports finish_reason "stop") is tool_use."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    if finish_reason == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def usage(chat_usage: dict[str, Any] | None, prompt_tokens: int | None = None) -> dict[str, int]:
    chat_usage = chat_usage or {}
    prompt = chat_usage.get("prompt_tokens", prompt_tokens) or 0
    details = chat_usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") or 0
    created = details.get("created_cache_tokens") or 0
    out = {
        "input_tokens": max(0, prompt - cached - created),
        "output_tokens": chat_usage.get("completion_tokens") or 0,
    }
    if details.get("cached_tokens") is not None:
        out["cache_read_input_tokens"] = cached
    if details.get("created_cache_tokens") is not None:
        out["cache_creation_input_tokens"] = created
    return out


def message(payload: dict[str, Any]) -> dict[str, Any]:
    """The Messages answer for a chat completion's first choice (raise `Invalid` when a tool call's
    arguments are not a JSON object: no `tool_use` block can carry them; vLLM answers 400 too)."""
    choice = (payload.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    reasoning = msg.get("reasoning") or msg.get("reasoning_content")
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": uuid.uuid4().hex})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    tool_calls = msg.get("tool_calls") or []
    for call in tool_calls:
        function = call.get("function") or {}
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except (ValueError, RecursionError):
            arguments = None
        if not isinstance(arguments, dict):
            raise Invalid(
                "tool_calls",
                f"the model's tool call arguments are not a JSON object: {function.get('arguments')!r}",
            )
        content.append(
            {"type": "tool_use", "id": call.get("id"), "name": function.get("name"), "input": arguments}
        )
    # the arguments were read above: every call is complete
    used = bool(tool_calls)
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"), used, used)
    out: dict[str, Any] = {
        "id": payload.get("id") or f"msg_{int(time.time() * 1000)}",
        "type": "message",
        "role": "assistant",
        "content": content or [{"type": "text", "text": ""}],
        "model": payload.get("model"),
    }
    if reason is not None:
        out["stop_reason"] = reason
    if sequence is not None:
        out["stop_sequence"] = sequence
    out["usage"] = usage(payload.get("usage"))
    return out


def count(body: dict[str, Any]) -> dict[str, Any]:
    """count_tokens' answer for a `/tokenize` count."""
    return {"input_tokens": body["count"], "context_management": {"original_input_tokens": body["count"]}}


# ---------------------------------------------------------------------------------------------------------
# Streams: chat chunks -> Anthropic's events


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data)


class MessagesRelay(TranslatedRelay):
    """A chat completion stream turned into Anthropic's event stream, block by block (`TranslatedRelay`:
    the last events, message_delta and message_stop, wait in `held` until the call is committed).

    Events as vLLM's `/v1/messages` sends them: message_start (from the first chunk), then one open block at
    a time (thinking, text, tool_use; index + 1 at each stop), content_block_delta with text_delta,
    thinking_delta, input_json_delta; a thinking block ends with a signature_delta; text that arrives while
    a tool_use block is open is sent as its own text block once that block closes; message_delta carries
    the stop reason and usage, message_stop ends the stream. An upstream error chunk closes the open block
    and sends an error event, and nothing after it."""

    def __init__(self, assembler: StreamAssembler) -> None:
        super().__init__(assembler)
        self._index = 0
        self._open: str | None = None  # "text", "thinking", or a tool call's id
        self._tools: dict[int, str] = {}  # tool call index -> id
        self._arguments: dict[str, str] = {}  # tool call id -> its arguments so far
        self._last_tool: str | None = None  # the last tool_use block opened
        self._buffered: list[str] = []  # text sent while a tool_use block was open
        self._finish: str | None = None
        self._stop: Any = None
        self._prompt_tokens: int | None = None

    def _error(self, code: Any, message: str, out: list[bytes]) -> None:
        self._buffered = []  # as vLLM: the open block is closed, text held back is dropped
        self._close(out)
        out.append(error_event(code if isinstance(code, int) else 500, message))

    def _start(self, chunk: dict[str, Any], out: list[bytes]) -> bool:
        prompt_ids = chunk.get("prompt_token_ids")
        self._prompt_tokens = len(prompt_ids) if isinstance(prompt_ids, list) else None
        start = usage(self._usage, self._prompt_tokens)
        start["output_tokens"] = 0
        out.append(
            _event(
                "message_start",
                {
                    "type": "message_start",
                    "message": {
                        "id": chunk.get("id") or f"msg_{int(time.time() * 1000)}",
                        "type": "message",
                        "role": "assistant",
                        "content": [],
                        "model": chunk.get("model"),
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": start,
                    },
                },
            )
        )
        return False  # vLLM's first chunk is the role chunk: its content is not sent

    def _translate(self, chunk: dict[str, Any], out: list[bytes]) -> None:
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning") or delta.get("reasoning_content")
            if reasoning:
                self._block("thinking", {"type": "thinking", "thinking": ""}, out)
                out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
            text = delta.get("content")
            if text:
                if self._open is not None and self._open not in ("text", "thinking"):
                    self._buffered.append(text)
                else:
                    self._block("text", {"type": "text", "text": ""}, out)
                    out.append(self._delta({"type": "text_delta", "text": text}))
            for call in delta.get("tool_calls") or ():
                self._tool_delta(call, out)
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]
                self._stop = choice.get("stop_reason")

    def _tool_delta(self, call: dict[str, Any], out: list[bytes]) -> None:
        function = call.get("function") or {}
        call_id, name = call.get("id"), function.get("name")
        index = call.get("index", 0)
        if call_id and name and call_id != self._open:
            self._close(out)
            self._tools[index] = call_id
            self._arguments[call_id] = ""
            self._open = self._last_tool = call_id
            out.append(
                _event(
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "content_block": {"type": "tool_use", "id": call_id, "name": name, "input": {}},
                        "index": self._index,
                    },
                )
            )
        arguments = function.get("arguments")
        target = call_id or self._tools.get(index)
        if arguments and target is not None and target == self._open:  # vLLM sends the open block's only
            self._arguments[target] += arguments
            out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event(
            "content_block_delta", {"type": "content_block_delta", "delta": delta, "index": self._index}
        )

    def _block(self, kind: str, block: dict[str, Any], out: list[bytes]) -> None:
        if self._open == kind:
            return
        self._close(out)
        self._open = kind
        out.append(
            _event(
                "content_block_start",
                {"type": "content_block_start", "content_block": block, "index": self._index},
            )
        )

    def _close(self, out: list[bytes]) -> None:
        if self._open is None:
            return
        if self._open == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": uuid.uuid4().hex}))
        closed, self._open = self._open, None
        out.append(_event("content_block_stop", {"type": "content_block_stop", "index": self._index}))
        self._index += 1
        if closed not in ("text", "thinking") and self._buffered:  # text held while a tool block was open
            text, self._buffered = "".join(self._buffered), []
            self._block("text", {"type": "text", "text": ""}, out)
            out.append(self._delta({"type": "text_delta", "text": text}))
            self._close(out)

    def _finish_events(self) -> list[bytes]:
        out: list[bytes] = []
        if not self._started:
            return out
        self._close(out)
        last = self._last_tool
        tool_used = last is not None
        complete = last is not None and _is_json(self._arguments[last])  # a call cut short must not run
        reason, sequence = stop_reason(self._finish or "stop", self._stop, tool_used, complete)
        out.append(
            _event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage(self._usage, self._prompt_tokens),
                },
            )
        )
        out.append(_event("message_stop", {"type": "message_stop"}))
        return out
