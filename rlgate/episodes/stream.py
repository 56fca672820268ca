"""The closed-episode stream, read by learners through a consumer group.

Delivery is at least once: an entry stays pending until a learner acknowledges it after training
(`ack`, which also marks the rollout consumed, exactly once); entries a dead consumer left pending are
taken over with `reclaim` (XAUTOCLAIM) once they have been idle longer than the given time.
"""

from __future__ import annotations

from typing import cast

from redis import exceptions as redis_exc

from rlgate.episodes.lifecycle import EpisodeLifecycle
from rlgate.episodes.records import ClosedEpisode
from rlgate.episodes.store import EpisodeStore

# XREADGROUP's reply on a connection without decoding: per stream, its entries (id, fields; no fields for
# an entry deleted since it was delivered)
StreamReply = list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]


class ClosedEpisodes:
    """A learner's view of the stream: one consumer group, any number of consumers."""

    def __init__(self, store: EpisodeStore, group: str = "learners") -> None:
        self.store = store
        self.group = group
        self.key = store.keys.episodes
        self.lifecycle = EpisodeLifecycle(store)

    async def ensure_group(self) -> None:
        """Create the consumer group (from the stream's start) unless it exists."""
        async with self.store.guard():
            try:
                await self.store.redis.xgroup_create(self.key, self.group, id="0", mkstream=True)
            except redis_exc.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def read(self, consumer: str, count: int = 64, block_ms: int = 1000) -> list[ClosedEpisode]:
        """New entries for `consumer` (they stay pending until acknowledged); waits up to `block_ms`."""
        async with self.store.guard(block_ms / 1000):
            reply = cast(
                StreamReply | None,
                await self.store.redis.xreadgroup(
                    self.group, consumer, {self.key: ">"}, count=count, block=block_ms
                ),
            )
        return [
            ClosedEpisode.from_entry(entry_id, fields)
            for _, entries in reply or ()
            for entry_id, fields in entries
        ]

    async def read_own_pending(self, consumer: str, count: int = 1024) -> list[ClosedEpisode]:
        """Entries delivered to `consumer` earlier and never acknowledged (a restarted learner's own). An
        entry that is no longer on the stream (deleted: its fields are gone) is acknowledged here, since
        nobody can read it any more and, left pending, it would hold the stream's trimming back."""
        return (await self.own_pending(consumer, count))[0]

    async def own_pending(self, consumer: str, count: int = 1024) -> tuple[list[ClosedEpisode], int]:
        """`read_own_pending`, and how many pending entries the reply held, deleted ones included (fewer
        than `count`: there are no more)."""
        async with self.store.guard():
            reply = cast(
                StreamReply | None,
                await self.store.redis.xreadgroup(self.group, consumer, {self.key: "0"}, count=count),
            )
            entries = [entry for _, entries in reply or () for entry in entries]
            gone = [entry_id for entry_id, fields in entries if not fields]
            if gone:
                await self.store.redis.xack(self.key, self.group, *gone)
        return [ClosedEpisode.from_entry(entry_id, fields) for entry_id, fields in entries if fields], len(
            entries
        )

    async def ack(self, episode: ClosedEpisode) -> bool:
        """Acknowledge a trained-on episode: marks the rollout consumed (True the first time) and XACKs."""
        first = await self.lifecycle.consume(episode.rollout_id)
        await self.drop(episode)
        return first

    async def claim(self, episode: ClosedEpisode, consumer: str, lease_s: float) -> str:
        """Claim the episode's rollout for training (`EpisodeLifecycle.claim`): `claimed`, `not_closed` or
        `held` (another learner's lease runs)."""
        return await self.lifecycle.claim(episode.rollout_id, consumer, lease_s)

    async def drop(self, episode: ClosedEpisode) -> None:
        """XACK an entry without marking its rollout consumed: a second copy of an episode that this
        learner trains through another entry of the same step."""
        async with self.store.guard():
            await self.store.redis.xack(self.key, self.group, episode.entry_id)

    async def reclaim(self, consumer: str, min_idle_ms: int, count: int = 64) -> list[ClosedEpisode]:
        """Take over up to `count` entries other consumers left pending for at least `min_idle_ms` (dead
        learners), following XAUTOCLAIM's cursor through the whole pending list."""
        claimed: list[ClosedEpisode] = []
        cursor: bytes | str = "0-0"
        while len(claimed) < count:
            async with self.store.guard():
                reply = await self.store.redis.xautoclaim(
                    self.key,
                    self.group,
                    consumer,
                    min_idle_time=min_idle_ms,
                    start_id=cursor,
                    count=count - len(claimed),
                )
            cursor, entries = reply[0], reply[1]
            # entries deleted from the stream meanwhile come back without fields; XAUTOCLAIM drops them
            claimed.extend(
                ClosedEpisode.from_entry(entry_id, fields) for entry_id, fields in entries if fields
            )
            if cursor in (b"0-0", "0-0"):
                break
        return claimed

    async def pending(self) -> int:
        """How many entries are delivered but not yet acknowledged."""
        async with self.store.guard():
            info = await self.store.redis.xpending(self.key, self.group)
        return int(info["pending"])


__all__ = ["ClosedEpisode", "ClosedEpisodes"]
