"""Hermes-style tool-call parsing, as `vllm serve --enable-auto-tool-choice --tool-call-parser hermes`.

The model writes `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (one block per call).
`parse_hermes(text)` mirrors vLLM's `Hermes2ProToolParser.extract_tool_calls`: every block (a last one
missing its `</tool_call>` included) is parsed as JSON; arguments are re-serialized with
`json.dumps(..., ensure_ascii=False)`; the content is the text before the first `<tool_call>`, or None
when that is empty. If there is no `<tool_call>` or any block fails to parse, there are no tool calls and
the whole text is the content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON string, as the OpenAI API carries it

    def to_wire(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().int & 0xFFFFFFFFFFFFFFFF:016x}"


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished completion's text."""
    if TOOL_CALL_START not in text:
        return text, []
    try:
        calls = []
        for closed, unclosed in _BLOCK.findall(text):
            call = json.loads(closed or unclosed)
            calls.append(ToolCall(tool_call_id(), str(call["name"]),
                                  json.dumps(call.get("arguments", {}), ensure_ascii=False)))
    except (ValueError, KeyError, TypeError, AttributeError):
        return text, []
    if not calls:
        return text, []
    content = text[: text.find(TOOL_CALL_START)]
    return content or None, calls


_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')


def hermes_stream_deltas(pieces: list[str], calls: list[ToolCall]) -> list[dict | None]:
    """Per streamed text piece, the chat delta vLLM's streaming hermes parser sends (None: nothing yet).

    Text before the first `<tool_call>` streams as `content` (minus a possible partial tag); for call j,
    the first delta names it (`{"id", "type", "index": j, "function": {"name"}}`), later ones carry
    fragments of the raw `arguments` text as the model wrote it (`{"index": j, "function": {"arguments"}}`),
    without the call object's closing brace. `calls` (from `parse_hermes` on the whole text) give the ids.
    """
    out: list[dict | None] = []
    text, sent = "", 0
    named = [False] * len(calls)
    args_sent = [""] * len(calls)
    for piece in pieces:
        text += piece
        first = text.find(TOOL_CALL_START)
        end = first if first >= 0 else len(text) - _overlap(text, TOOL_CALL_START)
        content, deltas = None, []
        if end > sent:
            content, sent = text[sent:end], end
        blocks = text[first:].split(TOOL_CALL_START)[1:] if first >= 0 else []
        for j, block in enumerate(blocks[: len(calls)]):
            if TOOL_CALL_END in block:
                body, done = block[: block.index(TOOL_CALL_END)].strip(), True
            else:
                body = block[: len(block) - _overlap(block, TOOL_CALL_END)].strip()
                done = _is_json(body)
            if not named[j] and _NAME.search(body):
                named[j] = True
                deltas.append({"id": calls[j].id, "type": "function", "index": j,
                               "function": {"name": calls[j].name}})
            if named[j] and (match := _ARGUMENTS.search(body)):
                args = body[match.end():].rstrip() if done else body[match.end():]
                if done and args.endswith("}"):
                    args = args[:-1].rstrip()  # the call object's own closing brace
                if len(args) > len(args_sent[j]):
                    deltas.append({"index": j, "function": {"arguments": args[len(args_sent[j]):]}})
                    args_sent[j] = args
        out.append({"content": content, "tool_calls": deltas} if content or deltas else None)
    return out


def _overlap(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
