"""Real vLLM (its CPU build) against `rlgate serve`, side by side in one run: the demo on each, and the
gateway's added latency in front of each.

1. The quick demo (`rlgate demo --quick --inference E`, a fresh work directory each) on each engine: time
   to 90% success (the loop's seconds at the first step whose last-3-steps rate reaches it), episodes per
   second, the engine's start time (until it answered) and resident memory, and the final rate.
2. Each engine on the default tiny model with a gateway in front: `--requests` sequential chat completions
   of at most `--max-tokens` tokens (seeded), alternating, after a warm-up: straight to the engine with
   what the gateway adds upstream (log-probs and token ids: vLLM spends time computing them), and a plain
   call through the gateway (the same seed: the same tokens); the p50 and p90 latency of each, and the
   gateway's added latency: the median of the per-seed differences.

The engines, the gateway and the load share the machine's cores; nothing else should run meanwhile.

Run:  .venv/bin/python scripts/bench_engines.py [--requests 200] [--max-tokens 16] [--skip-demo]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _bench import start_gateway  # noqa: E402

from rlgate import vllm_server  # noqa: E402
from rlgate._net import free_port  # noqa: E402

ENGINES = ("vllm", "rlgate-serve")
CAPTURED = {"logprobs": True, "return_token_ids": True}  # what the gateway adds to a plain call upstream


def demo(engine: str, work: Path, redis_url: str) -> dict:
    out = work / f"demo-{engine}.json"
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "rlgate", "demo", "--quick", "--inference", engine, "--json", str(out)]
        + ["--workdir", str(work / f"demo-{engine}"), "--redis-url", redis_url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if result.returncode != 0:
        raise SystemExit(f"the demo on {engine} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    summary = json.loads(out.read_text())
    curve = summary["curve"]
    per_step = [c["episodes"] - (curve[j - 1]["episodes"] if j else 0) for j, c in enumerate(curve)]
    reached = None
    for i in range(4, len(curve)):  # the last 3 steps' episode-weighted rate, as the demo's target
        window = range(i - 2, i + 1)
        rate = sum(curve[j]["success_rate"] * per_step[j] for j in window) / sum(per_step[j] for j in window)
        if rate >= 0.9:
            reached = curve[i]["seconds"]
            break
    engine_info = summary["inference"]
    return {
        "engine": engine_info["name"],
        "start_s": engine_info.get("start_seconds"),
        "rss_gb": engine_info["rss_mb"] / 1024 if engine_info.get("rss_mb") else None,
        "to_90_s": reached,
        "episodes_per_s": summary["episodes"] / summary["loop_seconds"] if summary["loop_seconds"] else None,
        "initial": summary["initial_success_rate"],
        "final": summary["final_success_rate"],
        "wall_s": time.monotonic() - started,
    }


def start_engine(engine: str, model: Path, log_dir: Path) -> tuple[str, object]:
    port = free_port()
    if engine == "vllm":
        server = vllm_server.start(
            vllm_server.find_python(), model, log_dir / "vllm.log", port=port, served_model_names=("tiny",)
        )
        return server.url, server
    process = subprocess.Popen(
        [sys.executable, "-m", "rlgate", "serve", "--model", str(model), "--port", str(port)]
        + ["--served-model-name", "tiny", "--logprobs-mode", "processed_logprobs", "--log-format", "json"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=(log_dir / "serve.log").open("wb"),
        text=True,
    )
    if not process.stdout.readline().startswith("READY"):
        process.kill()
        raise SystemExit(f"rlgate serve did not start: {(log_dir / 'serve.log').read_text()[-2000:]}")
    return f"http://127.0.0.1:{port}", process


def latency(engine: str, model: Path, redis_url: str, work: Path, requests: int, max_tokens: int) -> dict:
    log_dir = work / f"latency-{engine}"
    log_dir.mkdir()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "What is 17 + 25?"}]}
    body |= {"max_tokens": max_tokens, "temperature": 1.0}
    direct, via = [], []
    upstream, handle = start_engine(engine, model, log_dir)
    gateway_process = None
    try:
        gateway, gateway_process = start_gateway(
            {
                "RLGATE_UPSTREAM_URL": f"{upstream}/v1",
                "RLGATE_REDIS_URL": redis_url,
                "RLGATE_KEY_PREFIX": f"bench-engines-{os.getpid()}",
            },
            log_dir / "gateway.log",
        )
        with httpx.Client(timeout=60) as client:
            for i in range(requests + 20):
                for url, into, extra in (
                    (f"{upstream}/v1", direct, CAPTURED),  # what the gateway asks the engine for
                    (f"{gateway}/rollouts/bench-{i}/v1", via, {}),
                ):
                    t0 = time.perf_counter()
                    response = client.post(f"{url}/chat/completions", json={**body, **extra, "seed": i})
                    took = time.perf_counter() - t0
                    assert response.status_code == 200, response.text
                    if i >= 20:  # warm-up
                        into.append(took * 1000)
    finally:
        if gateway_process is not None:
            gateway_process.terminate()
            gateway_process.wait(timeout=30)
        if isinstance(handle, vllm_server.VllmServer):
            handle.stop()
        else:
            handle.terminate()
            handle.wait(timeout=30)

    def pct(values: list[float], q: float) -> float:
        return statistics.quantiles(values, n=100)[int(q) - 1]

    return {
        "direct_p50": statistics.median(direct),
        "direct_p90": pct(direct, 90),
        "via_p50": statistics.median(via),
        "via_p90": pct(via, 90),
        # per seed, the same tokens both ways: the median of the paired differences
        "added_p50": statistics.median(v - d for v, d in zip(via, direct, strict=True)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--skip-demo", action="store_true")
    args = parser.parse_args()
    vllm_server.find_python()  # fails here, in one line, without vLLM

    from rlgate.inference.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build_tiny_model(work / "tiny", seed=0)
        demos = {} if args.skip_demo else {e: demo(e, work, args.redis_url) for e in ENGINES}
        try:
            latencies = {
                e: latency(e, model, args.redis_url, work, args.requests, args.max_tokens) for e in ENGINES
            }
        finally:  # the gateways' records
            import redis

            client = redis.Redis.from_url(args.redis_url)
            keys = list(client.scan_iter(match=f"bench-engines-{os.getpid()}:*", count=1000))
            if keys:
                client.unlink(*keys)

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    if demos:
        print("| engine | start (s) | resident (GB) | time to 90% (s) | episodes/s | success |")
        print("|---|---|---|---|---|---|")
        for d in demos.values():
            print(
                f"| {d['engine']} | {fmt(d['start_s'], '.1f')} | {fmt(d['rss_gb'], '.1f')} | "
                f"{fmt(d['to_90_s'], '.0f')} | {fmt(d['episodes_per_s'], '.1f')} | "
                f"{d['initial']:.1%} -> {d['final']:.1%} |"
            )
        print()
    print(
        f"| engine ({args.requests} sequential calls, {args.max_tokens} tokens) | direct p50 / p90 (ms) | "
        "through the gateway p50 / p90 (ms) | added, median of pairs (ms) |"
    )
    print("|---|---|---|---|")
    for engine, lat in latencies.items():
        print(
            f"| {engine} | {lat['direct_p50']:.1f} / {lat['direct_p90']:.1f} | "
            f"{lat['via_p50']:.1f} / {lat['via_p90']:.1f} | {lat['added_p50']:+.2f} |"
        )


if __name__ == "__main__":
    main()
