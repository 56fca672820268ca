"""The records rlgate keeps in Redis: a rollout (one agent episode) and its calls (LLM transitions).

Our own records are strict (`extra="forbid"`) and carry `schema_version`; Redis holds
`model_dump_json()` and readers use `model_validate_json()`.

Following Agent Lightning's unified data interface, an episode is the sequence of the policy LLM's
transitions `(input_t, output_t, r_t)`: each `CallRecord` is one transition, with the exact token ids and
sampling log-probs the inference server returned (never re-tokenized). A request with `n > 1` yields one
record per choice, sharing the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 1

Endpoint = Literal["chat.completions", "completions", "responses"]
# An API the gateway translates to one of the endpoints above (the record then holds what went upstream)
AgentApi = Literal["anthropic.messages", "openai.responses"]
Mode = Literal["train", "val"]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RolloutStatus(StrEnum):
    """Where a rollout is in its life (transitions: `rlgate.episodes.keys`)."""

    OPEN = "open"  # the agent is working; calls are recorded
    CLOSED = "closed"  # its final return is known; waiting for the learner
    CONSUMED = "consumed"  # trained on and acknowledged by a learner
    EXPIRED = "expired"  # no reward within its TTL; not trained on
    FAILED = "failed"  # its reward job gave up; not trained on


class FinishRequest(_Record):
    """What `POST /rollouts/{id}/finish` asked for: the reward job computes the reward from it."""

    reward_fn: str = Field(description="A registered reward function, an entry point or a dotted path.")
    ground_truth: Any = None
    params: dict[str, Any] = Field(default_factory=dict, description="Options of the reward function.")


class Rollout(_Record):
    """One agent episode: the unit a reward closes and the learner trains on."""

    schema_version: int = SCHEMA_VERSION
    rollout_id: str
    task_id: str | None = Field(None, description="The task this is a run of: the GRPO group key.")
    status: RolloutStatus = RolloutStatus.OPEN
    created_at: float = Field(description="Unix seconds.")
    expires_at: float | None = Field(None, description="When an open rollout expires (unix seconds).")
    mode: Mode = Field(
        "train",
        description="train: trained on once closed. val: a validation run, recorded and "
        "scored like any other, reported apart by the learner and never trained on.",
    )
    metadata: dict[str, Any] = Field(default_factory=dict)
    reward: float | None = Field(None, description="The final return R, once closed.")
    reward_metadata: dict[str, Any] | None = None
    closed_at: float | None = None
    consumed_at: float | None = None
    error: str | None = Field(None, description="Why the rollout failed (its reward job's last error).")
    finish: FinishRequest | None = Field(None, description="The reward job's request, if one was made.")
    agent_name: str | None = Field(None, description="The first named agent that made one of its calls.")
    first_version: int | None = Field(None, description="The lowest policy version that served a call.")
    last_version: int | None = Field(None, description="The highest policy version that served a call.")


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
    model: str | None = Field(
        None,
        description="The model the call was served by: the requested one, or "
        "the adapter the gateway sent it to (`Policy`).",
    )
    policy_version: int = Field(description="The policy version the gateway served this call with.")
    choice_index: int = 0
    stream: bool = False
    request: dict[str, Any] = Field(
        description="The request as the agent sent it (messages or prompt, tools, sampling parameters)."
    )
    request_shared: bool = Field(
        False,
        description="n > 1: the request is stored once per call, on its choice 0 (the record "
        "`choice_index` positions earlier); the store fills it in when it reads this choice.",
    )
    response: CallResponse | None = None
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    completion_logprobs: list[float] | None = Field(
        None, description="Log-prob of each sampled completion token, as the server reported it."
    )
    completion_token_texts: list[str] | None = Field(
        None,
        description="Each sampled completion token's text, as the server reported it with its log-prob "
        "(kept with RLGATE_RECORD_TOKEN_TEXT, for display; never trained on).",
    )
    started_at: float = Field(description="Unix seconds when the gateway received the request.")
    latency_ms: float = Field(description="From receiving the request to the complete upstream answer.")
    ttfb_ms: float | None = Field(None, description="Streams: time to the first upstream byte.")
    error: CallError | None = None
    server: str | None = Field(
        None, description="The inference server that answered (with several upstreams: `gateway.servers`)."
    )
    rerouted_from: str | None = Field(
        None,
        description="The server the rollout's earlier calls went to, when this call had to go elsewhere "
        "(that one was down or behind): its context was prefilled again here.",
    )
    agent_api: AgentApi | None = Field(
        None,
        description="The API the agent spoke when the gateway translated it: 'anthropic.messages' (the "
        "Messages API) or 'openai.responses' (the Responses API), served as the chat completion in "
        "`request` and `response`).",
    )

    @property
    def trainable(self) -> bool:
        """A call the learner can train on: no error, and the server's token ids. Its log-probs, when the
        server gave them, must cover every completion token; a server that gave none (vLLM's Responses API
        for an answer of tool calls only) leaves the learner to take its own pre-update log-probs as the
        sampler's for this call (importance weight 1)."""
        return (
            self.error is None
            and self.prompt_token_ids is not None
            and self.completion_token_ids is not None
            and (
                self.completion_logprobs is None
                or len(self.completion_logprobs) == len(self.completion_token_ids)
            )
        )


class IndexedCall(CallRecord):
    """A call as the API shows it: the record, its index in the rollout and its intermediate rewards."""

    index: int
    reward: float | None = Field(None, description="Intermediate reward r_t posted for this call.")
    air_reward: float | None = Field(None, description="Automatic intermediate reward (failed tool call).")


class RolloutEvent(_Record):
    """An event an agent posted with its rollout (Agent Lightning's event route): kept, not interpreted,
    except `reward` events, which close the episode and are not kept here."""

    event_type: str = Field(max_length=128)
    attempt_id: str | None = None
    timestamp: float = Field(description="Unix seconds when the gateway received it.")
    data: dict[str, Any] = Field(default_factory=dict)


class RolloutView(Rollout):
    """`GET /rollouts/{id}`: the rollout with its calls in order."""

    calls: list[IndexedCall] = Field(default_factory=list)
    events: list[RolloutEvent] = Field(
        default_factory=list, description="Events the agent posted (at most `EVENTS_MAX` per rollout)."
    )


class Policy(_Record):
    """The policy pointer the learner sets after each weight push (the `policy` hash).

    `adapter` is the name the inference servers serve the current weights under (a LoRA adapter loaded
    as `policy-v{N}`), or None when the weights were updated in place (full push) or never pushed. The
    gateway sends a call that asks for `base_model` to `adapter` instead and tags it with `version`.
    """

    version: int = 0
    adapter: str | None = None
    base_model: str | None = None
    draining: bool = Field(
        False,
        description="A full-weight push is under way: gateways hold new calls "
        "(or answer 429) until it is over; calls in flight finish on the old weights.",
    )


class RolloutSummary(BaseModel):
    """A rollout as `GET /rollouts` lists it: its state, without its metadata and calls."""

    rollout_id: str
    task_id: str | None = None
    status: RolloutStatus
    mode: Mode = "train"
    created_at: float = Field(description="Unix seconds.")
    closed_at: float | None = None
    reward: float | None = None
    error: str | None = None
    calls: int = Field(description="Call records held (one per choice).")
    agent_name: str | None = Field(None, description="The first named agent that made one of its calls.")
    first_version: int | None = Field(None, description="The lowest policy version that served a call.")
    last_version: int | None = Field(None, description="The highest policy version that served a call.")


class RolloutListing(BaseModel):
    """One page of `GET /rollouts`: newest first. A filtered page may hold fewer rollouts than asked for,
    even none; the listing goes on while `next_cursor` is not null."""

    rollouts: list[RolloutSummary]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last one.")


@dataclass(frozen=True, slots=True)
class ClosedEpisode:
    """One stream entry: a closed rollout waiting to be trained on. The entry's wire format is here, both
    ways: `fields` (what the closer writes with XADD) and `from_entry` (what a learner reads back)."""

    entry_id: str  # the stream's id ("" before it is added)
    rollout_id: str
    task_id: str | None
    reward: float
    mode: str = "train"  # val: a validation episode, scored apart and never trained on
    version: int | None = None  # the oldest policy version that served one of its calls (None: no call)

    def fields(self) -> list[str]:
        """The entry's field-value pairs, flat, as XADD takes them: the mode only when not train, the
        version only when known."""
        pairs = {
            "rollout_id": self.rollout_id,
            "task_id": self.task_id or "",
            "reward": repr(float(self.reward)),
        }
        if self.mode != "train":
            pairs["mode"] = self.mode
        if self.version is not None:
            pairs["version"] = str(self.version)
        return [x for kv in pairs.items() for x in kv]

    @classmethod
    def from_entry(cls, entry_id: bytes | str, fields: dict[bytes, bytes]) -> ClosedEpisode:
        def text(key: bytes) -> str:
            return fields.get(key, b"").decode()

        return cls(
            entry_id.decode() if isinstance(entry_id, bytes) else entry_id,
            text(b"rollout_id"),
            text(b"task_id") or None,
            float(text(b"reward") or "nan"),
            text(b"mode") or "train",
            int(version) if (version := text(b"version")).isdigit() else None,
        )
