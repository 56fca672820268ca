"""What the gateway asks of a vLLM upstream, what it strips again, and how answers become records.

One `EndpointSpec` per recorded endpoint. For a vLLM upstream the gateway asks for what training needs
(`return_token_ids: true`, and sampled-token log-probs) and, on the way back, removes what the agent did
not ask for, so the agent sees what plain vLLM would have sent (wire facts: docs/vllm-wire-format.md):
non-streaming bodies carry the unrequested fields as `null`; stream chunks omit them.

The records hold the server's token ids and log-probs exactly as returned; nothing is re-tokenized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlgate.episodes import CallResponse, Endpoint


@dataclass(slots=True)
class Injected:
    """Which fields the gateway added to the request and must strip from the answer."""

    token_ids: bool = False
    logprobs: bool = False

    @property
    def any(self) -> bool:
        return self.token_ids or self.logprobs


@dataclass(slots=True)
class Transition:
    """One choice of an answer, ready to become a `CallRecord`."""

    choice_index: int
    response: CallResponse
    prompt_token_ids: list[int] | None
    completion_token_ids: list[int] | None
    completion_logprobs: list[float] | None
    completion_token_texts: list[str] | None = None  # each sampled token's text, when asked for


# ---------------------------------------------------------------------------------------------------------
# Requests

_TRUE_STRINGS = frozenset({"1", "true", "t", "yes", "y", "on"})


def is_true(value: Any) -> bool:
    """A boolean request field as vLLM reads it (pydantic's lax mode: `1`, `"true"`, `"yes"`... are true)."""
    if value is True or value is False or value is None:
        return bool(value)
    if isinstance(value, (int, float)):
        return value == 1
    return isinstance(value, str) and value.strip().lower() in _TRUE_STRINGS


_FALSE_STRINGS = frozenset({"0", "false", "f", "no", "n", "off"})
# The boolean fields the gateway reads itself (to stream, to inject, to restore the answer), per endpoint.
_READ_BOOLEANS: dict[str, tuple[str, ...]] = {
    "chat.completions": ("stream", "return_token_ids", "logprobs"),
    "completions": ("stream", "return_token_ids", "echo"),
    "responses": ("stream", "enable_response_messages"),
}


class InvalidField(ValueError):
    """A request field the gateway reads or translates itself has a value vLLM would refuse: answered before
    anything is forwarded with `status` (400; 404 for a Responses request's unknown previous response) in the
    error shape of the API called, naming `param`."""

    def __init__(self, param: str | None, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


def optional_object(value: Any, param: str) -> dict[str, Any] | None:
    """A request field that is an object when given: None when absent, else the object (`InvalidField`
    when it is not one)."""
    if value is not None and not isinstance(value, dict):
        raise InvalidField(param, f"{param}: an object")
    return value


def chat_stream(stream: Any) -> dict[str, Any]:
    """The stream fields of the chat completion a translated request (Messages, Responses) becomes: its
    `stream` read as vLLM reads it (raise `InvalidField`), and when true, usage asked with every chunk (the
    translated stream's usage events need it)."""
    check_read_fields("chat.completions", {"stream": stream})
    if not is_true(stream):
        return {}
    return {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


def check_read_fields(endpoint: Endpoint, body: dict[str, Any]) -> None:
    """Refuse, as vLLM's pydantic models would, a value the gateway would otherwise read its own way: a
    boolean it reads (`stream`, ...) must be one pydantic's lax mode takes (true/false, 0/1, "yes"/"no",
    ...; null is unset), and `model` a string. Without this, `"stream": [null, null]` was read as false
    while the upstream streamed."""
    for name in _READ_BOOLEANS.get(endpoint, ()):
        value = body.get(name)
        if value is None or value is True or value is False:
            continue
        if isinstance(value, int | float) and value in (0, 1):
            continue
        if isinstance(value, str) and value.strip().lower() in _TRUE_STRINGS | _FALSE_STRINGS:
            continue
        raise InvalidField(name, f"{name}: Input should be a valid boolean, got {_short(value)}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidField("model", f"model: Input should be a valid string, got {_short(model)}")


# The fields that bound how long each choice of an answer can be, per endpoint (vLLM serves
# max_completion_tokens, else max_tokens; `min_tokens`, vLLM's own, forces at least that many).
_TOKEN_FIELDS: dict[str, tuple[str, ...]] = {
    "chat.completions": ("max_completion_tokens", "max_tokens", "min_tokens"),
    "completions": ("max_tokens", "min_tokens"),
    "responses": ("max_output_tokens",),
}
_LAX_INT: Any = None


def _lax_int(name: str, value: Any) -> int:
    """An integer field as vLLM's pydantic models read it (lax: 3, 3.0, "3"); `InvalidField` otherwise."""
    global _LAX_INT
    if type(value) is int:
        return value
    if _LAX_INT is None:
        from pydantic import TypeAdapter

        _LAX_INT = TypeAdapter(int)
    try:
        return int(_LAX_INT.validate_python(value))
    except ValueError:
        raise InvalidField(name, f"{name}: Input should be a valid integer, got {_short(value)}") from None


def prompt_count(body: dict[str, Any]) -> int:
    """How many prompts a completions request holds: vLLM answers `n` choices for each of a list of
    strings or of token-id lists; one string or one token-id list is one prompt."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return len(prompt)
    return 1


def answer_bounds(endpoint: Endpoint, body: dict[str, Any]) -> tuple[int, int, int | None, str | None]:
    """What a request lets its answer grow to: (n, prompts: each gets n choices, tokens per choice or None
    where the request names no bound, the field that names it). Raises `InvalidField` for a value vLLM
    would refuse as no integer."""
    asked = body.get("n")
    n = 1 if asked is None or endpoint == "responses" else _lax_int("n", asked)
    prompts = prompt_count(body) if endpoint == "completions" else 1
    tokens, field = None, None
    for name in _TOKEN_FIELDS.get(endpoint, ()):
        value = body.get(name)
        if value is None and endpoint == "completions" and name == "max_tokens":
            value = 16  # the completions API's default (null too)
        if value is None:
            continue
        value = _lax_int(name, value)
        if tokens is None or value > tokens:  # the largest one named (both checked, as vLLM checks both)
            tokens, field = value, name
    return n, prompts, tokens, field


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def inject(endpoint: Endpoint, body: dict[str, Any]) -> tuple[dict[str, Any], Injected]:
    """The body to send a vLLM upstream (a shallow copy when changed) and what was added to it."""
    injected = Injected()
    out = body
    # completions with `echo`: vLLM drops the echoed prompt from `text` when asked for token ids, so such
    # calls go upstream unchanged and are recorded without token ids.
    if endpoint == "completions" and body.get("echo"):
        return body, injected
    if not is_true(body.get("return_token_ids")):
        out = dict(body)
        out["return_token_ids"] = True
        injected.token_ids = True
    if endpoint == "chat.completions":
        # `top_logprobs` without `logprobs` is a 400 from vLLM: leave it so, not hidden by our injection.
        if not is_true(body.get("logprobs")) and not body.get("top_logprobs"):
            out = out if out is not body else dict(body)
            out["logprobs"] = True
            injected.logprobs = True
    elif body.get("logprobs") is None:
        # completions: `logprobs` is the number of top alternatives; 0 returns the sampled token's own.
        out = out if out is not body else dict(body)
        out["logprobs"] = 0
        injected.logprobs = True
    return out, injected


# ---------------------------------------------------------------------------------------------------------
# Non-streaming answers


def strip_response(endpoint: Endpoint, payload: dict[str, Any], injected: Injected) -> None:
    """Null the injected fields of an answer or a stream chunk in place, as plain vLLM serializes them."""
    if injected.token_ids and "prompt_token_ids" in payload:
        payload["prompt_token_ids"] = None
    for choice in payload.get("choices") or ():
        if injected.token_ids:
            if "token_ids" in choice:
                choice["token_ids"] = None
            if endpoint == "completions" and "prompt_token_ids" in choice:
                choice["prompt_token_ids"] = None
        if injected.logprobs and "logprobs" in choice:
            choice["logprobs"] = None


def transitions(
    endpoint: Endpoint, payload: dict[str, Any], injected: Injected | None = None, token_text: bool = False
) -> list[Transition]:
    """The transitions of a non-streaming answer: one per choice; with `token_text`,
    each sampled token's text too (`sampled_tokens`)."""
    usage = payload.get("usage")
    response_id = payload.get("id")
    prompt_token_ids = payload.get("prompt_token_ids")
    chat = endpoint == "chat.completions"  # else completions: a text, and the prompt's ids in each choice
    out: list[Transition] = []
    for choice in payload.get("choices") or ():
        response = CallResponse(
            id=response_id,
            message=choice.get("message") if chat else None,
            text=None if chat else choice.get("text"),
            finish_reason=choice.get("finish_reason"),
            stop_reason=choice.get("stop_reason"),
            usage=usage,
        )
        prompt_ids = prompt_token_ids if chat else choice.get("prompt_token_ids")
        out.append(
            Transition(
                choice_index=choice.get("index", len(out)),
                response=response,
                prompt_token_ids=prompt_ids,
                completion_token_ids=choice.get("token_ids"),
                completion_logprobs=sampled_logprobs(endpoint, choice.get("logprobs")),
                completion_token_texts=sampled_tokens(endpoint, choice.get("logprobs"))
                if token_text
                else None,
            )
        )
    return out


def sampled_logprobs(endpoint: Endpoint, logprobs: Any) -> list[float] | None:
    """The sampled tokens' log-probs from a choice's `logprobs` (chat: `content[].logprob`; completions:
    `token_logprobs`)."""
    if not logprobs:
        return None
    if endpoint == "chat.completions":
        content = logprobs.get("content")
        return None if content is None else [entry["logprob"] for entry in content]
    values = logprobs.get("token_logprobs")
    # `echo` puts the prompt's tokens first, the very first with a null log-prob: not a completion's.
    return None if values is None or None in values else list(values)


def sampled_tokens(endpoint: Endpoint, logprobs: Any) -> list[str] | None:
    """The sampled tokens' text from a choice's `logprobs` (chat: `content[].token`; completions:
    `tokens`), as the server decoded them one by one (a token that ends inside a UTF-8 character reads as
    the server wrote it); None where the server gave none, or gave the prompt's too (`echo`)."""
    if not logprobs:
        return None
    if endpoint == "chat.completions":
        content = logprobs.get("content")
        return None if content is None else [str(entry.get("token") or "") for entry in content]
    values, tokens = logprobs.get("token_logprobs"), logprobs.get("tokens")
    return None if tokens is None or values is None or None in values else [str(t or "") for t in tokens]
