"""Agent Lightning's rollout queue, kept with each rollout, so that its controller (`agl-controller`) can
drive rlgate unchanged.

Agent Lightning 1.0's controller polls its store for rollouts (`GET /api/rollouts?state_in=queuing&
state_in=running`), starts an agent process for each queuing one, and reports what happened to it
(`PATCH /api/rollouts/{id}`: running when started, succeeded or failed when it exited). Here each of its
rollouts is an ordinary rlgate rollout (the agent's calls and its reward event record into it), plus Agent
Lightning's view of it in the rollout's `agl` hash: `input`, `config`, `metadata` (JSON), `is_train`, and
its status: `state` (queuing -> running -> succeeded | failed), `last_attempt_id`, `error_message`,
`k8s_job_name`, `version` (+1 per change), `created_at`, `updated_at`. The queue (`Keys.agl_queue`) lists
the queuing and running ones by creation time; a rollout leaves it when it ends. A rollout its controller
reports failed is failed in rlgate too (never trained), unless its reward already closed it.

Which task a rollout belongs to (its GRPO group): `metadata.task_id` when it names one, else a digest of
its `input` (the same input is the same task).
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Literal, cast

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator
from redis.typing import EncodableT, FieldT

from rlgate.episodes import _lua
from rlgate.episodes.errors import InvalidId, RolloutExists, RolloutNotFound, StoreError
from rlgate.episodes.keys import _ID_RE, validate_id
from rlgate.episodes.store import EpisodeStore

AglState = Literal["queuing", "running", "succeeded", "failed"]
ACTIVE: tuple[AglState, ...] = ("queuing", "running")


class AglConflict(StoreError):
    """A state change Agent Lightning's state machine refuses (its server answers 409 too)."""


class AglLocal(BaseModel):
    agent_class: str | None = None
    env_map: dict[str, str] = Field(default_factory=dict)


class AglK8s(BaseModel):
    job_template: str | None = None


class AglConfig(BaseModel):
    """Agent Lightning's `RolloutConfig`: how its controller runs the agent."""

    timeout_seconds: int = 3600
    local: AglLocal | None = None
    k8s: AglK8s | None = None


class AglMetadata(BaseModel):
    """Agent Lightning's `RolloutMetadata`: its two fields typed (its controller validates them), any others."""

    model_config = ConfigDict(extra="allow")

    batch_idx: int | None = None
    sample_idx_in_batch: int | None = None


class AglCreate(BaseModel):
    """Agent Lightning's `RolloutCreate` (`config` and `metadata` may be null, as its SDK dumps them)."""

    model_config = ConfigDict(extra="forbid")

    input: Any
    is_train: bool = True
    config: AglConfig | None = None
    metadata: AglMetadata | None = None
    rollout_id: str | None = None


class AglStatusPatch(BaseModel):
    """Agent Lightning's `RolloutStatusPatch`: what its controller reports."""

    model_config = ConfigDict(extra="forbid")

    state: AglState | None = None
    k8s_job_name: str | None = Field(None, max_length=256)
    last_attempt_id: str | None = Field(None, max_length=32)
    error_message: str | None = None  # kept to its first 2,000 characters

    @field_validator("error_message")
    @classmethod
    def _bounded(cls, value: str | None) -> str | None:
        return None if value is None else value[:2000]


class AglPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    status: AglStatusPatch | None = None


def task_of(create: AglCreate) -> str:
    """The rlgate task (GRPO group) of an Agent Lightning rollout: `metadata.task_id`, else its input's digest."""
    named = getattr(create.metadata, "task_id", None) if create.metadata is not None else None
    if isinstance(named, str) and _ID_RE.fullmatch(named):
        return named
    digest = hashlib.sha256(orjson.dumps(create.input, option=orjson.OPT_SORT_KEYS)).hexdigest()
    return f"agl-{digest[:16]}"


class AglQueue:
    """Agent Lightning's rollouts in the episode store (see the module docstring)."""

    def __init__(self, store: EpisodeStore) -> None:
        self.store = store
        self.keys = store.keys
        self._patch = store.redis.register_script(_lua.AGL_PATCH)

    async def create(self, create: AglCreate, rollout_id: str) -> dict[str, Any]:
        """Create the rollout (queuing) and return it in Agent Lightning's shape; an id taken by one of its
        rollouts returns that one (its server is idempotent on ids); taken by another: `RolloutExists`."""
        try:
            rollout = await self.store.create_rollout(
                rollout_id, task_of(create), {"agl": True}, "train" if create.is_train else "val"
            )
        except RolloutExists:
            existing = await self.get(rollout_id)
            if existing is None:
                raise
            return existing
        now = repr(rollout.created_at)
        config = create.config or AglConfig()
        metadata = (create.metadata or AglMetadata()).model_dump()
        fields: dict[FieldT, EncodableT] = {
            "input": orjson.dumps(create.input),
            "config": config.model_dump_json(),
            "metadata": orjson.dumps(metadata),
            "is_train": "1" if create.is_train else "0",
            "state": "queuing",
            "version": "1",
            "created_at": now,
            "updated_at": now,
        }
        async with self.store.guard():
            await self.store.redis.hset(self.keys.agl(rollout_id), mapping=fields)
            await self.store.redis.zadd(self.keys.agl_queue, {rollout_id: rollout.created_at})
            size = await self.store.redis.zcard(self.keys.agl_queue)
            if size > self.store.index_max:  # bounded as the rollouts index is: the oldest go
                await self.store.redis.zremrangebyrank(
                    self.keys.agl_queue, 0, size - self.store.index_max - 1
                )
        found = await self.get(rollout_id)
        assert found is not None
        return found

    async def get(self, rollout_id: str) -> dict[str, Any] | None:
        validate_id(rollout_id, "rollout id")
        async with self.store.guard():
            fields = cast(dict[bytes, bytes], await self.store.redis.hgetall(self.keys.agl(rollout_id)))
        return _rollout(rollout_id, fields) if fields else None

    async def active(self, states: set[str], limit: int) -> list[dict[str, Any]]:
        """The queue's rollouts in one of `states` (queuing, running), oldest first, at most `limit`."""
        out: list[dict[str, Any]] = []
        if not states & set(ACTIVE):  # only queuing and running rollouts are in the queue
            return out
        async with self.store.guard():
            members = cast(list[bytes], await self.store.redis.zrange(self.keys.agl_queue, 0, -1))
            ids = [i.decode() for i in members]
        gone = []
        for rollout_id in ids:
            if len(out) >= limit:
                break
            try:
                rollout = await self.get(rollout_id)
            except InvalidId:
                rollout = None
            if rollout is None:  # its keys expired (retention)
                gone.append(rollout_id)
            elif rollout["status"]["state"] in states:
                out.append(rollout)
        if gone:
            async with self.store.guard():
                await self.store.redis.zrem(self.keys.agl_queue, *gone)
        return out

    async def patch(self, rollout_id: str, patch: AglStatusPatch) -> dict[str, Any]:
        """Apply the controller's report; `RolloutNotFound`, or `AglConflict` for a refused transition."""
        validate_id(rollout_id, "rollout id")
        async with self.store.guard():
            reply = await self._patch(
                keys=[self.keys.agl(rollout_id)],
                args=[
                    patch.state or "",
                    patch.last_attempt_id or "",
                    patch.error_message or "",
                    patch.k8s_job_name or "",
                    repr(time.time()),
                ],
            )
        outcome = reply[0].decode() if isinstance(reply[0], bytes) else reply[0]
        if outcome == "missing":
            raise RolloutNotFound(f"no Agent Lightning rollout {rollout_id!r}")
        state = reply[1].decode() if isinstance(reply[1], bytes) else reply[1]
        if outcome == "conflict":
            raise AglConflict(f"rollout {rollout_id!r} is {state}: it cannot become {patch.state}")
        if state not in ACTIVE:
            async with self.store.guard():
                await self.store.redis.zrem(self.keys.agl_queue, rollout_id)
        found = await self.get(rollout_id)
        if found is None:
            raise RolloutNotFound(f"no Agent Lightning rollout {rollout_id!r}")
        return found


def _rollout(rollout_id: str, fields: dict[bytes, bytes]) -> dict[str, Any]:
    """Agent Lightning's `Rollout` JSON from the agl hash."""

    def text(name: str) -> str | None:
        value = fields.get(name.encode())
        return None if value is None else value.decode()

    return {
        "rollout_id": rollout_id,
        "input": orjson.loads(fields[b"input"]),
        "is_train": text("is_train") == "1",
        "config": orjson.loads(fields[b"config"]),
        "metadata": orjson.loads(fields[b"metadata"]),
        "status": {
            "state": text("state"),
            "k8s_job_name": text("k8s_job_name"),
            "last_attempt_id": text("last_attempt_id"),
            "error_message": text("error_message"),
            "version": int(text("version") or 1),
            "created_at": float(text("created_at") or 0),
            "updated_at": float(text("updated_at") or 0),
        },
    }
