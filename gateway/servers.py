"""Several inference servers behind one gateway: each rollout sticks to one, new rollouts go to the least
loaded, a server that is down or behind on the policy gets none.

- **Sticky per rollout.** Every call of a rollout (its attempts included: they share its hash tag) goes to
  the server that served its first call, so its later turns hit the prefix cache its earlier turns built.
  The choice is kept in Redis with the rollout (`Keys.server`, a string with a TTL of twice the rollout
  TTL), so every gateway process and a restarted gateway send the rollout to the same server; each process
  also keeps a bounded cache of it.
- **Least loaded.** A new rollout goes to the eligible server with the fewest calls in flight from this
  process plus the requests running and waiting there (vLLM's `vllm:num_requests_running` and
  `vllm:num_requests_waiting` from its `/metrics`, read with the health check); between equal loads, the
  one this process placed fewer rollouts on.
- **Health.** Every `upstream_health_interval_s`, each server's `GET /health` (on the server's root, as
  vLLM serves it). A server that fails it, or refuses a call's connection, is out until it passes again;
  its rollouts move to another server on their next call (which prefills their context there again: the
  call's record says `rerouted_from`). A call in flight when its server dies fails (502), recorded.
- **Pushed together.** The learner records, per server, the policy version it loaded there
  (`Keys.server_versions`), before it moves the pointer; a server that has not loaded the version the
  pointer names is left out while another has it (a failed push to one server does not stop the others),
  and so is one whose model list lacks the pointer's adapter (restarted since the push). A server the
  learner has not reported on (no push yet, a learner that pushes elsewhere) is taken. When no healthy
  server has the version (the versions read before a push finished; a record left by an earlier run), the
  versions are read again once, and then every healthy server is taken rather than none (logged).

With one server (`upstream_url`, or a list of one) none of this runs: calls go straight to it.
"""

from __future__ import annotations

import asyncio
import collections
import re
import time
from dataclasses import dataclass
from typing import cast

import structlog

from gateway import errors
from gateway.settings import GatewaySettings
from gateway.upstream import Upstream
from rlgate import episodes
from rlgate.episodes import EpisodeStore, Policy, server_name

log = structlog.get_logger("rlgate.gateway")

CACHE_MAX = 100_000  # rollout -> server entries one process keeps
_QUEUE_RE = re.compile(rb"^vllm:num_requests_(?:running|waiting)(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)


@dataclass
class Server:
    name: str
    upstream: Upstream
    healthy: bool = True
    in_flight: int = 0
    queue: float = 0.0  # requests running and waiting there, from its /metrics
    loaded_version: int | None = None  # as the learner reported it; None: not reported
    placed: int = 0  # rollouts this process sent here first (the tie-break between equal loads)
    missing_adapter: bool = False  # its model list lacks the pointer's adapter (restarted since the push)
    health: Upstream | None = None  # a small pool of its own: busy call connections never fail a check

    @property
    def load(self) -> float:
        return self.in_flight + self.queue


class Servers:
    def __init__(self, settings: GatewaySettings, store: EpisodeStore) -> None:
        urls = settings.upstream_urls or [settings.upstream_url]
        self.servers = [Server(server_name(url), Upstream(settings, url)) for url in urls]
        if len(self.servers) > 1:
            for server, url in zip(self.servers, urls, strict=True):
                server.health = Upstream(settings, url, max_connections=2)
        self.by_name = {s.name: s for s in self.servers}
        self.store = store
        self.keys = store.keys
        self.interval_s = settings.upstream_health_interval_s
        self.ttl_s = max(1, int(settings.rollout_ttl_s * 2))
        self._sticky: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.policy: Policy = Policy()  # the pointer as last seen by a call (the health loop checks adapters)
        self._versions_read_at = 0.0
        self._versions_for = -1  # the pointer version the last read of the versions was made under
        self._reading: asyncio.Future[None] | None = None
        self._stale_warned = False

    @property
    def several(self) -> bool:
        return len(self.servers) > 1

    @property
    def first(self) -> Server:
        return self.servers[0]

    def any(self) -> Server:
        """A server for what is not a rollout's call (the model list, token counts): the first healthy one."""
        return next((s for s in self.servers if s.healthy), self.first)

    def connections(self) -> tuple[int, int]:
        """(open, idle) upstream connections of every server's pool together."""
        pools = [s.upstream.connections() for s in self.servers]
        return sum(p[0] for p in pools), sum(p[1] for p in pools)

    def eligible(self, server: Server, version: int) -> bool:
        return (
            server.healthy
            and not server.missing_adapter
            and (server.loaded_version is None or server.loaded_version >= version)
        )

    async def pick(self, rollout_id: str, policy: Policy, sticky: bool = True) -> tuple[Server, str | None]:
        """The server for a call of `rollout_id` under `policy`, and the server its earlier calls went to
        when that one cannot take it any more (None: not moved). `sticky=False` (a rollout id the gateway
        made up for a call that named none): least loaded, nothing kept."""
        if not self.several:
            return self.first, None
        self.policy = policy
        version = policy.version
        if version != self._versions_for:  # the pointer moved: the servers' versions, as recorded before it
            await self._read_versions_once(version)
        root = episodes.parent_of(rollout_id) or rollout_id  # attempts go where their rollout goes
        name = self._sticky.get(root) if sticky else None
        if name is None and sticky:
            name = await self._stored(root)
        current = self.by_name.get(name) if name is not None else None
        if current is not None and self.eligible(current, version):
            self._remember(root, current.name)
            return current, None
        candidates = [s for s in self.servers if self.eligible(s, version)]
        if not candidates and any(s.healthy for s in self.servers):
            await self._read_versions(min_age_s=0.05)  # a push may have finished since the last read
            candidates = [s for s in self.servers if self.eligible(s, version)]
            if not candidates:
                candidates = [s for s in self.servers if s.healthy]
                if not self._stale_warned:
                    self._stale_warned = True
                    log.warning(
                        "upstream_versions_behind",
                        version=version,
                        problem="no healthy inference server reports the pointer's policy version: "
                        "calls go to every healthy one (a learner that pushes elsewhere, or a record of "
                        "an earlier run in {prefix}:servers:versions)",
                    )
        if not candidates:
            raise errors.NoUpstream(
                "no inference server can take this call: every one is down; retry shortly",
                headers={"retry-after": "1"},
            )
        chosen = min(candidates, key=lambda s: (s.load, s.placed))
        chosen.placed += 1
        if sticky:
            # a first choice another process made at the same moment wins: the call goes there
            chosen = self.by_name[await self._store(root, chosen.name, replace=name is not None)]
            self._remember(root, chosen.name)
        return chosen, current.name if current is not None and current is not chosen else None

    def failed(self, server: Server) -> None:
        """A call could not reach `server`: out until its health check passes again."""
        if server.healthy and self.several:
            server.healthy = False
            log.warning("upstream_down", server=server.name, reason="a call could not connect")

    def _remember(self, root: str, name: str) -> None:
        self._sticky[root] = name
        self._sticky.move_to_end(root)
        if len(self._sticky) > CACHE_MAX:
            self._sticky.popitem(last=False)

    async def _stored(self, root: str) -> str | None:
        try:
            async with self.store.guard():
                value = await self.store.redis.get(self.keys.server(root))
        except episodes.StoreUnavailable:
            return None  # chosen again below; the record's commit reports Redis' trouble itself
        return cast(bytes, value).decode() if value is not None else None

    async def _store(self, root: str, name: str, replace: bool) -> str:
        """Keep the choice with the rollout and return the server the rollout goes to: a first choice
        another gateway process made at the same moment wins (SET NX), so its calls meet on one server."""
        try:
            async with self.store.guard():
                if replace:
                    await self.store.redis.set(self.keys.server(root), name, ex=self.ttl_s)
                elif not await self.store.redis.set(self.keys.server(root), name, ex=self.ttl_s, nx=True):
                    other = cast(bytes | None, await self.store.redis.get(self.keys.server(root)))
                    if other is not None and other.decode() in self.by_name:
                        return other.decode()
        except episodes.StoreUnavailable:
            pass
        return name

    async def _read_versions_once(self, version: int) -> None:
        """Read the versions once for a new pointer version, every call that sees it waiting on the one
        read (the learner records them before it moves the pointer, so they are complete then)."""
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._read_versions())
            self._versions_for = version
        await asyncio.shield(self._reading)

    async def _read_versions(self, min_age_s: float = 0.0) -> None:
        """The policy versions the learner loaded on each server (at most once per `min_age_s`)."""
        now = time.monotonic()
        if now - self._versions_read_at < min_age_s:
            return
        self._versions_read_at = now
        try:
            async with self.store.guard():
                loaded = await self.store.redis.hgetall(self.keys.server_versions)
            for server in self.servers:
                value = loaded.get(server.name.encode())
                server.loaded_version = int(value) if value is not None else None
        except (episodes.StoreUnavailable, ValueError):
            pass

    async def run(self) -> None:
        """The health loop (several servers only): each server's /health and /metrics, and the versions
        the learner loaded on each."""
        if not self.several:
            return
        while True:
            try:
                await asyncio.gather(*(self._check(s) for s in self.servers))
                await self._read_versions()
            except Exception:  # the loop must outlive anything one round meets
                log.exception("upstream_health_check_failed")
            await asyncio.sleep(self.interval_s)

    async def _check(self, server: Server) -> None:
        """/health decides; /metrics gives the queue; with an adapter named by the pointer, /v1/models
        must list it (a server restarted since the push has lost it)."""
        assert server.health is not None
        healthy = False
        adapter = self.policy.adapter
        try:
            async with server.health.request("GET", "/health", timeout_s=2.0, root=True) as response:
                await response.read(limit=1 << 16)
                healthy = response.status == 200
            if healthy and adapter:
                async with server.health.request("GET", "/models", timeout_s=2.0) as response:
                    body = await response.read(limit=8 << 20)
                    if response.status == 200:
                        server.missing_adapter = f'"id":"{adapter}"'.encode() not in body.replace(b" ", b"")
            elif not adapter:
                server.missing_adapter = False
            async with server.health.request("GET", "/metrics", timeout_s=2.0, root=True) as response:
                body = await response.read(limit=8 << 20)
                if response.status == 200:
                    server.queue = sum(float(v) for v in _QUEUE_RE.findall(body))
        except Exception:  # noqa: BLE001 - down, slow, or answering nonsense: what it says decides
            pass
        if healthy != server.healthy:
            log.warning("upstream_up" if healthy else "upstream_down", server=server.name)
        server.healthy = healthy

    def report(self) -> list[dict[str, object]]:
        """Per server: name, health, load and loaded version (for /healthz and the dashboard)."""
        return [
            {
                "server": s.name,
                "healthy": s.healthy,
                "in_flight": s.in_flight,
                "queue": s.queue,
                "loaded_version": s.loaded_version,
            }
            for s in self.servers
        ]

    async def aclose(self) -> None:
        for server in self.servers:
            await server.upstream.aclose()
            if server.health is not None:
                await server.health.aclose()
