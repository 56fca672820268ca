"""Pushing a new policy to the inference servers, and moving the policy pointer the gateway reads.

`--push lora`, the same calls against `rlgate serve` and vLLM (`--enable-lora`,
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`):

1. the adapter of version N is a PEFT folder `adapters/policy-vN` (the servers must see the same path:
   one machine, or a shared volume in docker compose);
2. `POST {server}/v1/load_lora_adapter {"lora_name": "policy-vN", "lora_path": ..., "load_inplace": true}`
   on every server (in place, so that re-pushing the same version after a restart is harmless);
3. the policy pointer in Redis moves to (N, policy-vN, base model): from the gateway's next poll on, calls
   that ask for the base model go to policy-vN and are tagged N;
4. `policy-v(N-2)` is unloaded (404 ignored) and its folder deleted. The previous adapter stays loaded:
   calls a gateway admitted before it saw the new pointer still find it, finish on the old weights and
   keep the old tag.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import aiohttp
import structlog

from episodes import EpisodeStore, Policy

log = structlog.get_logger("rlgate.learner")


class PushError(RuntimeError):
    """An inference server refused or did not answer a weight push."""


def adapter_name(version: int) -> str:
    return f"policy-v{version}"


class LoraPusher:
    def __init__(self, server_urls: list[str], adapters_dir: Path, store: EpisodeStore, base_model: str,
                 timeout_s: float = 120.0) -> None:
        self.server_urls = [u.rstrip("/") for u in server_urls]
        self.adapters_dir = adapters_dir
        self.store = store
        self.base_model = base_model
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    def path(self, version: int) -> Path:
        return (self.adapters_dir / adapter_name(version)).resolve()

    async def push(self, version: int) -> float:
        """Load version `version`'s adapter everywhere, move the pointer, retire version - 2; seconds taken."""
        t0 = time.perf_counter()
        name, path = adapter_name(version), self.path(version)
        if not (path / "adapter_config.json").is_file():
            raise PushError(f"no adapter at {path}")
        async with aiohttp.ClientSession(timeout=self.timeout) as session:
            for url in self.server_urls:
                await self._post(session, f"{url}/v1/load_lora_adapter",
                                 {"lora_name": name, "lora_path": str(path), "load_inplace": True})
            await self.store.set_policy(Policy(version=version, adapter=name, base_model=self.base_model))
            old = version - 2
            if old >= 1:
                for url in self.server_urls:
                    await self._post(session, f"{url}/v1/unload_lora_adapter", {"lora_name": adapter_name(old)},
                                     missing_ok=True)
                shutil.rmtree(self.path(old), ignore_errors=True)
        return time.perf_counter() - t0

    async def _post(self, session: aiohttp.ClientSession, url: str, body: dict, missing_ok: bool = False) -> None:
        try:
            async with session.post(url, json=body) as response:
                text = await response.text()
                if response.status == 404 and missing_ok:
                    return
                if response.status != 200:
                    raise PushError(f"{url} answered {response.status}: {text[:500]}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise PushError(f"{url} unreachable: {exc}") from exc
