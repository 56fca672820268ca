"""`scripts/chaos`: the whole loop (the one-token calc demo) while its parts die, and what survived.

    scripts/chaos --quick                  # a few minutes, 12 kills spread over every service
    scripts/chaos --kills 40 --minutes 25  # a longer run
    scripts/chaos --quick --json runs/chaos.json --inference rlgate-serve
    scripts/chaos --compose --quick        # the compose CPU profile's containers (ContainerService)

It starts the demo's processes on loopback, each under a supervisor thread that restarts it when it dies:
Redis (a redis-server of its own, AOF on with `appendfsync everysec`, as docs/deployment.md recommends),
the inference server (real vLLM where its venv is installed, else rlgate serve), the gateway, the reward
worker, the learner (it resumes from its checkpoint) and the demo's agents (never killed: they are the
outside world, and count what the gateway acknowledged in a ledger, `rlgate.demo.agent --ledger`). Then it kills,
with SIGKILL to the whole process group, one service after another in a seeded random order, every service
at least twice, at random moments; every other learner kill waits for the policy pointer to move (after the
push, before the acknowledgement) and every other worker kill for a job in flight. It prints what it
killed and when, and at the end a table counted apart from the services' own reports:

- calls: acknowledged (the agents' ledger) against recorded (the store, read directly, by response id);
- episodes: finished by an agent against closed, trained (`consumed` in the store), failed or expired with
  a reason, and trained twice (in two steps of the learner's `trained.jsonl`);
- reward jobs: per episode an agent finished, whether a job ended it (closed or failed it), and rq's jobs
  left started, queued or scheduled at the end;
- policy versions: named by the pointer (polled) against those the recorded calls were served with;
- the success rate's rise (the learner's steps, the demo's target) and the time to the target, against the
  same run without faults first (`--no-baseline` skips it).

The run ends when every kill is done and the target is met on a step trained after the last kill (or at
`--minutes`), then the agents stop and it waits up to `--drain-s` for every reward job and closed episode
to be done before counting.
`--json PATH` writes the table (keys `kills`, `acknowledged_calls_lost`, `episodes_trained_twice`,
`reached_target`, ...). The exit status is 1 when a call was lost, an episode was trained twice or left
untrained, a job was left hanging, a service died unasked, a call was served by a version the pointer
never named, or the target was not reached after the last kill.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import redis  # noqa: E402

from rlgate import vllm_server  # noqa: E402
from rlgate._net import free_port  # noqa: E402
from rlgate.demo import engines  # noqa: E402
from rlgate.demo.run import MODEL_NAME, DemoConfig, Where, commands, read_steps  # noqa: E402
from rlgate.episodes import rq_queue_key  # noqa: E402

SERVICES = ("gateway", "worker", "learner", "inference", "redis")
REWARD_JOB_TIMEOUT_S = 20  # math_answer takes milliseconds; a job whose worker died is retried 80 s later


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


class Service:
    """One process, restarted by its own supervisor thread whenever it dies (the thread that starts a
    process stays alive as long as it: the process's parent-death signal is tied to it)."""

    def __init__(
        self, name: str, launch: Callable[[Service], subprocess.Popen], ready: Callable[[], bool]
    ) -> None:
        self.name = name
        self.launch = launch
        self.ready = ready
        self.process: subprocess.Popen | None = None
        self.up_since: float | None = None
        self.exits_unasked = 0  # deaths nobody asked for (a service that fell over after another's kill)
        self.killed = False
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def up_for(self) -> float:
        with self.lock:
            alive = self.process is not None and self.process.poll() is None
            return time.monotonic() - self.up_since if alive and self.up_since else 0.0

    def kill(self) -> int | None:
        with self.lock:
            if self.process is None or self.process.poll() is not None:
                return None
            self.killed = True
            self.up_since = None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            return self.process.pid

    def supervise(self, stopping: threading.Event) -> None:
        while not stopping.is_set():
            try:
                process = self.launch(self)
            except Exception as exc:  # noqa: BLE001 (vLLM that did not come up: try again)
                say(f"{self.name}: did not start ({exc}); again in 2 s")
                stopping.wait(2)
                continue
            with self.lock:
                self.process, self.killed = process, False
            while process.poll() is None and not stopping.is_set() and not self.ready():
                stopping.wait(0.1)
            with self.lock:
                if process.poll() is None:
                    self.up_since = time.monotonic()
            while process.poll() is None and not stopping.is_set():
                stopping.wait(0.1)
            if stopping.is_set():
                return
            if not self.killed:
                self.exits_unasked += 1
                say(f"{self.name} exited by itself ({process.returncode}); restarting it")
            stopping.wait(0.5)

    def stop(self) -> None:
        with self.lock:
            process = self.process
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


class ContainerService:
    """One service of the compose CPU profile (`scripts/chaos --compose`): its container restarts under
    Docker's restart policy, not a thread of ours. A kill is SIGKILL to the container's main process from
    the host: a crash, which `restart: unless-stopped` restarts (`docker kill` would count as a stop). It is
    up once running and healthy after its latest start; a restart no kill asked for is an exit unasked."""

    def __init__(self, name: str, container: str, docker: httpx.Client) -> None:
        self.name = name
        self.container = container
        self.docker = docker
        self.lock = threading.Lock()
        self.up_since: float | None = None
        self.started_at: str | None = None  # Docker's State.StartedAt of the run being watched
        self.killed_start: str | None = None  # the start a kill ended (not up again until a new one)
        self.restarts_at_start: int | None = None
        self.restarts = 0
        self.kills = 0
        self.thread: threading.Thread | None = None

    @property
    def exits_unasked(self) -> int:
        return max(0, self.restarts - self.kills)

    def _state(self) -> dict[str, Any]:
        return self.docker.get(f"/containers/{self.container}/json").raise_for_status().json()

    def up_for(self) -> float:
        with self.lock:
            return time.monotonic() - self.up_since if self.up_since else 0.0

    def kill(self) -> int | None:
        try:
            info = self._state()
        except httpx.HTTPError:
            return None
        state = info["State"]
        pid = state["Pid"]
        if not state["Running"] or state.get("Restarting") or not pid:
            return None
        # the host's process of this container, not another one that reused the pid or lives in another
        # pid namespace (a rootless or remote engine): its cgroup names the container
        try:
            if info["Id"] not in Path(f"/proc/{pid}/cgroup").read_text():
                self._give_up(
                    f"pid {pid} of {self.container} is not this host's process of the container "
                    "(a rootless or remote Docker engine?): --compose needs the engine on this host"
                )
        except FileNotFoundError:
            return None  # it ended meanwhile
        with self.lock:
            killed_start = state["StartedAt"]
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return None
            except PermissionError as exc:
                self._give_up(f"cannot kill {self.container}'s process ({exc}): run as root")
            self.kills += 1
            self.up_since = None
            self.killed_start = killed_start
        return pid

    @staticmethod
    def _give_up(problem: str) -> NoReturn:
        """Stop the kills (the killer thread ends; the table counts the kills not made), saying why."""
        say(f"chaos: {problem}")
        raise SystemExit(1)

    def supervise(self, stopping: threading.Event) -> None:
        """Watch (Docker restarts): restarts counted, up once healthy after a start no kill ended."""
        while not stopping.wait(0.2):
            try:
                info = self._state()
            except httpx.HTTPError:
                continue
            state = info["State"]
            # a container waiting to be restarted still says Running (with Restarting, Pid 0) and its
            # last health until it starts again
            healthy = (
                state["Running"]
                and not state.get("Restarting")
                and bool(state["Pid"])
                and (state.get("Health") or {}).get("Status", "healthy") == "healthy"
            )
            with self.lock:
                if self.restarts_at_start is None:
                    self.restarts_at_start = info["RestartCount"]
                self.restarts = info["RestartCount"] - self.restarts_at_start
                if state["StartedAt"] != self.started_at:
                    self.started_at, self.up_since = state["StartedAt"], None
                if not healthy or state["StartedAt"] == self.killed_start:
                    self.up_since = None
                elif self.up_since is None:
                    self.up_since = time.monotonic()

    def stop(self) -> None:
        """Compose stops it (`compose-up-cpu`'s teardown)."""


@dataclass
class Kill:
    at_s: float
    service: str
    pid: int
    context: str


@dataclass
class Run:
    faults: bool
    workdir: Path
    config: DemoConfig  # the demo's settings this run starts its processes with (and judges the target by)
    kills: list[Kill] = field(default_factory=list)
    named_versions: set[int] = field(default_factory=lambda: {0})
    started: float = field(default_factory=time.monotonic)
    target_s: float | None = None
    success_at_target: float | None = None  # the demo's recent success rate when the target was met
    kills_before_target: int | None = None
    held_after_kills: bool = False  # the target met on a step trained after the last kill


def _popen(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("ab") as out:
        return subprocess.Popen(
            args,
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,  # killed as a group (rlgate serve's and vLLM's children with it)
            preexec_fn=vllm_server.die_with_parent,
        )


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _redis_ok(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


def services(args: argparse.Namespace, run: Run, model: Path, where: Where) -> dict[str, Service]:
    logs = run.workdir / "logs"
    redis_port = int(where.redis_url.rsplit(":", 1)[1].split("/")[0])
    serve_port = int(where.serve_urls[0].rsplit(":", 1)[1])
    (run.workdir / "redis").mkdir(parents=True, exist_ok=True)
    redis_args = [shutil.which("redis-server") or "redis-server", "--bind", "127.0.0.1"]
    redis_args += ["--port", str(redis_port), "--dir", str(run.workdir / "redis"), "--save", ""]
    redis_args += ["--appendonly", "yes", "--appendfsync", "everysec"]
    plan = commands(run.config, model, where)
    job_timeout = {"RLGATE_REWARD_JOB_TIMEOUT_S": str(REWARD_JOB_TIMEOUT_S)}

    def inference(service: Service) -> subprocess.Popen:
        if args.engine == "vllm":

            def starting(server: vllm_server.VllmServer) -> None:  # stoppable while it comes up
                with service.lock:
                    service.process, service.killed = server.process, False

            server = vllm_server.start(
                args.vllm_python,
                model,
                logs / "inference.log",
                port=serve_port,
                served_model_names=(MODEL_NAME,),
                on_start=starting,
            )
            return server.process
        serve = engines.serve_command(model, MODEL_NAME, serve_port, run.workdir)
        return _popen(serve, {}, logs / "inference.log")

    gateway_url = f"http://127.0.0.1:{where.gateway_port}"
    return {
        "redis": Service(
            "redis", lambda _: _popen(redis_args, {}, logs / "redis.log"), lambda: _redis_ok(where.redis_url)
        ),
        "inference": Service("inference", inference, lambda: _http_ok(f"{where.serve_urls[0]}/v1/models")),
        "gateway": Service(
            "gateway",
            lambda _: _popen(plan["gateway"][0], {**plan["gateway"][1], **job_timeout}, logs / "gateway.log"),
            lambda: _http_ok(f"{gateway_url}/healthz"),
        ),
        "worker": Service("worker", lambda _: _popen(*plan["worker"], logs / "worker.log"), lambda: True),
        "learner": Service("learner", lambda _: _popen(*plan["learner"], logs / "learner.log"), lambda: True),
    }


def _policy_version(client: redis.Redis, prefix: str) -> int | None:
    try:
        value = client.hget(f"{prefix}:policy", "version")
    except redis.RedisError:
        return None
    return int(value) if value is not None else None


def watch_pointer(run: Run, where: Where, stopping: threading.Event) -> None:
    """Every version the policy pointer names, polled every 20 ms (a step takes seconds)."""
    client = redis.Redis.from_url(where.redis_url, socket_timeout=1, socket_connect_timeout=1)
    while not stopping.wait(0.02):
        version = _policy_version(client, where.prefix)
        if version is not None:
            run.named_versions.add(version)


def killer(
    args: argparse.Namespace,
    run: Run,
    procs: dict[str, Service | ContainerService],
    where: Where,
    stopping: threading.Event,
) -> None:
    rng = random.Random(args.seed)
    plan = [*SERVICES, *SERVICES] + [rng.choice(SERVICES) for _ in range(args.kills - 2 * len(SERVICES))]
    rng.shuffle(plan)  # every service at least twice
    client = redis.Redis.from_url(where.redis_url, socket_timeout=1, socket_connect_timeout=1)
    aimed: Counter = Counter()
    for name in plan:
        if stopping.wait(rng.uniform(*args.interval)):
            return
        if not kill_one(args, run, procs, name, client, where, aimed, stopping):
            return


def kill_one(
    args: argparse.Namespace,
    run: Run,
    procs: dict[str, Service | ContainerService],
    name: str,
    client: redis.Redis,
    where: Where,
    aimed: Counter,
    stopping: threading.Event,
) -> bool:
    """Kill `name` once every service is up (again until a kill lands: a process may end between the
    check and the kill); False once the run is stopping."""
    service = procs[name]
    aimed[name] += 1
    while True:
        while service.up_for() < args.min_up_s or any(p.up_for() == 0 for p in procs.values()):
            if stopping.wait(0.2):  # every service up (and this one a while), so each kill is one fault
                return False
        context = "at a random moment"
        if name == "learner" and aimed[name] % 2 == 0:  # after a push, before the acknowledgement
            before = _policy_version(client, where.prefix)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not stopping.is_set():
                now = _policy_version(client, where.prefix)
                if now is not None and now != before:
                    context = f"just after it pushed v{now}"
                    break
                time.sleep(0.005)
        if name == "worker" and aimed[name] % 2 == 0:  # with a reward job in flight
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not stopping.is_set():
                with contextlib.suppress(redis.RedisError):
                    if client.zcard(f"rq:wip:{where.queue}"):
                        context = "as a reward job was in flight"
                        break
                time.sleep(0.001)
        pid = service.kill()
        if pid is None:
            continue
        at = time.monotonic() - run.started
        run.kills.append(Kill(round(at, 1), name, pid, context))
        say(f"kill {len(run.kills)}: {name} (pid {pid}) {context}")
        return True


def ledger(path: Path) -> tuple[dict[str, list[str]], dict[str, int], set[str]]:
    """The agents' count: acknowledged call ids per rollout, accepted finishes, failed episodes."""
    calls: dict[str, list[str]] = {}
    finished: dict[str, int] = {}
    failed: set[str] = set()
    if not path.is_file():
        return calls, finished, failed
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:  # a line torn when the agents stopped
            continue
        if "call" in entry:
            calls.setdefault(entry["rollout"], []).append(entry["call"])
        elif "finished" in entry:
            finished[entry["rollout"]] = entry["finished"]
        elif "failed" in entry:
            failed.add(entry["rollout"])
    return calls, finished, failed


def store_view(client: redis.Redis, prefix: str, rollouts: list[str]) -> dict[str, dict[str, Any]]:
    """Each rollout's hash and recorded calls, read from Redis directly."""
    view: dict[str, dict[str, Any]] = {}
    for start in range(0, len(rollouts), 500):
        chunk = rollouts[start : start + 500]
        pipe = client.pipeline(transaction=False)
        for rid in chunk:
            pipe.hgetall(f"{prefix}:rollout:{{{rid}}}")
            pipe.lrange(f"{prefix}:rollout:{{{rid}}}:calls", 0, -1)
        replies = pipe.execute()
        for i, rid in enumerate(chunk):
            fields = {k.decode(): v.decode() for k, v in replies[2 * i].items()}
            records = [json.loads(r) for r in replies[2 * i + 1]]
            view[rid] = {"hash": fields, "calls": records}
    return view


def _jobs_waiting(client: redis.Redis, queue: str) -> int:
    """rq's jobs not started: queued, being moved to a worker (its intermediate list), or scheduled for a
    retry with backoff (rq 3's keys)."""
    return (
        client.llen(rq_queue_key(queue))
        + client.llen(f"{rq_queue_key(queue)}:intermediate")
        + client.zcard(f"rq:scheduled:{queue}")
    )


def drain(args: argparse.Namespace, where: Where, finished: list[str], client: redis.Redis) -> float:
    """Wait until no reward job is queued or started and no finished episode is still open or closed
    untrained (up to --drain-s); seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < args.drain_s:
        try:
            jobs = _jobs_waiting(client, where.queue) + client.zcard(f"rq:wip:{where.queue}")
            pipe = client.pipeline(transaction=False)
            for rid in finished:
                pipe.hget(f"{where.prefix}:rollout:{{{rid}}}", "status")
            waiting = sum(1 for s in pipe.execute() if s in (b"open", b"closed"))
        except redis.RedisError:
            time.sleep(1)
            continue
        if not jobs and not waiting:
            break
        time.sleep(1)
    return time.monotonic() - t0


def count(
    args: argparse.Namespace,
    run: Run,
    where: Where,
    procs: dict[str, Service | ContainerService],
    drained_s: float,
) -> dict:
    client = redis.Redis.from_url(where.redis_url, socket_timeout=30)
    acked, finished, failed_by_agent = ledger(where.agent_stats)
    rollouts = sorted(set(acked) | set(finished) | failed_by_agent)
    view = store_view(client, where.prefix, rollouts)
    lost = []
    served: Counter = Counter()
    for rid, ids in acked.items():
        recorded = {(c.get("response") or {}).get("id") for c in view[rid]["calls"]}
        lost += [(rid, i) for i in ids if i not in recorded]
    for v in view.values():
        for c in v["calls"]:
            served[c["policy_version"]] += 1
    status = Counter(view[rid]["hash"].get("status", "missing") for rid in finished)
    no_reason = [
        rid
        for rid in finished
        if view[rid]["hash"].get("status") in ("failed", "expired") and not view[rid]["hash"].get("error")
    ]
    trained_in: Counter = Counter()
    steps_file = where.learner_dir / "trained.jsonl"
    trained_versions = set()
    unreadable = 0  # a torn line (the learner killed mid-write) is followed by a whole one; more is a bug
    if steps_file.is_file():
        for line in steps_file.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                unreadable += 1
                continue
            trained_versions.add(entry["policy_version"])
            trained_in.update(entry["rollouts"])
    twice = sorted(rid for rid, n in trained_in.items() if n > 1)
    consumed = [rid for rid in finished if view[rid]["hash"].get("status") == "consumed"]
    # acknowledged without training: alone in its group, or every call dropped (stale, failed, ...)
    consumed_untrained = [rid for rid in consumed if rid not in trained_in]
    queue = where.queue
    jobs = {  # per episode an agent finished (its finish asked for a job, perhaps twice on a retry)
        "asked": len(finished),
        "ended": sum(1 for rid in finished if view[rid]["hash"].get("status") not in (None, "open")),
        "failed": sum(1 for rid in finished if view[rid]["hash"].get("status") == "failed"),
        "started_at_end": client.zcard(f"rq:wip:{queue}"),
        "queued_at_end": _jobs_waiting(client, queue),
    }
    steps = read_steps(where.learner_dir / "steps.jsonl")
    cfg = run.config
    rates = [s["success_rate"] for s in steps]
    unnamed = sorted(v for v in served if v not in run.named_versions)
    return {
        "faults": run.faults,
        "kills": len(run.kills),
        "kills_by_service": dict(Counter(k.service for k in run.kills)),
        "kill_log": [k.__dict__ for k in run.kills],
        "exits_unasked": {name: p.exits_unasked for name, p in procs.items() if p.exits_unasked},
        "acknowledged_calls": sum(len(v) for v in acked.values()),
        "recorded_calls": sum(len(v["calls"]) for v in view.values()),
        "acknowledged_calls_lost": len(lost),
        "lost_examples": lost[:5],
        "episodes_finished": len(finished),
        "episodes_failed_by_agents": len(failed_by_agent),
        "episode_status": dict(status),
        "episodes_trained": len(consumed) - len(consumed_untrained),
        "episodes_consumed_untrained": len(consumed_untrained),
        "episodes_closed_untrained": status.get("closed", 0),
        "episodes_open_at_end": status.get("open", 0),
        "episodes_ended_without_reason": len(no_reason),
        "episodes_trained_twice": len(twice),
        "trained_ledger_unreadable_lines": unreadable,
        "reward_jobs": jobs,
        "versions_named": len(run.named_versions),
        "versions_served": len(served),
        "versions_trained": len(trained_versions),
        "calls_served_by_unnamed_versions": sum(served[v] for v in unnamed),
        "steps": len(steps),
        "success_first_step": rates[0] if rates else None,
        "success_final": sum(s["success_rate"] for s in cfg.recent(steps)) / len(cfg.recent(steps))
        if steps
        else None,
        "kills_before_target": run.kills_before_target,
        # met on a step trained after the last kill (the drain's last partial groups come after)
        "reached_target": run.held_after_kills,
        "success_at_target": run.success_at_target,
        "seconds_to_target": run.target_s,
        "drain_seconds": round(drained_s, 1),
        "seconds": round(time.monotonic() - run.started, 1),
    }


def _stop_run(stopping: threading.Event, kills_stop: threading.Event, agents: list[subprocess.Popen]) -> None:
    """The end of a run, however it ends: no more kills, the watchers stop, the agents' process killed."""
    kills_stop.set()
    stopping.set()
    for process in agents:
        if process.poll() is None:
            process.kill()


def demo_config(args: argparse.Namespace, workdir: Path, where: Where) -> DemoConfig:
    """The demo's settings a run starts its processes with and judges the target by."""
    return DemoConfig(
        workdir=workdir,
        minutes=args.minutes,
        target=args.target,
        quick=True,
        redis_url=where.redis_url,
        concurrency=args.concurrency,
        tasks_per_step=16,  # the demo's defaults (rlgate demo --help; docker-compose.cpu.yml's learner)
        rollouts_per_task=4,
        learning_rate=2e-3,
        seed=args.seed,
    )


def run_once(args: argparse.Namespace, faults: bool, model: Path) -> dict:
    workdir = args.workdir / ("chaos" if faults else "baseline")
    shutil.rmtree(workdir, ignore_errors=True)
    (workdir / "logs").mkdir(parents=True)
    if args.compose:
        return compose_run_once(args, faults, workdir)
    where = Where(
        f"redis://127.0.0.1:{free_port()}/0",
        [f"http://127.0.0.1:{free_port()}"],
        free_port(),
        "chaos",
        workdir / "learner",
        workdir / "agent.jsonl",
    )
    run = Run(faults, workdir, demo_config(args, workdir, where))
    procs = services(args, run, model, where)
    stopping, kills_stop = threading.Event(), threading.Event()
    agents: list[subprocess.Popen] = []  # the agents' process, once started
    try:
        return _run(args, run, where, procs, model, faults, stopping, kills_stop, agents.append)
    finally:
        _stop_run(stopping, kills_stop, agents)
        for name in ("learner", "worker", "gateway", "inference", "redis"):
            procs[name].stop()


def docker_socket() -> str:
    """The local engine's socket (DOCKER_HOST's unix:// path, else Docker's default)."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if not host.startswith("unix://"):
        raise SystemExit(
            f"chaos: --compose kills containers' processes on this host; DOCKER_HOST={host} is not"
        )
    return host.removeprefix("unix://")


COMPOSE_CONTAINERS = {
    "redis": "redis",
    "inference": "vllm",
    "gateway": "gateway",
    "worker": "worker",
    "learner": "learner",
}


def compose_run_once(args: argparse.Namespace, faults: bool, workdir: Path) -> dict:
    """One run on the compose CPU profile, from a clean start (`down --volumes`, then `up --wait`): the
    containers and Docker's restart policies in place of the supervisor threads; the agents on the host
    through the gateway's control port, as `scripts/compose-up-cpu` runs them."""
    compose = json.loads(os.environ["RLGATE_CHAOS_COMPOSE"])
    run_dir = Path(os.environ["RLGATE_CPU_RUN_DIR"])
    port = {
        name: int(os.environ[f"RLGATE_CPU_{name}_PORT"]) for name in ("GATEWAY", "CONTROL", "SERVE", "REDIS")
    }
    log = (workdir / "logs" / "compose.log").open("ab")
    subprocess.run([*compose, "down", "--volumes", "--timeout", "10"], check=True, stdout=log, stderr=log)
    with contextlib.suppress(FileNotFoundError):  # the last run's checkpoint: this run starts from none
        shutil.rmtree(run_dir / "learner")
    say(f"{'chaos' if faults else 'baseline (no faults)'}: docker compose up --wait")
    up = subprocess.run(
        [*compose, "up", "--detach", "--wait", "--wait-timeout", "600", "--no-build"], stdout=log, stderr=log
    )
    if up.returncode != 0:
        raise SystemExit(f"chaos: docker compose up failed; see {workdir / 'logs' / 'compose.log'}")
    where = Where(
        f"redis://127.0.0.1:{port['REDIS']}/0",
        [f"http://127.0.0.1:{port['SERVE']}"],
        port["GATEWAY"],
        "rlgate",  # the profile's key prefix and reward queue (rlgate-rewards)
        run_dir / "learner",
        workdir / "agent.jsonl",
    )
    run = Run(faults, workdir, demo_config(args, workdir, where))  # the profile's learner is the demo's
    docker = httpx.Client(
        transport=httpx.HTTPTransport(uds=docker_socket()), base_url="http://docker", timeout=10
    )
    procs = {
        name: ContainerService(name, f"rlgate-cpu-{c}-1", docker) for name, c in COMPOSE_CONTAINERS.items()
    }
    stopping, kills_stop = threading.Event(), threading.Event()
    agents: list[subprocess.Popen] = []
    control = ("--control", f"http://127.0.0.1:{port['CONTROL']}")  # rollouts and their keys (operator token)
    try:
        return _run(
            args,
            run,
            where,
            procs,
            Path("/models/tiny"),
            faults,
            stopping,
            kills_stop,
            agents.append,
            control,
        )
    finally:
        _stop_run(stopping, kills_stop, agents)
        docker.close()
        log.close()


def _run(
    args: argparse.Namespace,
    run: Run,
    where: Where,
    procs: dict[str, Service | ContainerService],
    model: Path,
    faults: bool,
    stopping: threading.Event,
    kills_stop: threading.Event,
    register: Callable[[subprocess.Popen], None],
    agent_args: tuple[str, ...] = (),
) -> dict:
    workdir = run.workdir
    say(f"{'chaos' if faults else 'baseline (no faults)'}: starting {', '.join(procs)} in {workdir}")
    for name in ("redis", "inference", "gateway", "worker", "learner"):
        procs[name].thread = threading.Thread(target=procs[name].supervise, args=(stopping,), daemon=True)
        procs[name].thread.start()
        deadline = time.monotonic() + 600
        while procs[name].up_for() == 0:
            if time.monotonic() > deadline:
                raise SystemExit(f"chaos: {name} did not come up; see {workdir / 'logs'}")
            time.sleep(0.2)
    config = run.config
    agent_args, agent_env = commands(config, model, where, ("--ledger", str(where.agent_stats), *agent_args))[
        "agent"
    ]
    group_deadline = time.monotonic() + 300
    client = redis.Redis.from_url(where.redis_url, socket_timeout=5)
    while time.monotonic() < group_deadline:  # the agents start once the learner reads the stream
        with contextlib.suppress(redis.RedisError):
            if client.exists(f"{where.prefix}:episodes") and client.xinfo_groups(f"{where.prefix}:episodes"):
                break
        time.sleep(0.2)
    run.started = time.monotonic()
    agent = _popen(agent_args, agent_env, workdir / "logs" / "agent.log")
    register(agent)
    threading.Thread(target=watch_pointer, args=(run, where, stopping), daemon=True).start()
    chaos = threading.Thread(target=killer, args=(args, run, procs, where, kills_stop), daemon=True)
    if faults:
        chaos.start()
    shown = 0
    steps_when_kills_ended: int | None = None
    while time.monotonic() - run.started < args.minutes * 60:
        steps = read_steps(where.learner_dir / "steps.jsonl")
        if len(steps) > shown:
            shown = len(steps)
            last = steps[-1]
            say(f"step {last['step']}: v{last['policy_version']} success {last['success_rate']:.0%}")
        if run.target_s is None and config.reached(steps):
            run.target_s = round(time.monotonic() - run.started, 1)
            run.kills_before_target = len(run.kills)
            recent = config.recent(steps)
            run.success_at_target = sum(s["success_rate"] for s in recent) / len(recent)
            say(f"target reached in {run.target_s} s")
        if steps_when_kills_ended is None and not chaos.is_alive():
            steps_when_kills_ended = len(steps)
        # done when the target holds on a step trained after the last kill: the loop learned through them
        if (
            steps_when_kills_ended is not None
            and len(steps) > steps_when_kills_ended
            and config.reached(steps)
        ):
            run.held_after_kills = True
            break
        time.sleep(0.5)
    kills_stop.set()
    if faults:
        chaos.join(timeout=90)
    say("stopping the agents; draining")
    agent.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        agent.wait(timeout=30)
    _, finished, _ = ledger(where.agent_stats)
    drained = drain(args, where, list(finished), client)
    return count(args, run, where, procs, drained)


def table(baseline: dict | None, chaos: dict) -> str:
    rows = [
        ("kills", "kills"),
        ("services that died unasked", "exits_unasked"),
        ("calls acknowledged", "acknowledged_calls"),
        ("calls recorded", "recorded_calls"),
        ("acknowledged calls lost", "acknowledged_calls_lost"),
        ("episodes finished by agents", "episodes_finished"),
        ("episodes failed by agents", "episodes_failed_by_agents"),
        ("episodes trained", "episodes_trained"),
        ("consumed, in no step", "episodes_consumed_untrained"),
        ("closed, untrained at the end", "episodes_closed_untrained"),
        ("open at the end", "episodes_open_at_end"),
        ("ended without a reason", "episodes_ended_without_reason"),
        ("episodes trained twice", "episodes_trained_twice"),
        ("episodes with a reward job / ended", None),
        ("ended failed by their job", None),
        ("jobs started or queued at the end", None),
        ("versions named / served", None),
        ("calls served by unnamed versions", "calls_served_by_unnamed_versions"),
        ("training steps", "steps"),
        ("success: first step -> target", None),
        ("reached target", "reached_target"),
        ("seconds to target", "seconds_to_target"),
        ("kills before the target", "kills_before_target"),
    ]

    def cell(r: dict | None, label: str, key: str | None) -> str:
        if r is None:
            return "-"
        j = r["reward_jobs"]
        special = {
            "episodes with a reward job / ended": f"{j['asked']} / {j['ended']}",
            "ended failed by their job": str(j["failed"]),
            "jobs started or queued at the end": str(j["started_at_end"] + j["queued_at_end"]),
            "versions named / served": f"{r['versions_named']} / {r['versions_served']}",
            "success: first step -> target": (
                f"{r['success_first_step']:.0%} -> {r['success_at_target'] or r['success_final']:.0%}"
                if r["steps"]
                else "no step"
            ),
        }
        if label in special:
            return special[label]
        value = r[key]
        if isinstance(value, dict):
            return ", ".join(f"{k} {v}" for k, v in value.items()) or "0"
        return str(value)

    lines = [f"| {'':34} | {'no faults':>16} | {'chaos':>16} |", f"|{'-' * 36}|{'-' * 18}|{'-' * 18}|"]
    for label, key in rows:
        lines.append(f"| {label:34} | {cell(baseline, label, key):>16} | {cell(chaos, label, key):>16} |")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="12 kills, at most 8 minutes of loop.")
    parser.add_argument("--kills", type=int, default=None, help="Kills (at least 2 per service; default 40).")
    parser.add_argument("--minutes", type=float, default=None, help="Bound of each run's loop (default 25).")
    parser.add_argument("--interval", type=float, nargs=2, default=None, metavar=("MIN", "MAX"))
    parser.add_argument("--min-up-s", type=float, default=3.0, help="A service is killed once up this long.")
    parser.add_argument("--drain-s", type=float, default=240.0, help="Wait for jobs and episodes at the end.")
    parser.add_argument("--target", type=float, default=0.9, help="The demo's target success rate.")
    parser.add_argument("--concurrency", type=int, default=16, help="Agent episodes in flight.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the kills, the model and the questions.")
    parser.add_argument("--inference", default="auto", choices=["auto", "vllm", "rlgate-serve"])
    parser.add_argument("--vllm-python", type=Path, default=None, help="Python of vLLM's venv.")
    parser.add_argument("--workdir", type=Path, default=Path("runs/chaos"))
    parser.add_argument("--no-baseline", action="store_true", help="Skip the run without faults.")
    parser.add_argument("--json", type=Path, default=None, help="Write the results here.")
    parser.add_argument(
        "--compose",
        action="store_true",
        help="The compose CPU profile in containers (Docker's restart policies) instead of local processes: "
        "run as `scripts/chaos --compose`, which has scripts/compose-up-cpu build and tear it down.",
    )
    args = parser.parse_args(argv)
    quick = args.quick
    args.kills = args.kills if args.kills is not None else (12 if quick else 40)
    args.minutes = args.minutes if args.minutes is not None else (8.0 if quick else 25.0)
    args.interval = tuple(args.interval) if args.interval else ((3.0, 8.0) if quick else (5.0, 20.0))
    if args.kills < 2 * len(SERVICES):
        parser.error(f"--kills: at least {2 * len(SERVICES)} (two per service)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.compose:
        if "RLGATE_CHAOS_COMPOSE" not in os.environ:
            print("chaos: --compose runs under scripts/compose-up-cpu: use `scripts/chaos --compose`")
            return 2
        args.engine = os.environ.get("RLGATE_CHAOS_INFERENCE", "vllm")
        if args.inference not in ("auto", args.engine):
            print(f"chaos: the compose profile was started with {args.engine}, not {args.inference}")
            return 2
        if os.geteuid() != 0:  # the containers' processes are root's
            print("chaos: --compose kills the containers' processes from the host: run it as root")
            return 2
        say(f"inference: {args.engine}, in the compose CPU profile's containers")
        return report(args, Path("/models/tiny"))
    if shutil.which("redis-server") is None:
        print(
            "chaos: redis-server is not installed (it restarts Redis with AOF): apt-get install redis-server"
        )
        return 2
    try:
        args.engine, reason = engines.choose(args.inference, args.vllm_python)
        if args.engine == "vllm":
            args.vllm_python = vllm_server.find_python(args.vllm_python)
    except vllm_server.VllmUnavailable as exc:
        print(f"chaos: {exc}")
        return 2
    say(f"inference: {args.engine}" + (f" (not vLLM: {reason})" if reason else ""))
    from rlgate.inference.tiny_model import build_tiny_model

    model = args.workdir / "model"
    if not (model / "config.json").is_file():
        build_tiny_model(model, seed=args.seed)
    return report(args, model)


def report(args: argparse.Namespace, model: Path) -> int:
    """The run without faults (unless --no-baseline), the run with them, the table; the exit status."""
    baseline = None if args.no_baseline else run_once(args, False, model)
    chaos = run_once(args, True, model)
    print(table(baseline, chaos), flush=True)
    results = {**chaos, "engine": args.engine, "compose": args.compose, "baseline": baseline}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    jobs = chaos["reward_jobs"]
    bad = {
        "acknowledged calls lost": chaos["acknowledged_calls_lost"],
        "episodes trained twice": chaos["episodes_trained_twice"],
        "reward jobs left hanging": jobs["started_at_end"]
        + jobs["queued_at_end"]
        + jobs["asked"]
        - jobs["ended"],
        "calls served by a version never named": chaos["calls_served_by_unnamed_versions"],
        "episodes ended without a reason": chaos["episodes_ended_without_reason"],
        "episodes finished but never trained nor dropped": chaos["episodes_closed_untrained"]
        + chaos["episodes_open_at_end"],
        "services that died unasked": sum(chaos["exits_unasked"].values()),
        "kills not made (of --kills)": args.kills - chaos["kills"],
        "target not reached": int(not chaos["reached_target"]),
    }
    failed = {k: v for k, v in bad.items() if v}
    print("chaos: " + ("; ".join(f"{k}: {v}" for k, v in failed.items()) if failed else "everything held"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
