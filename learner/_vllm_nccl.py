"""The NCCL transport of `--push full` to vLLM on GPUs, through vLLM's own trainer-side weight-transfer
client (vLLM 0.33: `vllm.distributed.weight_transfer`). NOT RUN: written against vLLM 0.33.0's source, no
GPU was available to run it; `rlgate serve` and the tests use the safetensors transport instead.

vLLM must run with `VLLM_SERVER_DEV_MODE=1` and `--weight-transfer-config '{"backend": "nccl"}'`. The
learner opens an NCCL group as rank 0 with every vLLM worker (world size 1 + vLLM's, read from
`GET /get_world_size`), at `push_nccl_address:push_nccl_port`, which the vLLM workers must reach.
`WeightTransferTrainerFactory.trainer_init` does the rendezvous and `POST /init_weight_transfer_engine`;
each `send_weights()` runs `/start_weight_update`, `/update_weights` (names, dtypes, shapes) while the
tensors are broadcast, and `/finish_weight_update` (vLLM's engine sends no version there; the pusher sets
it with `/update_weight_version`).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import torch


class VllmNcclSender:
    """One NCCL group with the workers of one vLLM server; `send(weights)` is one full update round."""

    def __init__(self, server_url: str, master_address: str, master_port: int) -> None:
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        self.server_url = server_url
        self._round: dict[str, torch.Tensor] = {}
        owner = self

        class _Source(WeightSource):  # type: ignore[misc]  # vLLM: not installed where mypy runs (Any)
            """The policy's current weights (base names, adapter merged), read fresh each round."""

            @property
            def metadata(self) -> list[ParamMeta]:
                return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in owner._round.items()]

            def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
                yield from owner._round.items()

        world = httpx.get(f"{server_url}/get_world_size", params={"include_dp": True}, timeout=60)
        world.raise_for_status()
        self.client = HTTPVLLMWeightSyncClient(server_url)
        init = NCCLTrainerInitInfo(
            master_address=master_address,
            master_port=master_port,
            world_size=1 + int(world.json()["world_size"]),
            rank=0,
        )
        self.engine = WeightTransferTrainerFactory.trainer_init(init, client=self.client, source=_Source())

    def send(self, weights: dict[str, torch.Tensor], version: str) -> None:
        """One round: every tensor of `weights` (on the GPU), then the served version set to `version`."""
        self._round = weights
        try:
            self.engine.send_weights()  # start_weight_update, update_weights + broadcast, finish_weight_update
        finally:
            self._round = {}
        httpx.post(
            f"{self.server_url}/update_weight_version", json={"new_version": version}, timeout=60
        ).raise_for_status()
