"""The learner on two data-parallel ranks (gloo on this CPU, DeepSpeed ZeRO), all real processes: Redis,
`rlgate serve` on a tiny model, the gateway, OpenAI-SDK episodes, and `rlgate learner` started by
torchrun (or as two processes with the launcher's variables set by hand, to kill one of them)."""

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
from conftest import REDIS_URL, ROOT, Proc, free_port, rlgate, start_gateway, start_rlgate_serve
from test_learner_e2e import BIAS, MESSAGES, MODEL, steps  # the same agent as the one-rank tests
from test_learner_e2e import learner_env as e2e_learner_env

pytest.importorskip("openrlhf")
pytest.importorskip("deepspeed")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc, Path]]:
    from rlgate.inference.tiny_model import build_tiny_model

    tmp = tmp_path_factory.mktemp("learner_ranks")
    model = build_tiny_model(tmp / "tiny", seed=3)
    serve = start_rlgate_serve(model, tmp, MODEL, lora=True, weights_root=tmp_path_factory.getbasetemp())
    gateway = start_gateway(tmp, serve.url + "/v1", policy_poll_s="0.05")
    yield serve, gateway, model
    gateway.kill(signal.SIGTERM)
    serve.kill(signal.SIGTERM)


def episodes(gateway: Proc, tasks: tuple[str, ...]) -> list[str]:
    """Four episodes per task, two calls each, rewards 0 1 0 1."""
    rids = []
    for task in tasks:
        for i in range(4):
            rid = uuid.uuid4().hex
            client = openai.OpenAI(base_url=f"{gateway.url}/tasks/{task}/rollouts/{rid}/v1", api_key="unused")
            for _ in range(2):
                client.chat.completions.create(
                    model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0.8, logit_bias=BIAS
                )
            answer = httpx.post(
                f"{gateway.url}/rollouts/{rid}/reward", json={"reward": float(i % 2)}, timeout=10
            )
            assert answer.status_code == 200, answer.text
            rids.append(rid)
    return rids


def learner_env(model: Path, serve: Proc, out: Path, **settings: str) -> dict[str, str]:
    """test_learner_e2e's learner environment (for a server without a key) on DeepSpeed ZeRO-1, one thread
    per rank, `settings` on top."""
    defaults = {
        "engine": "deepspeed",
        "zero_stage": "1",
        # several micro-batches per rank: the gradients of all of them must reach the optimizer
        "micro_batch_tokens": "64",
        "threads": "1",
        "tensorboard": "false",
    }
    return {**e2e_learner_env(model, serve, out, **{**defaults, **settings}), "OMP_NUM_THREADS": "1"}


def learner(model: Path, serve: Proc, out: Path, ranks: int, **settings: str) -> subprocess.Popen:
    """`rlgate learner`, one process or `ranks` started by torchrun."""
    launcher = (
        [] if ranks == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    )
    return subprocess.Popen(
        [sys.executable, *launcher, "-m", "rlgate", "learner"],
        env=learner_env(model, serve, out, **settings),
        cwd=ROOT,
        stdout=(out.parent / f"{out.name}.log").open("ab"),
        stderr=subprocess.STDOUT,
    )


def adapter(out: Path, version: int) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "adapters" / f"policy-v{version}" / "adapter_model.safetensors"))


def pending(client: redis.Redis) -> int:
    try:
        return client.xpending("rlgate:episodes", "learners")["pending"]
    except redis.ResponseError:  # no consumer group yet
        return 0


def test_shares_cover_the_samples_once_balanced_by_tokens():
    from learner.samples import Sample, shard

    lengths = [9, 3, 7, 7, 2, 5, 4]
    samples = [Sample([1] * n, [True] * (n - 1), [1.0] * (n - 1), [0.0] * (n - 1), 1.0, ()) for n in lengths]
    shares = shard(samples, 2)
    # longest first, each to the lighter rank: 9 -> 0, 7 -> 1, 7 -> 1, 5 -> 0, 4 -> 0, 3 -> 1, 2 -> 1
    assert [[len(s.tokens) for s in share] for share in shares] == [[9, 5, 4], [3, 7, 7, 2]]
    assert shard(samples, 1) == [samples]
    assert [len(share) for share in shard(samples[:1], 3)] == [1, 0, 0]  # fewer samples than ranks
    with pytest.raises(ValueError):
        shard(samples, 0)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"RLGATE_LEARNER_ENGINE": "torch"}, "2 ranks train through DeepSpeed"),
        ({"RLGATE_LEARNER_ZERO_STAGE": "3"}, "ZeRO-3 across ranks is not supported"),
    ],
)
def test_settings_several_ranks_cannot_train_with_are_one_line(
    tmp_path: Path, redis_client: redis.Redis, settings: dict, message: str
):
    """Refused before any process group forms: the launcher's other rank need not exist."""
    from rlgate.inference.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", seed=0)
    env = {
        **os.environ,
        "RLGATE_LEARNER_REDIS_URL": REDIS_URL,
        "RLGATE_LEARNER_MODEL": str(model),
        "RLGATE_LEARNER_OUTPUT_DIR": str(tmp_path / "out"),
        "RLGATE_LEARNER_ENGINE": "deepspeed",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        **settings,
    }
    result = rlgate("learner", env=env, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    [line] = [x for x in result.stderr.splitlines() if x.startswith("rlgate learner: error:")]
    assert message in line and "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ranks_make_the_same_update_as_one(stack, redis_client: redis.Redis, tmp_path: Path):
    """The same closed episodes trained by one process and by two ranks under torchrun: the same adapter
    (within float tolerance), the same loss and gradient norm, and rank 0 alone pushed and acknowledged."""
    serve, gateway, model = stack
    rids = episodes(gateway, ("a", "b"))
    # the store as it is now, to give both learners the same episodes
    saved = {key: redis_client.dump(key) for key in redis_client.scan_iter(count=1000)}

    one = tmp_path / "one"
    proc = learner(model, serve, one, ranks=1)
    assert proc.wait(timeout=300) == 0, (tmp_path / "one.log").read_text()[-4000:]

    # the live gateway may write between the flush and the restore (its sweeper, the reward stream's group):
    # the saved state wins
    redis_client.flushdb()
    for key, value in saved.items():
        redis_client.restore(key, 0, value, replace=True)
    two = tmp_path / "two"
    proc = learner(model, serve, two, ranks=2)
    assert proc.wait(timeout=300) == 0, (tmp_path / "two.log").read_text()[-4000:]

    [a], [b] = steps(one), steps(two)
    assert a["ranks"] == 1 and b["ranks"] == 2
    assert a["samples"] == b["samples"] == 16 and a["tokens"] == b["tokens"] and a["episodes"] == 8
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5) and a["grad_norm"] > 0
    assert b["entropy"] == pytest.approx(a["entropy"], rel=1e-5)
    weights_one, weights_two = adapter(one, 1), adapter(two, 1)
    assert weights_one.keys() == weights_two.keys()
    moved = max(float(w.abs().max()) for n, w in weights_one.items() if "lora_B" in n)
    assert moved > 1e-3  # the step changed the adapter (B starts at zero)
    # AdamW's first step is lr x g / (|g| + eps) per element (0.05 here, about lr x sign(g)): an element
    # whose gradient is within a few eps of 0 turns the reduction order's float noise into a visible
    # difference (measured 1.02e-5 once, 1.0e-4 once), while a wrong reduction moves elements by the order
    # of the step itself (a flipped sign: 0.1); a wrong scale shows in grad_norm above. So: every element
    # within 2e-3 (4% of the step), and all but a few in a thousand within 1e-5.
    for name, w in weights_one.items():
        diff = (weights_two[name] - w).abs()
        assert diff.max() < 2e-3, name
        assert int((diff > 1e-5).sum()) <= max(2, diff.numel() // 500), (name, int((diff > 1e-5).sum()))
    # rank 0 alone pushed and acknowledged: the step once, every episode consumed once
    assert redis_client.xlen("rlgate:learner:steps") == 1
    assert pending(redis_client) == 0
    assert all(redis_client.hget(f"rlgate:rollout:{{{rid}}}", "status") == b"consumed" for rid in rids)
    assert redis_client.hget("rlgate:policy", "version") == b"1"
    log = (tmp_path / "two.log").read_text()
    assert '"rank":1' in log.replace(" ", "") and "step_share" in log


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_rank_fails_the_step_and_nothing_is_acknowledged(
    stack, redis_client: redis.Redis, tmp_path: Path
):
    """Two ranks started by hand with the launcher's variables. Rank 1 is frozen once it waits for orders,
    the step begins on rank 0 (it read the episodes) and cannot end without rank 1; rank 1 is killed. Rank 0
    exits non-zero at once, with one line, having trained, pushed and acknowledged nothing."""
    serve, gateway, model = stack
    out = tmp_path / "learner"
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = learner_env(model, serve, out, dist_timeout_s="120")
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "rlgate", "learner"],
                env=env,
                cwd=ROOT,
                stdout=(tmp_path / f"rank{rank}.log").open("wb"),
                stderr=subprocess.STDOUT,
            )
        )
    leader, follower = procs
    try:
        deadline = time.monotonic() + 240
        # both ranks are up: rank 1 waits for orders, rank 0 reads the stream through its consumer group
        while "rank_started" not in (tmp_path / "rank1.log").read_text() or not redis_client.exists(
            "rlgate:episodes"
        ):
            assert time.monotonic() < deadline and leader.poll() is None and follower.poll() is None
            time.sleep(0.05)
        follower.send_signal(signal.SIGSTOP)
        rids = episodes(gateway, ("k1", "k2"))
        while pending(redis_client) < 8:  # rank 0 read the step's episodes: the step has begun
            assert time.monotonic() < deadline and leader.poll() is None
            time.sleep(0.01)
        follower.send_signal(signal.SIGKILL)
        started = time.monotonic()
        code = leader.wait(timeout=60)
        elapsed = time.monotonic() - started
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=20)
    text = (tmp_path / "rank0.log").read_text()
    assert code == 1 and elapsed < 60, text[-3000:]
    assert "rlgate learner: error: rank 0 of 2" in text and "Traceback" not in text, text[-3000:]
    assert steps(out) == [] and not (out / "adapters" / "policy-v1").exists()
    assert not (out / "checkpoint" / "latest.pt").exists()
    # nothing acknowledged: the entries stay pending for this consumer, the episodes closed and claimable
    assert pending(redis_client) == 8
    assert all(redis_client.hget(f"rlgate:rollout:{{{rid}}}", "status") == b"closed" for rid in rids)
    assert redis_client.hget("rlgate:policy", "version") in (None, b"0")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ranks_checkpoint_and_resume(stack, redis_client: redis.Redis, tmp_path: Path):
    """Each rank saves its part of the checkpoint (DeepSpeed's per-rank ZeRO files); two ranks restarted
    on the same output_dir resume from it: step 2 is version 2, the optimizer state is every rank's own."""
    serve, gateway, model = stack
    episodes(gateway, ("c1", "c2"))
    out = tmp_path / "learner"
    first = learner(model, serve, out, ranks=2, zero_stage="2")
    assert first.wait(timeout=300) == 0, (tmp_path / "learner.log").read_text()[-4000:]
    state = out / "checkpoint" / "v1" / "policy"
    parts = sorted(p.name for p in state.iterdir())
    assert [p for p in parts if "optim_states" in p] == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ], parts
    time.sleep(0.3)  # the gateway sees version 1
    rids = episodes(gateway, ("c3", "c4"))
    again = learner(model, serve, out, ranks=2, zero_stage="2", max_steps="2")
    assert again.wait(timeout=300) == 0, (tmp_path / "learner.log").read_text()[-4000:]
    one, two = steps(out)
    assert two["step"] == 2 and two["policy_version"] == 2 and two["ranks"] == 2
    assert two["staleness_mean"] == 0 and two["samples"] == 16 and two["grad_norm"] > 0
    assert redis_client.hget("rlgate:policy", "version") == b"2" and pending(redis_client) == 0
    assert all(redis_client.hget(f"rlgate:rollout:{{{rid}}}", "status") == b"consumed" for rid in rids)
    log = (tmp_path / "learner.log").read_text()
    assert '"event":"resumed"' in log.replace(" ", "")
    assert [p.name for p in (out / "checkpoint").iterdir() if p.is_dir()] == ["v2"]
    # another number of ranks cannot take the optimizer state over: one line, nothing trained
    other = learner(model, serve, out, ranks=1, zero_stage="2", max_steps="3")
    assert other.wait(timeout=300) == 2
    log = (tmp_path / "learner.log").read_text()
    assert "was saved by 2 rank(s), this learner runs 1" in log and len(steps(out)) == 2


_SLOW_SERVER = """
import asyncio, sys
from aiohttp import web

async def slow(request):
    await request.read()
    await asyncio.sleep(float(sys.argv[2]))
    return web.json_response({})

app = web.Application()
app.router.add_post("/v1/load_lora_adapter", slow)
app.router.add_post("/v1/unload_lora_adapter", slow)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=lambda *_: print("READY", flush=True))
"""


def test_a_push_longer_than_the_ranks_timeout_does_not_fail_the_step(
    stack, redis_client: redis.Redis, tmp_path: Path
):
    """Rank 0 pushes to a server that takes 2.5x the ranks' collective timeout to load an adapter (a large
    model's weights): the other rank, waiting for its next order, hears "wait" orders meanwhile, and the
    step completes."""
    serve, gateway, model = stack
    port = free_port()
    slow = subprocess.Popen(
        [sys.executable, "-c", _SLOW_SERVER, str(port), "25"], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        assert slow.stdout.readline().strip() == "READY"
        episodes(gateway, ("s1", "s2"))
        out = tmp_path / "learner"
        env_urls = json.dumps([serve.url, f"http://127.0.0.1:{port}"])
        proc = learner(model, serve, out, ranks=2, dist_timeout_s="10", inference_urls=env_urls)
        assert proc.wait(timeout=300) == 0, (tmp_path / "learner.log").read_text()[-4000:]
        [step] = steps(out)
        assert step["policy_version"] == 1 and step["push_seconds"] >= 25
        assert pending(redis_client) == 0
    finally:
        slow.kill()
        slow.wait(timeout=10)
