"""Bounded reads for dashboards: counts that need no SCAN, and what a listing shows of each rollout's calls.

Every read here costs O(1) or O(log N) Redis work per key, or a bounded number of bytes per rollout, so a
dashboard can poll it on a store of millions of rollouts:

- open rollouts: `ZCARD` of the expiry schedule (`Keys.expiry` holds exactly the open rollouts: the
  gateway adds one at creation, closing, failing and expiring remove it);
- rollouts started lately: `ZCOUNT` of the listing index (`Keys.rollouts`) over a time window;
- closed episodes: the stream's `XINFO STREAM` (length, `entries-added`) and the learners' consumer
  group's `lag` and `pending` (`XINFO GROUPS`), as `EpisodeStore.backlog` reads them;
- reward jobs waiting: `LLEN` of the rq queue;
- the policy pointer and the newest learner step.

A listing shows each rollout's agent and the policy versions that served it from fields of the rollout
hash that the record script keeps (`agent_name`, `first_version`, `last_version`: `EpisodeStore.list_rollouts`
reads them with the rest of the summary), never from the call records, which may be megabytes each.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from rlgate.episodes.keys import rq_queue_key
from rlgate.episodes.records import Policy
from rlgate.episodes.store import EpisodeStore

STEPS_MAX = 2000  # most learner steps one read returns


@dataclass(frozen=True, slots=True)
class StoreCounts:
    """A snapshot of the store's counters (`StoreOverview.counts`)."""

    taken_at: float
    open: int = 0  # open rollouts
    indexed: int = 0  # rollouts in the listing index
    started_recently: int = 0  # rollouts created within `window_s`
    window_s: float = 60.0
    stream_length: int = 0  # entries on the closed-episode stream (trimmed entries not counted)
    closed_total: int = 0  # entries ever added to it (`entries-added`; its length before Redis 7)
    has_group: bool = False  # whether the learners' consumer group exists
    group_lag: int = 0  # entries not yet delivered to the group
    group_pending: int = 0  # delivered, not yet acknowledged
    reward_jobs: int = 0  # reward jobs waiting in the rq queue
    policy: Policy = field(default_factory=Policy)
    last_step: dict[str, Any] | None = None  # the newest learner step

    @property
    def closed_waiting(self) -> int:
        """Closed episodes not yet acknowledged by the learners: the group's lag plus its pending entries,
        or the stream's length while there is no group (no learner started yet)."""
        return self.group_lag + self.group_pending if self.has_group else self.stream_length


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class StoreOverview:
    """Dashboard reads on an `EpisodeStore` (its keys, its timeout, its error translation)."""

    def __init__(self, store: EpisodeStore, reward_queue: str | None = None, group: str = "learners") -> None:
        self.store = store
        self.keys = store.keys
        self.queue_key = rq_queue_key(reward_queue) if reward_queue else None
        self.group = group

    async def counts(self, window_s: float = 60.0) -> StoreCounts:
        """The counters, read in two round trips."""
        now = time.time()
        redis, keys = self.store.redis, self.keys
        async with self.store.guard():
            pipe = redis.pipeline(transaction=False)
            pipe.zcard(keys.expiry)
            pipe.zcard(keys.rollouts)
            pipe.zcount(keys.rollouts, now - window_s, "+inf")
            pipe.exists(keys.episodes)
            pipe.hgetall(keys.policy)
            pipe.xrevrange(keys.learner_steps, count=1)
            open_, indexed, recent, has_stream, policy, step = await pipe.execute()
            info: dict[Any, Any] = {}
            groups: list[dict[Any, Any]] = []
            if has_stream:
                pipe = redis.pipeline(transaction=False)
                pipe.xinfo_stream(keys.episodes)
                pipe.xinfo_groups(keys.episodes)
                info, groups = await pipe.execute()
        jobs = await self.store.queue_length(self.queue_key) if self.queue_key else 0  # rq's Redis
        group = next((g for g in groups if _text(g.get("name")) == self.group), None)
        length = int(info.get("length") or 0)
        return StoreCounts(
            taken_at=now,
            open=int(open_),
            indexed=int(indexed),
            started_recently=int(recent),
            window_s=window_s,
            stream_length=length,
            closed_total=int(info.get("entries-added") or length),
            has_group=group is not None,
            group_lag=int((group or {}).get("lag") or 0),
            group_pending=int((group or {}).get("pending") or 0),
            reward_jobs=jobs,
            policy=Policy.model_validate({_text(k): _text(v) for k, v in policy.items() if v != b""})
            if policy
            else Policy(),
            last_step=orjson.loads(step[0][1][b"data"]) if step else None,
        )

    async def call_count(self, rollout_id: str) -> int:
        async with self.store.guard():
            return int(await self.store.redis.llen(self.keys.calls(rollout_id)))

    async def learner_steps(self, count: int) -> list[dict[str, Any]]:
        """The newest `count` learner steps (at most `STEPS_MAX`), oldest first."""
        return await self.store.learner_steps(max(1, min(count, STEPS_MAX)))
