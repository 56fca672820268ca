"""Runtime LoRA in `rlgate serve`, vLLM's contract: an adapter saved by peft is loaded by name, selected by
`"model"`, changes the outputs, and unloading it leaves the base model as it was."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from conftest import Proc, start_rlgate_serve  # noqa: E402

from rlgate.inference.tiny_model import build_tiny_model  # noqa: E402

MODEL = "tiny"
PROMPT = {
    "messages": [{"role": "user", "content": "What is 17 + 25?"}],
    "max_tokens": 12,
    "temperature": 0,
    "return_token_ids": True,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("lora") / "tiny", seed=0)


def save_adapter(model_dir: Path, path: Path, seed: int) -> Path:
    """A LoRA adapter as the learner saves one; random B (not peft's zero init), so it changes outputs."""
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    config = peft.LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft.get_peft_model(base, config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    # adapters are saved in each test's tmp_path: the root is pytest's base folder
    proc = start_rlgate_serve(
        model_dir,
        tmp_path_factory.mktemp("lora_log"),
        MODEL,
        lora=True,
        weights_root=tmp_path_factory.getbasetemp(),
    )
    yield proc
    proc.kill(signal.SIGTERM)


def tokens(server: Proc, model: str) -> list[int]:
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"model": model, **PROMPT}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def test_load_select_unload(server: Proc, model_dir: Path, tmp_path: Path):
    adapter = save_adapter(model_dir, tmp_path / "policy-v1", seed=1)
    base_before = tokens(server, MODEL)

    loaded = httpx.post(
        f"{server.url}/v1/load_lora_adapter", json={"lora_name": "policy-v1", "lora_path": str(adapter)}
    )
    assert (
        loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'policy-v1' added successfully."
    )
    models = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert [(m["id"], m["parent"], m["root"]) for m in models] == [
        (MODEL, None, str(model_dir)),
        ("policy-v1", MODEL, str(adapter)),
    ]

    with_adapter = tokens(server, "policy-v1")
    assert with_adapter != base_before
    assert tokens(server, MODEL) == base_before  # the base model is untouched
    # the adapter's tokens are those of the merged model, computed directly
    merged = (
        peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True), adapter
        )
        .merge_and_unload()
        .eval()
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(PROMPT["messages"], add_generation_prompt=True, tokenize=False)
    )
    with torch.no_grad():
        direct = merged.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=258, pad_token_id=256
        )[0, len(prompt) :].tolist()
    assert with_adapter == direct

    again = httpx.post(
        f"{server.url}/v1/load_lora_adapter", json={"lora_name": "policy-v1", "lora_path": str(adapter)}
    )
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    other = save_adapter(model_dir, tmp_path / "policy-v2", seed=2)
    inplace = httpx.post(
        f"{server.url}/v1/load_lora_adapter",
        json={"lora_name": "policy-v1", "lora_path": str(other), "load_inplace": True},
    )
    assert inplace.status_code == 200 and tokens(server, "policy-v1") != with_adapter

    unloaded = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "policy-v1"})
    assert (
        unloaded.status_code == 200
        and unloaded.text == "Success: LoRA adapter 'policy-v1' removed successfully."
    )
    gone = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "policy-v1", **PROMPT})
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "NotFoundError"
    assert tokens(server, MODEL) == base_before
    missing = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "policy-v1"})
    assert missing.status_code == 404
    nowhere = httpx.post(
        f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)}
    )
    assert nowhere.status_code == 404 and nowhere.json()["error"] == {
        "message": f"Loading lora x failed: No adapter found for {tmp_path}",
        "type": "NotFoundError",
        "param": None,
        "code": 404,
    }  # vLLM's LoRAAdapterNotFoundError


LORA_ROUTES = ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"]


def test_without_runtime_lora_updating_the_routes_are_404_and_change_nothing(model_dir: Path, tmp_path: Path):
    """As vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING: the routes do not exist (404, FastAPI's body), and
    no adapter is loaded; vLLM's variable turns them on when "1" or "true" (any case), and only then."""
    adapter = save_adapter(model_dir, tmp_path / "policy-v1", seed=1)
    body = {"lora_name": MODEL + "-x", "lora_path": str(adapter), "load_inplace": True}
    for env in ({}, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "yes"}):
        proc = start_rlgate_serve(model_dir, tmp_path, MODEL, env=env)
        try:
            before = tokens(proc, MODEL)
            for path in LORA_ROUTES:
                answer = httpx.post(f"{proc.url}{path}", json=body, timeout=60)
                assert (answer.status_code, answer.json()) == (404, {"detail": "Not Found"}), (env, path)
            assert [m["id"] for m in httpx.get(f"{proc.url}/v1/models").json()["data"]] == [MODEL]
            assert tokens(proc, MODEL) == before
        finally:
            proc.kill(signal.SIGTERM)
    proc = start_rlgate_serve(
        model_dir, tmp_path, MODEL, weights_root=tmp_path, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": " True"}
    )
    try:
        loaded = httpx.post(f"{proc.url}/v1/load_lora_adapter", json=body, timeout=60)
        assert loaded.status_code == 200, loaded.text
    finally:
        proc.kill(signal.SIGTERM)


def test_an_adapter_outside_the_root_is_answered_as_a_missing_one(model_dir: Path, tmp_path: Path):
    """`lora_path` is read only from under the weights root (here the default: the model's parent folder):
    an adapter outside it (directly, through `..`, through a symlink) gets the very answer of a folder that
    does not exist, and is not loaded."""
    root, elsewhere = model_dir.parent, tmp_path / "elsewhere"
    real = save_adapter(model_dir, elsewhere / "policy-v1", seed=1)
    (root / f"link-{tmp_path.name}").symlink_to(real)
    proc = start_rlgate_serve(model_dir, tmp_path, MODEL, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    try:
        before = tokens(proc, MODEL)

        def answer(path: Path) -> tuple[int, dict]:
            response = httpx.post(
                f"{proc.url}/v1/load_lora_adapter",
                json={"lora_name": "policy-v1", "lora_path": str(path)},
                timeout=60,
            )
            body = response.json()
            body["error"]["message"] = body["error"]["message"].replace(str(path), "PATH")
            return response.status_code, body

        missing = answer(root / "nothing-here")
        assert missing == (
            404,
            {
                "error": {
                    "message": "Loading lora policy-v1 failed: No adapter found for PATH",
                    "type": "NotFoundError",
                    "param": None,
                    "code": 404,
                }
            },
        )
        for outside in (real, root / os.path.relpath(real, root), root / f"link-{tmp_path.name}"):
            assert answer(outside) == missing
        assert [m["id"] for m in httpx.get(f"{proc.url}/v1/models").json()["data"]] == [MODEL]
        assert tokens(proc, MODEL) == before
        inside = save_adapter(model_dir, root / f"inside-{tmp_path.name}", seed=1)  # the same, under the root
        loaded = httpx.post(
            f"{proc.url}/v1/load_lora_adapter",
            json={"lora_name": "policy-v1", "lora_path": str(inside)},
            timeout=60,
        )
        assert loaded.status_code == 200, loaded.text
    finally:
        proc.kill(signal.SIGTERM)
