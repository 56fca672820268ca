"""The learner's policy on DeepSpeed, through OpenRLHF's `DeepspeedStrategy` (`--engine deepspeed`).

OpenRLHF's `setup_distributed()` assumes CUDA (it calls `torch.cuda.set_device`), so the process group is
set up here: `deepspeed.init_distributed` with gloo on a CPU (nccl on a GPU), from the launcher's
RANK/WORLD_SIZE/MASTER_* variables, or, when the learner was started without a launcher, as a group of
one on a free local port. Then `strategy.prepare((actor, cfg))` builds the DeepSpeed engine exactly as
OpenRLHF's trainers do: its ZeRO config (`get_train_ds_config`: stage, gradient clipping, bf16 on a GPU,
fp32 on a CPU), AdamW with bias/norm weights exempt from weight decay, a constant learning rate; and
`strategy.backward` / `strategy.optimizer_step` / `strategy.get_grad_norm` drive each update. The train
batch is one micro-batch per optimizer call (OpenRLHF's dynamic-batch mode): gradients of a step's
micro-batches accumulate and one `optimizer_step` applies them.

One process: the learner reads episodes and trains in rank 0 only; data parallelism across ranks (rank 0
scattering each step's samples) is not built, so `deepspeed --num_gpus N` is not a way to run it yet.
First use compiles DeepSpeed's CPU ops (about a minute each on 2 cores; cached in ~/.cache/torch_extensions).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from learner._openrlhf import Actor


def _init_distributed(device: torch.device) -> None:
    import deepspeed

    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:  # no launcher: a group of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
        )
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    if dist.get_world_size() != 1:
        raise RuntimeError("the learner trains in one process: data parallelism across ranks is not built")


class DeepSpeedEngine:
    """Wraps `actor` in a DeepSpeed engine through OpenRLHF's strategy; the policy's optimizer interface."""

    def __init__(
        self,
        actor: Actor,
        device: torch.device,
        *,
        zero_stage: int,
        learning_rate: float,
        weight_decay: float,
        max_grad_norm: float,
        seed: int,
    ) -> None:
        from openrlhf.utils.deepspeed import DeepspeedStrategy

        _init_distributed(device)
        args = SimpleNamespace(
            ds=SimpleNamespace(
                param_dtype="bf16" if device.type == "cuda" else "fp32",
                zero_stage=zero_stage,
                tensor_parallel_size=1,
                ring_attn_size=1,
            ),
            train=SimpleNamespace(dynamic_batch_enable=True),
            local_rank=-1,
        )
        self.strategy = DeepspeedStrategy(
            seed=seed,
            max_norm=max_grad_norm,
            micro_train_batch_size=1,
            train_batch_size=1,
            zero_stage=zero_stage,
            args=args,
        )
        cfg = {
            "optim": "adam",
            "adam": {"lr": learning_rate, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": weight_decay},
            "lr_scheduler": "constant",
            "lr_warmup_ratio": 0.0,
            "scheduler_steps": 1,
            "max_norm": max_grad_norm,
        }
        self.actor, self.optimizer, self.scheduler = self.strategy.prepare((actor, cfg))

    @property
    def engine(self) -> Any:
        return self.actor.model

    def backward(self, loss: torch.Tensor) -> None:
        self.strategy.backward(loss, self.actor, self.optimizer)

    def step(self) -> float:
        """Clip (DeepSpeed's `gradient_clipping`), step, zero the gradients; the norm before clipping."""
        self.strategy.optimizer_step(self.optimizer, self.actor, self.scheduler)
        return self.strategy.get_grad_norm(self.actor)

    def save(self, directory: Path) -> None:
        self.engine.save_checkpoint(str(directory), tag="policy")

    def load(self, directory: Path) -> None:
        path, _ = self.engine.load_checkpoint(str(directory), tag="policy")
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {directory}")
