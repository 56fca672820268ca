"""The client for the inference server: one keep-alive pool (`gateway._http`), errors translated in one
place.

The client was chosen by measurement (scripts/bench_http_clients.py): aiohttp beat httpx and httpcore by
a wide margin, and our own lean client beats aiohttp on the gateway's hot path.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from gateway._http import Client, HTTPError, Response
from gateway.errors import UpstreamError, UpstreamTimeout
from gateway.settings import GatewaySettings


class Upstream:
    def __init__(
        self, settings: GatewaySettings, url: str | None = None, max_connections: int | None = None
    ) -> None:
        self.base = (url or settings.upstream_url).rstrip("/")
        # identity: the body is parsed here (never decompressed), so no upstream may compress it
        headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        if settings.upstream_api_key is not None:
            headers["Authorization"] = f"Bearer {settings.upstream_api_key.get_secret_value()}"
        self._client = Client(
            self.base,
            limit=max_connections or settings.upstream_max_connections,
            timeout_s=settings.upstream_timeout_s,
            connect_timeout_s=10.0,
            keepalive_s=settings.upstream_keepalive_s,
            headers=headers,
        )

    @property
    def ignored_proxy(self) -> str | None:
        """The proxy variable that applies to this server and that the client does not use (gateway._http)."""
        return self._client.ignored_proxy

    def connections(self) -> tuple[int, int]:
        """(open, idle) connections of the pool."""
        return self._client.open_connections, self._client.idle_connections

    async def aclose(self) -> None:
        await self._client.aclose()

    @asynccontextmanager
    async def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        timeout_s: float | None = None,
        root: bool = False,
    ) -> AsyncIterator[Response]:
        """An upstream response whose headers have arrived; read its body inside the block. With `root`,
        `path` is on the server's root (vLLM's `/tokenize`) rather than under the base URL's `/v1`."""
        if root:
            path = self._client.prefix.removesuffix("/v1") + path
        try:
            async with self._client.request(method, path, body, timeout_s, prefixed=not root) as response:
                yield response
        except TimeoutError as exc:
            raise UpstreamTimeout(
                f"the inference server did not answer within its time limit ({path})"
            ) from exc
        except HTTPError as exc:
            raise UpstreamError(f"the inference server failed: {exc}") from exc

    @staticmethod
    async def chunks(response: Response) -> AsyncIterator[bytes]:
        """The body of a streaming response, as it arrives; failures raise `UpstreamError`."""
        try:
            async for data in response.chunks():
                yield data
        except TimeoutError as exc:
            raise UpstreamTimeout("the inference server's stream exceeded its time limit") from exc
        except HTTPError as exc:
            raise UpstreamError(f"the inference server's stream broke: {exc}") from exc
