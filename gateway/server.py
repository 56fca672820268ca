"""Runs the gateway under uvicorn (uvloop event loop, httptools parser, no access log: the gateway
writes one canonical line per call itself)."""

from __future__ import annotations

import uvicorn

from gateway.app import Gateway
from gateway.settings import GatewaySettings


def serve(settings: GatewaySettings, app: Gateway | None = None) -> None:
    """Serve `app` (default: a plain `Gateway(settings)`) until interrupted."""
    config = uvicorn.Config(
        app or Gateway(settings), host=settings.host, port=settings.port, loop="uvloop", http="httptools",
        lifespan="on", access_log=False, log_config=None, log_level=settings.log_level,
        timeout_keep_alive=75, server_header=False, date_header=False, proxy_headers=False,
    )
    uvicorn.Server(config).run()
