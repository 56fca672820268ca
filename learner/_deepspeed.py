"""The learner's policy on DeepSpeed, through OpenRLHF's `DeepspeedStrategy` (`--engine deepspeed`).

OpenRLHF's `setup_distributed()` assumes CUDA (it calls `torch.cuda.set_device`), so the process group is
set up here: `deepspeed.init_distributed` with gloo on a CPU (nccl on a GPU), from the launcher's
RANK/WORLD_SIZE/MASTER_* variables, or, when the learner was started without a launcher, as a group of
one on a free local port. Then `strategy.prepare((actor, cfg))` builds the DeepSpeed engine exactly as
OpenRLHF's trainers do: its ZeRO config (`get_train_ds_config`: stage, gradient clipping, bf16 on a GPU,
fp32 on a CPU), AdamW with bias/norm weights exempt from weight decay, a constant learning rate; and
`strategy.backward` / `strategy.optimizer_step` / `strategy.get_grad_norm` drive each update. The train
batch is one micro-batch per optimizer call (OpenRLHF's dynamic-batch mode): gradients of a step's
micro-batches accumulate, the last one's backward marked as the accumulation boundary (`backward`), and
one `optimizer_step` applies them.

Several ranks (a launcher's RANK/WORLD_SIZE, `learner.ranks`): DeepSpeed averages the ranks' gradients at
every backward (ZeRO 0-2 as configured), and the loss is scaled so that the average is the whole step's
gradient (`policy.Policy.update`). First use compiles DeepSpeed's CPU ops (about a minute each on 2 cores;
cached in ~/.cache/torch_extensions).
"""

from __future__ import annotations

import datetime
import os
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import torch
import torch.distributed as dist

from learner._openrlhf import Actor


def init_distributed(device: torch.device, timeout_s: float = 600.0) -> None:
    """The default process group: from the launcher's variables, or a group of one on a free local port;
    gloo on a CPU, nccl on a GPU (`device` is this rank's, set as the current CUDA device first). A
    collective waits at most `timeout_s` for the other ranks."""
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
    deepspeed.init_distributed(
        dist_backend="nccl" if device.type == "cuda" else "gloo",
        timeout=datetime.timedelta(seconds=timeout_s),
        verbose=False,
    )


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

        init_distributed(device)
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

    def backward(self, loss: torch.Tensor, last: bool = True) -> None:
        """Accumulate the gradient of `loss`; `last`: the step's last micro-batch, where DeepSpeed reduces
        the accumulated gradients (over the ranks) for the optimizer. Without this the engine's
        one-micro-batch config (gradient_accumulation_steps 1) makes every backward a boundary, and ZeRO
        1/2 keep only the last micro-batch's gradient (`stage_1_and_2.copy_grads_in_partition` assigns
        `averaged_gradients` at each boundary): measured here, DeepSpeed 0.19.6."""
        self.engine.set_gradient_accumulation_boundary(last)
        self.strategy.backward(loss, self.actor, self.optimizer)

    def step(self) -> float:
        """Clip (DeepSpeed's `gradient_clipping`), step, zero the gradients; the norm before clipping."""
        self.strategy.optimizer_step(self.optimizer, self.actor, self.scheduler)
        return cast(float, self.strategy.get_grad_norm(self.actor))

    def save(self, directory: Path) -> None:
        self.engine.save_checkpoint(str(directory), tag="policy")

    def load(self, directory: Path) -> None:
        path, _ = self.engine.load_checkpoint(str(directory), tag="policy")
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {directory}")
