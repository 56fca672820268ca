"""The requests `rlgate serve` reads (vLLM 0.33's OpenAI protocol) and its error tree.

Request models accept unknown fields (`extra="allow"`), as vLLM's `OpenAIBaseModel` does: clients send
fields we do not use (`user`, `metadata`, ...) and must not get a 400 for them. Responses are built in
`rlgate.inference.server` key by key in vLLM's order (docs/vllm-wire-format.md), because their exact layout
(every key present, `null` when unused, per-chunk key sets in streams) is the contract.

Errors: one shallow tree, each class with its HTTP status and vLLM error `type`; the server's one handler
turns them into `{"error": {"message", "type", "param", "code"}}` with `code` = the HTTP status.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(OpenAIModel):
    """What chat and completions share: the checks on their sampling fields. Each request declares its
    fields itself, in the order of vLLM's model, so that a request with several invalid fields gets vLLM's
    list of errors in vLLM's order."""

    if TYPE_CHECKING:
        model: str | None
        max_tokens: int | None
        temperature: float | None
        top_p: float | None
        top_k: int | None
        n: int
        seed: int | None
        stop: str | list[str] | None
        stop_token_ids: list[int] | None
        logit_bias: dict[str, float] | None
        return_token_ids: bool | None
        stream: bool | None
        stream_options: StreamOptions | None

    # Accepted at their neutral values only: the engine does not implement them (a 400 rather than a
    # silently different distribution).
    NEUTRAL: ClassVar[dict[str, Any]] = {
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "min_p": 0.0,
        "min_tokens": 0,
        "ignore_eos": False,
    }

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise invalid("Stream options can only be defined when `stream=True`.", "stream_options")
        return self

    @model_validator(mode="after")
    def _unsupported(self) -> SamplingFields:
        for name, value in self.NEUTRAL.items():
            if getattr(self, name) not in (None, value):
                raise BadRequest(f"`{name}` is not supported by rlgate serve (only {value!r}).", param=name)
        return self

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop) if s]


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]]
    model: str | None = None
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=0, le=20)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=64)
    presence_penalty: float | None = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    top_k: int | None = None
    min_p: float | None = 0.0
    repetition_penalty: float | None = 1.0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = 0
    echo: bool | None = False
    return_token_ids: bool | None = False

    NEUTRAL: ClassVar[dict[str, Any]] = {**SamplingFields.NEUTRAL, "echo": False}

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and self.top_logprobs < 0:
            if self.top_logprobs != -1:
                raise invalid(
                    "`top_logprobs` must be a positive value or -1.", "top_logprobs", self.top_logprobs
                )
            raise BadRequest(
                "`top_logprobs: -1` (the whole vocabulary) is not supported by rlgate serve.",
                param="top_logprobs",
            )
        if self.top_logprobs and not self.logprobs:
            raise invalid("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        return self

    @model_validator(mode="after")
    def _tool_usage(self) -> ChatCompletionRequest:
        """vLLM's `check_tool_usage`; afterwards `tool_choice` is what vLLM works with ("auto" when tools
        come without it, "none" with neither; None only when the client sent null)."""
        if self.tools == []:
            raise invalid(
                "`tools` must not be an empty array. Either provide at least one tool or omit the field "
                "entirely.",
                "tools",
            )
        if "tool_choice" not in self.model_fields_set:
            self.tool_choice = "auto" if self.tools else "none"
            return self
        choice = self.tool_choice
        if choice is None or choice == "none":
            return self
        if self.tools is None:
            raise invalid("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if not isinstance(choice, dict):
            if choice not in ("auto", "required"):
                raise invalid(
                    f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or '
                    f'"required" are supported.',
                    "tool_choice",
                )
            return self
        usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
        function = choice.get("function")
        if not isinstance(function, dict):
            raise invalid(
                f"Invalid value for `function`: `{function}` in `tool_choice`! {usage}",
                "tool_choice.function",
            )
        if "name" not in function:
            raise invalid(
                f"Expected field `name` in `function` in `tool_choice`! {usage}", "tool_choice.function.name"
            )
        name = function["name"]
        if not isinstance(name, str) or not name:
            raise invalid(
                f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}",
                "tool_choice.function.name",
            )
        if not any((tool.get("function") or {}).get("name") == name for tool in self.tools):
            raise invalid(
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
                "tool_choice",
            )
        return self


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    echo: bool | None = False
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = Field(default=None, le=20)
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=64)
    presence_penalty: float | None = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = 0.0
    repetition_penalty: float | None = 1.0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = 0
    return_token_ids: bool | None = False

    @model_validator(mode="after")
    def _vllm_checks(self) -> CompletionRequest:
        if self.logprobs is not None and self.logprobs < 0:
            if self.logprobs != -1:
                raise invalid("`logprobs` must be a positive value or -1.", "logprobs", self.logprobs)
            raise BadRequest(
                "`logprobs: -1` (the whole vocabulary) is not supported by rlgate serve.", param="logprobs"
            )
        if not self.prompt:
            raise invalid("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        return self


class TokenizeRequest(OpenAIModel):
    """vLLM's TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest (`messages`) in one model."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise BadRequest("give exactly one of `prompt` and `messages`", param="prompt")
        return self


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------- errors


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's POST /v1/load_lora_adapter body."""

    model_config = ConfigDict(extra="allow")

    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's POST /v1/unload_lora_adapter body."""

    model_config = ConfigDict(extra="allow")

    lora_name: str = ""
    lora_int_id: int | None = None


class ServeError(Exception):
    """Base: an error answered as `{"error": {...}}` with `status`."""

    status = 500
    type = "InternalServerError"
    headers: dict[str, str] = {}

    def __init__(self, message: str, *, param: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param
        if type is not None:
            self.type = type

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}
        }


class BadRequest(ServeError, ValueError):
    """400. A ValueError too, so that raising it inside a pydantic validator surfaces as a 400."""

    status = 400
    type = "BadRequestError"


def invalid(message: str, param: str, value: Any = None) -> BadRequest:
    """A 400 worded as vLLM's `VLLMValidationError`: the message, then `(parameter=..., value=...)`."""
    extras = [f"parameter={param}"] + ([f"value={value}"] if value is not None else [])
    return BadRequest(f"{message} ({', '.join(extras)})", param=param)


# pydantic-core's names for union branches and wrappers, which vLLM leaves out of an error's `loc`
_INTERNAL_LOC = {
    "function-wrap",
    "function-after",
    "function-before",
    "function-plain",
    "json-or-python",
    "lax-or-strict",
    "chain",
    "default",
    "nullable",
    "tagged-union",
    "union",
    "call",
    "arguments",
    "is-instance",
    "is-subclass",
    "callable",
    "str",
    "int",
    "float",
    "bool",
    "bytes",
    "bytearray",
    "list",
    "tuple",
    "dict",
    "set",
    "frozenset",
    "complex",
    "none",
    "nonetype",
}


def _loc(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if not (re.search(r"[\[\]{}()]", str(p)) or str(p).lower() in _INTERNAL_LOC)]
    return ".".join(parts or map(str, loc))


def _shown(value: Any) -> Any:
    """An error's `input` as vLLM shows it: containers described, long text cut."""
    if isinstance(value, bytes | bytearray):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, list | tuple | set | frozenset | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = value if isinstance(value, str) else str(value)
    return text[:200] + "...[truncated]" if len(text) > 200 else text


def request_validation_error(errors: list[dict[str, Any]]) -> BadRequest:
    """vLLM's 400 for a request its models reject (`validation_exception_handler`): `errors` as pydantic
    gives them, each `loc` starting with "body"; at most 10 are listed, each cut at 1,000 characters."""
    lines = []
    for error in errors[:10]:
        shown = {
            "type": error["type"],
            "loc": _loc(tuple(error["loc"])),
            "msg": error["msg"],
            "input": _shown(error.get("input")),
        }
        if "ctx" in error:
            shown["ctx"] = error["ctx"]
        text = str(shown)
        lines.append(text[:1000] + "...[truncated]" if len(text) > 1000 else text)
    count, label = len(errors), "error" if len(errors) == 1 else "errors"
    message = f"{count} validation {label}:\n" + "".join(f"  {line}\n" for line in lines)
    if count > len(lines):
        message += f"  ...and {count - len(lines)} more {label}\n"
    return BadRequest(message.rstrip(), param=_loc(tuple(errors[0]["loc"])), type="Bad Request")


class ModelNotFound(ServeError):
    status = 404
    type = "NotFoundError"
