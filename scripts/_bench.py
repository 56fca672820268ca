"""What several benchmarks in scripts/ share: `rlgate gateway` started as a process and waited for."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from rlgate._net import free_port

ROOT = Path(__file__).resolve().parent.parent


def start_gateway(env: dict[str, str], log: Path) -> tuple[str, subprocess.Popen]:
    """`rlgate gateway` of this checkout on a free port, with `env` over this process's environment, its
    output in `log`; returns (its URL, its process) once `/healthz` answers 200 (exits if it never does)."""
    port = free_port()
    environ = {**os.environ, **env, "RLGATE_PORT": str(port), "RLGATE_LOG_LEVEL": "warning"}
    process = subprocess.Popen(
        [sys.executable, "-m", "rlgate", "gateway"],
        cwd=ROOT,
        env=environ,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        if process.poll() is not None:
            break
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return url, process
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    process.kill()
    raise SystemExit(f"the gateway did not start; see {log}")
