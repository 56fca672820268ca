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
  (`Keys.server_versions`); a server that has not loaded the version the policy pointer names is left out
  until it has (a failed push to one server does not stop the others, nor stop serving).
  A server the learner has not reported on (no push yet, or a learner that pushes elsewhere) is eligible.

With one server (`upstream_url`, or a list of one) none of this runs: calls go straight to it.
"""

from __future__ import annotations

import asyncio
import collections
import re
import time
from dataclasses import dataclass, field

import structlog

import episodes
from episodes import EpisodeStore, server_name
from gateway import errors
from gateway.settings import GatewaySettings
from gateway.upstream import Upstream

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
    checked_at: float = field(default=0.0)

    @property
    def load(self) -> float:
        return self.in_flight + self.queue


class Servers:
    def __init__(self, settings: GatewaySettings, store: EpisodeStore) -> None:
        urls = settings.upstream_urls or [settings.upstream_url]
        self.servers = [Server(server_name(url), Upstream(settings, url)) for url in urls]
        self.by_name = {s.name: s for s in self.servers}
        self.store = store
        self.keys = store.keys
        self.interval_s = settings.upstream_health_interval_s
        self.ttl_s = max(1, int(settings.rollout_ttl_s * 2))
        self._sticky: collections.OrderedDict[str, str] = collections.OrderedDict()

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
        return server.healthy and (server.loaded_version is None or server.loaded_version >= version)

    async def pick(self, rollout_id: str, version: int) -> tuple[Server, str | None]:
        """The server for a call of `rollout_id` while the policy pointer names `version`, and the server
        its earlier calls went to when that one cannot take it any more (None: not moved)."""
        if not self.several:
            return self.first, None
        root = episodes.parent_of(rollout_id) or rollout_id  # attempts go where their rollout goes
        name = self._sticky.get(root)
        if name is None:
            name = await self._stored(root)
        current = self.by_name.get(name) if name is not None else None
        if current is not None and self.eligible(current, version):
            self._remember(root, current.name)
            return current, None
        candidates = [s for s in self.servers if self.eligible(s, version)]
        if not candidates:
            raise errors.NoUpstream(
                "no inference server can take this call: every one is down or has not loaded policy "
                f"version {version} yet; retry shortly",
                headers={"retry-after": "1"},
            )
        chosen = min(candidates, key=lambda s: (s.load, s.placed))
        chosen.placed += 1
        await self._store(root, chosen.name, replace=current is not None)
        self._remember(root, chosen.name)
        return chosen, current.name if current is not None else None

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
        return value.decode() if value is not None else None

    async def _store(self, root: str, name: str, replace: bool) -> None:
        """Keep the choice with the rollout; a first choice another gateway process made at the same
        moment wins (SET NX), so the rollout's calls still meet on one server."""
        try:
            async with self.store.guard():
                if replace:
                    await self.store.redis.set(self.keys.server(root), name, ex=self.ttl_s)
                elif not await self.store.redis.set(self.keys.server(root), name, ex=self.ttl_s, nx=True):
                    other = await self.store.redis.get(self.keys.server(root))
                    if other is not None and other.decode() in self.by_name:
                        name = other.decode()
        except episodes.StoreUnavailable:
            pass
        self._remember(root, name)

    async def run(self) -> None:
        """The health loop (several servers only): each server's /health and /metrics, and the versions
        the learner loaded on each."""
        if not self.several:
            return
        while True:
            await asyncio.gather(*(self._check(s) for s in self.servers))
            try:
                async with self.store.guard():
                    loaded = await self.store.redis.hgetall(self.keys.server_versions)
                for server in self.servers:
                    value = loaded.get(server.name.encode())
                    server.loaded_version = int(value) if value is not None else None
            except (episodes.StoreUnavailable, ValueError):
                pass
            await asyncio.sleep(self.interval_s)

    async def _check(self, server: Server) -> None:
        healthy = False
        try:
            async with server.upstream.request("GET", "/health", timeout_s=2.0, root=True) as response:
                await response.read(limit=1 << 16)
                healthy = response.status == 200
            async with server.upstream.request("GET", "/metrics", timeout_s=2.0, root=True) as response:
                body = await response.read(limit=8 << 20)
                if response.status == 200:
                    server.queue = sum(float(v) for v in _QUEUE_RE.findall(body))
        except (errors.GatewayError, ValueError, OSError):
            pass
        if healthy != server.healthy:
            log.warning("upstream_up" if healthy else "upstream_down", server=server.name)
        server.healthy = healthy
        server.checked_at = time.time()

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
