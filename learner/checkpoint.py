"""Learner checkpoints: the trainable weights, the optimizer, the step, the policy version, and the
stream entries the step trained on (acknowledged only after the checkpoint is on disk and the push
succeeded; a restarted learner re-pushes the checkpoint's version and acknowledges those entries, so
that no episode is trained twice).

One file, `checkpoint/latest.pt`, replaced atomically (written next to it, fsynced, renamed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from episodes import ClosedEpisode


@dataclass
class Checkpoint:
    step: int
    version: int
    policy_state: dict[str, Any]
    trained: list[ClosedEpisode]


def _file(output_dir: Path) -> Path:
    return output_dir / "checkpoint" / "latest.pt"


def save(output_dir: Path, checkpoint: Checkpoint) -> Path:
    target = _file(output_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    payload = {
        "step": checkpoint.step,
        "version": checkpoint.version,
        "policy": checkpoint.policy_state,
        "trained": [(e.entry_id, e.rollout_id, e.task_id, e.reward) for e in checkpoint.trained],
    }
    with tmp.open("wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    return target


def load(output_dir: Path) -> Checkpoint | None:
    target = _file(output_dir)
    if not target.is_file():
        return None
    payload = torch.load(target, weights_only=True)
    trained = [ClosedEpisode(entry_id, rollout_id, task_id, reward)
               for entry_id, rollout_id, task_id, reward in payload["trained"]]
    return Checkpoint(payload["step"], payload["version"], payload["policy"], trained)
