"""The episode lifecycle against the real Redis: exactly-once close under races, expiry, failure, the
outbox, and the learners' consumer group (at-least-once delivery, reclaiming a dead consumer's entries)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
from conftest import REDIS_URL, call_record

from rlgate.episodes import (
    CallNotFound,
    ClosedEpisodes,
    EpisodeLifecycle,
    EpisodeStore,
    RewardConflict,
    RolloutExpired,
    RolloutNotFound,
    RolloutNotOpen,
    _lua,
)


def run(scenario, ttl_s: float = 3600.0):
    async def go():
        store = EpisodeStore.from_url(REDIS_URL, prefix="t", rollout_ttl_s=ttl_s)
        try:
            return await scenario(store, EpisodeLifecycle(store))
        finally:
            await store.aclose()

    return asyncio.run(go())


def stream_rollouts(client: redis.Redis) -> list[str]:
    return [fields[b"rollout_id"].decode() for _, fields in client.xrange("t:episodes")]


def test_many_concurrent_closers_close_once_and_publish_once(redis_client: redis.Redis):
    async def scenario(store, lifecycle):
        await store.record_calls("race", "task", [call_record("race")])
        same = await asyncio.gather(*(lifecycle.close("race", 1) for _ in range(30)))
        await store.record_calls("race2", "task", [call_record("race2")])
        mixed = await asyncio.gather(
            *(lifecycle.close("race2", r) for r in [0.5] * 10 + [0.25] * 10), return_exceptions=True
        )
        # late losers may have re-added an outbox intent: the sweeper clears it without publishing again
        repaired = await lifecycle.repair_outbox(grace_s=0)
        return same, mixed, await store.get_rollout("race"), repaired

    same, mixed, rollout, repaired = run(scenario)
    assert sorted(r.outcome for r in same) == ["closed"] + ["unchanged"] * 29
    assert rollout.status == "closed" and rollout.reward == 1.0 and rollout.closed_at
    winners = [r for r in mixed if not isinstance(r, Exception) and r.outcome == "closed"]
    conflicts = [r for r in mixed if isinstance(r, RewardConflict)]
    assert len(winners) == 1 and len(conflicts) == 10  # the losing reward's 10 posts all conflict
    assert stream_rollouts(redis_client) == ["race", "race2"] and repaired == []
    assert redis_client.zcard("t:outbox") == 0 and redis_client.zcard("t:expiry") == 0


def test_close_errors_and_same_reward_again(redis_client: redis.Redis):
    async def scenario(store, lifecycle):
        with pytest.raises(RolloutNotFound):
            await lifecycle.close("nobody", 1)
        await store.create_rollout("r1", "t1")
        first = await lifecycle.close("r1", 1)
        again = await lifecycle.close("r1", 1.0)  # 1 and 1.0 are the same reward
        with pytest.raises(RewardConflict) as conflict:
            await lifecycle.close("r1", 0)
        with pytest.raises(ValueError):
            await lifecycle.close("r1", float("nan"))
        with pytest.raises(RolloutNotOpen):  # a closed rollout takes no more calls
            await store.record_calls("r1", None, [call_record("r1")])
        return first, again, conflict.value

    first, again, conflict = run(scenario)
    assert (first.outcome, again.outcome, conflict.reward) == ("closed", "unchanged", 1.0)
    assert stream_rollouts(redis_client) == ["r1"]


def test_expiry_and_fill_reward(redis_client: redis.Redis):
    async def scenario(store, lifecycle):
        await store.create_rollout("old")
        await store.record_calls("old-filled", None, [call_record("old-filled")])
        await store.create_rollout("young")
        redis_client.zadd("t:expiry", {"young": time.time() + 3600})
        redis_client.hset("t:rollout:{young}", "expires_at", time.time() + 3600)
        await asyncio.sleep(0.3)
        first = await lifecycle.expire_due(limit=1)  # one at a time: "old" first (earliest)
        second = await lifecycle.expire_due(fill_reward=-1.0)
        with pytest.raises(RolloutExpired):
            await lifecycle.close("old", 1)
        with pytest.raises(RolloutNotOpen):
            await store.record_calls("old", None, [call_record("old")])
        return first, second, await store.get_rollout("old-filled"), await store.get_rollout("young")

    first, second, filled, young = run(scenario, ttl_s=0.2)
    assert first == {"old": "expired"} and second == {"old-filled": "closed"}
    assert filled.status == "closed" and filled.reward == -1.0 and filled.reward_metadata == {"filled": True}
    assert young.status == "open"
    assert stream_rollouts(redis_client) == ["old-filled"]


def test_outbox_repair_publishes_what_a_dead_closer_left(redis_client: redis.Redis):
    async def scenario(store, lifecycle):
        await store.create_rollout("orphan", "t9")
        for version in (4, 2, 6):  # the entry names the oldest version that served a call
            await store.record_calls(
                "orphan", None, [call_record("orphan").model_copy(update={"policy_version": version})]
            )
        # a closer that wrote its intent and closed, then died before publishing
        redis_client.zadd("t:outbox", {"orphan": time.time() - 60})
        redis_client.eval(_lua.CLOSE, 1, "t:rollout:{orphan}", "0.75", "{}", repr(time.time()))
        assert stream_rollouts(redis_client) == []
        unchanged = await lifecycle.close("orphan", 0.75)  # a retry of the same post does not publish
        assert stream_rollouts(redis_client) == []
        repaired = await lifecycle.repair_outbox(grace_s=10)
        again = await lifecycle.repair_outbox(grace_s=0)
        return unchanged, repaired, again

    unchanged, repaired, again = run(scenario)
    assert unchanged.outcome == "unchanged" and repaired == ["orphan"] and again == []
    [(_, fields)] = redis_client.xrange("t:episodes")
    assert fields == {b"rollout_id": b"orphan", b"task_id": b"t9", b"reward": b"0.75", b"version": b"2"}


def test_intermediate_rewards_and_failure(redis_client: redis.Redis):
    async def scenario(store, lifecycle):
        await store.record_calls("r2", None, [call_record("r2"), call_record("r2")])
        await lifecycle.set_call_reward("r2", 1, 0.5)
        await lifecycle.set_call_reward("r2", 0, -0.1, automatic=True)
        with pytest.raises(CallNotFound):
            await lifecycle.set_call_reward("r2", 2, 0.5)
        with pytest.raises(RolloutNotFound):
            await lifecycle.set_call_reward("nobody", 0, 0.5)
        view = await store.get_rollout_view("r2")
        failed = await lifecycle.fail("r2", "reward job raised ValueError")
        failed_again = await lifecycle.fail("r2", "again")
        with pytest.raises(RolloutNotOpen):
            await lifecycle.close("r2", 1)
        return view, failed, failed_again, await store.get_rollout("r2")

    view, failed, failed_again, rollout = run(scenario)
    assert [(c.reward, c.air_reward) for c in view.calls] == [(None, -0.1), (0.5, None)]
    assert failed and not failed_again
    assert rollout.status == "failed" and rollout.error == "reward job raised ValueError"
    assert stream_rollouts(redis_client) == []


def test_consumer_group_acks_and_reclaims_a_dead_consumers_entries(redis_client: redis.Redis):
    async def scenario(store, lifecycle):
        closed = ClosedEpisodes(store)
        await closed.ensure_group()
        await closed.ensure_group()  # idempotent
        for i in range(4):
            await store.record_calls(f"e{i}", "task", [call_record(f"e{i}")])
            await lifecycle.close(f"e{i}", i / 4)
        dead = await closed.read("learner-dead", count=3, block_ms=100)  # reads, then dies without acking
        alive = await closed.read("learner-alive", count=10, block_ms=100)
        too_early = await closed.reclaim("learner-alive", min_idle_ms=60_000)
        acks = [await closed.ack(e) for e in alive]  # the live learner trains and acknowledges its own
        await asyncio.sleep(0.25)
        taken = await closed.reclaim("learner-alive", min_idle_ms=200)
        acks += [await closed.ack(e) for e in taken]
        duplicate = await closed.ack(taken[0])
        return (
            dead,
            alive,
            too_early,
            taken,
            acks,
            duplicate,
            await closed.pending(),
            [(await store.get_rollout(f"e{i}")).status for i in range(4)],
        )

    dead, alive, too_early, taken, acks, duplicate, pending, statuses = run(scenario)
    assert [e.rollout_id for e in dead] == ["e0", "e1", "e2"] and [e.rollout_id for e in alive] == ["e3"]
    assert dead[1].reward == 0.25 and dead[1].task_id == "task"
    assert too_early == [] and [e.rollout_id for e in taken] == ["e0", "e1", "e2"]
    assert acks == [True] * 4 and duplicate is False and pending == 0
    assert statuses == ["consumed"] * 4


def test_a_closed_but_unpublished_episode_survives_expiry_sweeps(redis_client: redis.Redis):
    """Regression: a closer (webhook or the fill sweeper) that closed and then failed to publish. Later
    sweeps see the rollout is no longer open; they must leave its intent for the outbox repair."""

    async def scenario(store, lifecycle):
        await store.create_rollout("webhook-died", "t")
        await store.create_rollout("filler-died", "t")
        await asyncio.sleep(0.25)  # both are past their TTL now
        old = time.time() - 60
        redis_client.zadd("t:outbox", {"webhook-died|a1": old, "filler-died|b2": old})
        redis_client.eval(_lua.CLOSE, 1, "t:rollout:{webhook-died}", "1.0", "{}", repr(time.time()))
        redis_client.eval(_lua.EXPIRE, 1, "t:rollout:{filler-died}", repr(time.time()), "-1.0")
        retried = await lifecycle.close("webhook-died", 1)  # the client retries its post: unchanged
        swept = await lifecycle.expire_due(fill_reward=-1.0)
        assert stream_rollouts(redis_client) == []
        repaired = await lifecycle.repair_outbox(grace_s=10)
        return retried, swept, repaired

    retried, swept, repaired = run(scenario, ttl_s=0.2)
    assert retried.outcome == "unchanged"
    assert swept == {"webhook-died": "not_open", "filler-died": "not_open"}
    assert sorted(repaired) == ["filler-died", "webhook-died"]
    assert sorted(stream_rollouts(redis_client)) == ["filler-died", "webhook-died"]
    assert redis_client.zcard("t:outbox") == 0 and redis_client.zcard("t:expiry") == 0


def test_failed_posts_change_nothing_and_rewards_are_canonical(redis_client: redis.Redis):
    async def scenario(store, lifecycle):
        await store.create_rollout("c1")
        await store.create_rollout("c2")
        before = {k: redis_client.dump(k) for k in redis_client.keys("*")}
        with pytest.raises(RolloutNotFound):
            await lifecycle.close("ghost", 1)
        with pytest.raises(ValueError):
            await lifecycle.close("c1", 1, {"huge": 2**70})
        with pytest.raises(ValueError):
            await lifecycle.close("c1", float("inf"))
        after = {k: redis_client.dump(k) for k in redis_client.keys("*")}
        zero = await lifecycle.close("c2", 0.0)
        negative_zero = await lifecycle.close("c2", -0.0)
        with pytest.raises(RewardConflict):
            await lifecycle.close("c2", 0.5)
        return before, after, zero, negative_zero

    before, after, zero, negative_zero = run(scenario)
    assert after == before
    assert (zero.outcome, negative_zero.outcome) == ("closed", "unchanged")
    assert redis_client.zcard("t:outbox") == 0


def test_repair_never_republishes_a_consumed_episode(redis_client: redis.Redis):
    async def scenario(store, lifecycle):
        await store.create_rollout("done")
        # published and consumed, but the closer died before setting the flag
        redis_client.eval(_lua.CLOSE, 1, "t:rollout:{done}", "1.0", "{}", repr(time.time()))
        redis_client.xadd("t:episodes", {"rollout_id": "done", "task_id": "", "reward": "1.0"})
        await lifecycle.consume("done")
        redis_client.zadd("t:outbox", {"done|c3": time.time() - 60})
        return await lifecycle.repair_outbox(grace_s=10)

    assert run(scenario) == []
    assert stream_rollouts(redis_client) == ["done"]
    assert redis_client.hget("t:rollout:{done}", "published") == b"1" and redis_client.zcard("t:outbox") == 0


def test_a_rollout_whose_reward_job_never_closed_it_fails_at_its_ttl(redis_client: redis.Redis):
    from rlgate.episodes import FinishRequest

    async def scenario(store, lifecycle):
        await store.create_rollout("judged")
        await lifecycle.set_finish("judged", FinishRequest(reward_fn="f1", ground_truth="x"))
        await asyncio.sleep(0.25)
        return await lifecycle.expire_due(fill_reward=0.0), await store.get_rollout("judged")

    swept, rollout = run(scenario, ttl_s=0.2)
    assert swept == {"judged": "failed"} and rollout.status == "failed"
    assert rollout.error == "the reward job did not close the episode before its TTL"
    assert stream_rollouts(redis_client) == []


def test_call_rewards_stop_when_the_rollout_closes(redis_client: redis.Redis):
    """A learner may read a closed episode at any moment: a per-call reward after the close is refused
    (it would otherwise be kept where no training sees it), the webhook's and AIR's alike."""

    async def scenario(store, lifecycle):
        await store.record_calls("late", None, [call_record("late")])
        await lifecycle.set_call_reward("late", 0, 0.5)
        await lifecycle.close("late", 1)
        before = {k: redis_client.dump(k) for k in redis_client.keys("*")}
        for automatic in (False, True):
            with pytest.raises(RolloutNotOpen) as refused:
                await lifecycle.set_call_reward("late", 0, 0.25, automatic=automatic)
            assert refused.value.status == "closed"
        after = {k: redis_client.dump(k) for k in redis_client.keys("*")}
        return before, after, await store.get_rollout_view("late")

    before, after, view = run(scenario)
    assert after == before
    assert [(c.reward, c.air_reward) for c in view.calls] == [(0.5, None)]


def test_mark_failed_happens_once_and_is_never_published(redis_client: redis.Redis):
    async def scenario(store, lifecycle):
        await store.record_calls("f1", "task", [call_record("f1")])
        await lifecycle.mark_failed("f1", "the harness crashed")
        before = {k: redis_client.dump(k) for k in redis_client.keys("*")}
        refusals = []
        for call in (
            lambda: lifecycle.mark_failed("f1", "again"),
            lambda: lifecycle.close("f1", 1),
            lambda: lifecycle.set_call_reward("f1", 0, 1),
            lambda: lifecycle.mark_failed("ghost", "x"),
        ):
            try:
                await call()
            except Exception as exc:  # noqa: BLE001 - the type is what is checked
                refusals.append(type(exc))
        after = {k: redis_client.dump(k) for k in redis_client.keys("*")}
        await store.create_rollout("f2")
        await lifecycle.close("f2", 0.5)
        with pytest.raises(RolloutNotOpen) as closed:
            await lifecycle.mark_failed("f2", "too late")
        return (
            before,
            after,
            refusals,
            closed.value,
            await store.get_rollout("f1"),
            await store.get_rollout("f2"),
        )

    before, after, refusals, closed, failed, kept = run(scenario)
    assert refusals == [RolloutNotOpen, RolloutNotOpen, RolloutNotOpen, RolloutNotFound]
    assert after == before
    assert failed.status == "failed" and failed.error == "the harness crashed" and failed.closed_at
    assert closed.status == "closed" and kept.status == "closed" and kept.reward == 0.5
    assert stream_rollouts(redis_client) == ["f2"]  # only the closed one
    assert redis_client.zscore("t:expiry", "f1") is None and redis_client.zcard("t:outbox") == 0


def test_a_finished_rollout_keeps_its_keys_for_the_retention_time_then_they_go(redis_client: redis.Redis):
    """Consumed, expired and failed rollouts: every key of the rollout (hash, calls, rewards, AIR,
    events) gets the retention TTL in the script that ends it; a closed one waiting for a learner keeps
    its keys; with retention 0 nothing expires."""

    def keys(rid: str) -> list[str]:
        tag = f"t:rollout:{{{rid}}}"
        return [tag, f"{tag}:calls", f"{tag}:rewards", f"{tag}:air", f"{tag}:events"]

    async def scenario(store, lifecycle):
        store.retention_s = 600.0
        closed = ClosedEpisodes(store)
        await closed.ensure_group()
        for rid in ("trained", "waiting", "failed", "kept"):
            await store.record_calls(rid, "task", [call_record(rid)])
            await lifecycle.set_call_reward(rid, 0, 0.5)
            await lifecycle.set_call_reward(rid, 0, 0.25, automatic=True)
            redis_client.rpush(f"t:rollout:{{{rid}}}:events", "{}")
        await store.create_rollout("stale")
        redis_client.zadd("t:expiry", {"stale": 0})  # its TTL has passed
        redis_client.hset("t:rollout:{stale}", "expires_at", 0)
        await lifecycle.close("trained", 1.0)
        await lifecycle.close("waiting", 1.0)
        await lifecycle.mark_failed("failed", "the agent crashed")
        [entry, _] = await closed.read("l0", count=2, block_ms=100)
        assert await closed.ack(entry) and entry.rollout_id == "trained"
        assert await lifecycle.expire_due() == {"stale": "expired"}
        store.retention_s = 0.0
        await lifecycle.close("kept", 1.0)
        [kept] = [e for e in await closed.read("l0", count=5, block_ms=100) if e.rollout_id == "kept"]
        assert await closed.ack(kept)

    run(scenario)
    for rid in ("trained", "failed"):
        ttls = [redis_client.ttl(k) for k in keys(rid)]
        assert all(590 <= t <= 600 for t in ttls), (rid, ttls)
    assert 590 <= redis_client.ttl("t:rollout:{stale}") <= 600
    assert [redis_client.ttl(k) for k in keys("waiting")] == [-1] * 5  # closed, not yet trained: kept
    assert [redis_client.ttl(k) for k in keys("kept")] == [-1] * 5  # retention 0: forever
    redis_client.pexpire("t:rollout:{trained}", 1)  # and when the TTL runs out, the rollout is gone
    time.sleep(0.05)
    assert not redis_client.exists("t:rollout:{trained}")


def test_an_exporter_alone_does_not_let_the_stream_be_trimmed(redis_client: redis.Redis):
    """`rlgate export --follow`'s group acknowledges every entry; until the learners' group exists, nothing
    is trimmed (a learner started later must still find the episodes)."""

    async def scenario(store, lifecycle):
        for i in range(3):
            await store.record_calls(f"x{i}", "task", [call_record(f"x{i}")])
            await lifecycle.close(f"x{i}", 1.0)
        store.retention_s = 0.001
        exporters = ClosedEpisodes(store, "exporters")
        await exporters.ensure_group()
        for entry in await exporters.read("export", count=3, block_ms=100):
            await exporters.drop(entry)
        await asyncio.sleep(0.01)
        before_learners = await lifecycle.trim_episodes("learners")
        learners = ClosedEpisodes(store, "learners")
        await learners.ensure_group()
        seen = [e.rollout_id for e in await learners.read("l", count=3, block_ms=100)]
        for entry in await learners.read_own_pending("l"):
            await learners.ack(entry)
        after = await lifecycle.trim_episodes("learners")
        return before_learners, seen, after

    before_learners, seen, after = run(scenario)
    assert before_learners == (0, None)
    assert seen == ["x0", "x1", "x2"]  # the learner started late still gets every episode
    assert after == (3, None)  # and once both groups have them, they go


def test_the_sweeper_trims_only_entries_every_group_acknowledged_past_the_retention(
    redis_client: redis.Redis,
):
    """The stream keeps what any consumer group has not acknowledged (pending, or not yet delivered), and
    what is younger than the retention; nothing is trimmed while no group exists or retention is 0. The
    group that holds entries back is named."""

    async def scenario(store, lifecycle):
        for i in range(6):
            await store.record_calls(f"e{i}", "task", [call_record(f"e{i}")])
            await lifecycle.close(f"e{i}", 1.0)
        store.retention_s = 0.001
        await asyncio.sleep(0.01)
        no_group = await lifecycle.trim_episodes()
        a, b = ClosedEpisodes(store, "a"), ClosedEpisodes(store, "b")
        await a.ensure_group()
        await b.ensure_group()
        read_a = await a.read("la", count=6, block_ms=100)  # a: all six delivered
        for entry in read_a[:2] + read_a[3:]:
            await a.ack(entry)  # a leaves e2 pending
        for entry in await b.read("lb", count=4, block_ms=100):  # b: e0-e3 delivered and acknowledged
            await b.drop(entry)
        await asyncio.sleep(0.01)
        store.retention_s = 0.0
        off = await lifecycle.trim_episodes()
        store.retention_s = 3600.0
        young = await lifecycle.trim_episodes()
        store.retention_s = 0.001
        pending_in_a = await lifecycle.trim_episodes()
        await a.drop(read_a[2])  # a has acknowledged everything now; b has not been given e4, e5
        undelivered_in_b = await lifecycle.trim_episodes()
        left = stream_rollouts(redis_client)
        redis_client.delete("t:episodes")  # a group of its own on an empty stream holds nothing back
        await ClosedEpisodes(store, "fresh").ensure_group()
        fresh = await lifecycle.trim_episodes()
        return no_group, off, young, pending_in_a, undelivered_in_b, left, fresh

    no_group, off, young, pending_in_a, undelivered_in_b, left, fresh = run(scenario)
    assert no_group == off == young == fresh == (0, None)
    assert pending_in_a == (2, "a")  # e0, e1: acknowledged by both; e2 is pending in a
    assert undelivered_in_b == (2, "b")  # e2, e3 (b's last delivered); e4 and e5 not yet read by b
    assert left == ["e4", "e5"]


def test_the_stream_entry_reads_back_what_is_written():
    """The closed-episode stream entry's wire format is one model (`ClosedEpisode`: `fields` for XADD,
    `from_entry` for a learner), so what a closer writes is what a learner reads, for every shape."""
    from rlgate.episodes import ClosedEpisode

    for episode in (
        ClosedEpisode("", "r1", "t1", 1.0),
        ClosedEpisode("", "r2", None, -0.25, mode="val", version=7),
        ClosedEpisode("", "r3", "t", 0.1 + 0.2, version=0),
    ):
        flat = episode.fields()
        wire = {k.encode(): v.encode() for k, v in zip(flat[::2], flat[1::2], strict=True)}
        assert ClosedEpisode.from_entry(b"5-0", wire) == ClosedEpisode(
            "5-0", *[getattr(episode, f) for f in ("rollout_id", "task_id", "reward", "mode", "version")]
        )
    assert "mode" not in ClosedEpisode("", "r", "t", 1.0).fields()  # train is the default, not written
    # the wire itself, as learners of earlier releases read it (the field names, the reward's text)
    assert ClosedEpisode("", "r", "t", 1, "val", 3).fields() == [
        *("rollout_id", "r", "task_id", "t", "reward", "1.0", "mode", "val", "version", "3")
    ]
