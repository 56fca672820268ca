"""Episode state transitions: close (reward), intermediate rewards, fail, expire, consume, and the outbox
that puts every closed episode on the stream. The states and keys are described in `rlgate.episodes.keys`."""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from rlgate.episodes import _lua
from rlgate.episodes.errors import (
    CallNotFound,
    RewardConflict,
    RolloutExpired,
    RolloutNotFound,
    RolloutNotOpen,
)
from rlgate.episodes.records import ClosedEpisode, FinishRequest
from rlgate.episodes.store import EpisodeStore


def canonical_reward(reward: float) -> str:
    """The one string a reward is stored as, so that 1, 1.0, 1e0 (and -0.0, 0.0) compare equal in Lua."""
    value = float(reward) + 0.0  # + 0.0 turns -0.0 into 0.0
    if not math.isfinite(value):
        raise ValueError(f"a reward must be a finite number, not {reward!r}")
    return repr(value)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _require_open(rollout_id: str, status: str) -> None:
    """Raise the error of a script that needed an open rollout and found `status` ('' when missing)."""
    if status == "":
        raise RolloutNotFound(f"no rollout {rollout_id!r}")
    if status == "expired":
        raise RolloutExpired(f"rollout {rollout_id!r} expired")
    if status != "open":
        raise RolloutNotOpen(rollout_id, status)


def _intent(rollout_id: str) -> str:
    """An outbox member of one closer: each has its own, so nobody removes another's intent."""
    return f"{rollout_id}|{uuid.uuid4().hex[:16]}"


@dataclass(frozen=True, slots=True)
class CloseResult:
    """`closed`: this call closed the rollout. `unchanged`: it was already closed with this reward."""

    outcome: str
    reward: float


def _closed_or_same(reply: Any) -> bool:
    """CLOSE wrote (closed), or answers for an earlier write that must be on the replicas too (same)."""
    return reply[0] in (b"closed", b"same")


class EpisodeLifecycle:
    """Every transition is one Lua script on the rollout's hash: exactly once under any race."""

    def __init__(self, store: EpisodeStore) -> None:
        self.store = store
        self.keys = store.keys
        redis = store.redis
        # what a reward's sender is told is done survives a failover with `?wait_replicas=N`
        self._outbox_add = store.durable_script(_lua.OUTBOX_ADD)
        self._close = store.durable_script(_lua.CLOSE)
        self._add_episode = store.durable_script(_lua.ADD_EPISODE)
        self._set_call_reward = store.durable_script(_lua.SET_CALL_REWARD)
        self._mark_published = redis.register_script(_lua.MARK_PUBLISHED)
        self._expire = redis.register_script(_lua.EXPIRE)
        self._fail = redis.register_script(_lua.FAIL)
        self._consume = redis.register_script(_lua.CONSUME)
        self._claim = redis.register_script(_lua.CLAIM)
        self._set_finish = redis.register_script(_lua.SET_FINISH)
        self._trim_episodes = redis.register_script(_lua.TRIM_EPISODES)

    def _retention_ms(self) -> str:
        """The store's retention in whole milliseconds for the scripts: '0' (keep) only for 0."""
        retention_s = self.store.retention_s
        return str(max(1, math.ceil(retention_s * 1000))) if retention_s > 0 else "0"

    # ---------------------------------------------------------------------------------------------------
    # Final return

    async def close(
        self, rollout_id: str, reward: float, metadata: dict[str, Any] | None = None
    ) -> CloseResult:
        """Close an open rollout with its final return and publish it for the learners.

        The same reward again is `unchanged`; another reward raises `RewardConflict`; an unknown rollout
        `RolloutNotFound`; an expired one `RolloutExpired`; a failed one `RolloutNotOpen`; a reward that is
        not finite or metadata that is not JSON `ValueError`. Only the close itself changes anything.
        """
        value = canonical_reward(reward)
        try:
            metadata_json = orjson.dumps(metadata or {})
        except TypeError as exc:
            raise ValueError(f"metadata is not JSON (integers must fit in 64 bits): {exc}") from exc
        intent = _intent(rollout_id)
        async with self.store.durable_guard(scripts=2):
            # the intent first (the sweeper's way to the stream if this closer dies or its entry is lost)
            await self._outbox_add(keys=[self.keys.outbox], args=[repr(time.time()), intent])
            reply = await self._close(
                keys=[self.keys.rollout(rollout_id)],
                args=[value, metadata_json, repr(time.time())],
                wrote=_closed_or_same,  # a refusal (conflict, missing, expired) changed nothing: no wait
            )
        outcome = _text(reply[0])
        if outcome == "closed":
            await self._publish(
                rollout_id, (_text(reply[1]), _text(reply[2]), _text(reply[3])), value, intent
            )
            return CloseResult("closed", float(value))
        # Not ours to publish: the closer that closed it does, or, if that one died, the sweeper finds its
        # intent. So the stream holds each episode once in normal operation.
        async with self.store.guard():
            await self.store.redis.zrem(self.keys.outbox, intent)
        if outcome == "same":
            return CloseResult("unchanged", float(value))
        if outcome == "conflict":
            raise RewardConflict(rollout_id, float(_text(reply[1])))
        if outcome == "missing":
            raise RolloutNotFound(f"no rollout {rollout_id!r}")
        if outcome == "expired":
            raise RolloutExpired(f"rollout {rollout_id!r} expired before its reward arrived")
        raise RolloutNotOpen(rollout_id, outcome)

    async def _publish(
        self, rollout_id: str, hashed: tuple[str, str, str] | None, reward: str, intent: str
    ) -> None:
        """Put a closed episode on the stream (at least once), then clear the intent and its expiry.
        `hashed`: the rollout's task id, mode and first version as the close script read them (None: read
        them here). A validation episode (mode val) carries its mode: learners score it apart and never
        train on it; `version`, the oldest policy version that served one of its calls, lets them report success
        per serving version."""
        async with self.store.durable_guard():
            if hashed is None:
                values = await self.store.redis.hmget(
                    self.keys.rollout(rollout_id), "task_id", "mode", "first_version"
                )
                task_id, mode_name, version = (_text(v or b"") for v in values)
            else:
                task_id, mode_name, version = hashed
            entry = ClosedEpisode(
                "",
                rollout_id,
                task_id or None,
                float(reward),
                mode_name or "train",
                int(version) if version.isdigit() else None,
            )
            await self._add_episode(keys=[self.keys.episodes], args=entry.fields())
            await self._mark_published(keys=[self.keys.rollout(rollout_id)])
            async with self.store.redis.pipeline(transaction=False) as pipe:
                pipe.zrem(self.keys.outbox, intent)
                pipe.zrem(self.keys.expiry, rollout_id)
                await pipe.execute()

    # ---------------------------------------------------------------------------------------------------
    # Intermediate rewards, reward jobs, failure

    async def set_call_reward(
        self, rollout_id: str, index: int, reward: float, *, automatic: bool = False
    ) -> None:
        """Attach an intermediate reward r_t to call `index` (webhook, or AIR when `automatic`) of an open
        rollout; `RolloutNotOpen` once it is closed (the learner may have read it already)."""
        target = self.keys.air(rollout_id) if automatic else self.keys.rewards(rollout_id)
        async with self.store.durable_guard():
            reply = await self._set_call_reward(
                keys=[self.keys.rollout(rollout_id), self.keys.calls(rollout_id), target],
                args=[index, canonical_reward(reward)],
                wrote=lambda r: r[0] == b"ok",
            )
        outcome = _text(reply[0])
        if outcome == "no_call":
            raise CallNotFound(f"rollout {rollout_id!r} has no call {index}")
        _require_open(rollout_id, {"ok": "open", "missing": ""}.get(outcome, outcome))

    async def set_finish(self, rollout_id: str, finish: FinishRequest) -> None:
        """Store the reward job's request on an open rollout."""
        async with self.store.guard():
            status = _text(
                await self._set_finish(keys=[self.keys.rollout(rollout_id)], args=[finish.model_dump_json()])
            )
        _require_open(rollout_id, status)

    async def fail(self, rollout_id: str, error: str) -> bool:
        """Mark an open rollout failed (not trained on); False if it was not open any more."""
        return await self._fail_open(rollout_id, error) == "open"

    async def mark_failed(self, rollout_id: str, error: str) -> None:
        """Mark an open rollout failed on request, exactly once. It is never published, so no learner
        trains on it. `RolloutNotFound`, `RolloutExpired`, or `RolloutNotOpen` (closed, consumed, failed
        already) when it is not open; then nothing changed."""
        _require_open(rollout_id, await self._fail_open(rollout_id, error))

    async def _fail_open(self, rollout_id: str, error: str) -> str:
        """The FAIL script: the status before ('open': failed now; '' when missing)."""
        async with self.store.guard():
            before = _text(
                await self._fail(
                    keys=self.keys.rollout_keys(rollout_id),
                    args=[error[:2000], repr(time.time()), self._retention_ms()],
                )
            )
            if before == "open":
                await self.store.redis.zrem(self.keys.expiry, rollout_id)
        return before

    async def claim(self, rollout_id: str, owner: str, lease_s: float) -> str:
        """Claim a closed rollout for training by `owner` for `lease_s` seconds (renewable by the same
        owner; the lease runs on Redis's clock). Returns `claimed`, `not_closed` (consumed, failed, gone)
        or `held` (another owner's lease runs)."""
        async with self.store.guard():
            reply = int(
                await self._claim(
                    keys=[self.keys.rollout(rollout_id)], args=[owner, str(max(1, int(lease_s * 1000)))]
                )
            )
        return {1: "claimed", 0: "not_closed", -1: "held"}[reply]

    async def consume(self, rollout_id: str) -> bool:
        """Mark a closed rollout consumed by a learner; True only the first time. Its keys expire after
        the store's `retention_s` (0: kept)."""
        async with self.store.guard():
            return bool(
                await self._consume(
                    keys=self.keys.rollout_keys(rollout_id), args=[repr(time.time()), self._retention_ms()]
                )
            )

    # ---------------------------------------------------------------------------------------------------
    # Sweeping: expiry and outbox repair

    async def expire_due(self, fill_reward: float | None = None, limit: int = 200) -> dict[str, str]:
        """Expire (or close with `fill_reward`) open rollouts whose TTL has passed. Returns what happened."""
        now = time.time()
        fill = "" if fill_reward is None else canonical_reward(fill_reward)
        async with self.store.guard():
            due = await self.store.redis.zrangebyscore(self.keys.expiry, "-inf", now, start=0, num=limit)
        done: dict[str, str] = {}
        for raw in due:
            rollout_id = _text(raw)
            intent = _intent(rollout_id)
            async with self.store.guard():
                if fill:
                    await self.store.redis.zadd(self.keys.outbox, {intent: now})
                reply = await self._expire(
                    keys=self.keys.rollout_keys(rollout_id), args=[repr(now), fill, self._retention_ms()]
                )
            outcome = _text(reply[0])
            if outcome == "closed":
                await self._publish(rollout_id, None, fill, intent)
            else:
                async with self.store.guard(), self.store.redis.pipeline(transaction=False) as pipe:
                    if fill:
                        pipe.zrem(self.keys.outbox, intent)
                    if outcome == "not_due":  # its deadline moved: keep it scheduled at the real one
                        pipe.zadd(self.keys.expiry, {rollout_id: float(_text(reply[1]))})
                    else:  # expired now, or no longer open (its closer clears what else is left)
                        pipe.zrem(self.keys.expiry, rollout_id)
                    await pipe.execute()
            done[rollout_id] = outcome
        return done

    async def trim_episodes(self, learner_group: str | None = None) -> tuple[int, str | None]:
        """Remove closed-episode stream entries that every consumer group has acknowledged and that are
        older than the store's `retention_s` (none while it is 0; none while the group `learner_group`,
        when given, does not exist: another group, an exporter's, acknowledging entries does not mean a
        learner has them). Returns how many went and the group
        that holds back entries older than the retention, if one does (a learner stuck on an old entry,
        or the group of an old experiment nobody reads: `XGROUP DESTROY` it)."""
        if self.store.retention_s <= 0:
            return 0, None
        cutoff = f"{max(0, int((time.time() - self.store.retention_s) * 1000))}-0"
        async with self.store.guard():
            removed, holder = await self._trim_episodes(
                keys=[self.keys.episodes], args=[cutoff, learner_group or ""]
            )
        return int(removed), _text(holder) or None

    async def repair_outbox(self, grace_s: float = 30.0, limit: int = 200) -> list[str]:
        """Publish closed episodes whose closer died (or failed) before publishing them; drop intents that
        led nowhere. Only intents older than `grace_s` are looked at: younger ones belong to live closers.
        Returns the ids of the episodes published here."""
        async with self.store.guard():
            stale = await self.store.redis.zrangebyscore(
                self.keys.outbox, "-inf", time.time() - grace_s, start=0, num=limit
            )
        repaired = []
        for raw in stale:
            intent = _text(raw)
            rollout_id = intent.partition("|")[0]
            async with self.store.guard():
                status, published, reward = await self.store.redis.hmget(
                    self.keys.rollout(rollout_id), "status", "published", "reward"
                )
            if status == b"closed" and published == b"0":
                await self._publish(rollout_id, None, _text(reward), intent)
                repaired.append(rollout_id)
                continue
            async with self.store.guard():
                if status == b"consumed" and published == b"0":
                    # on the stream already (a learner consumed it) though the flag was never set
                    await self._mark_published(keys=[self.keys.rollout(rollout_id)])
                await self.store.redis.zrem(self.keys.outbox, intent)
        return repaired
