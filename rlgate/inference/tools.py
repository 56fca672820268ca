"""Hermes-style tool calls, as `vllm serve --enable-auto-tool-choice --tool-call-parser hermes` reports them.

The model writes `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (one block per call).
What vLLM 0.33 makes of a choice's text (its `Hermes2ProToolParser`, `DelegatingParser`,
`assemble_chat_message_fields` and `resolve_finish_reason`; tests/test_vllm_oracle.py runs them on the same
texts and compares):

- `parse_hermes(text)`: every block (a last one missing its `</tool_call>` included) must be a JSON object
  with a string `name` and an `arguments` key; arguments are re-serialized with `json.dumps(...,
  ensure_ascii=False)`. Content is the text before the first `<tool_call>`, or None when empty. If there
  is no `<tool_call>`, or any block is not such a call, there are no calls and the whole text is content.
- `chat_fields(text, tool_choice, engine_finish)`: the message of a non-streaming answer. `tool_choice`
  "none" keeps the text as content; otherwise the text is parsed (a named tool or "required" too: hermes
  has no constrained-decoding path in vLLM). With calls, whitespace-only content is None; "auto",
  "required" or a named tool keep the calls ("required" and named ones report content "" instead of
  None); an explicit `tool_choice: null` drops them (keeping only the text before them). The finish
  reason is "tool_calls" when calls are kept and the engine stopped on its own, except for a named tool
  ("stop").
- `HermesStream`: the deltas of a streamed choice, token by token. Text before the first `<tool_call>`
  streams as content, holding back a suffix that could be the start of the tag; for call j, the first
  delta names it once its name is complete (`{"id", "type", "index": j, "function": {"name"}}`), later
  ones carry the new part of the raw `arguments` text as the model wrote it (`{"index": j, "function":
  {"arguments"}}`), without the call object's closing brace once it is complete. Calls stream as they
  appear, whether or not the whole text parses in the end (as vLLM's).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON string, as the OpenAI API carries it

    def to_wire(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().int & 0xFFFFFFFFFFFFFFFF:016x}"


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished completion's text."""
    if TOOL_CALL_START not in text:
        return text, []
    calls = []
    for closed, unclosed in _BLOCK.findall(text):
        try:
            call = json.loads(closed or unclosed)
        except ValueError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
            return text, []
        calls.append(
            ToolCall(tool_call_id(), call["name"], json.dumps(call["arguments"], ensure_ascii=False))
        )
    content = text[: text.find(TOOL_CALL_START)]
    return content or None, calls


def chat_fields(
    text: str, tool_choice: str | dict[str, Any] | None, engine_finish: str
) -> tuple[str | None, list[ToolCall], str]:
    """(content, tool calls, finish_reason) of a non-streaming chat choice. `tool_choice` is the request's
    after vLLM's defaulting ("auto" when tools are given without it, "none" without tools; None only when
    the client sent null)."""
    named = isinstance(tool_choice, dict)
    forced = named or tool_choice == "required"
    if tool_choice == "none":
        content, calls = text, []
    else:
        content, calls = parse_hermes(text)
        if calls and content is not None and not content.strip():
            content = None
        if not calls and forced and not text.strip():
            content = None
    if not (forced or tool_choice == "auto"):
        calls = []
    elif forced:
        content = content or ""
    finish = "tool_calls" if calls and engine_finish == "stop" and not named else engine_finish
    return content, calls, finish


def keeps_tool_calls(tool_choice: str | dict[str, Any] | None) -> bool:
    return isinstance(tool_choice, dict) or tool_choice in ("auto", "required")


@dataclass
class HermesStream:
    """One streamed choice's hermes parser state: `step(piece)` gives the delta to send for the text one
    token adds (None: nothing yet). On the last step (`finished`), when that step sends tool-call deltas
    and the last call seen never streamed arguments, `"{}"` is appended to the last delta's arguments, as
    vLLM's parser does when generation ends. `keep_calls=False` (`tool_choice: null`) drops call deltas.

    Each step rescans the choice's text so far (C-speed string searches; the open block is JSON-parsed
    only when it ends in "}"), so a choice costs time quadratic in its length with a small constant: one
    tool call of 4.5k tokens (13k characters) takes about 27 ms in all, of 18k tokens about 0.4 s, on one
    CPU core. A fully incremental parser would need the tag and JSON state carried across steps."""

    keep_calls: bool = True
    text: str = ""
    sent: int = 0
    names: list[str | None] = field(default_factory=list)
    args: list[str | None] = field(default_factory=list)
    streamed: bool = False  # a tool call delta went out: the finish reason becomes "tool_calls"

    def step(self, piece: str, finished: bool = False) -> dict[str, Any] | None:
        self.text += piece
        first = self.text.find(TOOL_CALL_START)
        end = first if first >= 0 else len(self.text) - _overlap(self.text, TOOL_CALL_START)
        content = None
        if end > self.sent:
            content, self.sent = self.text[self.sent : end], end
        deltas: list[dict[str, Any]] = []
        for j, (body, complete) in enumerate(self._blocks()):
            if j == len(self.names):
                self.names.append(None)
                self.args.append(None)
            if self.names[j] is None:
                match = _NAME.search(body)
                if match is None:
                    break  # call j+1 waits for call j's name
                self.names[j] = match.group(1)
                deltas.append(
                    {
                        "id": tool_call_id(),
                        "type": "function",
                        "index": j,
                        "function": {"name": match.group(1)},
                    }
                )
            args = _arguments(body, complete)
            if args is not None and len(args) > len(self.args[j] or ""):
                deltas.append({"index": j, "function": {"arguments": args[len(self.args[j] or "") :]}})
                self.args[j] = args
        if finished and deltas and self.args and self.args[-1] is None:
            last = deltas[-1]["function"]
            last["arguments"] = last.get("arguments", "") + "{}"
        if deltas and not self.keep_calls:
            deltas = []
        if not content and not deltas:
            return None
        self.streamed = self.streamed or bool(deltas)
        delta: dict[str, Any] = {"content": content}
        if deltas:
            delta["tool_calls"] = deltas
        return delta

    def _blocks(self) -> list[tuple[str, bool]]:
        """(JSON text, complete) of each `<tool_call>` region so far."""
        blocks, pos = [], 0
        while (start := self.text.find(TOOL_CALL_START, pos)) >= 0:
            body_start = start + len(TOOL_CALL_START)
            stop = self.text.find(TOOL_CALL_END, body_start)
            if stop >= 0:
                blocks.append((self.text[body_start:stop].strip(), True))
                pos = stop + len(TOOL_CALL_END)
                continue
            raw = self.text[body_start:]
            body = raw[: len(raw) - _overlap(raw, TOOL_CALL_END)].strip()
            # `complete` only matters (in `_arguments`) for a body ending in "}": parsing others, which on
            # every token of a long call is most of the work, cannot change a delta
            blocks.append((body, body.endswith("}") and _is_json(body)))
            break
        return blocks


def hermes_stream_deltas(pieces: list[str], keep_calls: bool = True) -> list[dict[str, Any] | None]:
    """Per streamed text piece (the last one finishes the choice), the chat delta (None: nothing to send)."""
    stream = HermesStream(keep_calls)
    return [stream.step(piece, i == len(pieces) - 1) for i, piece in enumerate(pieces)]


def _arguments(body: str, complete: bool) -> str | None:
    match = _ARGUMENTS.search(body)
    if match is None:
        return None
    args = body[match.end() :]
    if complete:
        args = args.rstrip()
        if args.endswith("}"):
            args = args[:-1].rstrip()  # the call object's own closing brace
    return args


def _overlap(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
