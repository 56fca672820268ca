"""Learner benchmark: one update's time and tokens/s against batch size, the LoRA and full pushes against
a real `rlgate serve` (everything a push does, from saving the weights to moving the policy pointer), and
the update on 1 and 2 data-parallel ranks (DeepSpeed ZeRO-1; gloo on a CPU, NCCL on GPUs), each rank a
process started with the launcher's variables, as torchrun would.

    .venv/bin/python scripts/bench_learner.py                        # tiny model, CPU
    .venv/bin/python scripts/bench_learner.py --device cuda --hidden 512 --layers 8 --ranks 1   # one GPU
    .venv/bin/python scripts/bench_learner.py --device cuda --hidden 512 --layers 8 --ranks 1,2,4,8

Samples have the demo's shape scaled up: a `--prompt`-token prompt and a `--completion`-token completion,
one call per sample, random tokens, advantages +-1. Each cell is the median of `--repeat` updates after
one warm-up. Prints Markdown tables. The ranks table counts one episode per sample (one call each): its
episodes/s is the update's throughput, the whole step's samples over its time, and per rank that over
the number of ranks; every rank runs `--threads` torch threads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from learner.policy import Policy  # noqa: E402
from learner.samples import Transition, build_samples, micro_batches  # noqa: E402
from learner.settings import LearnerSettings  # noqa: E402
from rlgate._net import free_port as _free_port  # noqa: E402
from rlgate.inference.tiny_model import build_tiny_model  # noqa: E402


def episodes(n: int, prompt: int, completion: int, rng: random.Random) -> list[list[Transition]]:
    return [
        [
            Transition(
                f"r{i}",
                0,
                tuple(rng.randrange(256) for _ in range(prompt)),
                tuple(rng.randrange(256) for _ in range(completion)),
                tuple([-2.0] * completion),
                rng.choice([1.0, -1.0]),
                0,
            )
        ]
        for i in range(n)
    ]


def timed_updates(policy: Policy, batches: list, repeat: int, ranks: Any = None) -> tuple[float, Any]:
    """A warm-up update, then the median of `repeat` timed ones (with `ranks`: each ends when the slowest
    rank's does), and the last one's stats."""
    policy.update(batches)  # warm-up
    times = []
    for _ in range(repeat):
        if ranks is not None:
            ranks.barrier()
        if policy.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        stats = policy.update(batches)
        if policy.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        times.append(ranks.max([elapsed])[0] if ranks is not None else elapsed)
    return statistics.median(times), stats


def bench_updates(settings: LearnerSettings, sizes: list[int], args: argparse.Namespace) -> list[dict]:
    policy = Policy(settings)
    rng = random.Random(0)
    rows = []
    for size in sizes:
        batches = micro_batches(
            build_samples(episodes(size, args.prompt, args.completion, rng)),
            settings.micro_batch_tokens,
            policy.pad_token_id,
        )
        step, stats = timed_updates(policy, batches, args.repeat)
        rows.append(
            {
                "samples": size,
                "micro_batches": len(batches),
                "step_s": step,
                "action_tokens_per_s": stats.tokens / step,
                "tokens_per_s": size * (args.prompt + args.completion) / step,
            }
        )
    return rows


def rank_worker(args: argparse.Namespace) -> None:
    """One rank of `bench_ranks` (started with RANK/WORLD_SIZE/MASTER_* set): its share of the step's samples,
    `--repeat` timed updates after a warm-up; rank 0 writes the median to `--json`."""
    from learner.ranks import Ranks
    from learner.samples import shard

    settings = LearnerSettings(
        model=args.model,
        tensorboard=False,
        device=args.device,
        engine="deepspeed",
        zero_stage=1,
        micro_batch_tokens=args.micro_batch_tokens,
        dist_timeout_s=300,
    )
    ranks = Ranks.start(settings)
    policy = Policy(settings, ranks)
    samples = build_samples(episodes(args.size, args.prompt, args.completion, random.Random(0)))
    mine = shard(samples, ranks.size)[ranks.rank]
    batches = micro_batches(mine, settings.micro_batch_tokens, policy.pad_token_id) if mine else []
    batches = ranks.pad(batches, policy.pad_token_id)
    step, stats = timed_updates(policy, batches, args.repeat, ranks)
    if ranks.leader:
        args.json.write_text(
            json.dumps({"step_s": step, "tokens": stats.tokens, "micro_batches": len(batches)})
        )


def bench_ranks(model: Path, counts: list[int], sizes: list[int], args: argparse.Namespace) -> list[dict]:
    rows = []
    for size in sizes:
        for count in counts:
            result = Path(tempfile.mkdtemp(prefix="bench_ranks_")) / "result.json"
            port = str(_free_port())
            procs = []
            for rank in range(count):
                env = {
                    **os.environ,
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(count),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port,
                    "OMP_NUM_THREADS": str(args.threads),
                }
                command = [
                    sys.executable,
                    __file__,
                    "--rank-worker",
                    "--model",
                    str(model),
                    "--size",
                    str(size),
                ]
                command += ["--json", str(result), "--device", args.device, "--threads", str(args.threads)]
                command += ["--prompt", str(args.prompt), "--completion", str(args.completion)]
                command += [
                    "--repeat",
                    str(args.repeat),
                    "--micro-batch-tokens",
                    str(args.micro_batch_tokens),
                ]
                procs.append(
                    subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                )
            errors = [p.communicate(timeout=900)[1] for p in procs]
            if any(p.returncode for p in procs):
                raise SystemExit(f"a rank failed:\n{errors[0].decode()[-3000:]}")
            r = json.loads(result.read_text())
            rows.append(
                {
                    "ranks": count,
                    "samples": size,
                    "micro_batches_per_rank": r["micro_batches"],
                    "step_s": r["step_s"],
                    "episodes_per_s": size / r["step_s"],
                    "episodes_per_s_per_rank": size / r["step_s"] / count,
                    "action_tokens_per_s": r["tokens"] / r["step_s"],
                }
            )
    return rows


async def bench_push(
    settings: LearnerSettings, model: Path, repeat: int, redis_url: str
) -> dict[str, list[float]]:
    from learner.push import FullPusher, LoraPusher
    from rlgate.episodes import EpisodeStore

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import start_rlgate_serve

    logs = Path(tempfile.mkdtemp(prefix="bench_learner_"))
    # the pushers save under `logs`: the server reads adapters and weight files from there only
    serve = start_rlgate_serve(model, logs, "tiny", lora=True, dev_mode=True, weights_root=logs)
    store = EpisodeStore.from_url(redis_url, prefix=f"bench-learner-{int(time.time())}")
    try:
        policy = Policy(settings)
        times: dict[str, list[float]] = {"lora": [], "full": []}
        pushers = {
            "lora": LoraPusher([serve.url], logs / "adapters", store, "tiny"),
            # no gateway polls this store: no drain wait
            "full": FullPusher([serve.url], logs / "weights", store, "tiny", drain_s=0.0),
        }
        for kind, pusher in pushers.items():
            for version in range(1, repeat + 2):
                seconds = await pusher.push(version, policy)
                if version > 1:  # the first push warms up
                    times[kind].append(seconds)
        await store.redis.delete(store.keys.policy)
        return times
    finally:
        await store.aclose()
        serve.process.terminate()
        serve.process.wait(timeout=20)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--completion", type=int, default=16)
    parser.add_argument("--sizes", default="8,32,128,512")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--ranks", default="1,2", help="data-parallel ranks to compare ('' for none)")
    parser.add_argument("--rank-sizes", default="128,512", help="samples per step in the ranks table")
    parser.add_argument("--micro-batch-tokens", type=int, default=2048, help="ranks table: per micro-batch")
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.rank_worker:
        rank_worker(args)
        raise SystemExit(0)
    model = build_tiny_model(
        Path(tempfile.mkdtemp(prefix="bench_model_")) / "m",
        seed=0,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=max(4, args.hidden // 64),
    )
    settings = LearnerSettings(model=model, tensorboard=False, device=args.device, micro_batch_tokens=8192)
    params = sum(p.numel() for p in Policy(settings).actor.parameters())
    rows = bench_updates(settings, [int(s) for s in args.sizes.split(",")], args)
    print(
        f"\nmodel: {params / 1e6:.2f}M parameters (hidden {args.hidden}, {args.layers} layers), LoRA r=8, "
        f"device {args.device}, torch threads {args.threads}, samples of {args.prompt}+{args.completion} tokens\n"
    )
    print("| samples per step | micro-batches | update s | action tokens/s | all tokens/s |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['samples']} | {r['micro_batches']} | {r['step_s']:.3f} | {r['action_tokens_per_s']:,.0f} | "
            f"{r['tokens_per_s']:,.0f} |"
        )
    push: dict[str, list[float]] = {}
    if args.device == "cpu":
        push = asyncio.run(bench_push(settings, model, args.repeat, args.redis_url))
        print("\n| push to rlgate serve | median ms | max ms | pushes |\n|---|---:|---:|---:|")
        labels = {
            "lora": "LoRA (save adapter, load_lora_adapter, pointer, unload v-2)",
            "full": "full (save safetensors, pause, start/update/finish, resume, pointer)",
        }
        for kind, times in push.items():
            print(
                f"| {labels[kind]} | {statistics.median(times) * 1000:.1f} | {max(times) * 1000:.1f} | "
                f"{len(times)} |"
            )
    rank_rows: list[dict] = []
    if args.ranks:
        counts = [int(c) for c in args.ranks.split(",")]
        rank_rows = bench_ranks(model, counts, [int(s) for s in args.rank_sizes.split(",")], args)
        print(
            f"\n| ranks (DeepSpeed ZeRO-1, {args.threads} thread(s) each) | samples per step | micro-batches per "
            "rank | update s | episodes/s | episodes/s per rank | action tokens/s |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for r in rank_rows:
            print(
                f"| {r['ranks']} | {r['samples']} | {r['micro_batches_per_rank']} | {r['step_s']:.3f} | "
                f"{r['episodes_per_s']:,.0f} | {r['episodes_per_s_per_rank']:,.0f} | {r['action_tokens_per_s']:,.0f} |"
            )
    if args.json:
        args.json.write_text(json.dumps({"updates": rows, "push_s": push, "ranks": rank_rows}, indent=2))
