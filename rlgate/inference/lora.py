"""Runtime LoRA adapters for `rlgate serve`, with vLLM's contract (`--enable-lora` and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`):

    POST /v1/load_lora_adapter   {"lora_name", "lora_path", "load_inplace"}  -> 200 "Success: ..." (text)
    POST /v1/unload_lora_adapter {"lora_name"}                               -> 200 "Success: ..." (text)

and a request selects an adapter with `"model": "<lora_name>"`; `/v1/models` lists loaded adapters with
the base model as `parent`. Here an adapter is a PEFT folder (as the learner saves it) merged into its own
copy of the base model, with its own engine and scheduler: simple and exact for the small models this
server is for (memory grows by one model per adapter; vLLM instead applies adapters per request in a
shared batch).

The routes exist only when runtime LoRA updating is enabled, and `lora_path` must lie under the weights
root (`rlgate.inference.access`); a path outside it gets vLLM's answer for a missing adapter (404, "Loading lora
NAME failed: No adapter found for PATH").
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass

from torch import nn

from rlgate.inference.access import WeightsRoot
from rlgate.inference.engine import Engine, LogprobsMode
from rlgate.inference.protocol import BadRequest, ServeError
from rlgate.inference.scheduler import Scheduler


class AdapterNotFound(ServeError):
    status = 404
    type = "NotFoundError"


@dataclass
class Adapter:
    name: str
    path: str
    scheduler: Scheduler


class Adapters:
    def __init__(
        self,
        base: nn.Module,
        base_name: str,
        pad_token_id: int,
        eos_token_ids: tuple[int, ...],
        window_s: float,
        logprobs_mode: LogprobsMode = "raw_logprobs",
        *,
        root: WeightsRoot | None = None,
    ) -> None:
        self.base = base
        self.root = root  # None: no path is accepted
        # replaced or unloaded adapters' schedulers finishing the requests they took, by their drain task
        self._draining: dict[asyncio.Task[None], Scheduler] = {}
        self.logprobs_mode = logprobs_mode
        self.base_name = base_name
        self.pad_token_id = pad_token_id
        self.eos_token_ids = eos_token_ids
        self.window_s = window_s
        self.loaded: dict[str, Adapter] = {}

    async def load(self, name: str, path: str, inplace: bool = False) -> str:
        if not name or not path:
            raise BadRequest("Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
        if name == self.base_name:
            raise BadRequest(
                f"The lora adapter name '{name}' conflicts with a served base model.", param="lora_name"
            )
        if name in self.loaded and not inplace:
            raise BadRequest(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        # outside the root: the very answer of a missing adapter
        folder = self.root.resolve(path) if self.root else None
        if folder is None or not (folder / "adapter_config.json").is_file():
            raise AdapterNotFound(f"Loading lora {name} failed: No adapter found for {path}")
        merged = await asyncio.to_thread(self._merge, str(folder))
        scheduler = Scheduler(
            Engine(merged, self.pad_token_id, self.eos_token_ids, self.logprobs_mode), window_s=self.window_s
        )
        scheduler.start()
        previous = self.loaded.get(name)
        self.loaded[name] = Adapter(name, path, scheduler)
        if previous is not None:  # in place: requests already queued on the old weights finish on them
            self._drain(previous)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, name: str) -> str:
        if not name:
            raise BadRequest("'lora_name' needs to be provided to unload a LoRA adapter.", param="lora_name")
        adapter = self.loaded.pop(name, None)
        if adapter is None:
            raise AdapterNotFound(f"The lora adapter '{name}' cannot be found.", param="lora_name")
        self._drain(adapter)  # requests it already took finish on it
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _merge(self, path: str) -> nn.Module:
        from peft import PeftModel

        try:
            model = PeftModel.from_pretrained(copy.deepcopy(self.base), path)
        except (OSError, ValueError, KeyError) as exc:
            raise BadRequest(f"could not load the LoRA adapter at {path}: {exc}", param="lora_path") from exc
        return model.merge_and_unload().eval()

    def _drain(self, adapter: Adapter) -> None:
        """Let the adapter's scheduler finish its queued and running requests in the background."""
        task = asyncio.create_task(adapter.scheduler.drain())
        self._draining[task] = adapter.scheduler
        task.add_done_callback(lambda done: self._draining.pop(done, None))

    async def aclose(self) -> None:
        for task, scheduler in list(self._draining.items()):
            task.cancel()
            await scheduler.aclose()
        for adapter in self.loaded.values():
            await adapter.scheduler.aclose()
        self.loaded.clear()
