"""The requests `rlgate serve` reads (vLLM 0.33's OpenAI protocol) and its error tree.

Request models accept unknown fields (`extra="allow"`), as vLLM's `OpenAIBaseModel` does: clients send
fields we do not use (`user`, `metadata`, ...) and must not get a 400 for them. Responses are built in
`inference.server` key by key in vLLM's order (docs/vllm-wire-format.md), because their exact layout
(every key present, `null` when unused, per-chunk key sets in streams) is the contract.

Errors: one shallow tree, each class with its HTTP status and vLLM error `type`; the server's one handler
turns them into `{"error": {"message", "type", "param", "code"}}` with `code` = the HTTP status.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(OpenAIModel):
    """The sampling fields chat and completions share (vLLM names and defaults)."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    n: int = Field(default=1, ge=1, le=64)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool | None = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    # Accepted at their neutral values only: the engine does not implement them (a 400 rather than a
    # silently different distribution).
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    min_p: float | None = 0.0
    min_tokens: int | None = 0
    ignore_eos: bool | None = False

    @model_validator(mode="after")
    def _unsupported(self) -> SamplingFields:
        neutral = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0,
                   "min_tokens": 0, "ignore_eos": False}
        for name, value in neutral.items():
            if getattr(self, name) not in (None, value):
                raise BadRequest(f"`{name}` is not supported by rlgate serve (only {value!r}).", param=name)
        return self

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop) if s]


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=0, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise BadRequest("when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
        return self


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool | None = False


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
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class BadRequest(ServeError, ValueError):
    """400. A ValueError too, so that raising it inside a pydantic validator surfaces as a 400."""

    status = 400
    type = "BadRequestError"


class ModelNotFound(ServeError):
    status = 404
    type = "NotFoundError"
