"""The sweeper: expires open rollouts past their TTL (or closes them with the fill reward), republishes
closed episodes whose closer died before publishing them, and trims the closed-episode stream of entries
every learner group acknowledged more than `retention_s` ago.

Every gateway process runs one, but only the holder of a lease in Redis (`keys.sweeper`, `SweeperLease`)
sweeps: one pass per interval for the whole deployment, not one per process. Each process asks once
per interval (one script call); the holder renews its lease with that call, and when it dies the lease
runs out (`lease_s`: three intervals plus 5 s) and another process takes over. A pass that outlives the
lease could overlap the next holder's; that is still correct, as each transition is an exactly-once
script and the stream is at-least-once anyway (the learner's claim is the exactly-once point), only no
longer the cheap case."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import socket
import time
import uuid

import structlog

from reward_hooks.settings import RewardSettings
from rlgate.episodes import EpisodeLifecycle, EpisodeStore, StoreUnavailable

log = structlog.get_logger("rlgate.sweeper")

# KEYS[1] the lease; ARGV[1] this holder's token, ARGV[2] the lease in ms. 1 if this holder has it now.
_HOLD = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 1
end
return 0
"""
# KEYS[1] the lease; ARGV[1] this holder's token: let it go if still ours.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class SweeperLease:
    """Which one process of a deployment sweeps: a Redis key holding its token, with a TTL."""

    def __init__(self, store: EpisodeStore, lease_s: float) -> None:
        self.store = store
        self.key = store.keys.sweeper
        self.lease_ms = max(1, round(lease_s * 1000))
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"  # who, for inspection
        self._hold = store.redis.register_script(_HOLD)
        self._release = store.redis.register_script(_RELEASE)

    async def hold(self) -> bool:
        """Take the lease, or renew it if this holder has it; whether it does now."""
        async with self.store.guard():
            return bool(await self._hold(keys=[self.key], args=[self.token, self.lease_ms]))

    async def release(self) -> None:
        async with self.store.guard():
            await self._release(keys=[self.key], args=[self.token])


def lease_s(settings: RewardSettings) -> float:
    return 3 * settings.sweep_interval_s + 5.0


async def sweep_once(
    lifecycle: EpisodeLifecycle, settings: RewardSettings, learner_group: str = "learners"
) -> tuple[dict[str, str], list[str]]:
    expired = await lifecycle.expire_due(fill_reward=settings.expired_fill_reward)
    repaired = await lifecycle.repair_outbox(grace_s=settings.outbox_grace_s)
    for rollout_id, outcome in expired.items():
        log.info("rollout_expired", rollout_id=rollout_id, outcome=outcome)
    for rollout_id in repaired:
        log.warning("episode_republished", rollout_id=rollout_id)
    await _trim(lifecycle, learner_group)
    return expired, repaired


_held_back_warned = -math.inf  # when (monotonic) the sweeper last named a group holding trimming back


async def _trim(lifecycle: EpisodeLifecycle, learner_group: str) -> None:
    """Trim the closed-episode stream (`EpisodeLifecycle.trim_episodes`); say, at most every 10 minutes,
    which consumer group holds back entries older than the retention."""
    global _held_back_warned
    trimmed, holder = await lifecycle.trim_episodes(learner_group)
    retention_s = lifecycle.store.retention_s
    if trimmed:
        log.info("episodes_trimmed", entries=trimmed, retention_s=retention_s)
    if holder is not None and time.monotonic() - _held_back_warned > 600:
        _held_back_warned = time.monotonic()
        log.warning(
            "episodes_trim_held_back",
            group=holder,
            retention_s=retention_s,
            hint="this consumer group has entries older than the retention unacknowledged or undelivered; "
            "if nobody reads it any more (an old experiment's), remove it with XGROUP DESTROY",
        )


async def sweep_forever(
    store: EpisodeStore, settings: RewardSettings, learner_group: str = "learners"
) -> None:
    """Expire, repair and trim while this process holds the sweeper's lease; the stream is trimmed only
    once the learners' consumer group `learner_group` exists (`EpisodeLifecycle.trim_episodes`)."""
    lifecycle = EpisodeLifecycle(store)
    lease = SweeperLease(store, lease_s(settings))
    holding = False
    try:
        while True:
            try:
                held = await lease.hold()
                if held != holding:
                    log.info("sweeper_lease_taken" if held else "sweeper_lease_lost", holder=lease.token)
                holding = held
                if held:
                    await sweep_once(lifecycle, settings, learner_group)
            except StoreUnavailable as exc:
                log.warning("sweep_failed", error=str(exc))
            except Exception:  # a sweeper that dies silently would stop expiry and repair for good
                log.exception("sweep_crashed")
            await asyncio.sleep(settings.sweep_interval_s)
    finally:  # a process that stops hands the sweeping on at once, not after the lease runs out
        if holding:
            with contextlib.suppress(Exception):
                await lease.release()
