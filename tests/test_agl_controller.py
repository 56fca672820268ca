"""Agent Lightning's own controller drives the gateway unchanged: the real `agl-controller` (agentlightning
1.0.2, Python 3.12, in `.venv-agl`, which scripts/test makes) polls the gateway's rollout queue, starts an
agent process for each queued rollout with the environment it builds (`AGL_*` and the `env_map`), and reports
what became of it; the agents (tests/agl_agent.py, written as Agent Lightning's run them) call the model
through the gateway and post their rewards. The upstream is the fake vLLM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from conftest import ROOT, Proc, gateway_fixture

CONTROLLER_KEY = "agl-controller-key-for-tests"
OPERATOR = {"Authorization": "Bearer agl-controller-test-operator"}
CONTROLLER = {"Authorization": f"Bearer {CONTROLLER_KEY}"}


def agl_python() -> Path:
    """The Python of Agent Lightning's venv; skips without it (a failure under RLGATE_TEST_NO_SKIP)."""
    python = Path(os.environ.get("RLGATE_AGL_PYTHON") or ROOT / ".venv-agl" / "bin" / "python")
    if not (python.parent / "agl-controller").is_file():
        pytest.skip(f"agentlightning is not installed next to {python} (scripts/test installs it)")
    return python


agl_gateway = gateway_fixture(
    "agl_controller",
    agl_controller_key=CONTROLLER_KEY,
    operator_token=OPERATOR["Authorization"].removeprefix("Bearer "),
    agent_rewards="true",
    model_aliases=json.dumps({"auto": "fake-model"}),
)


def queue(gateway: Proc, *rollouts: dict) -> list[dict]:
    answer = httpx.post(f"{gateway.url}/api/rollouts", json=list(rollouts), headers=CONTROLLER, timeout=10)
    assert answer.status_code == 201, answer.text
    return answer.json()


def active(gateway: Proc) -> list[dict]:
    answer = httpx.get(
        f"{gateway.url}/api/rollouts",
        params=[("state_in", "queuing"), ("state_in", "running"), ("limit", "50")],
        headers=CONTROLLER,
        timeout=10,
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_agl_controller_runs_agents_against_the_gateway_to_closed_episodes(
    agl_gateway: Proc, redis_client, tmp_path: Path
):
    python = agl_python()
    local = {"env_map": {"QUESTION": "input.question", "ANSWER": "input.answer"}}
    good, bad, val = queue(
        agl_gateway,
        {
            "input": {"question": "6*7?", "answer": "42"},
            "config": {"local": {**local, "agent_class": "agl_agent:MathAgent"}},
        },
        {
            "input": {"question": "1+1?", "answer": "2"},
            "config": {"local": {**local, "agent_class": "agl_agent:FailingAgent"}},
        },
        {
            "input": {"question": "6*7?", "answer": "42"},
            "is_train": False,
            "config": {"local": {**local, "agent_class": "agl_agent:MathAgent"}},
        },
    )
    assert {r["status"]["state"] for r in (good, bad, val)} == {"queuing"}
    assert len(active(agl_gateway)) == 3
    log = (tmp_path / "controller.log").open("wb")
    controller = subprocess.Popen(
        [
            str(python.parent / "agl-controller"),
            "runner_type=local",
            f"agl_server.url={agl_gateway.url}",
            f"agl_server.key={CONTROLLER_KEY}",
            "local_runner.poll_interval=1",
            f"hydra.run.dir={tmp_path / 'hydra'}",  # Hydra's output folder, out of the repository
        ],
        cwd=ROOT
        / "tests",  # where the agents' module is (the controller starts them in its working directory)
        stdout=log,
        stderr=subprocess.STDOUT,
        env={k: v for k, v in os.environ.items() if not k.startswith(("RLGATE_", "VIRTUAL_ENV"))},
    )
    try:
        deadline = time.monotonic() + 120
        while active(agl_gateway) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert active(agl_gateway) == [], (tmp_path / "controller.log").read_text()[-4000:]
    finally:
        controller.send_signal(signal.SIGINT)
        controller.wait(timeout=60)

    def show(rollout: dict) -> tuple[dict, dict]:
        ours = httpx.get(
            f"{agl_gateway.url}/rollouts/{rollout['rollout_id']}", headers=OPERATOR, timeout=10
        ).json()
        theirs = httpx.patch(  # an empty patch answers the rollout as it is
            f"{agl_gateway.url}/api/rollouts/{rollout['rollout_id']}", json={}, headers=CONTROLLER, timeout=10
        ).json()
        return ours, theirs

    ours, theirs = show(good)
    assert theirs["status"]["state"] == "succeeded" and theirs["status"]["last_attempt_id"] == "0"
    assert ours["status"] == "closed" and ours["reward"] in (0.0, 1.0) and ours["mode"] == "train"
    assert ours["reward_metadata"]["source"] == "agent_event"
    [call] = ours["calls"]
    assert call["request"]["messages"][0]["content"] == "6*7?"  # the env_map's QUESTION reached the agent
    assert call["prompt_token_ids"] and len(call["completion_logprobs"]) == len(call["completion_token_ids"])
    ours, theirs = show(bad)
    assert theirs["status"]["state"] == "failed" and "exited with code 1" in theirs["status"]["error_message"]
    assert ours["status"] == "failed" and ours["calls"] == []  # never trained
    ours, _ = show(val)
    assert ours["mode"] == "val" and ours["status"] == "closed"
    # the same input is the same task: the GRPO group of the two math rollouts
    assert show(good)[0]["task_id"] == ours["task_id"] != show(bad)[0]["task_id"]


def test_the_rollout_queue_is_the_controllers_alone(agl_gateway: Proc, redis_client):
    # config and metadata null, as Agent Lightning's SDK dumps a RolloutCreate
    [queued] = queue(
        agl_gateway, {"input": {"q": 1}, "rollout_id": "agl-queue-auth", "config": None, "metadata": None}
    )
    assert queued["config"]["timeout_seconds"] == 3600 and queued["metadata"]["batch_idx"] is None
    # idempotent on the id, as Agent Lightning's server is
    assert queue(agl_gateway, {"input": {"q": 1}, "rollout_id": "agl-queue-auth"}) == [queued]
    # metadata its controller could not read back is refused here, not in its poll
    bad = httpx.post(
        f"{agl_gateway.url}/api/rollouts",
        json=[{"input": 1, "metadata": {"batch_idx": "x"}}],
        headers=CONTROLLER,
    )
    assert bad.status_code == 422, bad.text
    base = f"{agl_gateway.url}/api/rollouts"
    assert httpx.get(base, params={"state_in": "queuing"}, headers=OPERATOR).status_code == 200
    assert httpx.get(base, params={"state_in": "queuing"}).status_code == 401
    assert (
        httpx.get(base, params={"state_in": "queuing"}, headers={"Authorization": "Bearer nope"}).status_code
        == 401
    )
    # the state machine: queuing -> running -> succeeded | failed, nothing back
    patch = f"{base}/agl-queue-auth"
    assert httpx.patch(patch, json={"status": {"state": "succeeded"}}, headers=CONTROLLER).status_code == 409
    assert httpx.patch(patch, json={"status": {"state": "running"}}, headers=CONTROLLER).status_code == 200
    assert httpx.patch(patch, json={"status": {"state": "queuing"}}, headers=CONTROLLER).status_code == 409
    assert httpx.patch(patch, json={"status": {"bogus": 1}}, headers=CONTROLLER).status_code == 422
    assert (
        httpx.patch(f"{base}/nobody", json={"status": {"state": "running"}}, headers=CONTROLLER).status_code
        == 404
    )
    assert httpx.post(base, json={"input": 1}, headers=CONTROLLER).status_code == 422  # a list is expected
    # the controller's key opens every rollout's agent routes (it hands it to all its agents)
    call = httpx.post(
        f"{agl_gateway.url}/proxy/rollout/agl-queue-auth/attempt/0/mode/train/openai/v1/chat/completions",
        json={"model": "auto", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers=CONTROLLER,
        timeout=10,
    )
    assert call.status_code == 200, call.text
