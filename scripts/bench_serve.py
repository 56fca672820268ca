"""Benchmark `rlgate serve` on the tiny model: short chat completions per second and latency by concurrency.

Builds the tiny model (`rlgate make-tiny-model`) into a temporary folder, starts `rlgate serve` on it, and
drives POST /v1/chat/completions (one user message, `max_tokens` 8, temperature 1) from `concurrency`
workers for a fixed number of requests per cell, after a warm-up. The server and the load generator share
the machine's cores. Then it times runtime LoRA loads (POST /v1/load_lora_adapter of a peft adapter on
q_proj/v_proj, r=8) and unloads, and full-weight updates through vLLM's phases (start_weight_update,
update_weights from a safetensors file of every weight, finish_weight_update with a version).

Run:  .venv/bin/python scripts/bench_serve.py [--requests 400] [--concurrency 1 16 32] [--max-tokens 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from rlgate._net import free_port

ROOT = Path(__file__).resolve().parent.parent


async def drive(url: str, body: bytes, concurrency: int, n: int) -> tuple[float, list[float], int]:
    latencies: list[float] = []
    tokens = 0
    remaining = n
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector, headers={"content-type": "application/json"}) as s:

        async def worker() -> None:
            nonlocal remaining, tokens
            while remaining > 0:
                remaining -= 1
                t0 = time.perf_counter()
                async with s.post(url, data=body) as response:
                    answer = await response.json()
                    if response.status != 200:
                        raise RuntimeError(f"HTTP {response.status}: {answer}")
                latencies.append(time.perf_counter() - t0)
                tokens += answer["usage"]["completion_tokens"]

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start, latencies, tokens


def time_lora(base_url: str, model: Path, tmp: Path, runs: int = 5) -> dict[str, list[float]]:
    """Wall time of loading and unloading a saved peft adapter through the server's vLLM-style routes."""
    import urllib.request

    import peft
    import transformers

    adapter = tmp / "adapter"
    base = transformers.AutoModelForCausalLM.from_pretrained(model, local_files_only=True)
    config = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft.get_peft_model(base, config).save_pretrained(adapter)

    def post(path: str, body: dict) -> float:
        request = urllib.request.Request(
            f"{base_url}{path}",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
            method="POST",
        )
        t0 = time.perf_counter()
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"LoRA load": [], "LoRA unload": [], "full-weight update": []}
    for _ in range(runs):
        times["LoRA load"].append(
            post("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(adapter)})
        )
        times["LoRA unload"].append(post("/v1/unload_lora_adapter", {"lora_name": "a"}))

    from safetensors.torch import save_file

    weights = tmp / "weights.safetensors"
    plain = transformers.AutoModelForCausalLM.from_pretrained(
        model, local_files_only=True
    )  # peft changed `base`
    save_file({n: p.detach().contiguous() for n, p in plain.named_parameters()}, str(weights))
    post("/init_weight_transfer_engine", {"init_info": {}})
    for version in range(runs):
        t0 = time.perf_counter()
        post("/start_weight_update", {})
        post("/update_weights", {"update_info": {"path": str(weights)}})
        post("/finish_weight_update", {"weight_version": str(version)})
        times["full-weight update"].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400, help="requests per cell")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 32])
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlgate-bench-serve-") as tmp:
        model = Path(tmp) / "tiny"
        subprocess.run(
            [sys.executable, "-m", "rlgate", "make-tiny-model", str(model)],
            check=True,
            capture_output=True,
            cwd=ROOT,
        )
        port = free_port()
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rlgate",
                "serve",
                "--model",
                str(model),
                "--port",
                str(port),
                "--served-model-name",
                "tiny",
                "--log-level",
                "warning",
                # the LoRA and weight-update routes it times, reading files under tmp only
                "--allow-runtime-lora-updating",
                "true",
                "--dev-mode",
                "true",
                "--weights-root",
                tmp,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
        )
        try:
            assert server.stdout.readline().startswith("READY"), "rlgate serve did not start"
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            body = json.dumps(
                {
                    "model": "tiny",
                    "max_tokens": args.max_tokens,
                    "temperature": 1.0,
                    "messages": [{"role": "user", "content": "What is 17 + 25?"}],
                }
            ).encode()
            asyncio.run(drive(url, body, 4, 40))  # warm-up
            print(
                f"\n{args.requests} requests per cell, max_tokens {args.max_tokens}, "
                f"server and load generator on the same {len(os.sched_getaffinity(0))} cores\n"
            )
            print("| concurrency | completions/s | tokens/s | p50 ms | p99 ms |")
            print("|---:|---:|---:|---:|---:|")
            for concurrency in args.concurrency:
                wall, latencies, tokens = asyncio.run(drive(url, body, concurrency, args.requests))
                q = statistics.quantiles(latencies, n=100, method="inclusive")
                print(
                    f"| {concurrency} | {len(latencies) / wall:,.0f} | {tokens / wall:,.0f} | "
                    f"{q[49] * 1000:.1f} | {q[98] * 1000:.1f} |"
                )
            print("\n| operation | median ms (5 runs) |\n|---|---:|")
            for name, seconds in time_lora(f"http://127.0.0.1:{port}", model, Path(tmp)).items():
                print(f"| {name} | {statistics.median(seconds) * 1000:.1f} |")
        finally:
            server.terminate()
            server.wait(timeout=20)


if __name__ == "__main__":
    main()
