"""The learner end to end, all real processes: Redis, `rlgate serve` on a tiny model, the gateway, an
OpenAI-SDK agent, and `rlgate learner`. Closed episodes -> one step -> a LoRA adapter pushed -> the next
call through the gateway is served by it and tagged with the new version."""

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
from conftest import REDIS_URL, ROOT, Proc, recorded_calls, start_gateway, start_rlgate_serve

pytest.importorskip("openrlhf")

MODEL = "tiny"
SERVE_KEY = "serve-key-for-the-learner-tests"
AUTH = {"Authorization": f"Bearer {SERVE_KEY}"}
MESSAGES = [{"role": "user", "content": "2+3="}]
# The agent restricts the answer to a few tokens, as the demo's agent does: the learner must use the same
# processing (bias, temperature) for its log-probs to be those of the distribution sampled from.
BIAS = {str(ord(c)): 30.0 for c in "0123456789"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc, Path]]:
    from rlgate.inference.tiny_model import build_tiny_model

    tmp = tmp_path_factory.mktemp("learner_e2e")
    model = build_tiny_model(tmp / "tiny", seed=3)
    # the learner pushes adapters (LoRA routes) and full weights (dev-mode routes), saved in each test's
    # tmp_path: the server reads them from under pytest's base folder
    # the server guards /v1 with a key, as a production vLLM would: the gateway and the learner send it
    serve = start_rlgate_serve(
        model,
        tmp,
        MODEL,
        lora=True,
        dev_mode=True,
        weights_root=tmp_path_factory.getbasetemp(),
        api_key=SERVE_KEY,
    )
    gateway = start_gateway(tmp, serve.url + "/v1", policy_poll_s="0.05", upstream_api_key=SERVE_KEY)
    yield serve, gateway, model
    gateway.kill(signal.SIGTERM)
    serve.kill(signal.SIGTERM)


@pytest.fixture(autouse=True)
def _gateway_at_version_0(request: pytest.FixtureRequest) -> None:
    """A test on the shared stack starts from the base policy as the gateway sees it: `redis_client` resets
    the pointer, and the gateway reads it within its poll (50 ms); a call made before would go to the last
    test's adapter, whose log-probs are not the base model's the learner starts from."""
    if "stack" not in request.fixturenames or "redis_client" not in request.fixturenames:
        return
    request.getfixturevalue("redis_client")  # the flush first
    gateway = request.getfixturevalue("stack")[1]
    deadline = time.monotonic() + 10
    while httpx.get(f"{gateway.url}/healthz", timeout=5).json()["policy_version"] != 0:
        assert time.monotonic() < deadline, "the gateway kept an earlier test's policy version"
        time.sleep(0.02)


def episode(gateway: Proc, task: str, reward: float, calls: int = 2, agent: str | None = None) -> str:
    rid = uuid.uuid4().hex
    client = openai.OpenAI(
        base_url=f"{gateway.url}/tasks/{task}/rollouts/{rid}/v1",
        api_key="unused",
        default_headers={"X-Agent-Name": agent} if agent else None,
    )
    for _ in range(calls):
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0.8, logit_bias=BIAS
        )
    answer = httpx.post(f"{gateway.url}/rollouts/{rid}/reward", json={"reward": reward}, timeout=10)
    assert answer.status_code == 200, answer.text
    return rid


def learner_env(model: Path, serve: Proc, out: Path, **settings: str) -> dict[str, str]:
    """`rlgate learner`'s environment: one step of 2 tasks x 4 rollouts from `serve`'s episodes, written to
    `out`, each of `settings` as RLGATE_LEARNER_<NAME> on top."""
    env = {
        **os.environ,
        "RLGATE_LEARNER_REDIS_URL": REDIS_URL,
        "RLGATE_LEARNER_MODEL": str(model),
        "RLGATE_LEARNER_SERVED_MODEL_NAME": MODEL,
        "RLGATE_LEARNER_INFERENCE_URLS": json.dumps([serve.url]),
        "RLGATE_LEARNER_OUTPUT_DIR": str(out),
        "RLGATE_LEARNER_TASKS_PER_STEP": "2",
        "RLGATE_LEARNER_ROLLOUTS_PER_TASK": "4",
        "RLGATE_LEARNER_MAX_STEPS": "1",
        "RLGATE_LEARNER_LEARNING_RATE": "0.05",
        "RLGATE_LEARNER_LOG_FORMAT": "json",
    }
    env.update({f"RLGATE_LEARNER_{k.upper()}": v for k, v in settings.items()})
    return env


def learner(model: Path, serve: Proc, out: Path, **settings: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rlgate", "learner"],
        env=learner_env(model, serve, out, **{"inference_api_key": SERVE_KEY, **settings}),
        cwd=ROOT,
        stdout=(out.parent / f"{out.name}.log").open("ab"),
        stderr=subprocess.STDOUT,
    )


def steps(out: Path) -> list[dict]:
    path = out / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.8, "logit_bias": BIAS},
        # top-k then top-p truncate the distribution sampled from (vLLM's order): the learner re-applies both
        {"temperature": 0.9, "top_k": 40, "top_p": 0.6},
        {"temperature": 0.005, "top_p": 0.9},  # raised to vLLM's floor of 0.01
    ],
)
def test_the_servers_log_probs_are_the_learners(
    stack, redis_client: redis.Redis, tmp_path: Path, sampling: dict
):
    """What `rlgate serve` reported for a processed sample is what the learner computes."""
    from learner.policy import Policy
    from learner.samples import Transition, build_samples, micro_batches
    from learner.settings import LearnerSettings
    from learner.transitions import sampling_processing

    serve, gateway, model = stack
    rid = uuid.uuid4().hex
    client = openai.OpenAI(base_url=f"{gateway.url}/tasks/t/rollouts/{rid}/v1", api_key="unused")
    extra = {k: v for k, v in sampling.items() if k == "top_k"}
    for seed in range(3):
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=4,
            seed=seed,
            extra_body=extra,
            **{k: v for k, v in sampling.items() if k != "top_k"},
        )
    policy = Policy(LearnerSettings(model=model, tensorboard=False))
    for call in recorded_calls(gateway, rid):
        temperature, bias, top_k, top_p = sampling_processing(call["request"], 1.0)
        assert temperature == max(sampling["temperature"], 0.01)
        assert (top_k, top_p) == (sampling.get("top_k", 0), sampling.get("top_p", 1.0))
        t = Transition(
            rid,
            call["index"],
            tuple(call["prompt_token_ids"]),
            tuple(call["completion_token_ids"]),
            tuple(call["completion_logprobs"]),
            1.0,
            0,
            temperature,
            bias,
            top_k,
            top_p,
        )
        [batch] = micro_batches(build_samples([[t]]), 10_000, policy.pad_token_id)
        ours = policy.log_probs(batch)[batch.action_mask]
        assert ours.tolist() == pytest.approx(call["completion_logprobs"], abs=2e-4)


def test_a_step_pushes_an_adapter_that_serves_the_next_call(stack, redis_client: redis.Redis, tmp_path: Path):
    serve, gateway, model = stack
    rewards = {"add-1": [1.0, 0.0, 0.0, 1.0], "add-2": [0.0, 0.0, 1.0, 0.0]}
    rids = [episode(gateway, task, r) for task, values in rewards.items() for r in values]
    out = tmp_path / "learner"
    proc = learner(model, serve, out)
    assert proc.wait(timeout=240) == 0, (out.parent / "learner.log").read_text()[-4000:]

    [step] = steps(out)
    assert step["policy_version"] == 1 and step["episodes"] == 8 and step["groups"] == 2
    assert step["samples"] == 16 and step["calls"] == 16  # identical credit: every call trains
    assert step["reward_mean"] == pytest.approx(3 / 8) and step["grad_norm"] > 0
    assert step["rollout_kl"] == pytest.approx(0.0, abs=1e-3)  # on-policy: the server's log-probs are ours
    assert (out / "adapters" / "policy-v1" / "adapter_config.json").is_file()
    assert (out / "checkpoint" / "latest.pt").is_file() and list((out / "tensorboard").iterdir())
    # the step's numbers also go to Redis, on a capped stream (for dashboards)
    [published] = [json.loads(fields[b"data"]) for _, fields in redis_client.xrange("rlgate:learner:steps")]
    assert published["step"] == 1 and published["loss"] == pytest.approx(step["loss"])
    assert (
        published["episodes"] == 8 and published["val_episodes"] == 0 and published["val_reward_mean"] is None
    )

    # every episode consumed exactly once, nothing pending on the stream
    assert all(redis_client.hget(f"rlgate:rollout:{{{rid}}}", "status") == b"consumed" for rid in rids)
    assert redis_client.xpending("rlgate:episodes", "learners")["pending"] == 0
    assert redis_client.hgetall("rlgate:policy") == {
        b"version": b"1",
        b"adapter": b"policy-v1",
        b"base_model": MODEL.encode(),
        b"draining": b"0",
    }
    models = [m["id"] for m in httpx.get(f"{serve.url}/v1/models", headers=AUTH).json()["data"]]
    assert models == [MODEL, "policy-v1"]

    # the next call asks for the base model; the gateway sends it to the adapter and tags it version 1
    time.sleep(0.3)  # > the gateway's policy poll interval
    rid = uuid.uuid4().hex
    client = openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rid}/v1", api_key="unused")
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, logit_bias=BIAS)
    [call] = recorded_calls(gateway, rid)
    assert call["policy_version"] == 1 and call["model"] == "policy-v1"
    assert call["request"]["model"] == MODEL  # recorded as the agent sent it

    # and the adapter changed the policy: the same prompt and continuation score differently
    def logprobs(model_name: str) -> list[float]:
        body = {
            "model": model_name,
            "prompt": call["prompt_token_ids"],
            "max_tokens": 1,
            "logprobs": 1,
            "temperature": 0.8,
            "seed": 1,
            "return_token_ids": True,
            "logit_bias": BIAS,
        }
        return httpx.post(f"{serve.url}/v1/completions", json=body, timeout=30, headers=AUTH).json()[
            "choices"
        ][0]["logprobs"]

    base, adapted = logprobs(MODEL), logprobs("policy-v1")
    assert base["top_logprobs"] != adapted["top_logprobs"]


def test_only_the_chosen_agents_calls_train(stack, redis_client: redis.Redis, tmp_path: Path):
    serve, gateway, model = stack
    for task, values in {"a": [1.0, 0.0, 0.0, 0.0], "b": [0.0, 1.0, 1.0, 0.0]}.items():
        for i, r in enumerate(values):
            episode(gateway, task, r, calls=2, agent="solver" if i % 2 else "critic")
    out = tmp_path / "learner"
    proc = learner(model, serve, out, train_agents='["solver"]')
    assert proc.wait(timeout=240) == 0, (out.parent / "learner.log").read_text()[-4000:]
    [step] = steps(out)
    # the critic's episodes still count for the groups' baselines (reward_mean over all 8)
    assert step["calls"] == 16 and step["dropped_other_agent"] == 8 and step["samples"] == 8
    assert step["episodes"] == 8 and step["reward_mean"] == pytest.approx(3 / 8)


def test_stale_calls_are_dropped(stack, redis_client: redis.Redis, tmp_path: Path):
    serve, gateway, model = stack
    for task in ("a", "b", "c"):  # all served by version 0
        for i in range(4):
            episode(gateway, task, float(i % 2))
    out = tmp_path / "learner"
    first = learner(model, serve, out, max_staleness="0")  # trains a and b; c stays pending for it
    assert first.wait(timeout=240) == 0, (out.parent / "learner.log").read_text()[-4000:]
    time.sleep(0.3)  # the gateway sees version 1
    for i in range(4):
        episode(gateway, "d", float(i % 2))  # served by version 1
    # the stream delivers at least once: group a's entries again, as an outbox repair could
    for _, fields in redis_client.xrange("rlgate:episodes"):
        if fields[b"task_id"] == b"a":
            redis_client.xadd("rlgate:episodes", fields)
    # resumes from its checkpoint by default (version 1, its optimizer), without being told
    again = learner(model, serve, out, max_staleness="0", max_steps="2", tasks_per_step="3")
    assert again.wait(timeout=240) == 0, (out.parent / "learner.log").read_text()[-4000:]
    one, two = steps(out)
    assert one["dropped_stale"] == 0 and one["samples"] == 16
    # step 2 took back its own pending group c (version 0, now stale: 1 - 0 > 0), trained d, and skipped
    # the redelivered, already trained episodes of a
    assert two["episodes"] == 8 and two["dropped_stale"] == 8 and two["samples"] == 8
    assert two["already_trained"] == 4
    assert two["policy_version"] == 2 and two["staleness_mean"] == 0


def test_a_learner_killed_mid_step_redelivers_and_trains_nothing_twice(
    stack, redis_client: redis.Redis, tmp_path: Path
):
    serve, gateway, model = stack
    rids = [episode(gateway, task, float(i % 2)) for task in ("k1", "k2") for i in range(4)]
    out = tmp_path / "learner"
    proc = learner(model, serve, out)
    deadline = time.monotonic() + 120

    def pending() -> int:
        try:
            return redis_client.xpending("rlgate:episodes", "learners")["pending"]
        except redis.ResponseError:  # the learner has not created its group yet
            return 0

    while pending() == 0:  # it has read the episodes: the step has begun
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=20)

    again = learner(model, serve, out, resume="true")
    assert again.wait(timeout=240) == 0, (out.parent / "learner.log").read_text()[-4000:]
    trained = steps(out)
    assert sum(s["episodes"] for s in trained) == 8 and [s["step"] for s in trained] == [1]
    assert all(redis_client.hget(f"rlgate:rollout:{{{rid}}}", "status") == b"consumed" for rid in rids)
    assert redis_client.xpending("rlgate:episodes", "learners")["pending"] == 0
    assert redis_client.hget("rlgate:policy", "version") == b"1"


def test_a_full_push_updates_the_servers_weights_and_the_version(
    stack, redis_client: redis.Redis, tmp_path: Path
):
    serve, gateway, model = stack
    for task, values in {"f1": [1.0, 0.0, 0.0, 1.0], "f2": [0.0, 1.0, 0.0, 0.0]}.items():
        for r in values:
            episode(gateway, task, r)
    probe = {"model": MODEL, "prompt": [50, 43, 51, 61], "max_tokens": 1, "temperature": 0, "logprobs": 1}
    before = httpx.post(f"{serve.url}/v1/completions", json=probe, timeout=30, headers=AUTH).json()[
        "choices"
    ][0]["logprobs"]
    out = tmp_path / "learner"
    proc = learner(model, serve, out, finetune="full", push="full", push_drain_s="0.2")
    assert proc.wait(timeout=240) == 0, (out.parent / "learner.log").read_text()[-4000:]
    [step] = steps(out)
    assert step["policy_version"] == 1 and step["samples"] == 16
    assert httpx.get(f"{serve.url}/weight_info").json() == {"weight_version": "1"}
    assert httpx.get(f"{serve.url}/is_paused").json() == {"is_paused": False}
    assert redis_client.hgetall("rlgate:policy") == {
        b"version": b"1",
        b"adapter": b"",
        b"base_model": b"tiny",
        b"draining": b"0",
    }
    after = httpx.post(f"{serve.url}/v1/completions", json=probe, timeout=30, headers=AUTH).json()["choices"][
        0
    ]["logprobs"]
    assert after != before  # the base model itself changed
    time.sleep(0.3)
    rid = uuid.uuid4().hex
    client = openai.OpenAI(base_url=f"{gateway.url}/rollouts/{rid}/v1", api_key="unused")
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, logit_bias=BIAS)
    [call] = recorded_calls(gateway, rid)
    assert call["policy_version"] == 1 and call["model"] == MODEL
    # put the server's weights back for the other tests of this module
    post = lambda path, body=None: httpx.post(f"{serve.url}{path}", json=body, timeout=60)  # noqa: E731
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(model)
    save_file({n: p.detach().contiguous() for n, p in original.named_parameters()}, str(tmp_path / "orig.st"))
    assert post("/start_weight_update").status_code == 200
    assert post("/update_weights", {"update_info": {"path": str(tmp_path / "orig.st")}}).status_code == 200
    assert post("/finish_weight_update", {"weight_version": "0"}).status_code == 200


@pytest.mark.timeout(900)
def test_the_learner_on_deepspeed_trains_pushes_and_resumes(stack, redis_client: redis.Redis, tmp_path: Path):
    """`--engine deepspeed`: OpenRLHF's DeepspeedStrategy (ZeRO-1, gloo, fp32 on a CPU) does the update;
    its checkpoint is what a resumed learner continues from."""
    serve, gateway, model = stack
    for task in ("d1", "d2"):
        for i in range(4):
            episode(gateway, task, float(i % 2))
    out = tmp_path / "learner"
    first = learner(model, serve, out, engine="deepspeed", zero_stage="1")
    assert first.wait(timeout=600) == 0, (out.parent / "learner.log").read_text()[-4000:]
    [step] = steps(out)
    assert step["policy_version"] == 1 and step["grad_norm"] > 0 and step["samples"] == 16
    assert (out / "checkpoint" / "v1" / "policy").is_dir()  # DeepSpeed's own checkpoint layout
    time.sleep(0.3)
    for task in ("d3", "d4"):
        for i in range(4):
            episode(gateway, task, float(i % 2))
    again = learner(model, serve, out, engine="deepspeed", zero_stage="1", resume="true", max_steps="2")
    assert again.wait(timeout=600) == 0, (out.parent / "learner.log").read_text()[-4000:]
    one, two = steps(out)
    assert two["step"] == 2 and two["policy_version"] == 2 and two["staleness_mean"] == 0
    assert redis_client.hget("rlgate:policy", "version") == b"2"
    log = (out.parent / "learner.log").read_text()
    assert '"event": "resumed"' in log or '"event":"resumed"' in log


def test_an_episode_published_twice_trains_once_in_its_step(stack, redis_client: redis.Redis, tmp_path: Path):
    """A closer that died between XADD and marking the episode published leaves the outbox repair to
    publish it again: both entries land in one step. The episode trains once (the group's statistics
    see it once), its second entry is acknowledged without training."""
    serve, gateway, model = stack
    rewards = {"p1": [1.0, 0.0, 0.0, 0.0], "p2": [0.0, 1.0, 1.0, 0.0]}
    rids = [episode(gateway, task, r) for task, values in rewards.items() for r in values]
    first = next(f for _, f in redis_client.xrange("rlgate:episodes") if f[b"rollout_id"] == rids[0].encode())
    redis_client.xadd("rlgate:episodes", first)
    out = tmp_path / "learner"
    proc = learner(model, serve, out)
    assert proc.wait(timeout=240) == 0, (out.parent / "learner.log").read_text()[-4000:]
    [step] = steps(out)
    assert step["episodes"] == 8 and step["duplicates"] == 1 and step["samples"] == 16
    assert step["reward_mean"] == pytest.approx(3 / 8)  # with r0 twice: 4 / 9
    assert redis_client.xpending("rlgate:episodes", "learners")["pending"] == 0
    assert all(redis_client.hget(f"rlgate:rollout:{{{rid}}}", "status") == b"consumed" for rid in rids)


def test_an_episode_with_a_reward_beyond_float32_is_skipped_not_fatal(
    stack, redis_client: redis.Redis, tmp_path: Path
):
    """1e308 is finite for Python but not in the learner's float32: the episode is logged, counted,
    acknowledged and skipped, and the step trains on the others (it once crashed every restart)."""
    serve, gateway, model = stack
    rids = [episode(gateway, task, float(i % 2)) for task in ("n1", "n2") for i in range(4)]
    redis_client.hset(f"rlgate:rollout:{{{rids[0]}}}", "reward", "1e308")  # as an older gateway let it in
    out = tmp_path / "learner"
    proc = learner(model, serve, out)
    assert proc.wait(timeout=240) == 0, (out.parent / "learner.log").read_text()[-4000:]
    [step] = steps(out)
    assert step["episodes"] == 7 and step["dropped_invalid_reward"] == 1 and step["samples"] == 14
    assert redis_client.xpending("rlgate:episodes", "learners")["pending"] == 0
    assert "episode_skipped" in (out.parent / "learner.log").read_text()


def test_a_server_reporting_raw_logprobs_is_caught_on_the_first_step(
    stack, redis_client: redis.Redis, tmp_path: Path
):
    """vLLM's default --logprobs-mode is raw_logprobs (before temperature and logit_bias). A learner that
    expects processed log-probs stops on its first step with one line naming the cause, trains nothing
    and acknowledges nothing; told the server's mode, it trains (without importance correction)."""
    _, _, model = stack
    raw = start_rlgate_serve(
        model, tmp_path, MODEL, logprobs_mode="raw_logprobs", lora=True, dev_mode=True, weights_root=tmp_path
    )
    gateway = start_gateway(tmp_path, raw.url + "/v1", policy_poll_s="0.05")
    try:
        rids = [episode(gateway, task, float(i % 2)) for task in ("w1", "w2") for i in range(4)]
        out = tmp_path / "learner"
        proc = learner(model, raw, out)
        assert proc.wait(timeout=240) != 0
        text = (out.parent / "learner.log").read_text()
        assert "--logprobs-mode processed_logprobs" in text and "Traceback" not in text, text[-3000:]
        assert steps(out) == [] and redis_client.hget("rlgate:policy", "version") in (None, b"0")
        assert all(redis_client.hget(f"rlgate:rollout:{{{rid}}}", "status") == b"closed" for rid in rids)

        proc = learner(model, raw, out, logprobs_mode="raw_logprobs")
        assert proc.wait(timeout=240) == 0, (out.parent / "learner.log").read_text()[-4000:]
        [step] = steps(out)
        assert step["episodes"] == 8 and step["samples"] == 16
    finally:
        gateway.kill(signal.SIGTERM)
        raw.kill(signal.SIGTERM)


def test_dynamic_filtering_skips_uniform_groups_and_consumed_episodes_get_the_retention(
    stack, redis_client: redis.Redis, tmp_path: Path, monkeypatch
):
    """With dynamic filtering a group whose rewards are all equal is consumed untrained and the step
    trains the groups that differ; the step's success rate still counts every episode. Consumed
    episodes' keys expire after the retention that the shared RLGATE_RETENTION_S gives the learner."""
    serve, gateway, model = stack
    rewards = {"same": [1.0] * 4, "add-1": [1.0, 0.0, 0.0, 1.0], "add-2": [0.0, 1.0, 0.0, 0.0]}
    rids = {task: [episode(gateway, task, r) for r in values] for task, values in rewards.items()}
    out = tmp_path / "learner"
    monkeypatch.setenv("RLGATE_RETENTION_S", "900")
    proc = learner(model, serve, out, dynamic_filtering="true")
    assert proc.wait(timeout=240) == 0, (out.parent / "learner.log").read_text()[-4000:]

    [step] = steps(out)
    assert step["groups"] == 2 and step["samples"] == 16 and step["dropped_uniform"] == 4
    assert step["episodes"] == 12 and step["success_rate"] == pytest.approx(7 / 12)
    # per serving version: the uniform group's episodes (counted from their stream entries) with the
    # trained ones (from their rollouts); the previous test's push may reach the gateway mid-way
    expected: dict[str, list[float]] = {}
    for task, ids in rids.items():
        for rid, reward in zip(ids, rewards[task], strict=True):
            row = expected.setdefault(
                str(min(c["policy_version"] for c in recorded_calls(gateway, rid))), [0, 0, 0.0]
            )
            row[0], row[1], row[2] = row[0] + 1, row[1] + (reward >= 1.0), row[2] + reward
    assert step["by_version"] == expected
    assert sum(n for n, _, _ in step["by_version"].values()) == 12
    for task, ids in rids.items():
        for rid in ids:
            assert redis_client.hget(f"rlgate:rollout:{{{rid}}}", "status") == b"consumed", task
            # the TTL runs from the ack (uniform groups before the step trains): a loaded machine may take long
            assert 600 < redis_client.ttl(f"rlgate:rollout:{{{rid}}}") <= 900
            assert 600 < redis_client.ttl(f"rlgate:rollout:{{{rid}}}:calls") <= 900
    assert redis_client.xpending("rlgate:episodes", "learners")["pending"] == 0


def test_a_step_trains_messages_api_and_responses_api_episodes(
    stack, redis_client: redis.Redis, tmp_path: Path
):
    """Episodes of an Anthropic-SDK agent (the Messages API, translated to chat) and of a Responses-API agent
    train in one step like chat episodes: every call a sample, the server's log-probs the learner's own."""
    import anthropic

    serve, gateway, model = stack
    rids = []
    for i, reward in enumerate([1.0, 0.0, 0.0, 1.0]):
        rid = uuid.uuid4().hex
        agent = anthropic.Anthropic(base_url=f"{gateway.url}/tasks/messages/rollouts/{rid}", api_key="unused")
        for _ in range(2):
            agent.messages.create(
                model=MODEL, max_tokens=2, messages=MESSAGES, extra_body={"temperature": 0.8, "seed": i}
            )
        rids.append((rid, reward))
    for reward in [0.0, 1.0, 1.0, 0.0]:
        rid = uuid.uuid4().hex
        client = openai.OpenAI(base_url=f"{gateway.url}/tasks/responses/rollouts/{rid}/v1", api_key="unused")
        for _ in range(2):
            client.responses.create(model=MODEL, input="2+3=", max_output_tokens=2, temperature=0.8)
        rids.append((rid, reward))
    for rid, reward in rids:
        answer = httpx.post(f"{gateway.url}/rollouts/{rid}/reward", json={"reward": reward}, timeout=10)
        assert answer.status_code == 200, answer.text
    assert {c["agent_api"] for c in recorded_calls(gateway, rids[0][0])} == {"anthropic.messages"}
    assert {c["agent_api"] for c in recorded_calls(gateway, rids[-1][0])} == {"openai.responses"}

    out = tmp_path / "learner"
    proc = learner(model, serve, out)
    assert proc.wait(timeout=240) == 0, (out.parent / "learner.log").read_text()[-4000:]
    [step] = steps(out)
    assert step["episodes"] == 8 and step["groups"] == 2
    assert step["calls"] == 16 and step["samples"] == 16 and step["dropped_failed"] == 0
    # every call carries vLLM's log-prob of each token: both APIs are served as chat completions
    for rid, _ in rids:
        assert all(
            len(c["completion_logprobs"]) == len(c["completion_token_ids"])
            for c in recorded_calls(gateway, rid)
        )
    assert step["calls_without_server_logprobs"] == 0
    assert step["rollout_kl"] == pytest.approx(0.0, abs=1e-3)  # the recorded log-probs are the learner's
    assert step["grad_norm"] > 0
    assert all(redis_client.hget(f"rlgate:rollout:{{{rid}}}", "status") == b"consumed" for rid, _ in rids)
