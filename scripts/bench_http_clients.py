"""Benchmark async HTTP clients for rlgate's upstream hot path (rlgate's own vs aiohttp, httpx, httpcore).

Method
  * Upstream: a minimal HTTP/1.1 keep-alive server (raw asyncio protocol on uvloop) in a subprocess
    pinned to CPU 1. POST /v1/chat/completions returns a fixed ~1.5 KB vLLM-style chat completion, or
    with "stream": true a chunked text/event-stream of 20 `data: {...}` events + `data: [DONE]`,
    one write per event, yielding to the loop in between.
  * Clients run in this process, pinned to CPU 0, on uvloop unless --no-uvloop (with uvloop,
    aiohttp also runs on the stdlib loop as "aiohttp/asyncio"). httpx2/httpcore2 (pydantic's forks,
    same API) are included when installed. Cells: client x {plain, stream} x concurrency {1, 32};
    plain POSTs a ~1 KB JSON body and reads the whole body, stream reads it chunk by chunk as it
    arrives, as a proxy would (aiohttp iter_any(), httpx aiter_raw(), httpcore aiter_stream()).
  * Each cell: fresh client sized for its concurrency, warm-up, then N requests from `concurrency`
    workers. Clients are interleaved cell by cell within each round so drift hits all equally;
    rounds are pooled. Response sizes are checked.
  * req/s = requests / wall; CPU us/req = client process time.process_time() delta / requests (and
    its min-max over rounds); p50/p99 per-request latency; upstream CPU % = server CPU / wall
    (near 100 means req/s is bounded by the fake upstream; CPU us/req is still valid).
  * httpcore 1.x calls sniffio on every lock; without sniffio installed it re-tries the import each
    time, which is slow, so install sniffio (rlgate's .venv has it).

Run (full: about 4 min on a 2-vCPU VM; --quick: about 30 s)
  python3 -m venv /tmp/clientbench-venv
  /tmp/clientbench-venv/bin/pip install aiohttp httpx httpcore sniffio uvloop  # optional: httpx2
  /tmp/clientbench-venv/bin/python scripts/bench_http_clients.py [--quick] [--no-uvloop]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from functools import partial
from operator import methodcaller

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

PATH = "/v1/chat/completions"
TEXT = "The quick brown fox jumps over the lazy dog. " * 40
REQ = {
    "model": "Qwen/Qwen2.5-7B-Instruct",
    "max_tokens": 256,
    "temperature": 0.7,
    "top_p": 0.95,
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": TEXT[:800]},
    ],
}
PLAIN_BODY = json.dumps({**REQ, "stream": False}).encode()
STREAM_BODY = json.dumps({**REQ, "stream": True}).encode()
BASE = {
    "id": "chatcmpl-8f2c1e6b0d4a4c5e9b7a3f1d2e6c8a90",
    "created": 1732890000,
    "model": "Qwen/Qwen2.5-7B-Instruct",
}


def _http(status_extra: bytes, body: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nserver: fake-vllm\r\nconnection: keep-alive\r\n" + status_extra + body


def _build_responses() -> tuple[bytes, bytes, list[bytes]]:
    body = json.dumps(
        {
            **BASE,
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": TEXT[:1100],
                        "tool_calls": [],
                        "reasoning_content": None,
                    },
                    "logprobs": None,
                    "finish_reason": "stop",
                    "stop_reason": None,
                }
            ],
            "usage": {
                "prompt_tokens": 190,
                "total_tokens": 440,
                "completion_tokens": 250,
                "prompt_tokens_details": None,
            },
            "prompt_logprobs": None,
        }
    ).encode()
    plain = _http(b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body), body)
    events = []
    for i in range(20):
        delta = {"role": "assistant", "content": ""} if i == 0 else {"content": f" tok{i:02d}en"}
        events.append(
            json.dumps(
                {
                    **BASE,
                    "object": "chat.completion.chunk",
                    "choices": [
                        {
                            "index": 0,
                            "delta": delta,
                            "logprobs": None,
                            "finish_reason": "stop" if i == 19 else None,
                        }
                    ],
                }
            ).encode()
        )
    events = [b"data: " + e + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]
    chunks = [b"%x\r\n%s\r\n" % (len(e), e) for e in events] + [b"0\r\n\r\n"]
    head = _http(b"content-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    return plain, head, chunks


# ----------------------------------------------------------------------------- upstream server
def serve() -> None:
    os.sched_setaffinity(0, {1 % os.cpu_count()})
    plain, stream_head, chunks = _build_responses()
    clen = re.compile(rb"content-length:\s*(\d+)", re.IGNORECASE)

    class Upstream(asyncio.Protocol):
        def connection_made(self, transport):
            self.t, self.buf = transport, b""  # clients don't pipeline; one request at a time

        def data_received(self, data):
            self.buf += data
            while (end := self.buf.find(b"\r\n\r\n")) >= 0:
                m = clen.search(self.buf, 0, end)
                total = end + 4 + (int(m.group(1)) if m else 0)
                if len(self.buf) < total:
                    return
                body, self.buf = self.buf[end + 4 : total], self.buf[total:]
                if b'"stream": true' in body or b'"stream":true' in body:
                    self.task = asyncio.ensure_future(self.stream())  # keep a reference
                else:
                    self.t.write(plain)

        async def stream(self):
            self.t.write(stream_head)
            for c in chunks:
                await asyncio.sleep(0)
                if self.t.is_closing():
                    return
                self.t.write(c)

    async def main():
        srv = await asyncio.get_running_loop().create_server(Upstream, "127.0.0.1", 0, backlog=1024)
        print(srv.sockets[0].getsockname()[1], flush=True)
        await srv.serve_forever()

    (uvloop.run if uvloop else asyncio.run)(main())  # upstream always on uvloop when available


# ----------------------------------------------------------------------------- clients
async def make_client(lib: str, conc: int, url: str):
    """Return (plain, stream, close); plain/stream(body) -> number of response body bytes."""
    hdrs = {"Content-Type": "application/json"}
    if lib == "rlgate":  # gateway._http, what the gateway uses
        from gateway._http import Client

        c = Client(url.rsplit(PATH, 1)[0], limit=conc, headers=hdrs)

        async def plain(body):
            async with c.request("POST", PATH, body) as r:
                return len(await r.read())

        async def stream(body):
            n = 0
            async with c.request("POST", PATH, body) as r:
                async for chunk in r.chunks():
                    n += len(chunk)
            return n

        return plain, stream, c.aclose
    mod = importlib.import_module(lib)
    if lib == "aiohttp":
        s = mod.ClientSession(
            connector=mod.TCPConnector(limit=conc, limit_per_host=conc), auto_decompress=False
        )
        post, kw, close = partial(s.post, url, headers=hdrs), "data", s.close
        read, chunks = methodcaller("read"), (lambda r: r.content.iter_any())
    elif lib.startswith("httpx"):  # client.post() is stream() + aread() internally
        c = mod.AsyncClient(
            limits=mod.Limits(max_connections=conc, max_keepalive_connections=conc),
            timeout=30.0,
            trust_env=False,
        )
        post, kw, close = partial(c.stream, "POST", url, headers=hdrs), "content", c.aclose
        read, chunks = methodcaller("aread"), methodcaller("aiter_raw")
    else:  # httpcore / httpcore2
        p = mod.AsyncConnectionPool(max_connections=conc, max_keepalive_connections=conc)
        post, kw, close = partial(p.stream, "POST", url, headers=hdrs), "content", p.aclose
        read, chunks = methodcaller("aread"), methodcaller("aiter_stream")

    async def plain(body):
        async with post(**{kw: body}) as r:
            return len(await read(r))

    async def stream(body):
        n = 0
        async with post(**{kw: body}) as r:
            async for chunk in chunks(r):
                n += len(chunk)
        return n

    return plain, stream, close


async def drive(fn, body: bytes, conc: int, n: int, lat: list | None = None) -> int:
    left, nbytes = n, 0
    clock = time.perf_counter

    async def worker():
        nonlocal left, nbytes
        while left > 0:
            left -= 1
            t = clock()
            got = await fn(body)  # not `nbytes += await ...`: that loses updates across tasks
            nbytes += got
            if lat is not None:
                lat.append(clock() - t)

    await asyncio.gather(*(worker() for _ in range(conc)))
    return nbytes


def _installed(pkg: str) -> bool:
    if pkg == "rlgate":
        pkg = "gateway"
    return importlib.util.find_spec(pkg) is not None


def proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_cell(lib, mode, conc, n, warm, url, srv_pid, expect):
    plain, stream, close = await make_client(lib, conc, url)
    fn, body = (stream, STREAM_BODY) if mode == "stream" else (plain, PLAIN_BODY)
    await drive(fn, body, conc, warm)
    lat: list[float] = []
    w0, c0, s0 = time.perf_counter(), time.process_time(), proc_cpu(srv_pid)
    nbytes = await drive(fn, body, conc, n, lat)
    w1, c1, s1 = time.perf_counter(), time.process_time(), proc_cpu(srv_pid)
    await close()
    assert nbytes == n * expect[mode], (lib, mode, nbytes, n * expect[mode])
    return {"wall": w1 - w0, "cpu": c1 - c0, "srv": s1 - s0, "n": n, "lat": lat}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 rounds x 500 requests per cell")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=3000, help="requests per cell per round")
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument(
        "--clients",
        default="rlgate,aiohttp,httpx,httpcore,httpx2,httpcore2",
        help="comma-separated; ones not installed are skipped (httpx2/httpcore2 optional)",
    )
    ap.add_argument("--no-uvloop", action="store_true", help="run all clients on the stdlib loop")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        return serve()
    if a.quick:
        a.rounds, a.requests, a.warmup = 2, 500, 100
    use_uv = uvloop is not None and not a.no_uvloop
    if os.cpu_count() < 2:
        print("warning: <2 CPUs, client and upstream share a core", file=sys.stderr)

    srv = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{int(srv.stdout.readline())}{PATH}"
        os.sched_setaffinity(0, {0})
        plain, _, chunks = _build_responses()
        expect = {
            "plain": len(plain.split(b"\r\n\r\n", 1)[1]),
            "stream": sum(len(c.split(b"\r\n", 1)[1]) - 2 for c in chunks),
        }
        loops = {"uvloop": uvloop.new_event_loop} if use_uv else {}
        loops["asyncio"] = asyncio.new_event_loop
        main_loop = "uvloop" if use_uv else "asyncio"
        variants = [(lib, main_loop) for lib in a.clients.split(",") if _installed(lib)]
        if use_uv and ("aiohttp", "uvloop") in variants:
            variants.append(("aiohttp", "asyncio"))
        cells = [(m, c) for m in ("plain", "stream") for c in (1, 32)]
        res: dict = {}
        for rnd in range(a.rounds):
            for mode, conc in cells:
                for lib, loop in variants:
                    with asyncio.Runner(loop_factory=loops[loop]) as r:
                        out = r.run(run_cell(lib, mode, conc, a.requests, a.warmup, url, srv.pid, expect))
                    print(
                        f"round {rnd + 1} {lib}/{loop:7} {mode:6} c={conc:<2} "
                        f"{out['n'] / out['wall']:8.0f} req/s {out['cpu'] / out['n'] * 1e6:6.1f} us/req",
                        file=sys.stderr,
                    )
                    res.setdefault((lib, loop, mode, conc), []).append(out)
    finally:
        srv.terminate()
        srv.wait()

    print(
        f"\nPython {platform.python_version()} | "
        + " | ".join(
            f"{p} {md.version(p)}"
            for p in (
                "aiohttp",
                "httpx",
                "httpcore",
                "httpx2",
                "httpcore2",
                "h11",
                "anyio",
                "sniffio",
                "uvloop",
            )
            if _installed(p)
        )
    )
    if not _installed("sniffio"):
        print("WARNING: sniffio missing: httpcore 1.x retries `import sniffio` per lock (slow)")
    print(
        f"client loop: {main_loop}; {a.rounds} rounds x {a.requests} req/cell (+{a.warmup} warm-up); "
        "client CPU 0, upstream CPU 1"
    )
    print("CPU us/req: pooled over rounds (min-max of rounds)\n")
    print("| client | mode | concurrency | req/s | CPU us/req | p50 ms | p99 ms | upstream CPU % |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for mode, conc in cells:
        for lib, loop in variants:
            rs = res[(lib, loop, mode, conc)]
            n, wall = sum(r["n"] for r in rs), sum(r["wall"] for r in rs)
            cpu, srv_cpu = sum(r["cpu"] for r in rs), sum(r["srv"] for r in rs)
            per = sorted(r["cpu"] / r["n"] * 1e6 for r in rs)
            q = statistics.quantiles([x for r in rs for x in r["lat"]], n=100, method="inclusive")
            print(
                f"| {lib}/{loop} | {mode} | {conc} | {n / wall:,.0f} | "
                f"{cpu / n * 1e6:.0f} ({per[0]:.0f}-{per[-1]:.0f}) | "
                f"{q[49] * 1e3:.3f} | {q[98] * 1e3:.3f} | {srv_cpu / wall * 100:.0f} |"
            )


if __name__ == "__main__":
    main()
