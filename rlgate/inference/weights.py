"""Full-weight updates and pause/resume for `rlgate serve`, with vLLM 0.33's RL routes and semantics
(`vllm/entrypoints/rl/online/api_router.py`; vLLM registers them only with VLLM_SERVER_DEV_MODE=1, and so
does `rlgate serve`: `rlgate.inference.access`):

    POST /pause?mode=abort|wait|keep     {"status": "paused"}
    POST /resume                         {"status": "resumed"}
    GET  /is_paused                      {"is_paused": bool}
    POST /init_weight_transfer_engine    {"init_info": {...}}        {"message": "Weight transfer initialized"}
    POST /start_weight_update                                        {"message": "Weight update started"}
    POST /update_weights                 {"update_info": {...}}      {"message": "Weights updated"}
    POST /finish_weight_update           {"weight_version": "7"}?    {"message": "Weight update finished"}
    POST /update_weight_version          {"new_version": "7"}        {"success": true, "new_version": "7"}
    GET  /weight_info                    {"weight_version": "default" | the last version set}

The transport here is on the CPU: the `safetensors` backend (vLLM's backends are nccl, ipc, ...). Its
init_info is `{}`; its update_info is `{"path": FILE}`: a safetensors file of parameters by name (all or
some of the model's, same shapes), which the server loads and copies into its model between two batches,
so no batch ever runs on half-updated weights. The file must lie under the weights root
(`rlgate.inference.access`); a path outside it gets the same 400 as a missing file.

Pausing: `abort` and `wait` make new requests fail at once with 503 `ServiceUnavailableError` ("Generation
is paused. Please retry after it resumes.", vLLM's message; we add `Retry-After: 1`); `abort` answers
requests that are queued but not yet in a batch with `finish_reason: "abort"` and no tokens (the batch
already running finishes: batches last milliseconds here), `wait` lets every admitted request finish
before `/pause` returns; `keep` queues new requests until `/resume`. As in vLLM, an update does not pause
by itself: the caller pauses first when it needs in-flight requests to finish on the old weights, and the
version only changes at `finish_weight_update` (or `update_weight_version`).

Differences from vLLM: calls out of order (`update_weights` before `start_weight_update`, a second start,
a finish without start) are 409 Conflict here, where vLLM's worker raises and the server answers 500; a
LoRA adapter loaded before a full update keeps the base weights it was merged into (reload it).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any, Literal

import structlog
import torch
from torch import nn

from rlgate.inference.access import WeightsRoot
from rlgate.inference.protocol import BadRequest, ServeError
from rlgate.inference.scheduler import Scheduler

log = structlog.get_logger("rlgate.serve")

PauseMode = Literal["abort", "wait", "keep"]


class EnginePaused(ServeError):
    status = 503
    type = "ServiceUnavailableError"
    headers = {"Retry-After": "1"}


class WeightUpdateConflict(ServeError):
    status = 409
    type = "ConflictError"


class WeightSync:
    """The pause gate in front of generation and the weight-update state machine of one model."""

    def __init__(
        self,
        model: nn.Module,
        scheduler: Scheduler,
        queues: Callable[[], Iterable[Scheduler]] | None = None,
        *,
        root: WeightsRoot | None = None,
    ) -> None:
        self.model = model
        self.root = root  # update_info's path must lie under it (None: no path is accepted)
        self.scheduler = scheduler  # the base model's: a weight copy waits for its running batch
        # every scheduler whose queued requests `pause?mode=abort` ends (the base model's and each
        # LoRA adapter's, all of which `admit` gates)
        self.queues = queues or (lambda: (scheduler,))
        self.version = "default"
        self.mode: PauseMode = "abort"
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.initialized = False
        self.active = False

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    # -----------------------------------------------------------------------------------------------------
    # Pause gate

    @asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """Around one generation: refused while paused (abort, wait), held until resume (keep)."""
        while self.paused:
            if self.mode != "keep":
                raise EnginePaused("Generation is paused. Please retry after it resumes.")
            await self._resumed.wait()
        self._inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    async def pause(self, mode: PauseMode) -> None:
        if mode not in ("abort", "wait", "keep"):
            raise BadRequest(f"mode must be abort, wait or keep, not {mode!r}", param="mode")
        self.mode = mode
        self._resumed.clear()
        if mode == "abort":
            for queue in self.queues():
                queue.abort_pending()
        if mode in ("abort", "wait"):
            await self._idle.wait()  # abort: only the running batch is left; wait: everything admitted

    def resume(self) -> None:
        self._resumed.set()

    # -----------------------------------------------------------------------------------------------------
    # Weight transfer

    def init(self, init_info: dict[str, Any]) -> None:
        if init_info:
            raise BadRequest(
                f"Invalid init_info for safetensors: unexpected {sorted(init_info)}", param="init_info"
            )
        self.initialized = True

    def start(self) -> None:
        if not self.initialized:
            raise WeightUpdateConflict(
                "Weight transfer not configured: call /init_weight_transfer_engine first."
            )
        if self.active:
            raise WeightUpdateConflict(
                "start_weight_update called while a weight update is already active. "
                "Call finish_weight_update first."
            )
        self.active = True

    async def update(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> int:
        """Load the tensors named in `update_info` and copy them in between batches; returns how many."""
        if not self.active:
            raise WeightUpdateConflict("start_weight_update must be called before update_weights.")
        if isinstance(update_info, list):  # one entry per worker rank in vLLM; this server is one worker
            if len(update_info) != 1:
                raise BadRequest(
                    "this server has one worker: update_info must be one object", param="update_info"
                )
            update_info = update_info[0]
        try:
            tensors = await asyncio.to_thread(self._load, update_info)
            params = dict(self.model.named_parameters())
            for name, tensor in tensors.items():
                if name not in params:
                    raise BadRequest(f"the model has no parameter {name!r}", param="update_info")
                if tuple(tensor.shape) != tuple(params[name].shape):
                    raise BadRequest(
                        f"{name}: shape {tuple(tensor.shape)} != the model's {tuple(params[name].shape)}",
                        param="update_info",
                    )
            async with self.scheduler.lock:  # between two batches
                with torch.no_grad():
                    for name, tensor in tensors.items():
                        params[name].copy_(tensor.to(params[name].dtype))
        except Exception:
            self.active = False  # as vLLM: a failed update clears the active flag
            raise
        log.info("weights_updated", tensors=len(tensors))
        return len(tensors)

    def _load(self, update_info: dict[str, Any]) -> dict[str, torch.Tensor]:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = update_info.get("path") if isinstance(update_info, dict) else None
        extra = set(update_info) - {"path"} if isinstance(update_info, dict) else set()
        if not isinstance(path, str) or extra:
            raise BadRequest('update_info for safetensors is {"path": FILE}', param="update_info")
        file = self.root.resolve(path) if self.root else None  # outside the root: the same as missing
        if file is None or not file.is_file():
            raise BadRequest(f"no safetensors file at {path}", param="update_info")
        try:
            return load_file(file)
        except (SafetensorError, OSError) as exc:
            raise BadRequest(f"could not read {path}: {exc}", param="update_info") from exc

    def finish(self, weight_version: str | None) -> None:
        if not self.active:
            raise WeightUpdateConflict("finish_weight_update called without a matching start_weight_update.")
        self.active = False
        if weight_version is not None:
            self.version = str(weight_version)
