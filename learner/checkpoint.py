"""Learner checkpoints: the trainable weights, the optimizer, the step, the policy version, and the
stream entries the step trained on (acknowledged only after the checkpoint is on disk and the push
succeeded; a restarted learner re-pushes the checkpoint's version and acknowledges those entries, so
that no episode is trained twice).

`checkpoint/v{N}/` holds the policy's state (`Policy.save`: torch tensors, or DeepSpeed's checkpoint);
`checkpoint/latest.pt` names it and holds the rest, and is replaced atomically (written next to it,
fsynced, renamed) only after the state is complete; older state folders are deleted after that.

With several ranks (`learner.ranks`) every rank writes its part of the state (DeepSpeed's per-rank ZeRO
files) into the same folder, so `output_dir` must be one every rank sees (one machine, or a shared
volume); rank 0 alone clears the folder first and writes `latest.pt` once every rank's part is written.
A resumed learner must run as many ranks as the one that saved (ZeRO partitions the optimizer by rank):
`latest.pt` records how many (`ranks`), and the learner refuses another number with one line.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlgate.episodes import ClosedEpisode


@dataclass
class Checkpoint:
    step: int
    version: int
    policy_dir: Path
    trained: list[ClosedEpisode]
    ranks: int | None = None  # the ranks that saved it (None: saved before this was recorded)


def _file(output_dir: Path) -> Path:
    return output_dir / "checkpoint" / "latest.pt"


def save(
    output_dir: Path,
    step: int,
    version: int,
    policy: Any,
    trained: list[ClosedEpisode],
    ranks: Any = None,
) -> Path:
    """Every rank calls this (`ranks`: `learner.ranks.Ranks`, None for one process)."""
    target = _file(output_dir)
    state_dir = target.parent / f"v{version}"
    leader = ranks is None or ranks.leader
    if leader:
        shutil.rmtree(state_dir, ignore_errors=True)  # a half-written one from a crash
    if ranks is not None:
        ranks.barrier()
    policy.save(state_dir)
    if ranks is not None:
        ranks.barrier()  # every rank's part is on disk
    if not leader:
        return target
    tmp = target.with_suffix(".tmp")
    payload = {
        "step": step,
        "version": version,
        "policy_dir": state_dir.name,
        "trained": [(e.entry_id, e.rollout_id, e.task_id, e.reward) for e in trained],
        "ranks": ranks.size if ranks is not None else 1,
    }
    with tmp.open("wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    for old in target.parent.glob("v*"):
        if old.is_dir() and old != state_dir:
            shutil.rmtree(old, ignore_errors=True)
    return target


def load(output_dir: Path) -> Checkpoint | None:
    target = _file(output_dir)
    if not target.is_file():
        return None
    payload = torch.load(target, weights_only=True)
    trained = [
        ClosedEpisode(entry_id, rollout_id, task_id, reward)
        for entry_id, rollout_id, task_id, reward in payload["trained"]
    ]
    return Checkpoint(
        payload["step"],
        payload["version"],
        target.parent / payload["policy_dir"],
        trained,
        payload.get("ranks"),
    )
