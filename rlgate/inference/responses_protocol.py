"""The request of `POST /v1/responses` as vLLM 0.33 reads it (`entrypoints/openai/responses/protocol.py`
`ResponsesRequest`), and what it renders to: chat messages and chat-form tools for the chat template
(`responses/utils.py` `construct_input_messages`, `convert_tool_responses_to_completions_format`).

Fields are declared in vLLM's order with vLLM's defaults and its own 400s (`prompt`, `background` without
`store`, `tool_choice` against `tools`). Unknown fields are accepted and ignored, as vLLM's `OpenAIBaseModel`
does. Narrower than vLLM (each a 400 naming what is not supported, listed in docs/vllm-wire-format.md): tools
are flat function tools only, `tool_choice` is "none"/"auto"/"required" or `{"type": "function", "name"}`,
`text.format` only `{"type": "text"}`, input items are messages, `function_call` and `function_call_output`.
"""

from __future__ import annotations

import uuid
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from rlgate import responses_items as items
from rlgate.inference.protocol import BadRequest, SamplingFields, invalid

LOGPROBS_INCLUDE = "message.output_text.logprobs"
IncludeItem = Literal[
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    LOGPROBS_INCLUDE,
    "reasoning.encrypted_content",
]


class ResponsesRequest(SamplingFields):
    background: bool | None = False
    include: list[IncludeItem] | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = None
    model: str | None = None
    logit_bias: dict[str, float] | None = None
    parallel_tool_calls: bool | None = True
    previous_response_id: str | None = None
    prompt: Any = None
    reasoning: dict[str, Any] | None = None
    include_reasoning: bool = True
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    store: bool | None = True
    stream: bool | None = False
    temperature: float | None = None
    text: dict[str, Any] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int | None = 0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    user: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = None
    request_id: str = Field(default_factory=lambda: f"resp_{uuid.uuid4().int & 0xFFFFFFFFFFFFFFFF:016x}")
    enable_response_messages: bool = False
    previous_input_messages: list[Any] | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = Field(default_factory=list)
    stop_token_ids: list[int] | None = Field(default_factory=list)
    ignore_eos: bool = False

    # the chat fields SamplingFields checks that a Responses request does not have
    NEUTRAL: ClassVar[dict[str, Any]] = {
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "min_p": 0.0,
        "ignore_eos": False,
    }

    @model_validator(mode="after")
    def _stream_options_need_stream(
        self,
    ) -> ResponsesRequest:  # replaces the chat check: no stream_options here
        return self

    @field_validator("prompt_cache_retention", mode="before")
    @classmethod
    def _in_memory(cls, value: Any) -> Any:
        return "in_memory" if value == "in-memory" else value

    @field_validator("top_logprobs", mode="before")
    @classmethod
    def _top_logprobs_default(cls, value: Any) -> Any:
        return 0 if value is None else value

    @model_validator(mode="before")
    @classmethod
    def _vllm_checks(cls, data: Any) -> Any:
        """vLLM's `validate_background`, `validate_prompt` and `check_tool_usage`, in its order."""
        if not isinstance(data, dict):
            return data
        if data.get("background") and not data.get("store", True):
            raise invalid("background can only be used when `store` is true", "background")
        if data.get("prompt") is not None:
            raise invalid("prompt template is not supported", "prompt")
        tools, choice = data.get("tools"), data.get("tool_choice", "auto")
        named = isinstance(choice, dict) and choice.get("type") in ("function", "custom")
        if not tools:
            if choice in ("auto", "none"):
                data = {**data, "tool_choice": "none"}
            elif choice == "required":
                raise invalid(
                    "Tool choice 'required' must be specified with 'tools' parameter.", "tool_choice"
                )
            elif named:
                raise invalid("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")
        elif named and isinstance(tools, list):
            name = choice.get("name")
            if not name or not any(isinstance(t, dict) and t.get("name") == name for t in tools):
                raise invalid("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")
        return data

    @model_validator(mode="after")
    def _supported(self) -> ResponsesRequest:
        """What `rlgate serve` does not implement: a 400 rather than a silently different answer."""
        for tool in self.tools:
            if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
                raise BadRequest(
                    'rlgate serve supports function tools only ({"type": "function", "name", '
                    '"parameters", ...}).',
                    param="tools",
                )
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") != "function":
            raise BadRequest(
                'rlgate serve supports tool_choice "none", "auto", "required" or '
                '{"type": "function", "name"} only.',
                param="tool_choice",
            )
        fmt = (self.text or {}).get("format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            raise BadRequest(
                "rlgate serve does not implement structured outputs (text.format).", param="text"
            )
        return self

    def wants_logprobs(self) -> bool:
        """vLLM's `is_include_output_logprobs`: log-probs only through `include`."""
        return self.include is not None and LOGPROBS_INCLUDE in self.include

    def chat_messages(self) -> list[dict[str, Any]]:
        """The chat messages the template renders (vLLM's `construct_input_messages`): the instructions as a
        system message, a string input as one user message, items as their chat messages (a function call
        joins the assistant message before it)."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for item in self.input:
            message = _chat_message(
                item, messages[-1] if messages and messages[-1].get("role") == "assistant" else None
            )
            if message is not None:
                messages.append(message)
        return messages

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The flat Responses tools in chat form, for the chat template."""
        if not self.tools:
            return None
        return [
            {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}
            for tool in self.tools
        ]


def _chat_message(item: dict[str, Any], assistant: dict[str, Any] | None) -> dict[str, Any] | None:
    """One input item as a chat message (vLLM's `_construct_message_from_response_item`); None when it was
    merged into the assistant message before it."""
    kind = item.get("type")
    if kind == "function_call":
        if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
            raise invalid("a function_call item needs string `call_id`, `name` and `arguments`", "input")
        call = {
            "id": item["call_id"],
            "function": {"name": item["name"], "arguments": item["arguments"]},
            "type": "function",
        }
        return items.input_tool_call(call, assistant)
    if kind == "function_call_output":
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if item.get("role") == "assistant":
        content = item.get("content")
        text = (
            content
            if isinstance(content, str)
            else (
                content[0].get("text")
                if isinstance(content, list) and content and isinstance(content[0], dict)
                else None
            )
        )
        if text is not None:
            if assistant is not None and assistant.get("content") is None:
                assistant["content"] = text
                return None
            return {"role": "assistant", "content": text}
    if "role" in item and kind in (None, "message"):
        return {k: v for k, v in item.items() if k != "type"}
    raise invalid(f"Unsupported input item type: {kind}", "input")
