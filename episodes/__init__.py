"""The episode record and its Redis store, shared by the gateway, the reward hooks and the learner.

The three services import this package and never each other. `keys` is the key layout, `records` the
pydantic records that Redis holds as JSON, `store` the async store whose multi-key writes are Lua scripts.
"""

from episodes.errors import (
    CallNotFound,
    InvalidId,
    ModeMismatch,
    RecordTooLarge,
    RewardConflict,
    RolloutExists,
    RolloutExpired,
    RolloutFull,
    RolloutMissing,
    RolloutNotFound,
    RolloutNotOpen,
    StoreError,
    StoreUnavailable,
    TaskMismatch,
    TooManyAttempts,
)
from episodes.keys import Keys, attempt_episode, parent_of, server_name, validate_episode_id, validate_id
from episodes.lifecycle import CloseResult, EpisodeLifecycle, canonical_reward
from episodes.records import (
    SCHEMA_VERSION,
    AgentApi,
    CallError,
    CallRecord,
    CallResponse,
    Endpoint,
    FinishRequest,
    IndexedCall,
    Mode,
    Policy,
    Rollout,
    RolloutEvent,
    RolloutStatus,
    RolloutView,
)
from episodes.store import EVENT_MAX_BYTES, EVENTS_MAX, EpisodeStore
from episodes.stream import ClosedEpisode, ClosedEpisodes

__all__ = [
    "SCHEMA_VERSION",
    "CallError",
    "CallNotFound",
    "CloseResult",
    "ClosedEpisode",
    "ClosedEpisodes",
    "EpisodeLifecycle",
    "FinishRequest",
    "ModeMismatch",
    "RecordTooLarge",
    "RewardConflict",
    "RolloutExpired",
    "canonical_reward",
    "CallRecord",
    "CallResponse",
    "AgentApi",
    "Endpoint",
    "parent_of",
    "server_name",
    "EpisodeStore",
    "EVENTS_MAX",
    "EVENT_MAX_BYTES",
    "IndexedCall",
    "Mode",
    "InvalidId",
    "Keys",
    "Policy",
    "Rollout",
    "RolloutExists",
    "RolloutFull",
    "RolloutNotFound",
    "RolloutMissing",
    "RolloutNotOpen",
    "RolloutEvent",
    "RolloutStatus",
    "RolloutView",
    "StoreError",
    "StoreUnavailable",
    "TaskMismatch",
    "TooManyAttempts",
    "attempt_episode",
    "validate_episode_id",
    "validate_id",
]
