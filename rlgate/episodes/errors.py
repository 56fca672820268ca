"""Errors of the episode store. Services map them to HTTP statuses in their own error modules."""


class StoreError(Exception):
    """Base of every error raised by the episode store."""


class StoreUnavailable(StoreError):
    """Redis could not be reached or did not answer in time; nothing was written."""


class InvalidId(StoreError, ValueError):
    """A rollout or task id that cannot be used in a key (empty, too long, or odd characters)."""


class RolloutExists(StoreError):
    """A rollout with this id already exists."""


class RolloutNotFound(StoreError):
    """No rollout with this id."""


class RolloutNotOpen(StoreError):
    """The rollout is no longer open (closed, expired, ...): it takes no more calls."""

    def __init__(self, rollout_id: str, status: str) -> None:
        super().__init__(f"rollout {rollout_id!r} is {status}, not open")
        self.rollout_id = rollout_id
        self.status = status


class RolloutMissing(StoreError):
    """A call that must continue an existing rollout (it carries the rollout's key, which only `POST
    /rollouts` hands out) found none: Redis lost it, or it was deleted."""

    def __init__(self, rollout_id: str) -> None:
        super().__init__(
            f"rollout {rollout_id!r} was created but is no longer in Redis (its data was lost or "
            "deleted): it cannot be continued; start a new rollout"
        )
        self.rollout_id = rollout_id


class RolloutFull(StoreError):
    """The rollout already holds the most call records (`max_calls`), events or bytes
    (`EpisodeStore.rollout_max_bytes`, its attempts' included) it may; nothing written."""

    def __init__(self, rollout_id: str, held: int, limit: int, what: str = "calls") -> None:
        if what == "bytes":
            message = (
                f"rollout {rollout_id!r} holds {held} bytes of records and events, its attempts' included; "
                f"this would take it over {limit} (max_rollout_bytes): close it and start a new one"
            )
        else:
            setting = "max_calls_per_rollout" if what == "calls" else "a fixed limit"
            message = (
                f"rollout {rollout_id!r} holds {held} {what}; at most {limit} are kept per rollout "
                f"({setting}): close it and start a new one"
            )
        super().__init__(message)
        self.rollout_id = rollout_id
        self.held = held
        self.limit = limit


class TooManyAttempts(StoreError):
    """A rollout has had the most attempts it may (`max_attempts_per_rollout`); nothing written."""

    def __init__(self, rollout_id: str, limit: int) -> None:
        super().__init__(
            f"rollout {rollout_id!r} has had {limit} attempts, the most it may "
            "(max_attempts_per_rollout): start a new rollout"
        )
        self.rollout_id = rollout_id


class ModeMismatch(StoreError):
    """A call into a training rollout through a validation URL, or the other way round."""

    def __init__(self, rollout_id: str, mode: str, given: str) -> None:
        super().__init__(f"rollout {rollout_id!r} is a {mode} rollout, not {given}")
        self.rollout_id = rollout_id
        self.mode = mode


class RecordTooLarge(StoreError):
    """A call's records are larger than the store was told to keep (`max_record_bytes`); nothing written."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(
            f"this call's record would take {size} bytes, above the gateway's limit of {limit} "
            "(max_record_bytes): ask for fewer choices (n) or fewer tokens (max_tokens)"
        )
        self.size = size
        self.limit = limit


class TaskMismatch(StoreError):
    """A call names a different task than the one its rollout belongs to."""

    def __init__(self, rollout_id: str, task_id: str, given: str) -> None:
        super().__init__(f"rollout {rollout_id!r} belongs to task {task_id!r}, not {given!r}")
        self.rollout_id = rollout_id
        self.task_id = task_id
        self.given = given


class RolloutExpired(StoreError):
    """The rollout expired before its reward arrived."""


class RewardConflict(StoreError):
    """The rollout was already closed with a different reward."""

    def __init__(self, rollout_id: str, reward: float) -> None:
        super().__init__(f"rollout {rollout_id!r} is already closed with reward {reward}")
        self.rollout_id = rollout_id
        self.reward = reward


class CallNotFound(StoreError):
    """No call with this index in the rollout."""
