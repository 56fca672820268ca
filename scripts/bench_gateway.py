"""Benchmark the gateway's hot path side by side with the upstream alone and the LiteLLM proxy.

Method
  * Upstream: a canned vLLM server (raw asyncio protocol + httptools, 0 ms) answering POST
    /v1/chat/completions with bodies captured once from tests/fake_vllm.py (vLLM 0.33's exact wire
    format): with token ids and log-probs when the request asks for them (as the gateway does), plain
    otherwise; streams are one event per token (32 tokens), written at once.
  * Targets, interleaved round by round: `direct` (the upstream itself), `rlgate` (`rlgate gateway`
    recording into Redis), and `litellm` (LiteLLM proxy, one worker, no database) when its binary is
    given or on PATH. Proxies are pinned to CPU 0; the load generator, the upstream and a dedicated
    redis-server are pinned to CPU 1.
  * `--workers 1,2`: instead of one gateway, one per worker count (`rlgate gateway --workers N`, targets
    `rlgate-1w`, `rlgate-2w`, ...), and nothing pinned: N workers pinned to one CPU would measure nothing,
    so every process (load generator, upstream, Redis, gateways) shares every CPU. Cells default to
    stream off/on at concurrency 64.
  * Cells: stream off/on x concurrency 1/32; N requests per cell per round. Latency is request start to
    last byte; TTFB is to the first body byte. Proxy CPU per request comes from /proc (utime + stime of
    the proxy's process tree) over the cell. "added p50" = the target's p50 minus direct's p50.
  * Redis per recorded call: the dedicated redis-server's INFO (commands, network bytes, used_memory) and
    DBSIZE before and after each gateway cell, divided by the cell's calls: the sizing numbers of
    docs/deployment.md.

Run
  .venv/bin/python scripts/bench_gateway.py [--rounds 3] [--requests 2000] [--litellm PATH|none]
      [--cells unary:1,unary:32,stream:1,stream:32] [--py-spy PREFIX] [--rollout-keys] [--workers 1,2] [--poll-ui S]
      [--prompt-chars 0,3000] [--baseline DIR]
  (--baseline DIR: another checkout's gateway too, as target rlgate-baseline, pinned and measured as this
  one's: `git worktree add /tmp/before REV` then --baseline /tmp/before shows a change's cost in one run)
  (--prompt-chars: each cell once per prompt size, the prompt that many characters longer: the gateway's CPU
  and Redis cost per call for larger calls, side by side with the short ones)
  (--rollout-keys: the gateway requires rollout-scoped keys, and each agent sends its rollout's key)
  (--poll-ui S: while the load runs, a dashboard reader on the load's CPU fetches the /ui pages (overview,
  its live part, the rollouts listing, a rollout of the load, training) one after another every S seconds)
  (the CPU of py-spy itself is not the gateway's, but its sampling slows the gateway: profile in a run
  of its own, not in the one whose numbers you keep)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import uvloop

from gateway.auth import rollout_key
from rlgate._net import free_port

ROOT = Path(__file__).resolve().parent.parent
MODEL = "fake-model"
REQUEST = {
    "model": MODEL,
    "max_tokens": 32,
    "temperature": 0.7,
    "messages": [
        {"role": "system", "content": "You are a careful assistant. Answer briefly."},
        {"role": "user", "content": "What is the capital of France? Explain in one line."},
    ],
}
CPU_PROXY, CPU_LOAD = 0, 1


def request_of(chars: int) -> dict:
    """The benchmark's request, its user message made `chars` characters longer (byte-level tokens in the
    fake vLLM's tokenizer: about as many prompt tokens)."""
    if not chars:
        return REQUEST
    filler = ("the quick brown fox jumps over the lazy dog " * (chars // 44 + 1))[:chars]
    messages = [
        REQUEST["messages"][0],
        {"role": "user", "content": f"{REQUEST['messages'][1]['content']} {filler}"},
    ]
    return {**REQUEST, "messages": messages}


BENCH_KEY = "sk-rlgate-bench-5f0c2a9e7d314b6c8a1e4f2d9b7c3a60"  # LiteLLM's master key; ignored by the others
TICKS = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------------------
# The canned upstream


def capture_bodies(path: Path, sizes: list[int]) -> None:
    """Ask tests/fake_vllm.py once for the four answers per prompt size the canned upstream replays."""
    port = free_port()
    fake = subprocess.Popen(
        [sys.executable, str(ROOT / "tests/fake_vllm.py"), "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert fake.stdout.readline().startswith("READY")

    async def fetch() -> dict[str, str]:
        out = {}
        async with aiohttp.ClientSession() as session:
            for chars in sizes:
                for stream in (False, True):
                    for full in (False, True):
                        body = {
                            **request_of(chars),
                            "stream": stream,
                            **({"return_token_ids": True, "logprobs": True} if full else {}),
                        }
                        url = f"http://127.0.0.1:{port}/v1/chat/completions"
                        async with session.post(url, json=body) as r:
                            assert r.status == 200, await r.text()
                            out[
                                f"{chars}-{'stream' if stream else 'unary'}-{'full' if full else 'plain'}"
                            ] = await r.text()
        return out

    path.write_text(json.dumps(asyncio.run(fetch())))
    fake.terminate()


def serve_upstream(port: int, bodies_path: Path) -> None:
    import httptools

    bodies = json.loads(bodies_path.read_text())
    answers = {}
    for key, text in bodies.items():
        body = text.encode()
        kind = b"text/event-stream; charset=utf-8" if key.startswith("stream") else b"application/json"
        answers[key] = (
            b"HTTP/1.1 200 OK\r\ncontent-type: "
            + kind
            + b"\r\ncontent-length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
    sizes = sorted({int(key.split("-")[0]) for key in bodies})
    models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
    models_answer = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
        + str(len(models)).encode()
        + b"\r\n\r\n"
        + models
    )

    class Upstream(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport
            self.parser = httptools.HttpRequestParser(self)
            self.body = []

        def data_received(self, data):
            self.parser.feed_data(data)

        def on_url(self, url):
            self.url = url

        def on_body(self, body):
            self.body.append(body)

        def on_message_complete(self):
            body = b"".join(self.body)
            self.body = []
            if self.url.endswith(b"/models"):
                self.transport.write(models_answer)
                return
            stream = b'"stream":true' in body or b'"stream": true' in body
            full = b'"return_token_ids":true' in body or b'"return_token_ids": true' in body
            # the prompt size the request has (sizes should lie 500+ characters apart)
            chars = max((size for size in sizes if len(body) >= size), default=sizes[0])
            self.transport.write(
                answers[f"{chars}-{'stream' if stream else 'unary'}-{'full' if full else 'plain'}"]
            )

    async def main():
        server = await asyncio.get_running_loop().create_server(Upstream, "127.0.0.1", port, backlog=1024)
        print("READY", flush=True)
        await server.serve_forever()

    uvloop.run(main())


# ---------------------------------------------------------------------------------------------------------
# Processes


PIN = True  # off with --workers


def pinned(cpu: int):
    return lambda: os.sched_setaffinity(0, {cpu}) if PIN else None


def wait_http(url: str, timeout: float = 60) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its descendants."""
    children: dict[int, list[int]] = {}
    stats: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        stats[int(entry)] = (int(fields[11]) + int(fields[12])) / TICKS
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, 0.0)
        todo.extend(children.get(p, ()))
    return total


# ---------------------------------------------------------------------------------------------------------
# Load


async def drive(
    url: str, stream: bool, concurrency: int, n: int, rollout_keys: bytes | None = None, chars: int = 0
) -> tuple[float, list[float], list[float]]:
    body = json.dumps({**request_of(chars), "stream": stream}).encode()
    latencies: list[float] = []
    ttfbs: list[float] = []
    remaining = n
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency)
    async with aiohttp.ClientSession(
        connector=connector,
        headers={"content-type": "application/json", "authorization": f"Bearer {BENCH_KEY}"},
    ) as s:

        async def worker(i: int) -> None:
            nonlocal remaining
            headers = {"x-rollout-id": f"bench-{i}"}
            if rollout_keys is not None:  # the key of this agent's own rollout, as POST /rollouts returns it
                headers["authorization"] = f"Bearer {rollout_key(rollout_keys, f'bench-{i}')}"
            while remaining > 0:
                remaining -= 1
                t0 = time.perf_counter()
                async with s.post(url, data=body, headers=headers) as r:
                    first = await r.content.readany()
                    t1 = time.perf_counter()
                    rest = await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{url}: HTTP {r.status}: {first + rest!r}")
                t2 = time.perf_counter()
                latencies.append(t2 - t0)
                ttfbs.append(t1 - t0)

        start = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        wall = time.perf_counter() - start
    return wall, latencies, ttfbs


def poll_dashboard(base: str, token: str | None, every_s: float, stop: threading.Event, counts: dict) -> None:
    """Read the dashboard's pages, as a browser left open on it would, until `stop` is set."""
    import urllib.request

    pages = ["/ui", "/ui?fragment=1", "/ui/rollouts", "/ui/rollouts/bench-0", "/ui/training"]
    headers = {"authorization": f"Bearer {token}"} if token else {}
    while not stop.wait(every_s):
        for page in pages:
            try:
                with urllib.request.urlopen(
                    urllib.request.Request(base + page, headers=headers), timeout=30
                ) as r:
                    r.read()
                    counts["ok" if r.status == 200 else "failed"] += 1
            except OSError:
                counts["failed"] += 1


def redis_counters(port: int) -> dict[str, float]:
    """The dedicated Redis's counters: commands run, bytes in and out, memory used, keys."""
    import redis

    client = redis.Redis(port=port)
    try:
        info = client.info("all")
        commands = sum(v["calls"] for k, v in info.items() if k.startswith("cmdstat_"))
        return {
            "commands": commands,
            "in": info["total_net_input_bytes"],
            "out": info["total_net_output_bytes"],
            "memory": info["used_memory"],
            "keys": client.dbsize(),
        }
    finally:
        client.close()


def pct(values: list[float], q: float) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1000
        if len(values) > 1
        else values[0] * 1000
    )


# ---------------------------------------------------------------------------------------------------------
# The run


@dataclass
class Run:
    """One run's state: its temporary folder, the processes it started (stopped in reverse order by
    `stop`), the targets it loads, and what each cell measured."""

    tmp: Path
    procs: list[subprocess.Popen] = field(default_factory=list)
    redis_port: int = 0
    secret: bytes | None = None  # --rollout-keys: the secret the gateways derive rollout keys from
    # name -> (base URL, pid of the process tree whose CPU is the target's; None for direct)
    targets: dict[str, tuple[str, int | None]] = field(default_factory=dict)
    dashboard: tuple[str, str | None] = ("", None)  # the last gateway's URL and operator token (--poll-ui)
    results: dict[tuple[str, bool, int, int], dict[str, list[float]]] = field(default_factory=dict)
    redis_cost: dict[tuple[str, bool, int], dict[str, list[float]]] = field(default_factory=dict)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=2000, help="requests per cell per round")
    ap.add_argument("--litellm", default=shutil.which("litellm") or "none", help="litellm binary, or none")
    ap.add_argument(
        "--cells",
        default=None,
        help="which cells to run, as mode:concurrency (mode unary or stream); default "
        "unary:1,unary:32,stream:1,stream:32, with --workers unary:64,stream:64",
    )
    ap.add_argument(
        "--workers",
        help="compare gateways with these worker counts (comma-separated, e.g. 1,2) instead of one gateway",
    )
    ap.add_argument(
        "--py-spy",
        metavar="PREFIX",
        help="profile the gateway with py-spy during its cells (last round): PREFIX-<cell>.svg "
        "flame graphs; py-spy comes with the bench extra",
    )
    ap.add_argument(
        "--rollout-keys",
        action="store_true",
        help="the gateway requires rollout-scoped keys; each agent sends its rollout's key",
    )
    ap.add_argument(
        "--poll-ui",
        type=float,
        metavar="S",
        help="read the dashboard's /ui pages every S seconds during the load (a browser left open on it)",
    )
    ap.add_argument("--upstream-only", type=int, help=argparse.SUPPRESS)
    ap.add_argument(
        "--prompt-chars",
        default="0",
        help="comma-separated: make the prompt this many characters (about as many prompt tokens) longer, "
        "one set of cells per size, side by side (e.g. 0,3000; the fake vLLM's context is 4,096 tokens)",
    )
    ap.add_argument(
        "--baseline",
        type=Path,
        metavar="DIR",
        help="also run the gateway of another checkout (e.g. `git worktree add /tmp/before REV`), target "
        "rlgate-baseline, interleaved with this one's: a change's hot path before and after in one run",
    )
    ap.add_argument("--bodies", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.baseline is not None and (args.workers or not (args.baseline / "gateway").is_dir()):
        ap.error("--baseline: a checkout's folder (with its gateway/), without --workers")
    if args.baseline is not None and args.poll_ui:
        ap.error("--baseline with --poll-ui: the dashboard reader would load one of the two gateways only")
    return args


def start_upstream(run: Run) -> str:
    """This script again as the canned upstream, on the load's CPU; returns its base URL once it is ready."""
    up_port = free_port()
    upstream = subprocess.Popen(
        [sys.executable, __file__, "--upstream-only", str(up_port), "--bodies", str(run.tmp / "bodies.json")],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=pinned(CPU_LOAD),
    )
    run.procs.append(upstream)
    assert upstream.stdout.readline().startswith("READY")
    return f"http://127.0.0.1:{up_port}/v1"


def start_redis(run: Run) -> None:
    """A dedicated redis-server, without persistence, on the load's CPU."""
    run.redis_port = free_port()
    run.procs.append(
        subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(run.redis_port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            preexec_fn=pinned(CPU_LOAD),
        )
    )


def gateway_env(
    upstream_url: str, port: int, redis_port: int, workers: int, secret: bytes | None
) -> dict[str, str]:
    """The environment of one gateway: this process's, with the gateway's settings over it."""
    env = {
        **os.environ,
        "RLGATE_UPSTREAM_URL": upstream_url,
        "RLGATE_PORT": str(port),
        "RLGATE_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
        "RLGATE_LOG_FORMAT": "json",
        # each load worker records into one rollout for the whole run (bench-<i>): at concurrency 1 that
        # is every call of the run, above the default cap of 10,000 calls a rollout (409 rollout_full)
        "RLGATE_MAX_CALLS_PER_ROLLOUT": "0",
        **({"RLGATE_WORKERS": str(workers)} if workers else {}),
    }
    if secret is not None:
        env.update(
            RLGATE_ROLLOUT_KEY_SECRET=secret.decode(),
            RLGATE_REQUIRE_ROLLOUT_KEYS="true",
            RLGATE_OPERATOR_TOKEN=os.urandom(16).hex(),
        )
    return env


def start_gateways(
    run: Run, upstream_url: str, worker_counts: list[int], baseline: Path | None, agents: int
) -> None:
    """One gateway per worker count (and the baseline checkout's), each recording under its own key prefix,
    on the proxies' CPU; each is a target once its /healthz answers. With rollout keys, the agents'
    rollouts (bench-0 .. bench-<agents - 1>) are created on each first, as POST /rollouts would hand an
    agent its key: a rollout key is valid only for a rollout that exists."""
    gateways = [(f"rlgate-{n}w" if n else "rlgate", n, ROOT) for n in worker_counts]
    if baseline is not None:
        gateways.append(("rlgate-baseline", 0, baseline.resolve()))
    for name, workers, root in gateways:  # workers 0: one gateway, as `rlgate gateway` starts by default
        gw_port = free_port()
        env = gateway_env(upstream_url, gw_port, run.redis_port, workers, run.secret)
        gateway = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rlgate",
                "gateway",
            ],  # the code of `root` (python -m: its folder first)
            env={**env, "RLGATE_KEY_PREFIX": name},
            cwd=root,
            stdout=(run.tmp / f"{name}.log").open("wb"),
            stderr=subprocess.STDOUT,
            preexec_fn=pinned(CPU_PROXY),
        )
        run.procs.append(gateway)
        wait_http(f"http://127.0.0.1:{gw_port}/healthz")
        if run.secret is not None:
            create_rollouts(f"http://127.0.0.1:{gw_port}", env["RLGATE_OPERATOR_TOKEN"], agents)
        run.targets[name] = (f"http://127.0.0.1:{gw_port}/v1", gateway.pid)
        run.dashboard = (f"http://127.0.0.1:{gw_port}", env.get("RLGATE_OPERATOR_TOKEN"))


def create_rollouts(base: str, token: str, n: int) -> None:
    import urllib.request

    for i in range(n):
        request = urllib.request.Request(
            f"{base}/rollouts",
            data=json.dumps({"rollout_id": f"bench-{i}"}).encode(),
            headers={"authorization": f"Bearer {token}", "content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert answer.status == 201, answer.status


def start_litellm(run: Run, binary: str, upstream_url: str) -> None:
    """The LiteLLM proxy (one worker, no database) in front of the upstream, on the proxies' CPU; a target
    once it is live (its log's tail on stderr if it never is)."""
    ll_port = free_port()
    config = run.tmp / "litellm.yaml"
    config.write_text(
        f"model_list:\n  - model_name: {MODEL}\n    litellm_params:\n"
        f"      model: hosted_vllm/{MODEL}\n      api_base: {upstream_url}\n"
        f"      api_key: none\n"
    )
    litellm = subprocess.Popen(
        [binary, "--config", str(config), "--port", str(ll_port), "--num_workers", "1"],
        cwd=run.tmp,
        stdout=(run.tmp / "litellm.log").open("wb"),
        stderr=subprocess.STDOUT,
        preexec_fn=pinned(CPU_PROXY),
        env={**os.environ, "LITELLM_LOG": "ERROR", "LITELLM_MASTER_KEY": BENCH_KEY},
    )
    run.procs.append(litellm)
    try:
        wait_http(f"http://127.0.0.1:{ll_port}/health/liveliness", timeout=180)
    except Exception:
        print((run.tmp / "litellm.log").read_text()[-3000:], file=sys.stderr)
        raise
    run.targets["litellm"] = (f"http://127.0.0.1:{ll_port}/v1", litellm.pid)


def parse_cells(spec: str, sizes: list[int]) -> list[tuple[bool, int, int]]:
    """(stream, concurrency, prompt's extra characters) of each cell: the cells of `spec` once per size."""
    return [
        (mode == "stream", int(conc), chars)
        for chars in sizes
        for mode, conc in (cell.split(":") for cell in spec.split(","))
    ]


def warm_up(run: Run, cells: list[tuple[bool, int, int]]) -> None:
    """200 requests per cell to every target, before anything is measured."""
    for name, (url, _) in run.targets.items():
        for stream, conc, chars in cells:
            asyncio.run(
                drive(
                    f"{url}/chat/completions",
                    stream,
                    conc,
                    200,
                    run.secret if name.startswith("rlgate") else None,
                    chars,
                )
            )


def start_py_spy(prefix: str, pid: int, stream: bool, conc: int, chars: int) -> subprocess.Popen:
    """py-spy recording the process `pid` into PREFIX-<cell>.svg, once it had a second to attach."""
    out = f"{prefix}-{'stream' if stream else 'unary'}-c{conc}-p{chars}.svg"
    spy = subprocess.Popen(
        [
            shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"),
            "record",
            "--pid",
            str(pid),
            "--rate",
            "1000",
            "--nonblocking",
            "--output",
            out,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.0)  # py-spy attaches
    return spy


def measure_cell(run: Run, name: str, cell: tuple[bool, int, int], requests: int, py_spy: str | None) -> None:
    """One round of one cell on the target `name`: its latencies, throughput and CPU per request into
    `run.results`, and for a gateway what its calls cost Redis into `run.redis_cost` (profiled into py-spy's
    flame graphs when `py_spy` is a prefix)."""
    stream, conc, chars = cell
    url, pid = run.targets[name]
    spy = start_py_spy(py_spy, pid, stream, conc, chars) if py_spy else None
    cpu0 = tree_cpu_seconds(pid) if pid else 0.0
    keys = run.secret if name.startswith("rlgate") else None
    before = redis_counters(run.redis_port) if name.startswith("rlgate") else None
    wall, lat, ttfb = uvloop.run(drive(f"{url}/chat/completions", stream, conc, requests, keys, chars))
    cpu = (tree_cpu_seconds(pid) - cpu0) if pid else float("nan")
    if before is not None:  # what the recording cost Redis, per call of this cell
        after = redis_counters(run.redis_port)
        per_call = run.redis_cost.setdefault((name, stream, chars), {k: [] for k in after})
        for key, value in after.items():
            per_call[key].append((value - before[key]) / len(lat))
    if spy is not None:
        spy.send_signal(signal.SIGINT)  # py-spy writes its flame graph and exits
        spy.wait(timeout=60)
    result = run.results.setdefault(
        (name, stream, conc, chars), {"rps": [], "lat": [], "ttfb": [], "cpu": []}
    )
    result["rps"].append(len(lat) / wall)
    result["lat"].extend(lat)
    result["ttfb"].extend(ttfb)
    result["cpu"].append(cpu / len(lat) * 1000)


def run_rounds(run: Run, args: argparse.Namespace, cells: list[tuple[bool, int, int]]) -> dict[str, int]:
    """`args.rounds` rounds, each every cell on every target in turn, the dashboard read meanwhile with
    --poll-ui; returns the dashboard reader's counts of pages read and failed."""
    stop_polling, polled = threading.Event(), {"ok": 0, "failed": 0}
    if args.poll_ui:
        poller = threading.Thread(
            target=poll_dashboard,
            args=(*run.dashboard, args.poll_ui, stop_polling, polled),
            daemon=True,
        )
        poller.start()
    for r in range(args.rounds):
        for cell in cells:
            for name in run.targets:
                profile = name.startswith("rlgate") and r == args.rounds - 1
                measure_cell(run, name, cell, args.requests, args.py_spy if profile else None)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    stop_polling.set()
    return polled


def print_latency_table(run: Run, cells: list[tuple[bool, int, int]], sized: bool) -> None:
    """Per cell and target: throughput, latency, TTFB, added p50 over direct, proxy CPU per request."""
    print(
        ("| prompt chars " if sized else "")
        + "| target | stream | concurrency | req/s | p50 ms | p99 ms | TTFB p50 ms | added p50 ms | proxy CPU ms/req |"
    )
    print(("|---:" if sized else "") + "|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for stream, conc, chars in cells:
        base = pct(run.results[("direct", stream, conc, chars)]["lat"], 50)
        for name in run.targets:
            c = run.results[(name, stream, conc, chars)]
            p50 = pct(c["lat"], 50)
            cpu = statistics.median(c["cpu"])
            print(
                (f"| {chars:,} " if sized else "")
                + f"| {name} | {'yes' if stream else 'no'} | {conc} | {statistics.median(c['rps']):,.0f} | "
                f"{p50:.2f} | {pct(c['lat'], 99):.2f} | {pct(c['ttfb'], 50):.2f} | "
                f"{'' if name == 'direct' else f'{p50 - base:+.2f}'} | "
                f"{'' if name == 'direct' else f'{cpu:.3f}'} |"
            )


def print_redis_table(run: Run, sized: bool) -> None:
    """Per gateway, stream mode and prompt size: what a call cost Redis, the median over the rounds and
    concurrencies."""
    print(
        "\nRedis per recorded call (deltas of the dedicated redis-server's INFO over each cell, divided by "
        "its calls; each load worker records into one rollout of its own, bench-<i>, for the whole run, "
        "so this is a call added to an open rollout: the rollout's own hash and index entries, once per "
        "episode, are not in it; nothing is consumed or expired during the run)\n"
    )
    print(
        ("| prompt chars " if sized else "")
        + "| target | stream | commands/call | bytes in/call | bytes out/call | memory/call | keys/call |"
    )
    print(("|---:" if sized else "") + "|---|---|---:|---:|---:|---:|---:|")
    for (name, stream, chars), cost in run.redis_cost.items():
        med = {k: statistics.median(v) for k, v in cost.items()}
        print(
            (f"| {chars:,} " if sized else "")
            + f"| {name} | {'yes' if stream else 'no'} | {med['commands']:.2f} | {med['in']:,.0f} | "
            f"{med['out']:,.0f} | {med['memory']:,.0f} B | {med['keys']:.2f} |"
        )


def print_report(
    run: Run,
    args: argparse.Namespace,
    cells: list[tuple[bool, int, int]],
    sized: bool,
    polled: dict[str, int],
) -> None:
    """The run's layout, the dashboard reader's counts, and the two tables; `sized`: a prompt-size column."""
    layout = (
        f"proxies on CPU {CPU_PROXY}, load + upstream + redis on CPU {CPU_LOAD}"
        if PIN
        else f"nothing pinned: everything shares the {os.cpu_count()} CPUs"
    )
    print(f"\n{args.rounds} rounds x {args.requests} requests per cell; {layout}\n")
    if args.poll_ui:
        print(
            f"dashboard read every {args.poll_ui:g} s during the load: {polled['ok']} pages, "
            f"{polled['failed']} failed\n"
        )
    print_latency_table(run, cells, sized)
    print_redis_table(run, sized)


def stop(run: Run) -> None:
    """SIGTERM to every process, the last started first; SIGKILL to those still there after 10 s each;
    the temporary folder removed."""
    for p in reversed(run.procs):
        p.send_signal(signal.SIGTERM)
    for p in run.procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
    shutil.rmtree(run.tmp, ignore_errors=True)


def main() -> None:
    args = parse_args()
    if args.upstream_only:
        serve_upstream(args.upstream_only, Path(args.bodies))
        return

    global PIN
    PIN = args.workers is None
    worker_counts = [int(n) for n in args.workers.split(",")] if args.workers else [0]
    args.cells = args.cells or (
        "unary:64,stream:64" if args.workers else "unary:1,unary:32,stream:1,stream:32"
    )
    if PIN:
        os.sched_setaffinity(0, {CPU_LOAD})
    run = Run(tmp=Path(tempfile.mkdtemp(prefix="rlgate-bench-")))
    try:
        sizes = [int(n) for n in args.prompt_chars.split(",")]
        capture_bodies(run.tmp / "bodies.json", sizes)
        upstream_url = start_upstream(run)
        start_redis(run)
        run.secret = os.urandom(16).hex().encode() if args.rollout_keys else None
        run.targets["direct"] = (upstream_url, None)
        cells = parse_cells(args.cells, sizes)
        start_gateways(run, upstream_url, worker_counts, args.baseline, max(c for _, c, _ in cells))
        if args.litellm != "none":
            start_litellm(run, args.litellm, upstream_url)

        warm_up(run, cells)
        polled = run_rounds(run, args, cells)
        print_report(run, args, cells, len(sizes) > 1, polled)
    finally:
        stop(run)


if __name__ == "__main__":
    main()
