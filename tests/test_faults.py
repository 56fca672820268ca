"""The loop's services ride out each other dying, as `scripts/chaos` kills them: real processes (`rlgate
serve`, the gateway, the reward worker, the learner) on a Redis of their own, which a test kills with
SIGKILL and starts again (AOF on, as docs/deployment.md asks). Each test fails on the code before the fix
it guards: the learner and the worker exited when Redis went away, the learner exited when no inference
server took its push, a restarted server never got the pointer's adapter back (every call a 404 until
the next push, which needs episodes those calls cannot make), and a reward job whose worker died waited
for rq's maintenance, ten minutes by default."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis
from conftest import ROOT, Proc, free_port, start_gateway, start_rlgate_serve

MODEL = "tiny"
TESTS_ON_PATH = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}


class AofRedis:
    """A redis-server of its own with an append-only file, killed and started again on the same port."""

    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process: subprocess.Popen | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.directory)]
            + ["--save", "", "--appendonly", "yes", "--appendfsync", "everysec"],
            stdout=subprocess.DEVNULL,
        )
        client = self.client()
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                return
            except redis.RedisError:  # also "loading the dataset"
                assert self.process.poll() is None and time.monotonic() < deadline, (
                    "redis-server did not start"
                )
                time.sleep(0.05)

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    from rlgate.inference.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("faults") / "tiny", seed=3)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[AofRedis]:
    server = AofRedis(tmp_path / "redis")
    server.start()
    yield server
    if server.process is not None and server.process.poll() is None:
        server.kill()


def spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        args, env={**os.environ, **env}, cwd=ROOT, stdout=log.open("ab"), stderr=subprocess.STDOUT
    )


def learner(model: Path, store: AofRedis, servers: list[str], out: Path, **settings: str) -> subprocess.Popen:
    env = {
        "RLGATE_LEARNER_REDIS_URL": store.url,
        "RLGATE_LEARNER_MODEL": str(model),
        "RLGATE_LEARNER_SERVED_MODEL_NAME": MODEL,
        "RLGATE_LEARNER_INFERENCE_URLS": json.dumps(servers),
        "RLGATE_LEARNER_OUTPUT_DIR": str(out),
        "RLGATE_LEARNER_TASKS_PER_STEP": "1",
        "RLGATE_LEARNER_ROLLOUTS_PER_TASK": "2",
        "RLGATE_LEARNER_LOG_FORMAT": "json",
        **{f"RLGATE_LEARNER_{k.upper()}": v for k, v in settings.items()},
    }
    return spawn([sys.executable, "-m", "rlgate", "learner"], env, out.parent / "learner.log")


def worker(store: AofRedis, log: Path, **settings: str) -> subprocess.Popen:
    env = {
        "RLGATE_REDIS_URL": store.url,
        "RLGATE_REWARD_FN_MODULES": '["stall_rewards"]',
        **TESTS_ON_PATH,
        **{f"RLGATE_{k.upper()}": v for k, v in settings.items()},
    }
    return spawn([sys.executable, "-m", "rlgate", "worker", "--fork", "false"], env, log)


def call(gateway: Proc, task: str) -> str:
    rid = uuid.uuid4().hex
    client = openai.OpenAI(base_url=f"{gateway.url}/tasks/{task}/rollouts/{rid}/v1", api_key="unused")
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "2+2="}], max_tokens=2, temperature=1.0
    )
    return rid


def finish_by_job(gateway: Proc, rid: str, store: AofRedis, seconds: float = 0.0) -> None:
    body = {
        "reward_fn": "stall_rewards:sleeps",
        "params": {"seconds": seconds, "runs": [store.url, f"runs:{rid}"]},
    }
    response = httpx.post(f"{gateway.url}/rollouts/{rid}/finish", json=body, timeout=30)
    assert response.status_code == 202, response.text


def status(store: AofRedis, rid: str) -> bytes | None:
    return store.client().hget(f"rlgate:rollout:{{{rid}}}", "status")


def wait_until(predicate, timeout_s: float, what: str, *alive: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        for process in alive:
            assert process.poll() is None, f"{what}: a process exited with {process.returncode}"
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.1)


def steps(out: Path) -> list[dict]:
    path = out / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def group_exists(store: AofRedis) -> bool:
    try:
        return bool(store.client().xinfo_groups("rlgate:episodes"))
    except redis.RedisError:
        return False


def gateway_with_jobs(tmp_path: Path, serve: Proc, store: AofRedis, **settings: str) -> Proc:
    """A gateway that may name `stall_rewards` (the `jobs_path` fixture puts it on the path)."""
    return start_gateway(
        tmp_path, serve.url + "/v1", redis_url=store.url, reward_fn_modules='["stall_rewards"]', **settings
    )


@pytest.fixture
def jobs_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", TESTS_ON_PATH["PYTHONPATH"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_gateway_worker_and_learner_ride_out_a_redis_restart(
    model: Path, store: AofRedis, tmp_path: Path, jobs_path: None
):
    """Redis is killed (SIGKILL) after the first step, while the worker runs a job, and started again: the
    same gateway, worker and learner processes record, reward and train the next episodes (the learner then
    stops at max_steps)."""
    serve = start_rlgate_serve(model, tmp_path, MODEL, lora=True, weights_root=tmp_path)
    gateway = gateway_with_jobs(tmp_path, serve, store, policy_poll_s="0.1")
    jobs = worker(store, tmp_path / "worker.log")
    out = tmp_path / "learner"
    trainer = learner(model, store, [serve.url], out, max_steps="2", outage_s="120")
    try:
        wait_until(lambda: group_exists(store), 120, "the learner's group", trainer)
        for round_ in (1, 2):
            by_job, by_webhook = call(gateway, f"t{round_}"), call(gateway, f"t{round_}")
            finish_by_job(gateway, by_job, store)  # the worker's job closes it with 1.0
            answer = httpx.post(
                f"{gateway.url}/rollouts/{by_webhook}/reward", json={"reward": 0.0}, timeout=30
            )
            assert answer.status_code == 200, answer.text
            wait_until(
                lambda n=round_: len(steps(out)) == n or trainer.poll() == 0, 120, f"step {round_}", jobs
            )
            assert status(store, by_job) == b"consumed"
            if round_ == 1:
                # Redis dies while the worker runs a job (its end cannot be written: rq's loop quits)
                stalled = call(gateway, "stalled")
                finish_by_job(gateway, stalled, store, seconds=3.0)
                wait_until(
                    lambda r=stalled: store.client().get(f"runs:{r}") == b"1", 30, "the job started", jobs
                )
                store.kill()
                time.sleep(4)  # every service meets a Redis that is gone
                store.start()
        assert trainer.wait(timeout=60) == 0, (tmp_path / "learner.log").read_text()[-3000:]
        assert jobs.poll() is None and gateway.process.poll() is None  # the same processes
        assert [s["step"] for s in steps(out)] == [1, 2]
        log = (tmp_path / "learner.log").read_text()
        assert '"event":"outage"' in log.replace(" ", "") and '"event":"recovered"' in log.replace(" ", "")
    finally:
        for process in (trainer, jobs):
            if process.poll() is None:
                process.kill()
        gateway.kill()
        serve.kill()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_learner_waits_for_a_server_to_push_to_and_gives_a_restarted_one_its_adapter(
    model: Path, store: AofRedis, tmp_path: Path
):
    """The learner's only server is down when its first step is ready: the learner waits (it used to
    exit) and pushes once the server is up. The server is then killed and started again without adapters:
    the learner loads the pointer's adapter on it again within seconds."""
    recorder = start_rlgate_serve(model, tmp_path, MODEL, lora=True, weights_root=tmp_path)  # for the calls
    gateway = start_gateway(tmp_path, recorder.url + "/v1", redis_url=store.url)
    port = free_port()
    out = tmp_path / "learner"
    trainer = learner(model, store, [f"http://127.0.0.1:{port}"], out, server_check_s="0.5", outage_s="120")
    target: Proc | None = None

    def lists_the_adapter() -> bool:
        try:
            models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()["data"]
        except httpx.HTTPError:
            return False
        return "policy-v1" in [m["id"] for m in models]

    try:
        wait_until(lambda: group_exists(store), 120, "the learner's group", trainer)
        for reward in (0.0, 1.0):
            rid = call(gateway, "p1")
            httpx.post(f"{gateway.url}/rollouts/{rid}/reward", json={"reward": reward}, timeout=30)
        wait_until(
            lambda: '"outage"' in (tmp_path / "learner.log").read_text(), 120, "a push failing", trainer
        )
        target = start_rlgate_serve(model, tmp_path, MODEL, lora=True, weights_root=tmp_path, port=port)
        wait_until(lists_the_adapter, 60, "the push after the outage", trainer)
        assert store.client().hget("rlgate:policy", "version") == b"1"

        target.kill()  # SIGKILL: it comes back with the base model alone
        target = start_rlgate_serve(model, tmp_path, MODEL, lora=True, weights_root=tmp_path, port=port)
        assert not lists_the_adapter()
        wait_until(lists_the_adapter, 20, "the adapter loaded again", trainer)
        # by the learner (nothing else loads adapters here), which logs it once the server answered
        log = tmp_path / "learner.log"
        wait_until(lambda: '"adapter_reloaded"' in log.read_text(), 10, "the reload logged", trainer)
    finally:
        trainer.kill()
        for proc in (target, gateway, recorder):
            if proc is not None:
                proc.kill()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_reward_job_whose_worker_died_mid_job_is_retried(
    model: Path, store: AofRedis, tmp_path: Path, jobs_path: None
):
    """A worker is killed (SIGKILL) while its job runs; another worker retries the job once its time
    limit plus rq's 60 s have passed (the worker looks every `abandoned_check_s`: rq's default, 600 s,
    left the episode open for up to ten minutes) and closes the episode."""
    serve = start_rlgate_serve(model, tmp_path, MODEL, lora=True, weights_root=tmp_path)
    # the job's limit and retries are the gateway's (rq keeps them in the job)
    gateway = gateway_with_jobs(tmp_path, serve, store, reward_job_timeout_s="4", reward_job_backoff_s="[0]")
    first = worker(store, tmp_path / "worker1.log")
    second: subprocess.Popen | None = None
    try:
        rid = call(gateway, "w")
        finish_by_job(gateway, rid, store, seconds=2.0)
        runs = f"runs:{rid}"
        wait_until(lambda: store.client().get(runs) == b"1", 30, "the job started", first)
        first.send_signal(signal.SIGKILL)
        first.wait()
        second = worker(store, tmp_path / "worker2.log", abandoned_check_s="1")
        wait_until(lambda: status(store, rid) == b"closed", 110, "the episode closed by a retry", second)
        assert store.client().get(runs) == b"2"
        assert store.client().hget(f"rlgate:rollout:{{{rid}}}", "reward") in (b"1", b"1.0")
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
        gateway.kill()
        serve.kill()
