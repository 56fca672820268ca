"""Data-parallel ranks: one learner as K processes started by a launcher (torchrun or DeepSpeed's), on
DeepSpeed (`--engine deepspeed`), gloo on CPUs and NCCL on GPUs.

    torchrun --standalone --nproc-per-node 2 -m rlgate learner --engine deepspeed ...   # 2 ranks
    deepspeed --num_gpus 8 --no_local_rank --module rlgate learner --engine deepspeed ...  # DeepSpeed's

Who does what, per step (`learner.loop`):

- rank 0 (the leader) alone talks to Redis and the inference servers: it collects the step's groups,
  claims and reads the episodes, assigns credit, builds the samples, splits them into K shares balanced
  by tokens (`samples.shard`) and sends each rank its own (`send`: gloo `scatter_object_list`);
- every rank cuts its share into micro-batches, pads to the same number of micro-batches as the others
  (DeepSpeed reduces gradients at every backward: each rank must run as many), and trains: the loss of
  each micro-batch is normalised by the step's totals over all ranks (`totals`), times K, because
  DeepSpeed averages the ranks' gradients (OpenRLHF's `dp_size` argument); so the gradient is the
  1-rank gradient of the whole step;
- every rank saves its part of the checkpoint (DeepSpeed's ZeRO checkpoints are per rank, in the
  shared `output_dir`); rank 0 then writes `latest.pt`;
- every rank says whether its part succeeded (`agree`, an all-reduce of a flag); only then does rank 0
  push and acknowledge. A rank that died makes the others' next collective fail at once (gloo notices
  the closed connection) or after `dist_timeout_s` (a rank that hangs): they exit non-zero and nothing
  of the step is acknowledged; restarted with the same consumer name, rank 0 takes the episodes back.

While rank 0 waits for episodes or pushes weights it sends a "wait" order every `dist_timeout_s / 4` seconds, so that an
idle learner's other ranks do not time out. Control messages go over a gloo group of their own, on GPUs
too; the gradients over DeepSpeed's (NCCL on GPUs). The launcher's variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT) are its contract with the processes it starts, read here only.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import structlog
import torch
import torch.distributed as dist

from learner.samples import MicroBatch, Sample, collate
from learner.settings import LearnerSettings

log = structlog.get_logger("rlgate.learner")


class RanksMisconfigured(ValueError):
    """Settings several ranks cannot train with (one line for the command line)."""


class RankFailed(RuntimeError):
    """Another rank died or stopped answering: this step fails, nothing of it is acknowledged."""


@dataclass
class Order:
    """What rank 0 tells the other ranks: train a step (its share of the samples, the step and version it
    becomes), load a checkpoint, keep waiting, or stop."""

    kind: Literal["step", "resume", "wait", "stop"]
    step: int = 0
    version: int = 0
    samples: list[Sample] = field(default_factory=list)
    policy_dir: str = ""


def launched_ranks() -> tuple[int, int, int]:
    """(rank, world size, local rank) as the launcher set them; (0, 1, 0) without a launcher."""
    return (
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("WORLD_SIZE", "1")),
        int(os.environ.get("LOCAL_RANK", "0")),
    )


def _peer_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective failing because of another rank (gloo and NCCL raise RuntimeError)."""
    text = str(exc)
    return isinstance(exc, dist.DistError) or any(
        mark in text
        for mark in ("Connection closed by peer", "Connection reset", "gloo", "NCCL", "Timed out")
    )


class Ranks:
    """This process's place among the learner's ranks, and the collectives the loop needs.

    One rank (no launcher) needs no process group: every method is then a no-op or the identity."""

    def __init__(self, rank: int = 0, size: int = 1, local_rank: int = 0, timeout_s: float = 600.0) -> None:
        self.rank, self.size, self.local_rank, self.timeout_s = rank, size, local_rank, timeout_s
        self.control: Any = None  # the gloo group of control messages

    @classmethod
    def start(cls, settings: LearnerSettings) -> Ranks:
        """This process's ranks as the launcher started them, the process groups set up (several ranks).
        Raises `RanksMisconfigured` for settings several ranks cannot train with."""
        rank, size, local_rank = launched_ranks()
        ranks = cls(rank, size, local_rank, settings.dist_timeout_s)
        if size == 1:
            return ranks
        if settings.engine != "deepspeed":
            raise RanksMisconfigured(
                f"{size} ranks train through DeepSpeed, which reduces their gradients: add --engine deepspeed"
            )
        if settings.zero_stage == 3:
            raise RanksMisconfigured(
                "ZeRO-3 across ranks is not supported (rank 0 alone runs the log-prob check and saves what it "
                "pushes, which ZeRO-3 would need every rank for): use --zero-stage 1 or 2"
            )
        from learner._deepspeed import init_distributed

        device = settings.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        init_distributed(
            torch.device(device, local_rank) if device == "cuda" else torch.device(device), ranks.timeout_s
        )
        # control messages over gloo, whatever the gradients' backend
        ranks.control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=ranks.timeout_s))
        return ranks

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def keepalive_s(self) -> float | None:
        """How long rank 0 may wait for episodes before it sends a "wait" order (None: one rank)."""
        return self.timeout_s / 4 if self.size > 1 else None

    def _collective(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RankFailed:  # said already, by a collective inside `fn`
            raise
        except (RuntimeError, dist.DistError) as exc:
            if not _peer_failure(exc):
                raise
            raise RankFailed(f"rank {self.rank} of {self.size}: {what} failed: {str(exc)[:300]}") from exc

    def send(self, orders: Order | list[Order]) -> Order:
        """Rank 0: one order for every rank (the same one, or a list, one per rank); returns its own."""
        if isinstance(orders, Order):
            orders = [orders] * self.size
        if self.size == 1:
            return orders[0]
        out: list[Any] = [None]
        self._collective("sending an order", dist.scatter_object_list, out, orders, src=0, group=self.control)
        return cast(Order, out[0])

    def receive(self) -> Order:
        """The other ranks: the next order of rank 0."""
        out: list[Any] = [None]
        self._collective("waiting for rank 0", dist.scatter_object_list, out, None, src=0, group=self.control)
        return cast(Order, out[0])

    def agree(self, ok: bool = True) -> None:
        """Every rank says whether its part of the step succeeded; raises `RankFailed` unless all did."""
        if self.size == 1:
            return
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        self._collective(
            "agreeing on the step", dist.all_reduce, flag, op=dist.ReduceOp.MIN, group=self.control
        )
        if int(flag) != 1:
            raise RankFailed(f"rank {self.rank} of {self.size}: another rank failed its part of the step")

    def barrier(self) -> None:
        if self.size > 1:
            self._collective("a barrier", dist.barrier, group=self.control)

    def close(self) -> None:
        """Where rank 0 sends "stop" and where the others receive it: wait for every rank, then tear the
        process groups down. A process that exits with them up can abort on its way out ("terminate called
        without an active exception": gloo's threads still running while the interpreter's teardown runs).
        Never raises: a peer that died after "stop" only costs a warning, so the caller's own outcome (the
        run's end, a refused resume) stands."""
        if self.size == 1 or not dist.is_initialized():
            return
        try:
            self.barrier()
        except (
            RuntimeError
        ) as exc:  # a peer gone after "stop" (RankFailed, or gloo's own error): the exit stands
            log.warning("ranks_close_barrier_failed", rank=self.rank, error=str(exc))
        finally:
            try:
                dist.destroy_process_group()
            except (RuntimeError, ValueError) as exc:
                log.warning("ranks_teardown_failed", rank=self.rank, error=str(exc))

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over the ranks (float64)."""
        if self.size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        self._collective("summing over the ranks", dist.all_reduce, t, group=self.control)
        return t.tolist()

    def max(self, values: list[float]) -> list[float]:
        if self.size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        self._collective(
            "a maximum over the ranks", dist.all_reduce, t, op=dist.ReduceOp.MAX, group=self.control
        )
        return t.tolist()

    def pad(self, batches: list[MicroBatch], pad_token_id: int) -> list[MicroBatch]:
        """`batches` and as many empty micro-batches (two pad tokens, no action token: zero loss, zero
        gradient) as it takes for every rank to run the same number."""
        [most] = self.max([len(batches)])
        empty = Sample([pad_token_id, pad_token_id], [False], [0.0], [0.0], 1.0, ())
        return batches + [collate([empty], pad_token_id) for _ in range(int(most) - len(batches))]

    def guard(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)`, with a collective inside it failing because of another rank raised as
        `RankFailed` (DeepSpeed's gradient reductions, its checkpoint barriers)."""
        if self.size == 1:
            return fn(*args, **kwargs)
        return self._collective(what, fn, *args, **kwargs)


__all__ = ["Order", "RankFailed", "Ranks", "RanksMisconfigured", "launched_ranks"]
