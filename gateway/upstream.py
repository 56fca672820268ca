"""The client for the inference server: one aiohttp keep-alive pool, errors translated in one place.

aiohttp was chosen over httpx and httpcore by measurement: scripts/bench_http_clients.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
from yarl import URL

from gateway.errors import UpstreamError, UpstreamTimeout
from gateway.settings import GatewaySettings


class Upstream:
    def __init__(self, settings: GatewaySettings) -> None:
        self.base = settings.upstream_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=settings.upstream_timeout_s, connect=10.0)
        self._limit = settings.upstream_max_connections
        # identity: the body is parsed here (never auto-decompressed), so no upstream may compress it
        self._headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        if settings.upstream_api_key is not None:
            self._headers["Authorization"] = f"Bearer {settings.upstream_api_key.get_secret_value()}"
        self._urls: dict[str, URL] = {}
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=self._limit, keepalive_timeout=60, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=self._timeout, headers=self._headers, auto_decompress=False,
            skip_auto_headers=("User-Agent",), cookie_jar=aiohttp.DummyCookieJar(),
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    def url(self, path: str) -> URL:
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = URL(self.base + path)
        return url

    @asynccontextmanager
    async def request(self, method: str, path: str, body: bytes | None = None, timeout_s: float | None = None
                      ) -> AsyncIterator[aiohttp.ClientResponse]:
        """An upstream response whose headers have arrived; read its body inside the block."""
        assert self._session is not None, "Upstream.start() was not awaited"
        timeout = self._timeout if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with self._session.request(method, self.url(path), data=body, timeout=timeout) as response:
                yield response
        except TimeoutError as exc:
            raise UpstreamTimeout(f"the inference server did not answer within its time limit ({path})") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"the inference server failed: {type(exc).__name__}: {exc}") from exc

    @staticmethod
    async def chunks(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        """The body of a streaming response, as it arrives; failures raise `UpstreamError`."""
        try:
            async for data in response.content.iter_any():
                yield data
        except TimeoutError as exc:
            raise UpstreamTimeout("the inference server's stream exceeded its time limit") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"the inference server's stream broke: {type(exc).__name__}: {exc}") from exc
