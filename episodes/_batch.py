"""Group commit: concurrent script calls share one pipelined round trip to Redis.

Under load many calls finish at once; sending each record as its own EVALSHA costs a connection checkout,
a syscall pair and redis-py's per-command machinery every time. Here the first call starts a flush and
every call that arrives while a flush is in flight joins the next one, so a batch grows with the load
and a lone call goes out at once (no timer, no added latency). Each call still gets its own reply, and
a batch fails as a whole only when Redis itself fails (then every caller gets the error).
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as redis_exc


class ScriptBatcher:
    """Runs one Lua script for many concurrent callers, pipelining the EVALSHAs of each batch."""

    def __init__(self, redis: aioredis.Redis, source: str, timeout_s: float) -> None:
        self._redis = redis
        self._timeout_s = timeout_s  # per batch: a hung Redis fails the batch instead of stalling all
        self._script = redis.register_script(source)  # computes the sha; loads on NOSCRIPT
        self._pending: list[tuple[list[Any], asyncio.Future[Any]]] = []
        self._task: asyncio.Task[None] | None = None

    async def __call__(self, keys: list[str], args: list[Any]) -> Any:
        future = asyncio.get_running_loop().create_future()
        self._pending.append(([len(keys), *keys, *args], future))
        if self._task is None:
            self._task = asyncio.create_task(self._flush())
        # A caller that is cancelled while waiting does not cancel the write: its batch goes out anyway.
        return await future

    async def _flush(self) -> None:
        batch: list[tuple[list[Any], asyncio.Future[Any]]] = []
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    replies = await self._execute([params for params, _ in batch])
                except Exception as exc:  # Redis failed: every caller of this batch learns it
                    _fail(batch, exc)
                    continue
                for (_, future), reply in zip(batch, replies, strict=True):
                    if future.done():
                        continue
                    if isinstance(reply, Exception):
                        future.set_exception(reply)
                    else:
                        future.set_result(reply)
                batch = []
        except asyncio.CancelledError:  # shutting down: nobody waits forever, nobody sees a cancellation
            _fail(batch + self._pending, redis_exc.ConnectionError("the store is shutting down"))
            self._pending = []
            raise
        finally:
            self._task = None
            if self._pending:  # arrived after the loop ended but before this task finished
                self._task = asyncio.create_task(self._flush())

    async def _execute(self, batch: list[list[Any]]) -> list[Any]:
        replies = await self._pipeline(batch)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, redis_exc.NoScriptError)]
        if missing:  # Redis restarted or flushed its script cache: load the script and retry those
            await self._redis.script_load(self._script.script)
            again = await self._pipeline([batch[i] for i in missing])
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        return replies

    async def _pipeline(self, batch: list[list[Any]]) -> list[Any]:
        async with asyncio.timeout(self._timeout_s), self._redis.pipeline(transaction=False) as pipe:
            for params in batch:
                pipe.execute_command("EVALSHA", self._script.sha, *params)
            return await pipe.execute(raise_on_error=False)


def _fail(batch: list[tuple[list[Any], asyncio.Future[Any]]], exc: Exception) -> None:
    for _, future in batch:
        if not future.done():
            future.set_exception(exc)
