"""The real model's learner step on 2 cores, today's settings beside the tuned ones, in one run:
SmolLM2-135M-Instruct (`rlgate models pull`), LoRA (rank 16 on every linear layer of the blocks), one GRPO
step of Calc-X episodes shaped as the AutoGen agent's are through vLLM's template.

    .venv/bin/python scripts/bench_calc_x.py                 # 16 tasks x 4 rollouts, every setting
    .venv/bin/python scripts/bench_calc_x.py --tasks 4       # a smaller step
    .venv/bin/python scripts/bench_calc_x.py --engine        # vLLM: the base weights beside a LoRA adapter

`--engine` measures generation instead: real vLLM (its CPU build, the demo's flags) on the model, the
AutoGen Calc-X agent on `--episodes` val problems at 16 in flight, asking for the served model itself and
then for a LoRA adapter of rank 16 on every linear layer of the blocks loaded at run time (what the learner
pushes; its values do not change the cost), episodes/s and generated tokens/s of each.

Each episode is two calls rendered by the model's own chat template exactly as vLLM renders them for the
agent (system message, the calculator's definition, the question; then the call, the tool's result and
the answer), so the learner sees the prompts it sees in the demo: one system prompt for all, a question
per task group, trajectory samples. Rows (each in a fresh process, one warm-up step then the median of
`--repeat`): the forward pass (`full`: OpenRLHF's Actor, the head at every position, as before; `actions`:
the head at the action positions only; `shared-prefix`: that and the rows' common prefix once), the
micro-batch budget, torch threads, and bf16 autocast (where the CPU has no bf16 instructions it is slower).
Peak resident memory from the process's own rusage. A setting that runs out of memory says so.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SETTINGS = [  # (label, forward, micro-batch tokens, threads, bf16 autocast)
    ("today: full pass, 8192-token micro-batches", "full", 8192, 2, False),
    ("full pass, 4096-token micro-batches", "full", 4096, 2, False),
    ("actions only", "actions", 8192, 2, False),
    ("shared prefix", "shared-prefix", 8192, 2, False),
    ("shared prefix, one micro-batch", "shared-prefix", 65536, 2, False),
    ("shared prefix, one micro-batch, 1 thread", "shared-prefix", 65536, 1, False),
    ("shared prefix, one micro-batch, bf16 autocast", "shared-prefix", 65536, 2, True),
]


def episodes(model: Path, tasks: int, rollouts: int, seed: int = 0) -> list[list[Any]]:
    """Two-call Calc-X episodes as token ids of the model's chat template (module docstring)."""
    from transformers import AutoTokenizer

    from learner.samples import Transition
    from rlgate.demo.calc_x import OUTPUT_FORMAT, TOOL, calculate, problems

    tokenizer = AutoTokenizer.from_pretrained(model)
    tool = TOOL
    system = "You are a helpful AI assistant. Solve tasks using your tools. Reply with TERMINATE when the task has been completed."
    rng = random.Random(seed)
    out = []
    for problem in problems("train", tasks):
        for r in range(rollouts):
            expression = problem.expression if rng.random() < 0.7 else problem.expression.replace("+", "-", 1)
            call = {"name": "calculate", "arguments": {"expression": expression}}
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"{problem.question} {OUTPUT_FORMAT}"},
            ]

            def render(msgs: list[dict[str, Any]]) -> list[int]:
                text = tokenizer.apply_chat_template(
                    msgs, tools=[tool], add_generation_prompt=True, tokenize=False
                )
                return tokenizer.encode(text, add_special_tokens=False)

            first_prompt = render(messages)
            first = tokenizer.encode(
                f"<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>", add_special_tokens=False
            )
            messages += [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "calculate", "arguments": json.dumps(call["arguments"])},
                        }
                    ],
                },
                {"role": "tool", "content": calculate(expression), "tool_call_id": "c"},
            ]
            second_prompt = render(messages)
            second = tokenizer.encode(
                f"### ANSWER: {calculate(expression)} ###<|im_end|>", add_special_tokens=False
            )
            advantage = 1.0 if expression == problem.expression else -1.0
            rid = f"{problem.id}-{r}"
            out.append(
                [
                    Transition(
                        rid,
                        0,
                        tuple(first_prompt),
                        tuple(first),
                        tuple([-0.5] * len(first)),
                        advantage,
                        0,
                        0.7,
                    ),
                    Transition(
                        rid,
                        1,
                        tuple(second_prompt),
                        tuple(second),
                        tuple([-0.5] * len(second)),
                        advantage,
                        0,
                        0.7,
                    ),
                ]
            )
    return out


def one(args: argparse.Namespace, forward: str, budget: int, threads: int, bf16: bool) -> dict[str, Any]:
    """One setting in this process: the step's median seconds and the peak resident memory."""
    import contextlib

    import torch

    from learner.policy import Policy
    from learner.samples import build_samples, micro_batches
    from learner.settings import LearnerSettings
    from rlgate.models import pull

    torch.set_num_threads(threads)
    model = pull("smollm2-135m-instruct", log=lambda line: print(line, file=sys.stderr))
    samples = build_samples(episodes(model, args.tasks, args.rollouts), "trajectory")
    settings = LearnerSettings(
        model=model,
        tensorboard=False,
        forward=forward,
        micro_batch_tokens=budget,
        lora_rank=16,
        lora_alpha=32,
        learning_rate=2e-4,
    )
    policy = Policy(settings)
    batches = micro_batches(samples, budget, policy.pad_token_id)
    times = []
    for _ in range(args.repeat + 1):
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            policy.update(batches)
        times.append(time.perf_counter() - started)
    tokens = sum(len(s.tokens) for s in samples)
    return {
        "seconds": statistics.median(times[1:]),
        "samples": len(samples),
        "tokens": tokens,
        "action_tokens": sum(s.num_actions for s in samples),
        "micro_batches": len(batches),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def engine(args: argparse.Namespace) -> None:
    """The `--engine` table (module docstring)."""
    import asyncio
    import tempfile

    import httpx
    import torch
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import AutoModelForCausalLM

    from rlgate import vllm_server
    from rlgate._net import free_port
    from rlgate.demo.calc_x import problems
    from rlgate.demo.calc_x_agent import solve
    from rlgate.demo.calc_x_demo import graded
    from rlgate.models import pull

    model = Path(args.model) if args.model else pull("smollm2-135m-instruct")
    work = Path(tempfile.mkdtemp(prefix="bench-calc-x-"))
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    get_peft_model(
        base, LoraConfig(task_type=TaskType.CAUSAL_LM, r=16, lora_alpha=32, target_modules=targets)
    ).save_pretrained(work / "adapter")
    del base
    server = vllm_server.start(
        vllm_server.find_python(),
        model,
        work / "vllm.log",
        port=free_port(),
        served_model_names=("policy",),
        max_model_len=2048,
        kv_cache_gib=2,
    )
    try:
        loaded = httpx.post(
            f"{server.url}/v1/load_lora_adapter",
            json={"lora_name": "adapter", "lora_path": str(work / "adapter")},
            timeout=60,
        )
        loaded.raise_for_status()
        val = problems("val", args.episodes)
        print(
            f"real vLLM ({server.version}) on {model.name}; the AutoGen agent on {len(val)} val problems, 16 in flight, T=0\n"
        )
        print("| served as | episodes/s | calls | generated tokens/s | right |")
        print("|---|---:|---:|---:|---:|")
        for name in ("policy", "adapter"):
            results, seconds = asyncio.run(_episodes(solve, f"{server.url}/v1", name, val))
            tokens = _generated(server.url)
            right = sum(graded(r["final"], p.result) for r, p in zip(results, val, strict=True))
            calls = sum(r["model_calls"] for r in results)
            print(
                f"| {'the merged weights' if name == 'policy' else 'a LoRA adapter (r=16)'} | {len(val) / seconds:.2f} | {calls} | {tokens / seconds:.1f} | {right}/{len(val)} |",
                flush=True,
            )
    finally:
        server.stop()


_counted = [0.0]


def _generated(url: str) -> float:
    """Generated tokens since the last call, from vLLM's Prometheus counter."""
    import httpx

    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:generation_tokens_total"):
            total += float(line.rsplit(" ", 1)[1])
    delta, _counted[0] = total - _counted[0], total
    return delta


async def _episodes(
    solve: Any, base_url: str, model: str, val: list[Any]
) -> tuple[list[dict[str, Any]], float]:
    import asyncio

    limit = asyncio.Semaphore(16)

    async def one(problem: Any) -> dict[str, Any]:
        async with limit:
            return await solve(
                problem.question, base_url=base_url, api_key="unused", model=model, temperature=0.0
            )

    _generated(base_url.removesuffix("/v1"))
    started = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in val))
    return list(results), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--engine", action="store_true", help="Measure vLLM's generation instead.")
    parser.add_argument("--episodes", type=int, default=48, help="--engine: val problems per row.")
    parser.add_argument("--model", default=None, help="--engine: a model folder (default: SmolLM2).")
    parser.add_argument("--only", type=int, default=None, help=argparse.SUPPRESS)  # a child: one setting
    args = parser.parse_args()
    if args.engine:
        engine(args)
        return
    if args.only is not None:
        _, forward, budget, threads, bf16 = SETTINGS[args.only]
        print(json.dumps(one(args, forward, budget, threads, bf16)))
        return
    print(
        f"SmolLM2-135M-Instruct, LoRA r=16, one step of {args.tasks} tasks x {args.rollouts} two-call episodes "
        f"(trajectory samples); median of {args.repeat} steps after a warm-up\n"
    )
    print("| setting | s / step | samples | tokens | micro-batches | peak RSS (GB) |")
    print("|---|---:|---:|---:|---:|---:|")
    baseline = None
    for index, (label, *_rest) in enumerate(SETTINGS):
        child = subprocess.run(
            [
                sys.executable,
                __file__,
                "--only",
                str(index),
                "--tasks",
                str(args.tasks),
                "--rollouts",
                str(args.rollouts),
                "--repeat",
                str(args.repeat),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if child.returncode != 0:
            why = (
                "out of memory (killed)"
                if child.returncode in (-9, 137)
                else child.stderr.strip().splitlines()[-1][:80]
            )
            print(f"| {label} | {why} | | | | |", flush=True)
            continue
        row = json.loads(child.stdout.strip().splitlines()[-1])
        baseline = baseline or row["seconds"]
        print(
            f"| {label} | {row['seconds']:.1f} ({baseline / row['seconds']:.1f}x) | {row['samples']} | {row['tokens']} | "
            f"{row['micro_batches']} | {row['peak_rss_gb']:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
