"""`rlgate worker`'s loop: rq's worker (`SimpleWorker` with `--no-fork`), kept working through Redis outages
and stopping on SIGTERM or SIGINT whenever it comes.

rq's `work()` quits its loop on any error, a Redis that restarts among them (its teardown then fails too),
so the loop below makes a new worker, with backoff, until a stop is asked for. rq looks for jobs whose
worker died (to retry them, or fail their episode) only every `maintenance_interval` and only when a wait
for a job times out (after `worker_ttl - 15` s): both follow `abandoned_check_s` (rq's default: 10
minutes). rq's cleaning lock (899 s) is released when a clean fails and when a worker starts.
"""

from __future__ import annotations

import contextlib
import inspect
import signal
import time
from typing import Any

import redis
import structlog
from rq import Queue, SimpleWorker, Worker
from rq.exceptions import StopRequested
from rq.serializers import JSONSerializer

log = structlog.get_logger("rlgate.worker")


def work(connection: redis.Redis, queue: str, *, fork: bool, burst: bool, abandoned_check_s: int) -> None:
    """Run reward jobs from `queue` until stopped (or, with `burst`, until it is empty)."""
    stop_signals: list[int] = []

    class RewardWorker(Worker if fork else SimpleWorker):  # type: ignore[misc]  # base chosen at run time
        """rq's worker, kept working through Redis outages by the loop below, stopping on a signal
        whenever it comes, and never holding rq's cleaning lock past a failed clean."""

        def request_stop(self, signum: int, frame: Any) -> None:  # SIGTERM, SIGINT: a stop asked for
            stop_signals.append(signum)
            super().request_stop(signum, frame)

        def _install_signal_handlers(self) -> None:
            super()._install_signal_handlers()
            if stop_signals:  # asked for while the loop was starting a worker again
                self._stop_requested = True

        def unsubscribe(self) -> None:
            """rq unsubscribes, then stops its listener thread, and redis-py (8.x) waits in `stop()` for the
            thread's read to end, up to rq's 60 s: when the thread took the unsubscribe's own reply before
            the stop, a burst worker took a minute to exit (seen under load). Stopped first, the thread
            finds itself stopped when that reply wakes it."""
            thread = self.pubsub_thread
            if thread is None:
                return
            self.log.info("Worker %s: unsubscribing from channel %s", self.name, self.pubsub_channel_name)
            _stop_without_waiting(thread)
            with contextlib.suppress(redis.RedisError):
                self.pubsub.unsubscribe()  # the reply wakes the thread's read
            thread.join(timeout=1)
            # a thread still reading (a slow reply) closes the pubsub itself when its read ends: closing it
            # under that read would hand its connection back to the pool while the thread reconnects it
            if not thread.is_alive():
                with contextlib.suppress(redis.RedisError):
                    self.pubsub.close()

        def clean_registries(self) -> None:
            try:
                super().clean_registries()
            except Exception:
                # rq holds the lock 899 s unless it is released: a clean cut short (Redis gone) must
                # not keep every worker from looking for abandoned jobs that long
                with contextlib.suppress(redis.RedisError):
                    for each in self.queues:
                        each.release_maintenance_lock()
                raise

    # a worker killed while it cleaned left rq's lock behind (899 s): cleaning twice at once is harmless
    # (an abandoned job's retry and an episode's close or failure each happen once)
    Queue(queue, connection=connection).release_maintenance_lock()

    def stop_asked(signum: int, frame: Any) -> None:  # outside rq's loop (it installs its own inside)
        stop_signals.append(signum)

    def own_handlers() -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, stop_asked)

    own_handlers()
    wait = 0.5
    while not stop_signals:
        started = time.monotonic()
        worker = None
        try:
            worker = RewardWorker(
                [queue],
                connection=connection,
                serializer=JSONSerializer,
                maintenance_interval=abandoned_check_s,
                # rq looks only between jobs or when a wait for one times out, after worker_ttl - 15 s
                worker_ttl=abandoned_check_s + 15,
            )
            worker.work(burst=burst, with_scheduler=True)
            failure: Exception | None = None
        except redis.RedisError as exc:  # rq's own teardown (or its start) on a Redis that went away
            failure = exc
        except StopRequested:  # a signal to rq's handlers outside its loop
            return
        finally:
            own_handlers()
            if worker is not None and worker.pubsub_thread is not None and worker.pubsub_thread.is_alive():
                with contextlib.suppress(Exception):  # rq's teardown failed before unsubscribing
                    _stop_without_waiting(worker.pubsub_thread)
                    worker.pubsub_thread.join(timeout=1)
        if stop_signals:
            return
        if burst:
            if failure is not None:
                raise failure
            return
        # rq quits its loop on any error, a Redis restarting among them: a worker works on until stopped
        wait = 0.5 if time.monotonic() - started > 60 else wait
        reason = str(failure) if failure is not None else "rq's loop quit (its log says why)"
        log.warning("worker_restarting", error=reason, retry_in_s=wait)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not stop_signals:
            time.sleep(0.1)
        wait = min(wait * 2, 10.0)


def _stop_without_waiting(thread: Any) -> None:
    """Clear a redis-py pub/sub thread's running flag: redis-py 8's `stop()` would also wait for its read
    (up to rq's 60 s); older ones only clear the flag."""
    if "timeout" in inspect.signature(thread.stop).parameters:
        thread.stop(timeout=0)
    else:
        thread.stop()
