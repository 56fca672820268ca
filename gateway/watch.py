"""What the gateway reads from Redis in the background, every `policy_poll_s`, off the calls' path.

- **The policy pointer** (version, adapter) the learner moves after each push. When it disappears while
  the gateway serves a pushed version (Redis lost it), the gateway keeps serving the pointer it had
  instead of falling back to the base model tagged version 0: it logs `policy_pointer_lost` once and
  reports `degraded` on `/healthz` until a pointer is stored again (a resumed learner re-pushes its
  checkpoint's version). A stored pointer is always followed, a lower version too (a learner started
  afresh on purpose), with a warning.
- **The backlog** (`EpisodeStore.backlog`): episodes closed and not yet acknowledged by the learners'
  consumer group (`learner_group`) plus reward jobs queued. Above `max_backlog`, new rollouts are held back (`Proxy`): agents never outrun the
  rewards and the training, so what the learner trains on stays fresh.
- **Redis's memory** (`EpisodeStore.memory`: used_memory against maxmemory; on a cluster, the fullest
  primary). Above `redis_memory_high` of maxmemory, new rollouts are held back as for the backlog (429
  `redis_memory_high` after `backlog_wait_s`), before Redis itself refuses writes (and so every call);
  rollouts under way go on, each within `max_rollout_bytes`.
- **The store's epoch marker** (`EpisodeStore.epoch`): a random value the first gateway writes. When it
  disappears or changes, Redis lost its data (restarted without persistence, flushed, failed over to an
  empty replica). The gateway counts it (`rlgate_gateway_store_data_lost`), logs `store_data_lost`,
  reports `degraded`, and refuses calls into the rollouts it recorded before (409 `rollout_data_lost`):
  such a rollout would otherwise reopen empty and could be closed again with another reward. It knows
  the last `recent_rollouts` rollouts it recorded (a bounded FIFO); another process's cannot be told
  from new ones.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from gateway import errors
from gateway.metrics import GatewayMetrics
from gateway.settings import GatewaySettings
from rlgate import episodes
from rlgate.episodes import EpisodeStore

log = structlog.get_logger("rlgate.gateway")


class StoreWatch:
    def __init__(self, settings: GatewaySettings, store: EpisodeStore, metrics: GatewayMetrics) -> None:
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self.policy = episodes.Policy()
        self.backlog = 0
        self.over_backlog = False
        self.memory: tuple[int, int] = (0, 0)  # Redis's (used_memory, maxmemory); 0: no maxmemory
        self.memory_high = False  # used_memory above redis_memory_high of maxmemory
        self.backlog_clear = asyncio.Event()  # set while new rollouts may start (held calls wait on it)
        self.backlog_clear.set()
        self.epoch: str | None = None
        self.problems: dict[str, str] = {}  # what /healthz reports as degraded, by kind
        self.recent: dict[str, None] = {}  # rollouts this process recorded, oldest first (bounded)
        self.lost: frozenset[str] = frozenset()  # of those, the ones recorded before Redis lost its data
        self.queue_key = episodes.rq_queue_key(settings.reward_queue) if settings.reward_queue else None

    def refuse_lost(self, rollout_id: str) -> None:
        """409 for a rollout recorded here before Redis lost its data: it would reopen empty."""
        if self.lost and rollout_id in self.lost:
            raise errors.Conflict(
                f"rollout {rollout_id!r} was recorded before Redis lost its data: it cannot be "
                "continued, closed or created again; start a new rollout",
                code="rollout_data_lost",
            )

    @property
    def holding(self) -> bool:
        """Whether new rollouts are held back: the backlog is over `max_backlog`, or Redis's memory is high."""
        return self.over_backlog or self.memory_high

    def backlog_full(self) -> errors.BacklogFull:
        """The 429 for a new rollout while new rollouts are held (`holding`)."""
        if self.memory_high and not self.over_backlog:
            used, most = self.memory
            return errors.BacklogFull(
                f"Redis holds {used} of its {most} bytes (maxmemory; new rollouts wait above "
                f"redis_memory_high {self.settings.redis_memory_high}): new rollouts are held back; retry "
                "shortly",
                code="redis_memory_high",
                headers={"retry-after": str(max(1, round(self.settings.backlog_wait_s / 4)))},
            )
        return errors.BacklogFull(
            f"{self.backlog} episodes wait for rewards or training (max_backlog {self.settings.max_backlog}): "
            "new rollouts are held back; retry shortly",
            headers={"retry-after": str(max(1, round(self.settings.backlog_wait_s / 4)))},
        )

    def recorded(self, rollout_id: str) -> None:
        """Remember a rollout this process recorded a call into (cheap: one dict insert)."""
        recent = self.recent
        if rollout_id not in recent:
            recent[rollout_id] = None
            if len(recent) > self.settings.recent_rollouts:
                del recent[next(iter(recent))]

    async def run(self) -> None:
        failing: set[str] = set()  # checks whose failure was logged (once per failure, not per poll)
        while True:
            for name, check in (
                ("epoch", self._check_epoch),
                ("policy", self._check_policy),
                ("backlog", self._check_backlog),
                ("memory", self._check_memory),
            ):
                try:  # each on its own: a corrupted pointer must not stop the backlog check
                    await check()
                    failing.discard(name)
                    self.problems.pop(f"watch_{name}", None)
                except Exception as exc:
                    if name not in failing:
                        log.warning("store_watch_failed", check=name, error=str(exc)[:500])
                    failing.add(name)
                    if not isinstance(
                        exc, episodes.StoreUnavailable
                    ):  # Redis is up but its data is not right
                        self.problems[f"watch_{name}"] = f"reading the {name} fails: {str(exc)[:200]}"
            await asyncio.sleep(self.settings.policy_poll_s)

    async def _check_policy(self) -> None:
        policy = await self.store.stored_policy()
        if policy is None and self.policy.version > 0:
            if "policy_pointer" not in self.problems:
                log.error(
                    "policy_pointer_lost",
                    serving=self.policy.version,
                    hint="kept the last pointer seen; a learner that resumes re-pushes its version",
                )
                self.metrics.errors.labels("policy_pointer_lost").inc()
            self.problems["policy_pointer"] = (
                f"the policy pointer is gone from Redis; still serving version {self.policy.version}"
            )
            return
        policy = policy or episodes.Policy()
        if policy.version < self.policy.version:
            log.warning("policy_version_went_back", serving=self.policy.version, stored=policy.version)
        self.policy = policy
        self.problems.pop("policy_pointer", None)

    async def _check_backlog(self) -> None:
        if self.settings.max_backlog:
            self.backlog = await self.store.backlog(self.queue_key, self.settings.learner_group)
            over = self.backlog > self.settings.max_backlog
            if over != self.over_backlog:
                log.info(
                    "backlog_holding_new_rollouts" if over else "backlog_released",
                    backlog=self.backlog,
                    max_backlog=self.settings.max_backlog,
                )
            self.over_backlog = over
            self._hold()

    async def _check_memory(self) -> None:
        try:
            used, most = self.memory = await self.store.memory()
        except Exception:  # unknown (INFO refused, Redis down): not a reason to hold rollouts back
            if self.memory_high:
                log.warning("redis_memory_released", reason="its memory cannot be read")
            self.memory, self.memory_high = (0, 0), False
            self._hold()
            raise
        # held above redis_memory_high, released below 95% of it: no flapping at the line
        line = self.settings.redis_memory_high * (0.95 if self.memory_high else 1.0)
        high = most > 0 and used > line * most
        if high != self.memory_high:
            log.warning(
                "redis_memory_high_holding_new_rollouts" if high else "redis_memory_released",
                used_memory=used,
                maxmemory=most,
                redis_memory_high=self.settings.redis_memory_high,
            )
        self.memory_high = high
        self._hold()

    def _hold(self) -> None:
        if self.holding:
            self.backlog_clear.clear()
        else:
            self.backlog_clear.set()

    async def _check_epoch(self) -> None:
        epoch = await self.store.epoch(create=True)
        if self.epoch is None:
            self.epoch = epoch
            return
        if epoch == self.epoch:
            return
        self.epoch = epoch
        # bounded too: after several losses only the rollouts of the latest ones are remembered
        keep = (
            self.lost
            if len(self.lost) + len(self.recent) <= 2 * self.settings.recent_rollouts
            else frozenset()
        )
        self.lost = keep | frozenset(self.recent)
        self.recent = {}
        self.metrics.errors.labels("store_data_lost").inc()
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.problems["store"] = (
            f"Redis lost its data (the epoch marker changed at {when}); calls into "
            f"the {len(self.lost)} rollouts recorded here before are refused"
        )
        log.error(
            "store_data_lost",
            rollouts_refused=len(self.lost),
            hint="Redis restarted without its data, was flushed, or failed over to an empty replica: "
            "persist it (AOF) and replicate it",
        )


__all__ = ["StoreWatch"]
