"""Pushing a new policy to the inference servers, and moving the policy pointer the gateway reads.

Two ways, the same calls against `rlgate serve` and vLLM: `LoraPusher` and `FullPusher` (below).

`--push lora` (vLLM needs `--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`):

1. the adapter of version N is a PEFT folder `adapters/policy-vN` (the servers must see the same path:
   one machine, or a shared volume in docker compose);
2. `POST {server}/v1/load_lora_adapter {"lora_name": "policy-vN", "lora_path": ..., "load_inplace": true}`
   on every server (in place, so that re-pushing the same version after a restart is harmless);
3. the policy pointer in Redis moves to (N, policy-vN, base model): from the gateway's next poll on, calls
   that ask for the base model go to policy-vN and are tagged N;
4. `policy-v(N-2)` is unloaded (404 ignored) and its folder deleted. The previous adapter stays loaded:
   calls a gateway admitted before it saw the new pointer still find it, finish on the old weights and
   keep the old tag.

A server that restarts comes back without adapters, and every call the gateway sends it for the pointer's
adapter would be a 404 until the next push, which needs episodes those calls cannot make.
`LoraPusher.reload_missing` (the learner runs it every `server_check_s`) asks each server's
`/v1/models` and loads the adapter the policy pointer names where it is missing.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import time
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from rlgate.episodes import EpisodeStore, Policy, server_name

log = structlog.get_logger("rlgate.learner")


class PushError(RuntimeError):
    """An inference server refused or did not answer a weight push."""


ADAPTER_NAME = re.compile(r"policy-v[0-9]+")  # what `adapter_name` makes


def adapter_name(version: int) -> str:
    return f"policy-v{version}"


def _auth(api_key: str | None) -> dict[str, str]:
    """The inference servers' `--api-key` (vLLM guards /v1, where the LoRA routes are), as a header."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class LoraPusher:
    def __init__(
        self,
        server_urls: list[str],
        adapters_dir: Path,
        store: EpisodeStore,
        base_model: str,
        timeout_s: float = 120.0,
        api_key: str | None = None,
    ) -> None:
        self.headers = _auth(api_key)
        self.server_urls = [u.rstrip("/") for u in server_urls]
        self.adapters_dir = adapters_dir
        self.store = store
        self.base_model = base_model
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.lock = asyncio.Lock()  # a push and a reload never interleave

    def path(self, version: int) -> Path:
        return (self.adapters_dir / adapter_name(version)).resolve()

    async def reload_missing(self, check_timeout_s: float = 5.0) -> list[str]:
        """Load the adapter the policy pointer names on every server whose `/v1/models` does not list it
        (it restarted); the servers it was loaded on. A server that does not answer is left for the next
        check. The pointer, not this process's last push: a learner that restarted names the same adapter
        before its own first push succeeds."""
        async with self.lock:
            pointer = await self.store.policy()
            if not pointer.adapter or not ADAPTER_NAME.fullmatch(pointer.adapter):
                return []
            name, path = pointer.adapter, (self.adapters_dir / pointer.adapter).resolve()
            if not (path / "adapter_config.json").is_file():
                return []  # another learner's folder, or retired: nothing this learner can load
            reloaded = []
            # bounded well below a push's timeout: the lock holds the next push back meanwhile
            timeout = aiohttp.ClientTimeout(total=min(self.timeout.total or 30.0, 30.0))
            async with aiohttp.ClientSession(timeout=timeout, headers=self.headers) as session:
                for url in self.server_urls:
                    try:
                        async with session.get(
                            f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=check_timeout_s)
                        ) as response:
                            if response.status != 200:
                                continue
                            served = {m.get("id") for m in (await response.json()).get("data", [])}
                    except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
                        continue
                    if name in served:
                        continue
                    try:
                        await self._load(session, url, pointer.version, path)
                    except PushError as exc:
                        log.warning("adapter_reload_failed", server=url, adapter=name, error=str(exc))
                        continue
                    log.warning(
                        "adapter_reloaded", server=url, adapter=name, reason="the server did not list it"
                    )
                    reloaded.append(url)
            return reloaded

    async def _load(self, session: aiohttp.ClientSession, url: str, version: int, path: Path) -> None:
        """Load (in place) version `version`'s adapter on one server, and record that it holds it: with
        several servers, gateways route only to those that loaded the pointer's version."""
        await _post(
            session,
            f"{url}/v1/load_lora_adapter",
            {"lora_name": adapter_name(version), "lora_path": str(path), "load_inplace": True},
        )
        if len(self.server_urls) > 1:
            await self.store.set_server_version(server_name(url), version)

    async def push(self, version: int, policy: Any) -> float:
        """Save `policy`'s adapter as version `version`, load it everywhere, move the pointer, retire
        version - 2; seconds taken."""
        async with self.lock:
            return await self._push(version, policy)

    async def _push(self, version: int, policy: Any) -> float:
        t0 = time.perf_counter()
        name, path = adapter_name(version), self.path(version)
        policy.save_adapter(path)
        async with aiohttp.ClientSession(timeout=self.timeout, headers=self.headers) as session:
            failed: dict[str, str] = {}
            for url in self.server_urls:  # one server failing does not stop the others
                try:
                    await self._load(session, url, version, path)
                except PushError as exc:
                    failed[url] = str(exc)
                    log.warning("push_failed_on_server", server=url, version=version, error=str(exc))
            if len(failed) == len(self.server_urls):
                raise PushError(f"no inference server loaded {name}: {'; '.join(failed.values())}")
            await self.store.set_policy(Policy(version=version, adapter=name, base_model=self.base_model))
            old = version - 2
            if old >= 1:
                for url in self.server_urls:
                    try:
                        await _post(
                            session,
                            f"{url}/v1/unload_lora_adapter",
                            {"lora_name": adapter_name(old)},
                            missing_ok=True,
                        )
                    except PushError as exc:  # a server that is down: it loads afresh when back
                        log.warning("unload_failed_on_server", server=url, version=old, error=str(exc))
                shutil.rmtree(self.path(old), ignore_errors=True)
        return time.perf_counter() - t0


async def _post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any] | None, missing_ok: bool = False
) -> None:
    try:
        async with session.post(url, json=body) as response:
            text = await response.text()
            if response.status == 404 and missing_ok:
                return
            if response.status != 200:
                raise PushError(f"{url} answered {response.status}: {text[:500]}")
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise PushError(f"{url} unreachable: {exc}") from exc


class FullPusher:
    """`--push full`: vLLM's weight-transfer phases with the CPU transport of `rlgate serve` (a safetensors
    file of the merged weights at a path every server can read):

    1. the policy pointer is marked `draining`; after `push_drain_s` every gateway holds new calls (or
       answers 429) and calls already admitted keep their old version tag;
    2. `POST /pause?mode=wait` on every server: admitted requests finish on the old weights;
    3. once per server `POST /init_weight_transfer_engine {"init_info": {}}`, then `/start_weight_update`,
       `/update_weights {"update_info": {"path": ...}}`, `/finish_weight_update {"weight_version": "N"}`;
    4. `POST /resume`, then the pointer moves to (N, no adapter, draining off): the held calls go on,
       tagged N. If the update fails, the servers resume, the pointer stays at N - 1 without draining,
       and the error propagates (the step's episodes are not acknowledged).

    With `transport="nccl"` (vLLM on GPUs), step 3 is vLLM's own trainer-side client instead
    (`learner._vllm_nccl`, NOT RUN: no GPU was available): the tensors are broadcast over NCCL during
    `/update_weights` and the version is set with `/update_weight_version`.
    """

    def __init__(
        self,
        server_urls: list[str],
        weights_dir: Path,
        store: EpisodeStore,
        base_model: str,
        drain_s: float,
        timeout_s: float = 300.0,
        transport: str = "safetensors",
        nccl_address: str = "127.0.0.1",
        nccl_port: int = 29600,
        api_key: str | None = None,
    ) -> None:
        self.headers = _auth(api_key)
        self.transport = transport
        self.nccl_address = nccl_address
        self.nccl_port = nccl_port
        self._senders: dict[str, Any] = {}
        self.server_urls = [u.rstrip("/") for u in server_urls]
        self.weights_dir = weights_dir
        self.store = store
        self.base_model = base_model
        self.drain_s = drain_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.initialized: set[str] = set()

    def path(self, version: int) -> Path:
        return (self.weights_dir / f"policy-v{version}.safetensors").resolve()

    async def push(self, version: int, policy: Any) -> float:
        t0 = time.perf_counter()
        path = self.path(version)
        if self.transport == "safetensors":
            await asyncio.to_thread(policy.save_weights, path)
        previous = Policy(version=version - 1, base_model=self.base_model)
        await self.store.set_policy(previous.model_copy(update={"draining": True}))
        pushed = False
        try:
            await asyncio.sleep(self.drain_s)
            async with aiohttp.ClientSession(timeout=self.timeout, headers=self.headers) as session:
                for i, url in enumerate(self.server_urls):
                    if url in self.initialized:
                        continue
                    if self.transport == "nccl":
                        from learner._vllm_nccl import VllmNcclSender

                        self._senders[url] = await asyncio.to_thread(
                            VllmNcclSender, url, self.nccl_address, self.nccl_port + i
                        )
                    else:
                        await _post(session, f"{url}/init_weight_transfer_engine", {"init_info": {}})
                    self.initialized.add(url)
                paused = []
                try:
                    for url in self.server_urls:
                        await _post(session, f"{url}/pause?mode=wait", None)
                        paused.append(url)
                    weights = policy.weights() if self.transport == "nccl" else None  # once for all servers
                    for url in self.server_urls:
                        if weights is not None:
                            await asyncio.to_thread(self._senders[url].send, weights, str(version))
                            continue
                        await _post(session, f"{url}/start_weight_update", None)
                        await _post(session, f"{url}/update_weights", {"update_info": {"path": str(path)}})
                        await _post(session, f"{url}/finish_weight_update", {"weight_version": str(version)})
                    pushed = True
                finally:
                    for url in paused:
                        await _post(session, f"{url}/resume", None)
        finally:
            if pushed and len(self.server_urls) > 1:  # every server has it (a failure fails the whole push)
                for url in self.server_urls:
                    await self.store.set_server_version(server_name(url), version)
            current = Policy(version=version, base_model=self.base_model) if pushed else previous
            await self.store.set_policy(current)
        old = self.path(version - 2)
        old.unlink(missing_ok=True)
        return time.perf_counter() - t0
