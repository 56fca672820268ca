"""The OpenAI Responses API's items as vLLM 0.33's `/v1/responses` writes them, key by key in its order,
and its rule for an input function call: shared by the gateway's translation (`gateway.responses`) and
`rlgate serve` (`rlgate.inference.responses`), which answer alike (tests/test_gateway_differential.py)."""

from __future__ import annotations

from typing import Any


def message(item_id: str, parts: list[dict[str, Any]], status: str) -> dict[str, Any]:
    """An assistant `message` output item."""
    return {
        "id": item_id,
        "content": parts,
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": None,
    }


def text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    """An `output_text` content part."""
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def function_call(
    item_id: str, call_id: str, name: str, arguments: str, status: str, namespace: str | None = None
) -> dict[str, Any]:
    """A `function_call` output item."""
    return {
        "arguments": arguments,
        "call_id": call_id,
        "name": name,
        "type": "function_call",
        "id": item_id,
        "async": None,
        "caller": None,
        "namespace": namespace,
        "status": status,
    }


def stream_logprob(entry: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `_to_stream_logprobs`: a delta event's entries carry no bytes."""
    return {
        "token": entry["token"],
        "logprob": entry["logprob"],
        "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in entry["top_logprobs"]],
    }


def function_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A flat function tool as the answer echoes it (openai's `FunctionTool`, every field)."""
    return {
        "name": tool.get("name"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict"),
        "type": "function",
        "allowed_callers": tool.get("allowed_callers"),
        "async": tool.get("async"),
        "defer_loading": tool.get("defer_loading"),
        "description": tool.get("description"),
        "output_schema": tool.get("output_schema"),
    }


def reasoning(asked: Any) -> dict[str, Any] | None:
    """The request's `reasoning` as the answer echoes it (null when it sent none)."""
    if not isinstance(asked, dict):
        return None
    return {k: asked.get(k) for k in ("context", "effort", "generate_summary", "mode", "summary")}


def input_tool_call(call: dict[str, Any], assistant: dict[str, Any] | None) -> dict[str, Any] | None:
    """An input function call as chat (vLLM's `_construct_message_from_response_item`): added to the
    assistant message just before it (None), else an assistant message of its own."""
    if assistant is not None and isinstance(assistant.get("tool_calls"), list):
        assistant["tool_calls"].append(call)
        return None
    if assistant is not None and assistant.get("tool_calls") is None:
        assistant["tool_calls"] = [call]
        return None
    return {"role": "assistant", "tool_calls": [call]}
