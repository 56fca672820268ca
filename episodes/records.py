"""The records rlgate keeps in Redis: a rollout (one agent episode) and its calls (LLM transitions).

Our own records are strict (`extra="forbid"`) and carry `schema_version`; Redis holds
`model_dump_json()` and readers use `model_validate_json()`.

Following Agent Lightning's unified data interface, an episode is the sequence of the policy LLM's
transitions `(input_t, output_t, r_t)`: each `CallRecord` is one transition, with the exact token ids and
sampling log-probs the inference server returned (never re-tokenized). A request with `n > 1` yields one
record per choice, sharing the prompt.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 1

Endpoint = Literal["chat.completions", "completions", "responses"]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RolloutStatus(StrEnum):
    """Where a rollout is in its life. Only `open` exists until the reward lifecycle lands (issue 3)."""

    OPEN = "open"


class Rollout(_Record):
    """One agent episode: the unit a reward closes and the learner trains on."""

    schema_version: int = SCHEMA_VERSION
    rollout_id: str
    task_id: str | None = Field(None, description="The task this is a run of: the GRPO group key.")
    status: str = RolloutStatus.OPEN
    created_at: float = Field(description="Unix seconds.")
    metadata: dict[str, Any] = Field(default_factory=dict)


class CallError(_Record):
    """Why a call failed: an upstream error (its status kept), a broken stream, or the client leaving."""

    status: int = Field(description="The HTTP status the agent saw (or would have seen).")
    type: str
    message: str
    code: str | int | None = None


class CallResponse(_Record):
    """What the policy answered, in the shape of the endpoint that was called."""

    id: str | None = Field(None, description="The upstream's response id.")
    message: dict[str, Any] | None = Field(
        None, description="chat.completions: the assistant message (content, tool_calls, ...)."
    )
    text: str | None = Field(None, description="completions: the generated text.")
    output: list[Any] | None = Field(None, description="responses: the output items.")
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: dict[str, Any] | None = Field(
        None, description="Usage of the whole upstream response (shared by all choices when n > 1)."
    )


class CallRecord(_Record):
    """One LLM transition of a rollout, as served. Its index is its position in the rollout's calls."""

    schema_version: int = SCHEMA_VERSION
    rollout_id: str
    task_id: str | None = None
    agent_name: str | None = Field(None, description="From X-Agent-Name: which agent made the call.")
    endpoint: Endpoint
    model: str | None = None
    policy_version: int = Field(description="The policy version the gateway served this call with.")
    choice_index: int = 0
    stream: bool = False
    request: dict[str, Any] = Field(
        description="The request as the agent sent it (messages or prompt, tools, sampling parameters)."
    )
    response: CallResponse | None = None
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    completion_logprobs: list[float] | None = Field(
        None, description="Log-prob of each sampled completion token, as the server reported it."
    )
    started_at: float = Field(description="Unix seconds when the gateway received the request.")
    latency_ms: float = Field(description="From receiving the request to the complete upstream answer.")
    ttfb_ms: float | None = Field(None, description="Streams: time to the first upstream byte.")
    error: CallError | None = None

    @property
    def trainable(self) -> bool:
        """A call the learner can train on: no error, and the server's token ids and log-probs."""
        return (
            self.error is None
            and self.prompt_token_ids is not None
            and self.completion_token_ids is not None
            and self.completion_logprobs is not None
            and len(self.completion_logprobs) == len(self.completion_token_ids)
        )


class IndexedCall(CallRecord):
    """A call as the API shows it: the record plus its index in the rollout."""

    index: int


class RolloutView(Rollout):
    """`GET /rollouts/{id}`: the rollout with its calls in order."""

    calls: list[IndexedCall] = Field(default_factory=list)
