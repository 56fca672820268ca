"""Runs the gateway under uvicorn (uvloop event loop, httptools parser, no access log: the gateway
writes one canonical line per call itself).

With a control port, one process serves two listeners on one event loop: the agent port, whose server
runs the gateway's lifespan, and the control port. SIGINT/SIGTERM stop both.

Every listener has header and body read deadlines, a header size limit and a connection cap
(`gateway._connections`); WebSocket upgrades are off."""

from __future__ import annotations

import asyncio
import contextlib
import resource
import signal
from collections.abc import Iterator
from types import FrameType
from typing import Any

import structlog
import uvicorn
import uvloop

from gateway._connections import ConnectionLimits, Listener
from gateway.app import Gateway
from gateway.settings import GatewaySettings

log = structlog.get_logger("rlgate.gateway")
_RESERVED_FILES = 256  # open files kept for everything but agents' connections (Redis, logs, ...)


def serve(settings: GatewaySettings, app: Gateway | None = None) -> None:
    """Serve `app` (default: a plain `Gateway(settings)`) until interrupted."""
    app = app or Gateway(settings)
    limits = _limits(settings, listeners=1 if app.control is None else 2)
    if app.control is None:
        uvicorn.Server(
            _config(app, settings, Listener("agent", limits), settings.host, settings.port, lifespan="on")
        ).run()
        return
    assert settings.control_port is not None
    agent = _Quiet(
        _config(app, settings, Listener("agent", limits), settings.host, settings.port, lifespan="on")
    )
    control = _Quiet(
        _config(
            app.control,
            settings,
            Listener("control", limits),
            settings.control_host,
            settings.control_port,
            lifespan="off",
        )
    )
    # Both ports are bound before anything starts: if either is taken, uvicorn logs it and exits (status 1).
    sockets = agent.config.bind_socket(), control.config.bind_socket()

    def stop(sig: int, frame: FrameType | None) -> None:  # both drain their connections, then exit
        agent.handle_exit(sig, frame)
        control.handle_exit(sig, frame)

    async def both() -> None:
        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            await asyncio.gather(agent.serve([sockets[0]]), control.serve([sockets[1]]))
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    uvloop.run(both())


def _config(
    app: Any, settings: GatewaySettings, listener: Listener, host: str, port: int, lifespan: str
) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http=listener.protocol(),
        ws="none",
        lifespan=lifespan,
        access_log=False,
        log_config=None,
        log_level=settings.log_level,
        timeout_keep_alive=75,
        server_header=False,
        date_header=False,
        proxy_headers=False,
    )


def _limits(settings: GatewaySettings, listeners: int) -> ConnectionLimits:
    """The listeners' limits, with the connection cap lowered to what the open-file limit allows (raised
    first as far as the hard limit permits): past it, accept() fails and so would the gateway's own
    connections to the upstream and Redis."""
    needed = settings.max_connections * listeners + settings.upstream_max_connections + _RESERVED_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        soft = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    max_connections = settings.max_connections
    if soft != resource.RLIM_INFINITY and soft < needed:
        max_connections = max(1, (soft - settings.upstream_max_connections - _RESERVED_FILES) // listeners)
        log.warning("max_connections_lowered", max_connections=max_connections, open_file_limit=soft)
    return ConnectionLimits(
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        body_min_bytes_per_s=settings.body_min_bytes_per_s,
        max_body_bytes=settings.max_body_bytes,
        max_header_bytes=settings.max_header_bytes,
        max_connections=max_connections,
    )


class _Quiet(uvicorn.Server):
    """A server that leaves the signals to `serve`, which stops both listeners together."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
