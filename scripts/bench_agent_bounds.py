"""What an adversarial agent can make the gateway and Redis hold, with the per-agent bounds on (the defaults,
docs/security.md) and lifted, side by side in one run.

Each probe runs against a fresh `rlgate gateway` process (one worker) and a Redis of its own, in front of
an upstream written here that answers in vLLM's chat completion shape as fast as a socket takes it (the
engine's speed is not what is measured; its answers' size is):

1. `n=64, max_tokens=8192`: a call asking for 524,288 tokens with log-probs. Bounded: 400 limit_exceeded
   before the upstream is called (max_n 16). Lifted: the upstream answers all of it.
2. `n=16, max_tokens=16384`: the most the default token bounds let one call ask for (max_tokens_per_call
   262,144), the same on and lifted: what a call within the bounds costs.
3. An answer without end (a server that keeps sending; a stream that never finishes is the same to the
   reader). Bounded: read up to max_answer_bytes (128 MiB), then cut. Lifted: read until the upstream
   stops at `--endless-mib` (default 1024).
4. One rollout that keeps calling with 256 KiB requests (`--calls`, default 1200: 300 MiB). Bounded:
   max_rollout_bytes, here set to 64 MiB so the run stays short (the default is 256 MiB). Lifted: 0.

Printed per probe and configuration: the agent's answers (status codes), bytes the upstream sent, the
gateway's peak resident memory (VmHWM), Redis's used memory after the probe and the seconds it took.

Run:  .venv/bin/python scripts/bench_agent_bounds.py [--endless-mib 1024] [--calls 1200]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis

from rlgate._net import LoopbackServer, free_port, read_request

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench-model"
LIFTED = {
    "max_n": "1000000",
    "max_tokens_per_choice": "100000000",
    "max_tokens_per_call": "100000000000",
    "max_answer_bytes": str(1 << 40),
    "max_record_bytes": str(1 << 40),
    "max_rollout_bytes": "0",
    "max_calls_per_rollout": "0",
}


class Upstream(LoopbackServer):
    """A chat-completions server in vLLM's answer shape: n choices of max_tokens tokens each, with
    log-probs and token ids, generated as it is sent; `endless` keeps sending until `stop_after` bytes."""

    def __init__(self, endless: bool = False, stop_after: int = 0) -> None:
        self.endless, self.stop_after = endless, stop_after
        self.sent = 0
        super().__init__()

    def serve(self, conn: socket.socket) -> None:
        while self._one(conn):
            pass

    def _one(self, conn: socket.socket) -> bool:
        request = read_request(conn)
        if request is None:
            return False
        head, body = request
        if head.startswith(b"GET"):
            models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(models), models)
            )
            return True
        conn.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        for piece in self._answer(json.loads(body)):
            conn.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.sent += len(piece)
            if self.stop_after and self.sent >= self.stop_after:
                return False  # hang up: the answer never ends properly
        conn.sendall(b"0\r\n\r\n")
        return True

    def _answer(self, request: dict):
        n, tokens = int(request.get("n") or 1), int(request.get("max_tokens") or 16)
        entry = b'{"token":"x","logprob":-0.5,"bytes":[120],"top_logprobs":[]}'
        yield (
            b'{"id":"chatcmpl-b","object":"chat.completion","created":1,"model":"%s","choices":['
            % MODEL.encode()
        )
        for i in range(n):
            per = tokens if not self.endless else 1 << 40
            yield b'%s{"index":%d,"message":{"role":"assistant","content":"%s"},"logprobs":{"content":[' % (
                b"," if i else b"",
                i,
                b"x" * min(per, 1 << 16),
            )
            done = 0
            while done < per:
                k = min(4096, per - done)
                yield (b"," if done else b"") + b",".join([entry] * k)
                done += k
            yield b']},"finish_reason":"length","stop_reason":null,"token_ids":[%s]}' % b",".join(
                [b"120"] * tokens
            )
        yield (
            b'],"usage":{"prompt_tokens":4,"completion_tokens":%d,"total_tokens":%d},"prompt_token_ids":[1,2,3,4]}'
            % (
                n * tokens,
                n * tokens + 4,
            )
        )


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_probe(name: str, bounded: bool, work: Path, args: argparse.Namespace) -> dict:
    redis_port, port = free_port(), free_port()
    server = subprocess.Popen(
        [
            "redis-server",
            "--bind",
            "127.0.0.1",
            "--port",
            str(redis_port),
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
    )
    upstream = Upstream(
        endless=name == "endless", stop_after=args.endless_mib << 20 if name == "endless" else 0
    )
    settings = {} if bounded else dict(LIFTED)
    if name == "rollout" and bounded:
        settings["max_rollout_bytes"] = str(64 << 20)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLGATE_")}
    env.update({f"RLGATE_{k.upper()}": v for k, v in settings.items()})
    env.update(
        RLGATE_UPSTREAM_URL=upstream.url,
        RLGATE_REDIS_URL=f"redis://127.0.0.1:{redis_port}/0",
        RLGATE_PORT=str(port),
        RLGATE_LOG_LEVEL="warning",
        RLGATE_UPSTREAM_TIMEOUT_S="600",
        RLGATE_MAX_BODY_BYTES=str(16 << 20),
    )
    log = open(work / f"gateway-{name}-{bounded}.log", "w")  # noqa: SIM115
    gateway = subprocess.Popen(
        [sys.executable, "-m", "rlgate", "gateway"], env=env, cwd=ROOT, stdout=log, stderr=log
    )
    client = redis.Redis(port=redis_port)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or gateway.poll() is not None:
                raise SystemExit(
                    f"the gateway did not start: {(work / f'gateway-{name}-{bounded}.log').read_text()[-2000:]}"
                )
            time.sleep(0.1)
        base_memory = int(client.info("memory")["used_memory"])
        statuses: collections.Counter[int] = collections.Counter()
        chat = f"{url}/rollouts/probe-{name}/v1/chat/completions"
        messages = [{"role": "user", "content": "hi"}]
        t0 = time.monotonic()
        if name in ("n64", "n16"):
            n, tokens = (64, 8192) if name == "n64" else (16, 16384)
            body = {"model": MODEL, "messages": messages, "n": n, "max_tokens": tokens}
            statuses[httpx.post(chat, json=body, timeout=600).status_code] += 1
        elif name == "endless":
            body = {"model": MODEL, "messages": messages, "max_tokens": 16}
            try:
                statuses[httpx.post(chat, json=body, timeout=600).status_code] += 1
            except httpx.HTTPError:
                statuses[0] += 1  # the gateway hung up (or died)
        else:
            body = {"model": MODEL, "messages": messages, "max_tokens": 4, "pad": "x" * (256 << 10)}
            with httpx.Client(timeout=60) as http:
                for _ in range(args.calls):
                    statuses[http.post(chat, json=body).status_code] += 1
        seconds = time.monotonic() - t0
        rss = peak_rss_mib(gateway.pid)
        used = int(client.info("memory")["used_memory"]) - base_memory
        return {
            "probe": name,
            "bounds": "on" if bounded else "lifted",
            "answers": ", ".join(f"{k} x{v}" if v > 1 else str(k) for k, v in sorted(statuses.items())),
            "upstream MiB": upstream.sent / (1 << 20),
            "gateway peak RSS MiB": rss,
            "Redis MiB": used / (1 << 20),
            "s": seconds,
        }
    finally:
        gateway.terminate()
        try:
            gateway.wait(10)
        except subprocess.TimeoutExpired:
            gateway.kill()
        log.close()
        upstream.close()
        server.kill()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--endless-mib", type=int, default=1024, help="where the endless answer stops, lifted"
    )
    parser.add_argument("--calls", type=int, default=1200, help="calls of 256 KiB into one rollout")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlgate-bounds-") as tmp:
        for name in ("n64", "n16", "endless", "rollout"):
            for bounded in (True, False):
                rows.append(run_probe(name, bounded, Path(tmp), args))
                print(json.dumps(rows[-1]), file=sys.stderr)
    columns = list(rows[0])
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        cells = [f"{v:,.1f}" if isinstance(v, float) else str(v) for v in row.values()]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
