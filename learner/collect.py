"""Closed episodes in, task groups out: what one training step trains on.

The learner reads the closed-episode stream through its consumer group. Episodes wait, grouped by task
id (the GRPO group key), until a step can be formed:

- a group is *ready* when it holds `rollouts_per_task` episodes (it takes every episode of its task that
  has arrived, so a group may be larger);
- a step takes the `tasks_per_step` oldest ready groups; if fewer are ready, it goes ahead with what
  there is once the oldest waiting group has waited `max_group_wait_s`: every group with at least two
  episodes joins then, incomplete or not;
- a group of one (an episode without a task id, or one left alone after the wait) has no baseline:
  with `singleton_groups="drop"` it is acknowledged untrained and counted; with `"keep"` it trains with
  its return as advantage;
- with `dynamic_filtering` (DAPO's dynamic sampling, OpenRLHF's `--dynamic_filtering`), a group whose
  episodes all have the same reward (all right or all wrong: every advantage zero) is acknowledged
  untrained and tallied (`uniform`), and the step waits for `tasks_per_step` groups that differ. Without
  it such groups join steps with zero advantages: once nearly every group is right, a step's only
  signal is its rare failures, a tiny gradient that AdamW scales to a full-size step.

Nothing is acknowledged here except dropped singletons and, with `dynamic_filtering`, uniform groups:
the loop acknowledges a step's episodes after its checkpoint and push. A restarted learner first takes
back its own unacknowledged entries, and entries other consumers left pending longer than
`reclaim_idle_s` (dead learners) are claimed too.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import structlog

from rlgate.episodes import ClosedEpisode, ClosedEpisodes

log = structlog.get_logger("rlgate.learner")


@dataclass
class Group:
    """The episodes of one task in one step (`task_id` None: a group of one without a task)."""

    task_id: str | None
    episodes: list[ClosedEpisode]
    first_seen: float = field(default_factory=time.monotonic)


@dataclass
class Tally:
    """Episodes' rewards summed as they are scored: in all, and per oldest policy version that served one
    of the episode's calls (`by_version`: version -> [episodes, successes, reward sum]; episodes without a
    recorded call count in all only)."""

    success_threshold: float = 1.0
    episodes: int = 0
    reward_sum: float = 0.0
    successes: int = 0
    by_version: dict[int, list[float]] = field(default_factory=dict)

    def add(self, reward: float, version: int | None = None) -> None:
        success = reward >= self.success_threshold
        self.episodes += 1
        self.reward_sum += reward
        self.successes += success
        if version is not None:
            row = self.by_version.setdefault(version, [0, 0, 0.0])
            row[0] += 1
            row[1] += success
            row[2] += reward

    def versions(self) -> dict[str, list[float]]:
        """`by_version` as JSON keeps it (string keys), in version order."""
        return {str(v): list(self.by_version[v]) for v in sorted(self.by_version)}


class Collector:
    def __init__(
        self,
        stream: ClosedEpisodes,
        consumer: str,
        *,
        tasks_per_step: int,
        rollouts_per_task: int,
        max_group_wait_s: float,
        singleton_groups: str,
        reclaim_idle_s: float = 300.0,
        success_threshold: float = 1.0,
        dynamic_filtering: bool = False,
    ) -> None:
        self.stream = stream
        self.consumer = consumer
        self.tasks_per_step = tasks_per_step
        self.rollouts_per_task = rollouts_per_task
        self.max_group_wait_s = max_group_wait_s
        self.keep_singletons = singleton_groups == "keep"
        self.reclaim_idle_s = reclaim_idle_s
        self.waiting: dict[str, Group] = {}
        self.seen: set[str] = set()  # entry ids waiting here, so a redelivery is not counted twice
        self.dropped_singletons = 0
        self.validation = Tally(success_threshold)  # validation episodes scored since the last step
        self.dynamic_filtering = dynamic_filtering
        self.uniform = Tally(success_threshold)  # episodes of uniform groups dropped since the last step
        self._last_reclaim = 0.0

    async def start(self) -> None:
        await self.stream.ensure_group()
        own = await self.stream.read_own_pending(self.consumer)
        if own:
            log.info("pending_episodes_taken_back", count=len(own))
        await self._add(own)

    async def next_step(self, block_ms: int = 200, deadline_s: float | None = None) -> list[Group]:
        """Wait for a step's groups (or until `deadline_s` seconds passed: then [] if none is ready)."""
        started = time.monotonic()
        while True:
            groups = await self._take()
            if groups:
                return groups
            if deadline_s is not None and time.monotonic() - started > deadline_s:
                return []
            await self._add(await self.stream.read(self.consumer, count=512, block_ms=block_ms))
            if time.monotonic() - self._last_reclaim > min(30.0, self.reclaim_idle_s):
                self._last_reclaim = time.monotonic()
                await self._add(
                    await self.stream.reclaim(self.consumer, int(self.reclaim_idle_s * 1000), 512)
                )

    def waiting_episodes(self) -> int:
        return sum(len(g.episodes) for g in self.waiting.values())

    async def _add(self, entries: list[ClosedEpisode]) -> None:
        for entry in entries:
            if entry.entry_id in self.seen:
                continue
            if entry.mode == "val":  # scored apart, never trained on: acknowledged (consumed) at once
                if await self.stream.ack(entry) and math.isfinite(entry.reward):
                    self.validation.add(entry.reward, entry.version)
                continue
            self.seen.add(entry.entry_id)
            key = entry.task_id if entry.task_id is not None else f"\0{entry.rollout_id}"
            group = self.waiting.get(key)
            if group is None:
                group = self.waiting[key] = Group(entry.task_id, [])
            group.episodes.append(entry)
        # episodes without a task are groups of one from the start
        for key in [k for k, g in self.waiting.items() if g.task_id is None]:
            if not self.keep_singletons:
                await self._drop(self.waiting.pop(key))

    async def _take(self) -> list[Group]:
        now = time.monotonic()
        if self.dynamic_filtering:  # uniform groups that would join a step now (ready, or overdue)
            for key in [
                k
                for k, g in self.waiting.items()
                if g.task_id is not None
                and (len(g.episodes) >= self.rollouts_per_task or now - g.first_seen >= self.max_group_wait_s)
                and _uniform(g)
            ]:
                await self._drop_uniform(self.waiting.pop(key))
        ordered = sorted(self.waiting.items(), key=lambda item: item[1].first_seen)
        ready = [
            (k, g)
            for k, g in ordered
            if len(g.episodes) >= self.rollouts_per_task or (g.task_id is None and self.keep_singletons)
        ]
        if len(ready) >= self.tasks_per_step:
            chosen = ready[: self.tasks_per_step]
        elif ordered and now - ordered[0][1].first_seen >= self.max_group_wait_s:
            overdue = [
                (k, g)
                for k, g in ordered
                if now - g.first_seen >= self.max_group_wait_s and (k, g) not in ready
            ]
            if not self.keep_singletons:  # alone after the wait: no baseline, dropped
                for key in [k for k, g in overdue if len(g.episodes) == 1]:
                    await self._drop(self.waiting.pop(key))
                overdue = [(k, g) for k, g in overdue if len(g.episodes) > 1]
            chosen = (ready + overdue)[: self.tasks_per_step]
        else:
            return []
        groups = []
        for key, group in chosen:
            self.waiting.pop(key)
            self.seen.difference_update(e.entry_id for e in group.episodes)
            groups.append(group)
        return groups

    async def _drop(self, group: Group) -> None:
        for entry in group.episodes:
            self.seen.discard(entry.entry_id)
            await self.stream.ack(entry)
        self.dropped_singletons += len(group.episodes)

    async def _drop_uniform(self, group: Group) -> None:
        """Acknowledge a group whose rewards are all equal untrained (`dynamic_filtering`); its rewards
        still count in the step's success rate (`uniform`)."""
        for entry in group.episodes:
            self.seen.discard(entry.entry_id)
            if await self.stream.ack(entry):  # a second copy of an episode counts once
                self.uniform.add(entry.reward, entry.version)


def _uniform(group: Group) -> bool:
    """Every episode of the group has the same (finite) reward: no group-relative signal."""
    rewards = {entry.reward for entry in group.episodes}
    return len(group.episodes) > 1 and len(rewards) == 1 and all(math.isfinite(r) for r in rewards)
