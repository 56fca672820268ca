"""The demo's agents against an rlgate loop that runs elsewhere (docker compose: scripts/compose-up-cpu),
until the success rate rises; then `rlgate demo`'s summary.

    RLGATE_OPERATOR_TOKEN=... python -m rlgate.demo.external --gateway http://127.0.0.1:18100 \\
        --control http://127.0.0.1:18101 --redis-url redis://127.0.0.1:18179/0 \\
        --steps runs/compose-cpu/learner/steps.jsonl --json runs/compose-cpu/summary.json

Only the agents run here. The loop's learner must train as `rlgate demo`'s does (docker-compose.cpu.yml
sets it so: groups of `--rollouts-per-task` episodes, `--tasks-per-step` tasks a step); its per-step lines
(`steps.jsonl` in its output folder) are the progress and the summary, as in `rlgate.demo.run`. Redis is read
for the backlog only; its keys belong to the deployment and stay.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rlgate.demo.run import (
    MODEL_NAME,
    DemoConfig,
    read_steps,
    report,
    sigterm_as_interrupt,
    spawn,
    stop,
    summarize,
    watch,
)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateway", required=True, help="The gateway's agent port (base URL).")
    parser.add_argument(
        "--control",
        default=None,
        help="Its control port, where the agents' rollouts are "
        "created and rewarded (with RLGATE_OPERATOR_TOKEN); without it the gateway is open.",
    )
    parser.add_argument("--redis-url", required=True, help="The loop's Redis (read for the backlog).")
    parser.add_argument("--key-prefix", default="rlgate", help="The loop's key prefix (RLGATE_KEY_PREFIX).")
    parser.add_argument("--reward-queue", default="rlgate-rewards", help="Its reward queue.")
    parser.add_argument("--steps", type=Path, required=True, help="The learner's steps.jsonl.")
    parser.add_argument(
        "--workdir", type=Path, default=Path("runs/demo-external"), help="Logs, summary, curve."
    )
    parser.add_argument("--json", type=Path, default=None, help="Also write the JSON summary here.")
    parser.add_argument("--minutes", type=float, default=10.0, help="Stop after this long at the latest.")
    parser.add_argument("--target", type=float, default=0.9, help="Stop once the last 3 steps reach this.")
    parser.add_argument("--concurrency", type=int, default=16, help="Agent episodes in flight.")
    parser.add_argument("--tasks-per-step", type=int, default=16, help="The learner's tasks per step.")
    parser.add_argument("--rollouts-per-task", type=int, default=4, help="The learner's episodes per task.")
    parser.add_argument("--learning-rate", type=float, default=2e-3, help="The learner's (for the summary).")
    parser.add_argument("--max-backlog", type=int, default=128, help="The gateway's (for the summary).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the questions.")
    parser.add_argument(
        "--inference",
        default=None,
        help="The inference server's base URL: the summary names it (vLLM's /version) and checks it serves "
        f"{MODEL_NAME!r}.",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cfg = DemoConfig(
        workdir=args.workdir,
        minutes=args.minutes,
        target=args.target,
        quick=False,
        redis_url=args.redis_url,
        concurrency=args.concurrency,
        tasks_per_step=args.tasks_per_step,
        rollouts_per_task=args.rollouts_per_task,
        learning_rate=args.learning_rate,
        seed=args.seed,
        json_path=args.json,
        max_backlog=args.max_backlog,
    )
    (cfg.workdir / "logs").mkdir(parents=True, exist_ok=True)
    if args.inference:
        from rlgate.demo import engines

        try:
            cfg.engines.append(engines.running(args.inference, MODEL_NAME))
        except engines.vllm_server.VllmUnavailable as exc:
            print(f"rlgate.demo.external: {exc}", file=sys.stderr)
            return 1
        print(engines.describe(cfg.engines[0]), flush=True)
    where = {
        "redis": args.redis_url,
        "prefix": args.key_prefix,
        "queue": args.reward_queue,
        "steps": args.steps,
    }
    agent = [
        sys.executable,
        "-m",
        "rlgate.demo.agent",
        "--gateway",
        args.gateway,
        "--model",
        MODEL_NAME,
        "--concurrency",
        str(args.concurrency),
        "--rollouts-per-task",
        str(args.rollouts_per_task),
        "--seed",
        str(args.seed),
    ]
    started = time.monotonic()
    interrupted = False
    try:
        with sigterm_as_interrupt():  # SIGTERM stops the agents too, as Ctrl-C does
            spawn(cfg, "agent", agent + (["--control", args.control] if args.control else []))
            print(
                f"demo agents: gateway {args.gateway}"
                + (f", control {args.control}" if args.control else "")
                + f", learner steps {args.steps}, logs in {cfg.workdir / 'logs'}",
                flush=True,
            )
            watch(cfg, where, started)
    except KeyboardInterrupt:  # the agents stop, and the summary says what was learned so far
        interrupted = True
    finally:
        stop(cfg)
    summary = report(cfg, summarize(cfg, read_steps(args.steps), time.monotonic() - started, where))
    return 130 if interrupted else 0 if summary["curve"] else 1


if __name__ == "__main__":
    sys.exit(main())
