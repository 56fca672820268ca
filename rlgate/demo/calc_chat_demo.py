"""`rlgate demo --task calc-chat`: what differs from the one-token demo (`rlgate.demo.run` drives both).

Before the loop starts, the policy is warm-started the way real pipelines do it, through the product:

1. the base model (`rlgate.demo.base_model`, built once per machine and cached);
2. the teacher (`rlgate.demo.teacher`, scripted and imperfect on purpose) answers `WARM_EPISODES` Calc-X
   conversations of the unchanged agent (`rlgate.demo.chat_agent`) through an rlgate gateway, which records them
   under a key prefix of their own; the `math_answer` reward job closes each;
3. `rlgate export --format sft` writes them as chat rows;
4. `rlgate.demo.warm_start` fine-tunes the base on those rows: the warm policy.

Then `rlgate.demo.run` serves the warm policy and runs the same agent against the gateway with the learner
training on what it records. The learner's samples are trajectories (`sample_shape=trajectory`): the chat
template renders the model's tool call back exactly as it wrote it, so the second call's prompt extends the
first call's prompt and completion and an episode of two turns trains as one sequence (a call whose
prompt does not extend the previous one, e.g. after a malformed call the agent did not send back, starts
its own sample).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

if TYPE_CHECKING:
    from rlgate.demo.run import DemoConfig

WARM_EPISODES = 400
WARM_STEPS = 400
TEACHER_TOOL_RATE = 0.7
TEACHER_BROKEN_RATE = 0.6


def warm_policy(cfg: DemoConfig, redis_url: str) -> tuple[Path, dict[str, Any]]:
    """Build the warm-started policy in `cfg.workdir / "warm"`; returns its path and what happened."""
    from transformers.utils import logging as transformers_logging

    from rlgate.demo.base_model import cached_base_model

    transformers_logging.disable_progress_bar()  # the demo prints its own progress lines

    started = time.monotonic()
    base = cached_base_model(seed=cfg.seed, log=lambda line: print(line, flush=True))
    base_s = time.monotonic() - started
    prefix = f"demo-warm-{int(time.time())}-{os.getpid()}"
    sft = cfg.workdir / "warm_sft.jsonl"
    episodes, rows, removed = _teacher_traces(cfg, redis_url, prefix, sft)
    warm = cfg.workdir / "warm"
    result = _fine_tune(cfg, base, sft, warm)
    return warm, {
        "base_model": str(base),
        "base_model_seconds": round(base_s, 1),
        "teacher_episodes": len(episodes),
        "teacher_success_rate": sum(e["right"] for e in episodes) / max(len(episodes), 1),
        "teacher_tool_use": sum(e["used_tool"] for e in episodes) / max(len(episodes), 1),
        "sft_rows": rows,
        "key_prefix": prefix,
        "keys_removed": removed,
        **{f"sft_{k}": v for k, v in result.items()},
        "seconds": round(time.monotonic() - started, 1),
    }


def _rlgate(*args: str) -> list[str]:
    """The `rlgate` command line, run by this interpreter."""
    return [sys.executable, "-m", "rlgate", *args]


def _teacher_traces(
    cfg: DemoConfig, redis_url: str, prefix: str, sft: Path
) -> tuple[list[dict[str, Any]], int, int]:
    """Steps 2 and 3: the teacher's conversations recorded under `prefix`, rewarded, exported to `sft`.
    Returns the agent's episode stats, the exported row count, and how many keys the cleanup removed."""
    from rlgate.demo.run import cleanup, stop_named

    env = {
        "RLGATE_REDIS_URL": redis_url,
        "RLGATE_KEY_PREFIX": prefix,
        "RLGATE_LOG_FORMAT": "json",
        "RLGATE_REWARD_QUEUE": f"{prefix}-rewards",
    }
    removed = 0
    try:
        gateway_url = _start_teacher_gateway(cfg, env)
        episodes = _run_teacher_agent(cfg, gateway_url)
        wait_closed(redis_url, prefix, len(episodes))
        exported = export_sft(redis_url, prefix, sft)
    finally:  # also when something above failed: the warm-start processes stop, their keys go
        stop_named(cfg, ("warm-agent", "warm-worker", "warm-gateway", "teacher"))
        with contextlib.suppress(redis.RedisError):  # never in place of the error that got here
            removed = cleanup({"redis": redis_url, "prefix": prefix, "queue": f"{prefix}-rewards"})
    rows = json.loads(exported)["rows"]
    print(f"warm start: exported {rows} chat rows to {sft}", flush=True)
    return episodes, rows, removed


def _start_teacher_gateway(cfg: DemoConfig, env: dict[str, str]) -> str:
    """Start the teacher, a gateway in front of it (recording with `env`) and a reward worker; returns the
    gateway's URL once both answer."""
    from rlgate.demo.run import free_port, spawn, wait_http

    teacher_port = free_port()
    teacher = spawn(
        cfg,
        "teacher",
        [
            sys.executable,
            "-m",
            "rlgate.demo.teacher",
            "--port",
            str(teacher_port),
            "--seed",
            str(cfg.seed),
            "--tool-rate",
            str(TEACHER_TOOL_RATE),
            "--broken-rate",
            str(TEACHER_BROKEN_RATE),
        ],
    )
    wait_http(f"http://127.0.0.1:{teacher_port}/health", teacher, "the teacher")
    gateway_port = free_port()
    gateway = spawn(
        cfg,
        "warm-gateway",
        _rlgate("gateway"),
        {
            **env,
            "RLGATE_UPSTREAM_URL": f"http://127.0.0.1:{teacher_port}/v1",
            "RLGATE_PORT": str(gateway_port),
        },
    )
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    wait_http(f"{gateway_url}/healthz", gateway, "the warm-start gateway")
    spawn(cfg, "warm-worker", _rlgate("worker", "--fork", "false", "--log-level", "warning"), env)
    return gateway_url


def _run_teacher_agent(cfg: DemoConfig, gateway_url: str) -> list[dict[str, Any]]:
    """Run the chat agent for `WARM_EPISODES` conversations with the teacher through the gateway; returns
    the per-episode stats it wrote (at least half of them must have finished)."""
    from rlgate.demo.run import spawn

    stats = cfg.workdir / "warm_agent.jsonl"
    stats.unlink(missing_ok=True)
    print(f"warm start: {WARM_EPISODES} teacher episodes through the gateway {gateway_url}", flush=True)
    agent = spawn(
        cfg,
        "warm-agent",
        [
            sys.executable,
            "-m",
            "rlgate.demo.chat_agent",
            "--gateway",
            gateway_url,
            "--model",
            "teacher",
            "--episodes",
            str(WARM_EPISODES),
            "--concurrency",
            "16",
            "--prefix",
            "warm",
            "--seed",
            str(cfg.seed + 1000),
            "--stats",
            str(stats),
        ],
    )
    if agent.wait(timeout=600) != 0:
        raise RuntimeError(f"the warm-start agent failed; see {cfg.workdir / 'logs' / 'warm-agent.log'}")
    episodes = [json.loads(line) for line in stats.read_text().splitlines() if line.strip()]
    if len(episodes) < WARM_EPISODES // 2:
        raise RuntimeError(
            f"only {len(episodes)} of {WARM_EPISODES} teacher episodes finished; see "
            f"{cfg.workdir / 'logs'} (warm-agent.log, warm-gateway.log, teacher.log)"
        )
    return episodes


def export_sft(redis_url: str, prefix: str, sft: Path) -> str:
    """`rlgate export --format sft` of the rollouts under `prefix` into `sft`; returns its JSON summary."""
    exported = subprocess.run(
        _rlgate("export", str(sft), "--format", "sft", "--redis-url", redis_url, "--key-prefix", prefix),
        capture_output=True,
        text=True,
        check=False,
    )
    if exported.returncode != 0:
        raise RuntimeError(f"rlgate export failed: {exported.stderr.strip()[-500:]}")
    return exported.stdout


def _fine_tune(cfg: DemoConfig, base: Path, sft: Path, warm: Path) -> dict[str, Any]:
    """Step 4: fine-tune `base` on the chat rows in `sft` into `warm`; returns what `warm_start` reports."""
    from rlgate.demo.warm_start import warm_start

    return warm_start(
        base,
        sft,
        warm,
        steps=WARM_STEPS,
        batch_size=16,
        learning_rate=3e-3,
        seed=cfg.seed,
        log=lambda line: print(line, flush=True),
    )


def wait_closed(redis_url: str, prefix: str, episodes: int, timeout_s: float = 120.0) -> None:
    """Until the reward jobs have closed `episodes` rollouts (each close appends to the episode stream)."""
    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if int(client.xlen(f"{prefix}:episodes")) >= episodes:
                return
            time.sleep(0.2)
    finally:
        client.close()
    raise RuntimeError("the warm-start episodes were not all rewarded in time")


def step_agent_stats(steps: list[dict[str, Any]], stats_path: Path) -> list[dict[str, float | None]]:
    """Per learner step, the agent's view of the episodes that ended since the step before: the share
    that used the tool and the share that wrote a well-formed call (None where none ended)."""
    if not stats_path.is_file():
        return [{"tool_use": None, "well_formed": None} for _ in steps]
    episodes = [json.loads(line) for line in stats_path.read_text().splitlines() if line.strip()]
    out = []
    previous = float("-inf")
    for step in steps:
        window = [e for e in episodes if previous < e["time"] <= step["time"]]
        previous = step["time"]
        n = len(window)
        out.append(
            {
                "tool_use": sum(e["used_tool"] for e in window) / n if n else None,
                "well_formed": sum(e["well_formed"] for e in window) / n if n else None,
            }
        )
    return out
