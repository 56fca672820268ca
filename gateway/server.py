"""Runs the gateway under uvicorn (uvloop event loop, httptools parser, no access log: the gateway
writes one canonical line per call itself).

With a control port, one process serves two listeners on one event loop: the agent port, whose server
runs the gateway's lifespan, and the control port. SIGINT/SIGTERM stop both.

Every listener has header and body read deadlines, a header size limit and a connection cap
(`gateway._connections`); WebSocket upgrades are off.

With `workers` > 1 this process becomes a small supervisor, as gunicorn's arbiter or uvicorn's
`--workers`: it binds every socket first (a taken port is one error line and exit status 1), then
forks the workers, each of which builds its own `Gateway` and serves as above. The agent port has one
SO_REUSEPORT socket per worker, so the kernel spreads new connections over the workers evenly (one shared
socket lets whichever worker wakes first take a whole burst); the control port is one socket all workers
accept on. A worker that exits is started again on its socket, as uvicorn's supervisor does, except one
that exits before it served (its start-up failed: the supervisor stops and exits 1 rather than loop).
SIGTERM or SIGINT is passed to every worker once, which drains its connections and exits; the supervisor
then exits (0 when all exited cleanly). Workers die with the supervisor (PR_SET_PDEATHSIG) and sit in a
process group of their own, so a terminal's Ctrl-C reaches them once, through it. Metrics:
`gateway.metrics.share_across_processes`."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import resource
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any, Literal, NoReturn

import structlog
import uvicorn
import uvloop
from prometheus_client.multiprocess import mark_process_dead

from gateway._connections import ConnectionLimits, Listener
from gateway.app import Gateway
from gateway.metrics import share_across_processes
from gateway.settings import GatewaySettings

log = structlog.get_logger("rlgate.gateway")
_uvicorn_log = logging.getLogger("uvicorn.error")
_RESERVED_FILES = 256  # open files kept for everything but agents' connections (Redis, logs, ...)


def serve(
    settings: GatewaySettings, app: Gateway | None = None, build: Callable[[], Gateway] | None = None
) -> None:
    """Serve `app` until interrupted; default: `build()`, else a plain `Gateway(settings)`. With several
    `workers`, each worker calls `build` (default: a plain `Gateway`) and `app` is left unused."""
    build = build or (lambda: Gateway(settings))
    if settings.workers > 1:
        _supervise(settings, build)
    else:
        _serve(settings, app or build())


def _serve(
    settings: GatewaySettings,
    app: Gateway,
    agent_socket: socket.socket | None = None,
    control_socket: socket.socket | None = None,
) -> bool:
    """Serve one process's listeners (binding them unless given); whether they started."""
    limits = _limits(settings, listeners=1 if app.control is None else 2)
    agent_config = _config(
        app, settings, Listener("agent", limits), settings.host, settings.port, lifespan="on"
    )
    if app.control is None:
        server = uvicorn.Server(agent_config)
        server.run([agent_socket or _bind_socket(settings.host, settings.port)])
        return server.started
    assert settings.control_port is not None
    agent = _Quiet(agent_config)
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
    # Both ports are bound before anything starts: if either is taken, one error line and exit status 1.
    sockets = (
        agent_socket or _bind_socket(settings.host, settings.port),
        control_socket or _bind_socket(settings.control_host, settings.control_port),
    )

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
    return agent.started and control.started


# ---------------------------------------------------------------------------------------------------------
# Several workers

_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGCHLD}
_BOOT_FAILED = 3  # a worker's exit status when it stopped before serving (gunicorn's WORKER_BOOT_ERROR)
_PR_SET_PDEATHSIG = 1
_METRICS_DIR = "rlgate-metrics-"


def _supervise(settings: GatewaySettings, build: Callable[[], Gateway]) -> NoReturn:
    """Bind, fork `settings.workers` workers, restart the ones that die, stop them all on SIGTERM/SIGINT."""
    agent_sockets, control_socket = _bind(settings)
    _remove_stale_metrics()
    # prometheus_client's multiprocess directory, named after this supervisor
    shared = tempfile.mkdtemp(prefix=f"{_METRICS_DIR}{os.getpid()}-")
    workers: dict[int, int] = {}  # pid -> index of its agent socket
    started_at: dict[int, float] = {}  # index -> when its worker was last forked
    stopping, failed = False, False
    signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)  # taken one at a time below, never mid-fork

    def start(index: int) -> int:
        pid = os.fork()
        if pid == 0:
            _worker(settings, build, index, agent_sockets, control_socket, shared)
        workers[pid] = index
        started_at[index] = time.monotonic()
        return pid

    try:
        for index in range(settings.workers):
            start(index)
        log.info(
            "gateway_workers_started", workers=settings.workers, pids=sorted(workers), metrics_dir=shared
        )
        while workers:
            info = signal.sigwaitinfo(_SIGNALS)
            if info.si_signo != signal.SIGCHLD:
                if not stopping:  # the first: every worker drains its connections
                    log.info("gateway_workers_stopping", signal=signal.Signals(info.si_signo).name)
                    stopping = True
                    _signal_all(workers, signal.SIGTERM)
                    for sock in [*agent_sockets, *([control_socket] if control_socket else [])]:
                        sock.close()  # closed for good once the workers close theirs
                else:  # a second one forces the stop, as a second Ctrl-C does to a single uvicorn
                    log.info("gateway_workers_forced_stop", signal=signal.Signals(info.si_signo).name)
                    _signal_all(workers, signal.SIGINT)
                continue
            for pid, status in _reap():
                index = workers.pop(pid)
                mark_process_dead(pid, shared)
                code = os.waitstatus_to_exitcode(status)
                if stopping:
                    failed = failed or code != 0
                    continue
                if code == _BOOT_FAILED:
                    failed = True
                    log.error("gateway_worker_failed_to_start", pid=pid, hint="see its log lines above")
                    stopping = True
                    _signal_all(workers, signal.SIGTERM)
                    continue
                log.warning("gateway_worker_died", pid=pid, exit_code=code, worker=index)
                if time.monotonic() - started_at.get(index, 0.0) < 1.0:  # dying at once: no tight loop
                    time.sleep(1.0)
                log.info("gateway_worker_restarted", pid=start(index), worker=index)
    finally:
        _signal_all(workers, signal.SIGKILL)  # only after an error of the supervisor's own
        shutil.rmtree(shared, ignore_errors=True)
    log.info("gateway_workers_stopped", clean=not failed)
    sys.exit(1 if failed else 0)


def _remove_stale_metrics() -> None:
    """Remove the metrics directories of supervisors that are gone: one killed outright (SIGKILL) could
    not remove its own."""
    for path in Path(tempfile.gettempdir()).glob(f"{_METRICS_DIR}*-*"):
        pid = path.name.removeprefix(_METRICS_DIR).partition("-")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # another user's live process
            pass


def _bind(settings: GatewaySettings) -> tuple[list[socket.socket], socket.socket | None]:
    """The agent port's sockets, one per worker, and the control port's socket, all bound. The agent port
    is first bound without SO_REUSEPORT: that fails on a port anything holds, even another rlgate's
    SO_REUSEPORT sockets, which would otherwise share connections with ours."""
    first = _bind_socket(settings.host, settings.port)
    control = None
    if settings.control_port is not None:
        control = _bind_socket(settings.control_host, settings.control_port)
    host, port = first.getsockname()[:2]
    first.close()
    return [_bind_socket(host, port, reuse_port=True) for _ in range(settings.workers)], control


def _bind_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A socket bound as uvicorn binds one; a port that is taken is one error line and exit status 1."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        _uvicorn_log.error("cannot listen on %s port %d: %s", host, port, exc.strerror)
        sys.exit(1)
    if not reuse_port:  # uvicorn's own line (it logs none for sockets it is given)
        _uvicorn_log.info(
            "Uvicorn running on http://%s:%d (Press CTRL+C to quit)", host, sock.getsockname()[1]
        )
    sock.set_inheritable(True)
    return sock


def _worker(
    settings: GatewaySettings,
    build: Callable[[], Gateway],
    index: int,
    agent_sockets: list[socket.socket],
    control_socket: socket.socket | None,
    shared: str,
) -> NoReturn:
    """A forked worker: serve on socket `index` (and the shared control socket), then exit; never returns
    into the supervisor's code."""
    code = 1
    try:
        parent = os.getppid()
        os.setpgid(0, 0)
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the supervisor died before the line above
            os._exit(1)
        for sig in (signal.SIGTERM, signal.SIGINT):  # until uvicorn's handlers are in: stop at once
            signal.signal(sig, _exit_now)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
        for i, sock in enumerate(agent_sockets):
            if i != index:
                sock.close()
        structlog.contextvars.bind_contextvars(pid=os.getpid())  # on every log line of this worker
        share_across_processes(shared)
        app = build()
        app.add_background(lambda _store: app.metrics.sync_forever())
        code = 0 if _serve(settings, app, agent_sockets[index], control_socket) else _BOOT_FAILED
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        log.exception("gateway_worker_crashed")
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _exit_now(sig: int, frame: FrameType | None) -> None:
    """A worker's handler outside uvicorn's (which re-raises the signal once it has drained): exit 0."""
    raise SystemExit(0)


def _reap() -> Iterator[tuple[int, int]]:
    """(pid, wait status) of every child that has exited."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, status


def _signal_all(workers: dict[int, int], sig: int) -> None:
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _config(
    app: Any,
    settings: GatewaySettings,
    listener: Listener,
    host: str,
    port: int,
    lifespan: Literal["on", "off"],
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
