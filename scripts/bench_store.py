"""What recording a call costs Redis, by call size, on one Redis and on a Redis Cluster, side by side.

Starts its own redis-servers (no persistence): one standalone, a 3-master cluster, and a 3-master cluster
with a replica each that the store WAITs for (`?wait_replicas=1`). For each call size (prompt and
completion tokens, with their token ids, log-probs and text as the gateway records them) it records the
same calls through `EpisodeStore.record_calls` (the gateway's hot path: the pipelined record connection,
one Lua script per call) from `--concurrency` tasks in this one process, each task into a rollout of its
own, and prints per call: the servers' CPU (`used_cpu_user` + `used_cpu_sys`, masters and replicas
apart), the bytes sent to Redis, the memory it keeps (`used_memory`, masters only: a replica holds a
copy), and the calls per second this one client process reached.

    .venv/bin/python scripts/bench_store.py            # sizes 40/32, 2000/300, 8000/1000; 3 rounds
    .venv/bin/python scripts/bench_store.py --targets standalone --token-text off,on
                                                       # what RLGATE_RECORD_TOKEN_TEXT costs

The client shares the machine's cores with every redis-server: calls/s is a floor for the recording path,
not the gateway's throughput (scripts/bench_gateway.py measures that). The servers' CPU per call is what
sizes Redis: one Redis core records about 1e6 / (CPU us per call) calls per second.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from redis_servers import cluster_ports, redis_server_command  # noqa: E402

from rlgate.episodes import CallRecord, EpisodeStore  # noqa: E402


class Servers:
    """redis-servers of one target: `standalone`, `cluster` (3 masters) or `cluster+replicas` (3+3)."""

    def __init__(self, kind: str, root: Path) -> None:
        self.kind = kind
        n = {"standalone": 1, "cluster": 3, "cluster+replicas": 6}[kind]
        self.ports = cluster_ports(n)
        self.procs = []
        for port in self.ports:
            work = root / f"{kind}-{port}"
            work.mkdir()
            args = redis_server_command(port)
            if kind != "standalone":
                args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            self.procs.append(
                subprocess.Popen(args, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        for port in self.ports:
            for _ in range(200):
                try:
                    redis.Redis(port=port).ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.05)
        if kind != "standalone":
            replicas = ["--cluster-replicas", "1"] if kind == "cluster+replicas" else []
            subprocess.run(
                ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports), *replicas]
                + ["--cluster-yes"],
                check=True,
                capture_output=True,
            )
            self._wait_ok()

    def _wait_ok(self) -> None:
        for _ in range(300):
            states = []
            for port in self.ports:
                node = redis.Redis(port=port)
                info = node.info("replication")
                ok = node.execute_command("CLUSTER INFO")["cluster_state"] == "ok"
                states.append(ok and (info["role"] == "master" or info.get("master_link_status") == "up"))
            if all(states):
                return
            time.sleep(0.1)
        raise SystemExit(f"{self.kind}: the cluster did not become ready")

    @property
    def url(self) -> str:
        if self.kind == "standalone":
            return f"redis://127.0.0.1:{self.ports[0]}/0"
        wait = "/?wait_replicas=1" if self.kind == "cluster+replicas" else ""
        return f"redis+cluster://127.0.0.1:{self.ports[0]}{wait}"

    def counters(self) -> dict[str, float]:
        """CPU seconds (masters, replicas), bytes received, memory used and seconds spent running the
        record script (`EVALSHA`'s commandstats: the script alone, without the event loop and network
        work around it; masters), summed over nodes."""
        out = {"cpu_masters": 0.0, "cpu_replicas": 0.0, "in": 0.0, "memory": 0.0, "script": 0.0}
        for port in self.ports:
            info = redis.Redis(port=port).info("all")
            cpu = info["used_cpu_user"] + info["used_cpu_sys"]
            if info["role"] == "master":
                out["script"] += info.get("cmdstat_evalsha", {}).get("usec", 0) / 1e6
                out["cpu_masters"] += cpu
                out["in"] += info["total_net_input_bytes"]
                out["memory"] += info["used_memory"]
            else:
                out["cpu_replicas"] += cpu
        return out

    def flush(self) -> None:
        for port in self.ports:
            node = redis.Redis(port=port)
            if node.info("replication")["role"] == "master":
                node.flushall()

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def make_record(
    rollout_id: str, prompt: int, completion: int, rng: random.Random, token_text: bool = False
) -> CallRecord:
    """A call as the gateway records it: messages and answer text (~4 characters per token), the server's
    prompt and completion token ids, a log-prob per completion token, and with `token_text` each
    completion token's text (RLGATE_RECORD_TOKEN_TEXT)."""
    words = "the of and to in is that for it as with was on be at by this from".split()

    def text(tokens: int) -> str:
        return " ".join(rng.choice(words) for _ in range(tokens))

    answer = [rng.choice(words) for _ in range(completion)]
    return CallRecord(
        rollout_id=rollout_id,
        agent_name="solver",
        endpoint="chat.completions",
        model="Qwen/Qwen2.5-7B-Instruct",
        policy_version=3,
        request={
            "model": "Qwen/Qwen2.5-7B-Instruct",
            "messages": [
                {"role": "system", "content": text(prompt // 8)},
                {"role": "user", "content": text(prompt - prompt // 8)},
            ],
            "temperature": 1.0,
        },
        response={
            "id": "chatcmpl-0123456789abcdef",
            "message": {"role": "assistant", "content": " ".join(answer)},
            "finish_reason": "stop",
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            },
        },
        prompt_token_ids=[rng.randrange(151_000) for _ in range(prompt)],
        completion_token_ids=[rng.randrange(151_000) for _ in range(completion)],
        completion_logprobs=[-rng.random() * 3 for _ in range(completion)],
        **(
            {"completion_token_texts": [(" " if i else "") + w for i, w in enumerate(answer)]}
            if token_text
            else {}
        ),
        started_at=time.time(),
        latency_ms=812.4,
        ttfb_ms=95.1,
    )


async def record_all(url: str, prefix: str, record: CallRecord, calls: int, concurrency: int) -> float:
    """Record `calls` calls from `concurrency` tasks, each into a rollout of its own; returns seconds."""
    store = EpisodeStore.from_url(url, prefix=prefix, timeout_s=30)
    per_task = calls // concurrency
    try:

        async def agent(i: int) -> None:
            rid = f"bench-{prefix}-{i}"
            mine = record.model_copy(update={"rollout_id": rid})
            for _ in range(per_task):
                await store.record_calls(rid, None, [mine])

        await agent(-1)  # connections open, scripts loaded
        started = time.perf_counter()
        await asyncio.gather(*(agent(i) for i in range(concurrency)))
        return time.perf_counter() - started
    finally:
        await store.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--sizes", default="40/32,2000/300,8000/1000", help="prompt/completion tokens, comma-separated"
    )
    ap.add_argument("--targets", default="standalone,cluster,cluster+replicas")
    ap.add_argument(
        "--calls", type=int, default=4096, help="calls per cell (fewer for large sizes: see --bytes)"
    )
    ap.add_argument("--bytes", type=int, default=256 << 20, help="at most this much record JSON per cell")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--token-text", default="off", help="off, on, or off,on: records without/with each token's text"
    )
    args = ap.parse_args()
    variants = [v == "on" for v in args.token_text.split(",")]
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        raise SystemExit("bench_store: needs redis-server and redis-cli on PATH")
    sizes = [tuple(int(x) for x in size.split("/")) for size in args.sizes.split(",")]
    targets = args.targets.split(",")
    rng = random.Random(0)
    results: dict[tuple[str, tuple[int, int], bool], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        servers = {kind: Servers(kind, Path(tmp)) for kind in targets}
        try:
            for size, text in ((size, text) for size in sizes for text in variants):
                record = make_record("r", *size, rng, text)
                json_bytes = len(record.model_dump_json())
                calls = max(args.concurrency, min(args.calls, args.bytes // json_bytes))
                calls -= calls % args.concurrency
                for rnd in range(args.rounds):
                    for kind in (
                        targets if rnd % 2 == 0 else reversed(targets)
                    ):  # interleaved, order alternating
                        s = servers[kind]
                        s.flush()
                        time.sleep(0.2)
                        before = s.counters()
                        seconds = asyncio.run(record_all(s.url, f"b{rnd}", record, calls, args.concurrency))
                        after = s.counters()
                        done = calls + calls // args.concurrency  # and the warm-up task's calls
                        results.setdefault((kind, size, text), []).append(
                            {
                                "calls/s": calls / seconds,
                                "cpu_m": (after["cpu_masters"] - before["cpu_masters"]) / done * 1e6,
                                "cpu_r": (after["cpu_replicas"] - before["cpu_replicas"]) / done * 1e6,
                                "script": (after["script"] - before["script"]) / done * 1e6,
                                "in": (after["in"] - before["in"]) / done,
                                "memory": (after["memory"] - before["memory"]) / done,
                                "json": json_bytes,
                            }
                        )
        finally:
            for s in servers.values():
                s.stop()
    print(f"\nmedians of {args.rounds} rounds, concurrency {args.concurrency}, one client process\n")
    text_column = len(variants) > 1 or variants[0]
    print(
        "| tokens (prompt/completion) |" + (" token text |" if text_column else "") + " record JSON | target "
        "| calls/s | Redis CPU us/call (masters) | of it, the record script | replicas CPU us/call "
        "| bytes to Redis/call | memory/call |"
    )
    print("|---|" + ("---|" if text_column else "") + "---:|---|---:|---:|---:|---:|---:|---:|")
    for size in sizes:
        for text in variants:
            for kind in targets:
                rows = results[(kind, size, text)]

                def med(name: str, rows: list[dict[str, float]] = rows) -> float:
                    return statistics.median(r[name] for r in rows)

                replicas = f"{med('cpu_r'):.1f}" if kind == "cluster+replicas" else ""
                print(
                    f"| {size[0]}/{size[1]} |"
                    + (f" {'on' if text else 'off'} |" if text_column else "")
                    + f" {med('json'):,.0f} B | {kind} | {med('calls/s'):,.0f} "
                    f"| {med('cpu_m'):.1f} | {med('script'):.1f} | {replicas} | {med('in'):,.0f} "
                    f"| {med('memory'):,.0f} B |"
                )


if __name__ == "__main__":
    main()
