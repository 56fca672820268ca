"""The learner's collector on the real closed-episode stream: groups by task, readiness, the maximum wait,
groups of one, and redelivery of a dead learner's pending entries."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
from conftest import REDIS_URL

from learner.collect import Collector
from rlgate.episodes import ClosedEpisodes, EpisodeStore


def publish(redis_client: redis.Redis, task: str | None, n: int, start: int = 0) -> None:
    for i in range(n):
        redis_client.xadd(
            "t:episodes", {"rollout_id": f"{task}-{start + i}", "task_id": task or "", "reward": "1.0"}
        )


def collector(store: EpisodeStore, **kw) -> Collector:
    settings = dict(tasks_per_step=2, rollouts_per_task=3, max_group_wait_s=0.5, singleton_groups="drop")
    settings.update(kw)
    return Collector(ClosedEpisodes(store), "c0", **settings)


def run(coro):
    return asyncio.run(coro)


def with_store(body):
    """Run `body(store)` on a store of prefix "t", closed afterwards."""

    async def go():
        store = EpisodeStore.from_url(REDIS_URL, prefix="t")
        try:
            return await body(store)
        finally:
            await store.aclose()

    return run(go())


def test_a_step_takes_ready_groups_oldest_first(redis_client: redis.Redis):
    publish(redis_client, "a", 3)
    publish(redis_client, "b", 2)
    publish(redis_client, "c", 4)

    async def body(store):
        c = collector(store)
        await c.start()
        return await c.next_step(deadline_s=2), c.waiting_episodes()

    groups, waiting = with_store(body)
    assert [(g.task_id, len(g.episodes)) for g in groups] == [("a", 3), ("c", 4)]
    assert waiting == 2  # b is incomplete and keeps waiting


def test_after_the_wait_incomplete_groups_train_and_lone_episodes_are_dropped(redis_client: redis.Redis):
    publish(redis_client, "a", 3)  # ready
    publish(redis_client, "b", 2)  # incomplete: joins after the wait
    publish(redis_client, "s", 1)  # alone: dropped after the wait
    publish(redis_client, None, 2)  # no task: groups of one from the start, dropped at once

    async def body(store):
        c = collector(store, tasks_per_step=3)
        await c.start()
        t0 = time.monotonic()
        groups = await c.next_step(deadline_s=5)
        return groups, time.monotonic() - t0, c.dropped_singletons, await c.stream.pending()

    groups, waited, dropped, pending = with_store(body)
    assert [(g.task_id, len(g.episodes)) for g in groups] == [("a", 3), ("b", 2)]
    assert waited >= 0.45 and dropped == 3
    assert (
        pending == 5
    )  # the dropped ones are acknowledged, the step's are not (the loop acks after training)


def test_groups_of_one_train_when_kept(redis_client: redis.Redis):
    publish(redis_client, None, 2)

    async def body(store):
        c = collector(store, singleton_groups="keep")
        await c.start()
        return await c.next_step(deadline_s=2)

    groups = with_store(body)
    assert [(g.task_id, len(g.episodes)) for g in groups] == [(None, 1), (None, 1)]


@pytest.mark.parametrize("same_name", [True, False])
def test_a_dead_learners_pending_episodes_come_back(redis_client: redis.Redis, same_name: bool):
    publish(redis_client, "a", 3)
    publish(redis_client, "b", 3)

    async def body(store):
        first = collector(store)
        await first.start()
        assert len(await first.next_step(deadline_s=2)) == 2  # read, never acknowledged: it "dies"
        # a restarted learner with the same name takes its own back at once; another name claims them
        # once they have been idle longer than reclaim_idle_s
        second = Collector(
            ClosedEpisodes(store),
            "c0" if same_name else "c1",
            tasks_per_step=2,
            rollouts_per_task=3,
            max_group_wait_s=60,
            singleton_groups="drop",
            reclaim_idle_s=0.2,
        )
        await second.start()
        if not same_name:
            await asyncio.sleep(0.3)
        return await second.next_step(deadline_s=3)

    groups = with_store(body)
    assert sorted((g.task_id, len(g.episodes)) for g in groups) == [("a", 3), ("b", 3)]


def test_validation_episodes_are_scored_apart_and_never_trained(redis_client: redis.Redis):
    """A rollout created with mode val, closed like any other: on the stream with its mode, acknowledged
    (consumed) by the collector at once, its reward kept for the step's val_* numbers, in no group, and
    counted under the policy version that served its first call (its stream entry carries it)."""
    from rlgate.episodes import CallRecord, EpisodeLifecycle

    async def body(store):
        lifecycle = EpisodeLifecycle(store)
        for i, mode in enumerate(["val", "train", "train", "train", "val"]):
            await store.create_rollout(f"r{i}", "a", mode=mode)
            for version in (3, 5) if i == 0 else ():  # r4 made no call: no version to count it under
                call = CallRecord(
                    rollout_id=f"r{i}",
                    endpoint="completions",
                    policy_version=version,
                    request={},
                    started_at=0.0,
                    latency_ms=1.0,
                )
                await store.record_calls(f"r{i}", "a", [call])
            await lifecycle.close(f"r{i}", float(i))
        c = collector(store, tasks_per_step=1)
        await c.start()
        groups = await c.next_step(deadline_s=2)
        statuses = [(await store.get_rollout(f"r{i}")).status for i in range(5)]
        return groups, c.validation, statuses

    groups, validation, statuses = with_store(body)
    assert [[e.rollout_id for e in g.episodes] for g in groups] == [["r1", "r2", "r3"]]
    assert all(e.mode == "train" for g in groups for e in g.episodes)
    assert (validation.episodes, validation.reward_sum, validation.successes) == (2, 4.0, 1)
    assert validation.versions() == {"3": [1, 0, 0.0]}
    assert (
        statuses[0] == statuses[4] == "consumed" and statuses[1] == "closed"
    )  # trained ones: acked after training


def test_dynamic_filtering_drops_groups_whose_rewards_are_all_equal(redis_client: redis.Redis):
    """With dynamic_filtering a group of equal rewards (all right, all wrong) is acknowledged untrained and
    tallied for the step's success rate; the step waits for groups whose rewards differ, and an overdue
    incomplete group of equal rewards is dropped too. Without it the oldest ready groups train, equal or
    not."""
    from rlgate.episodes import EpisodeLifecycle

    rewards = {"a": [1, 1, 1], "b": [1, 0, 1], "c": [0, 0, 0], "d": [0, 1, 1], "e": [1, 1]}

    async def body(store, filtering):
        lifecycle = EpisodeLifecycle(store)
        for task, values in rewards.items():
            for i, reward in enumerate(values):
                await store.create_rollout(f"{task}-{i}-{filtering}", task)
                await lifecycle.close(f"{task}-{i}-{filtering}", float(reward))
        c = collector(store, dynamic_filtering=filtering)
        await c.start()
        first = await c.next_step(deadline_s=2)
        tally = (c.uniform.episodes, c.uniform.successes)
        pending = await c.stream.pending()
        second = await c.next_step(deadline_s=1.5)  # e waits out max_group_wait_s, then is dropped
        status = (await store.get_rollout(f"a-0-{filtering}")).status
        return first, tally, pending, second, c.uniform.episodes, await c.stream.pending(), status

    first, tally, pending, second, dropped, pending_after, status = with_store(lambda s: body(s, True))
    assert [g.task_id for g in first] == ["b", "d"]
    assert tally == (6, 3) and pending == 8  # a and c acknowledged; b, d (the step's) and e pending
    assert second == [] and dropped == 8 and pending_after == 6 and status == "consumed"
    redis_client.delete("t:episodes")
    first, tally, *_ = with_store(lambda s: body(s, False))
    assert [g.task_id for g in first] == ["a", "b"] and tally == (0, 0)
