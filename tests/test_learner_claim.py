"""A learner claims a closed episode before training on it (a lease in the rollout hash): with the real
Redis, two learners racing for the same episode (published twice, delivered to both), a dead learner's
lapsed claim, and a consumed episode."""

from __future__ import annotations

import asyncio

import redis
from conftest import REDIS_URL, call_record

from rlgate.episodes import ClosedEpisodes, EpisodeLifecycle, EpisodeStore, RolloutStatus


def run(scenario):
    async def go():
        store = EpisodeStore.from_url(REDIS_URL, prefix="t")
        try:
            return await scenario(store, EpisodeLifecycle(store))
        finally:
            await store.aclose()

    return asyncio.run(go())


def test_one_learner_wins_a_race_for_an_episode_and_its_claim_lapses_when_it_dies(redis_client: redis.Redis):
    async def scenario(store, lifecycle):
        await store.record_calls("r", "task", [call_record("r")])
        assert await lifecycle.claim("r", "a", 60) == "not_closed"  # open: nothing to train yet
        await lifecycle.close("r", 1.0)
        race = await asyncio.gather(*(lifecycle.claim("r", f"l{i % 5}", 60) for i in range(40)))
        assert set(race) == {"claimed", "held"}
        winners = {f"l{i % 5}" for i, won in enumerate(race) if won == "claimed"}
        owner = winners.pop() if len(winners) == 1 else None
        renewed = await lifecycle.claim("r", owner, 60)  # the owner renews
        other_before = await lifecycle.claim("r", "z", 60)
        await lifecycle.claim("r", owner, 0.2)  # then "dies" with a short lease: it runs out
        await asyncio.sleep(0.5)
        other_after = await lifecycle.claim("r", "z", 60)
        view = await store.get_rollout_view("r")
        consumed = await lifecycle.consume("r")
        after_consume = await lifecycle.claim("r", "z", 60)
        return owner, winners, renewed, other_before, other_after, view, consumed, after_consume

    owner, others, renewed, before, after, view, consumed, after_consume = run(scenario)
    assert owner is not None and not others  # exactly one learner holds it
    # renewable by its owner; another gets it only after it lapses
    assert (renewed, before, after) == ("claimed", "held", "claimed")
    assert view.status == RolloutStatus.CLOSED and consumed  # the claim fields stay out of the record
    assert after_consume == "not_closed"  # consumed: never trained again
    assert redis_client.hget("t:rollout:{r}", "claimed_by") == b"z"


def test_an_entry_whose_episode_another_learner_holds_stays_pending_until_it_can_be_trained(
    redis_client: redis.Redis, tmp_path
):
    """Learner A claimed the episode and died. Learner B reclaims A's pending entry (idle since its
    delivery) while A's lease still runs: B must leave it pending, not acknowledge it, and train it once
    the lease has lapsed (it once XACKed it: the episode was never trained)."""
    from types import SimpleNamespace

    from learner.collect import Group
    from learner.loop import Learner

    async def scenario(store, lifecycle):
        await store.record_calls("h", "task", [call_record("h")])
        await lifecycle.close("h", 1.0)
        stream = ClosedEpisodes(store)
        await stream.ensure_group()
        [entry] = await stream.read("a", count=10, block_ms=100)
        assert await stream.claim(entry, "a", 60) == "claimed"  # A claims
        [taken] = await stream.reclaim("b", 0, 10)  # B takes the entry over at once
        b = SimpleNamespace(store=store, stream=stream, settings=SimpleNamespace(consumer="b"), _lease_s=60)
        first = await Learner._read_episodes(b, [Group("task", [taken])])
        pending_after_first = await stream.pending()
        assert await stream.claim(entry, "a", 0.2) == "claimed"  # A dies: its lease runs out
        await asyncio.sleep(0.5)
        [again] = await stream.reclaim("b", 0, 10)
        second = await Learner._read_episodes(b, [Group("task", [again])])
        return first, pending_after_first, second

    first, pending, second = run(scenario)
    assert first[1] == [] and first[2]["claimed_elsewhere"] == 1 and pending == 1
    assert [e.rollout_id for e in second[1]] == ["h"] and second[2]["claimed_elsewhere"] == 0


def test_drop_acknowledges_an_entry_without_consuming_its_rollout(redis_client: redis.Redis):
    async def scenario(store, lifecycle):
        await store.record_calls("d", "task", [call_record("d")])
        await lifecycle.close("d", 0.5)
        stream = ClosedEpisodes(store)
        await stream.ensure_group()
        redis_client.xadd("t:episodes", {"rollout_id": "d", "task_id": "task", "reward": "0.5"})  # again
        first, second = await stream.read("c0", count=10, block_ms=100)
        await stream.drop(second)
        pending_after_drop = await stream.pending()
        status = (await store.get_rollout("d")).status
        await stream.ack(first)
        return pending_after_drop, status, await stream.pending(), (await store.get_rollout("d")).status

    pending_after_drop, status, pending, final = run(scenario)
    assert pending_after_drop == 1 and status == RolloutStatus.CLOSED
    assert pending == 0 and final == RolloutStatus.CONSUMED
