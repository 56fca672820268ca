"""Every Redis key rlgate uses, built in one place. This docstring is the key layout.

| key                                | type   | writer                                  | reader                   | TTL  |
|------------------------------------|--------|-----------------------------------------|--------------------------|------|
| `{prefix}:rollout:{<rid>}`         | hash   | gateway (create, every call), reward    | gateway, reward, learner | R    |
|                                    |        | hooks (close, fail), sweeper (expire),  |                          |      |
|                                    |        | learner (consume)                       |                          |      |
| `{prefix}:rollout:{<rid>}:calls`   | list   | gateway (one entry per choice)          | gateway, reward, learner | R    |
| `{prefix}:rollout:{<rid>}:rewards` | hash   | reward webhook (call index -> reward)   | learner, inspection      | R    |
| `{prefix}:rollout:{<rid>}:air`     | hash   | gateway AIR (call index -> reward)      | learner, inspection      | R    |
| `{prefix}:policy`                  | hash   | learner (`version`, `adapter`, `draining`,| gateway (polled)         | none |
|                                    |        | `base_model`: `records.Policy`)         |                          |      |
| `{prefix}:expiry`                  | zset   | gateway (rollout id -> expires_at)      | sweeper, /ui (count)     | none |
| `{prefix}:rollouts`                | zset   | gateway (rollout id -> created_at, at   | `GET /rollouts`, /ui     | none |
|                                    |        | creation; trimmed to the newest N)      |                          |      |
| `{prefix}:outbox`                  | zset   | reward hooks, sweeper (id -> intent ts) | sweeper (repair)         | none |
| `{prefix}:episodes`                | stream | reward hooks, sweeper (closed episodes) | learners (consumer group)| trim |
| `{prefix}:epoch`                   | string | gateway (SET NX, a random value)        | gateways (polled)        | none |
| `{prefix}:health`                  | string | gateway `/healthz` (a write probe)      | nobody                   | 60 s |
| `{prefix}:sweeper`                 | string | sweepers (SET NX PX: the lease of the   | sweepers                 | lease|
|                                    |        | one process sweeping, renewed by it)    |                          |      |
| `{prefix}:learner:steps`           | stream | learner (one entry per step: `data`, its| dashboards, inspection   | none |
|                                    |        | numbers as JSON; capped, ~10,000)       |                          |      |
| `{prefix}:webhook:<id>`            | string | reward webhook (SET NX: a signed        | reward webhook           | 2 T  |
|                                    |        | request's webhook-id, accepted once)    |                          |      |
| `{prefix}:rollout:{<rid>}:agl`     | hash   | Agent Lightning's store routes (create, | its controller (polled)  | R    |
|                                    |        | the controller's state changes)         |                          |      |
| `{prefix}:rollout:{<rid>}:server`  | string | gateway (the inference server the      | gateways                 | 2 x  |
|                                    |        | rollout's calls go to: SET NX, or SET   |                          | TTL  |
|                                    |        | when it moves)                          |                          |      |
| `{prefix}:servers:versions`        | hash   | learner (server -> policy version it    | gateways (polled)        | none |
|                                    |        | loaded there)                           |                          |      |
| `{prefix}:agl:queue`               | zset   | the same (id -> created_at while        | the same                 | none |
|                                    |        | queuing or running; trimmed like the    |                          |      |
|                                    |        | rollouts index)                         |                          |      |

- Retention (`R`, `EpisodeStore.retention_s`, `RLGATE_RETENTION_S`, default 7 days, 0: forever): the script
  that ends a rollout for good (consume, expire, fail) sets a TTL of `retention_s` on every key of the
  rollout (`Keys.rollout_keys`, events included), in the same script, so a finished rollout goes as a
  whole. A closed rollout no learner has consumed yet has no TTL: it waits for training. The sweeper
  trims (`XTRIM MINID`) stream entries older than `retention_s` that every consumer group has
  acknowledged (older than each group's oldest pending entry and not after its last delivered one), and
  trims nothing while no group exists.
- The rollout hash holds the fields of `records.Rollout` (`status`, `reward`, `closed_at`, ... with
  JSON for `metadata`, `reward_metadata` and `finish`; absent means null; `agent_name`, `first_version`
  and `last_version` kept by the record script on every call, so a listing need not read records) plus
  `published`, the outbox flag ('0' from closing until the episode is on the stream, then '1'), and a
  learner's training claim (`claimed_by`, `claimed_until_ms`: a lease, so an episode published twice
  trains once).
- The calls list holds one `records.CallRecord` as JSON per LLM transition, in commit order; a call's
  index is its position in the list (0-based), so it is never stored twice. A request with `n > 1`
  appends one entry per choice, in choice order, in the same script call.
- A webhook key remembers a signed request's `webhook-id` for 2 T, twice the signature tolerance
  (`RLGATE_WEBHOOK_TOLERANCE_S`, default 300 s): as long as the request's timestamp can be accepted. The
  same id again is refused (`409 webhook_replayed`), so a captured request cannot be sent twice. The id is
  not a hash tag: a global key, touched by one SET NX.
- The rollouts index lists rollouts by creation time for `GET /rollouts`; it is written next to the expiry
  entry when a rollout is created (outside the creating script: another slot on a cluster) and trimmed to
  the newest `EpisodeStore.index_max` entries (`RLGATE_ROLLOUT_INDEX_MAX`), so it never grows without
  bound. Rollouts created before it existed are not in it.
- The epoch marker tells a gateway that Redis lost its data: it is written once (SET NX) and only
  disappears with the rest (`gateway.watch`).
- Keys of one rollout carry the Redis Cluster hash tag `{<rid>}`, so every Lua script (they only ever
  touch one rollout's keys) hits one slot and runs unchanged on a cluster. An attempt of a rollout (Agent
  Lightning's retries: the episode `<rid>~<attempt>`) keeps its rollout's tag, `{prefix}:rollout:{<rid>}~<attempt>`
  and so on, so the record script that creates it can read its rollout (task, mode, status) and count its
  attempts (`attempts` in the rollout hash) atomically. The global keys (`policy`,
  `expiry`, `rollouts`, `outbox`, `episodes`, `agl:queue`, `servers:versions`) are only touched by
  single-key commands. On a cluster
  (`redis+cluster://`, `store.parse_url`) rq's reward-job queue is not among these keys: it lives in a
  standalone Redis of its own (`RLGATE_QUEUE_REDIS_URL`), rq does not run on a cluster.

Episode lifecycle (every transition is one script on the rollout hash, so it happens exactly once however
many gateways, webhooks or workers race on it):

    open --reward--> closed --learner ack--> consumed
    open --TTL passed--> expired          (or closed with the configured fill reward)
    open --POST /rollouts/{id}/fail--> failed   (an agent that crashed; never published, never trained)
    open --reward job gave up--> failed   (also at the TTL, if a reward job was asked for and never
                                           closed it: a killed worker)

Closed episodes reach learners through the `episodes` stream with an outbox, since the stream and the
rollout live in different slots: a closer first adds the rollout to `outbox`, then runs the close
script; the one caller that actually closed it XADDs `{rollout_id, task_id, reward}` (with `mode` for a
validation episode, `version` for the oldest policy version that served one of its calls) to the stream, sets
`published` to 1 and removes the outbox entry. If it dies in between, the sweeper finds the stale outbox
entry and publishes it (at least once; the learner's consume script is the exactly-once point). The
learners' consumer group reads with XREADGROUP, acknowledges with XACK after training (and marks the
rollout consumed), and takes over the pending entries of a dead consumer with XAUTOCLAIM once they have
been idle longer than its timeout.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from rlgate.episodes.errors import InvalidId

# Characters allowed in rollout and task ids: they appear in URL paths and inside a hash tag, so no
# slashes and no braces.
_ID_RE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
# An attempt of a rollout (Agent Lightning's retries) is an episode of its own, `{rollout_id}~{attempt_id}`:
# `~` is in no rollout id, so no rollout can be named like another's attempt.
ATTEMPT_SEPARATOR = "~"
_ATTEMPT_RE = re.compile(r"[A-Za-z0-9_\-]{1,32}")


def validate_id(value: str, what: str = "id") -> str:
    """Return `value` if it can be used as a rollout or task id, else raise `InvalidId`."""
    if not _ID_RE.fullmatch(value):
        raise InvalidId(f"invalid {what} {value!r}: use 1-128 characters from A-Z a-z 0-9 . _ : -")
    return value


def attempt_episode(rollout_id: str, attempt_id: str) -> str:
    """The episode an attempt of a rollout records into: the rollout itself for attempt "0", else
    `{rollout_id}~{attempt_id}` (a retry never collides with the attempt that failed)."""
    validate_id(rollout_id, "rollout id")
    if attempt_id == "0":
        return rollout_id
    if not _ATTEMPT_RE.fullmatch(attempt_id):
        raise InvalidId(f"invalid attempt id {attempt_id!r}: use 1-32 characters from A-Z a-z 0-9 _ -")
    return f"{rollout_id}{ATTEMPT_SEPARATOR}{attempt_id}"


def validate_episode_id(value: str, what: str = "rollout id") -> str:
    """Return `value` if it names a rollout or an attempt of one (`{rollout_id}~{attempt_id}`)."""
    base, sep, attempt = value.partition(ATTEMPT_SEPARATOR)
    if not _ID_RE.fullmatch(base) or (sep and not _ATTEMPT_RE.fullmatch(attempt)):
        raise InvalidId(
            f"invalid {what} {value!r}: use 1-128 characters from A-Z a-z 0-9 . _ : -, and for "
            f"an attempt of a rollout, ROLLOUT~ATTEMPT"
        )
    return value


def server_name(url: str) -> str:
    """An inference server's name in the store: its base URL without credentials and without `/v1`, scheme
    and host in lower case (the gateway's upstream URLs and the learner's inference URLs name a server
    alike: use the same host names in both)."""
    parts = urlsplit(url.strip())
    host = (parts.hostname or "").lower()
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    path = parts.path.rstrip("/").removesuffix("/v1").rstrip("/")
    return f"{parts.scheme.lower()}://{netloc}{path}"


def rq_queue_key(queue: str) -> str:
    """The list rq keeps a queue's waiting job ids in (rq's own name for it; not under the prefix)."""
    return f"rq:queue:{queue}"


def parent_of(episode_id: str) -> str | None:
    """The rollout an attempt episode belongs to; None for a rollout itself."""
    base, sep, _ = episode_id.partition(ATTEMPT_SEPARATOR)
    return base if sep else None


def _tag(episode_id: str) -> str:
    """The key part of an episode: its hash tag is its rollout's, so an attempt's keys share the slot of
    its rollout's (the record script reads the rollout when it creates the attempt)."""
    base, sep, attempt = episode_id.partition(ATTEMPT_SEPARATOR)
    return f"{{{base}}}{sep}{attempt}"


class Keys:
    """Builds the keys of one rlgate deployment; `prefix` lets several share a Redis."""

    __slots__ = (
        "prefix",
        "policy",
        "expiry",
        "rollouts",
        "outbox",
        "episodes",
        "epoch",
        "health",
        "sweeper",
        "learner_steps",
        "agl_queue",
        "server_versions",
    )

    def __init__(self, prefix: str = "rlgate") -> None:
        if not prefix or "{" in prefix or "}" in prefix:
            raise InvalidId(f"invalid key prefix {prefix!r}")
        self.prefix = prefix
        self.policy = f"{prefix}:policy"
        self.expiry = f"{prefix}:expiry"
        self.rollouts = f"{prefix}:rollouts"
        self.outbox = f"{prefix}:outbox"
        self.episodes = f"{prefix}:episodes"
        self.epoch = f"{prefix}:epoch"
        self.health = f"{prefix}:health"
        self.sweeper = f"{prefix}:sweeper"
        self.learner_steps = f"{prefix}:learner:steps"
        self.agl_queue = f"{prefix}:agl:queue"
        self.server_versions = f"{prefix}:servers:versions"

    def rollout(self, rollout_id: str) -> str:
        return f"{self.prefix}:rollout:{_tag(rollout_id)}"

    def calls(self, rollout_id: str) -> str:
        return f"{self.prefix}:rollout:{_tag(rollout_id)}:calls"

    def rewards(self, rollout_id: str) -> str:
        return f"{self.prefix}:rollout:{_tag(rollout_id)}:rewards"

    def air(self, rollout_id: str) -> str:
        return f"{self.prefix}:rollout:{_tag(rollout_id)}:air"

    def events(self, rollout_id: str) -> str:
        """The events the rollout's agent posted (Agent Lightning's event route), JSON, in order."""
        return f"{self.prefix}:rollout:{_tag(rollout_id)}:events"

    def server(self, rollout_id: str) -> str:
        """The inference server a rollout's calls go to (`gateway.servers`; several upstreams only)."""
        return f"{self.prefix}:rollout:{_tag(rollout_id)}:server"

    def agl(self, rollout_id: str) -> str:
        """Agent Lightning's view of the rollout (`rlgate.episodes.agl_queue`): its input, config and state."""
        return f"{self.prefix}:rollout:{_tag(rollout_id)}:agl"

    def rollout_keys(self, rollout_id: str) -> list[str]:
        """Every key of one rollout (one hash slot), the hash first: what retention expires together."""
        return [
            self.rollout(rollout_id),
            self.calls(rollout_id),
            self.rewards(rollout_id),
            self.air(rollout_id),
            self.events(rollout_id),
            self.agl(rollout_id),
        ]

    def webhook(self, msg_id: str) -> str:
        """A signed request's webhook-id (`reward_hooks.signing` allows A-Z a-z 0-9 _ - only)."""
        return f"{self.prefix}:webhook:{msg_id}"
