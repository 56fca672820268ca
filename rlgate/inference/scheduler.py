"""Batches concurrent generation requests for the engine: a short collection window, then one batch.

Requests that arrive within `window_s` of the first waiting one (or until `max_batch` rows are waiting)
run together in one `Engine.generate` call on a worker thread, so 16-32 parallel agents share one forward
pass per token instead of queueing behind each other. One batch runs at a time; requests that arrive
meanwhile form the next one. A row that fails in the engine fails its own request only.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from rlgate.inference.engine import Completion, Engine, SamplingParams


@dataclass
class _Pending:
    prompt: list[int]
    params: SamplingParams
    future: asyncio.Future[Completion]


class Scheduler:
    def __init__(self, engine: Engine, *, window_s: float = 0.003, max_batch: int = 64) -> None:
        self.engine = engine
        self.window_s = window_s
        self.max_batch = max_batch
        self._pending: list[_Pending] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.lock = asyncio.Lock()  # held while a batch runs; a weight update takes it between batches
        self.batches = 0  # how many engine batches ran (for tests and metrics)
        self.running = False  # a batch is in the engine now
        self.closed = False  # aclose() ran: a request now fails at once instead of waiting forever

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def drain(self) -> None:
        """Finish what is queued and running (on these weights), then stop: an adapter replaced in place
        or unloaded lets the requests it already took finish. Requests that reach this scheduler while it
        drains (looked up before the swap) are served too."""
        while self._task is not None and not self._task.done() and (self._pending or self.running):
            await asyncio.sleep(0.005)
        await self.aclose()

    async def aclose(self) -> None:
        """Stop now: every request queued or in the running batch fails ("shutting down"), and so does
        any that comes later."""
        self.closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for pending in self._pending:
            if not pending.future.done():
                pending.future.set_exception(RuntimeError("the inference server is shutting down"))

    def abort_pending(self) -> None:
        """Finish every queued request that is not in a batch yet with `finish_reason` "abort", no tokens."""
        pending, self._pending = self._pending, []
        self._wake.clear()
        for p in pending:
            if not p.future.done():
                p.future.set_result(Completion([], [], [], "abort"))

    async def generate(self, prompt: list[int], params: SamplingParams) -> Completion:
        """Queue one row and wait for its completion."""
        if self.closed:  # e.g. it picked a replaced adapter's scheduler before waiting out a pause
            raise RuntimeError("the inference server is shutting down")
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(prompt, params, future))
        self._wake.set()
        return await future

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            if len(self._pending) < self.max_batch:
                await asyncio.sleep(self.window_s)  # let the rest of a burst arrive
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
            if not self._pending:
                self._wake.clear()
            batch = [p for p in batch if not p.future.cancelled()]
            if not batch:
                continue
            self.running = True
            try:
                async with self.lock:
                    results = await asyncio.to_thread(
                        self.engine.generate, [p.prompt for p in batch], [p.params for p in batch]
                    )
            except Exception as exc:  # a bad batch fails its requests, not the server
                for pending in batch:
                    if not pending.future.done():
                        pending.future.set_exception(exc)
                continue
            except asyncio.CancelledError:  # aclose() during the batch: its requests fail, none hangs
                for pending in batch:
                    if not pending.future.done():
                        pending.future.set_exception(RuntimeError("the inference server is shutting down"))
                raise
            finally:
                self.running = False
                self.batches += 1
            for pending, result in zip(batch, results, strict=True):
                if pending.future.done():
                    continue
                if result.error is not None:  # that row's own failure: its batch-mates got their results
                    pending.future.set_exception(result.error)
                else:
                    pending.future.set_result(result)
