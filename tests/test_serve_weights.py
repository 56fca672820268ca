"""`rlgate serve`'s full-weight updates and pause/resume, vLLM's RL routes, against a real server process."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from conftest import Proc, start_rlgate_serve

pytest.importorskip("torch")

from rlgate.inference.tiny_model import build_tiny_model  # noqa: E402

PROMPT = [72, 105, 33, 32, 50, 43, 51, 61]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Proc, Path]]:
    # dev mode, and the default weights root: the model's parent, tmp_path
    proc = start_rlgate_serve(build_tiny_model(tmp_path / "tiny", seed=0), tmp_path, "tiny", dev_mode=True)
    yield proc, tmp_path
    proc.kill(signal.SIGTERM)


def greedy_top(url: str) -> tuple[int, float]:
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": 1,
        "return_token_ids": True,
    }
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    return choice["token_ids"][0], choice["logprobs"]["token_logprobs"][0]


def direct_top(model_dir: Path) -> tuple[int, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0, -1].float(), -1)
    return int(logp.argmax()), float(logp.max())


def save_weights(model_dir: Path, file: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, str(file))


def post(url: str, path: str, body: dict | None = None) -> httpx.Response:
    return (
        httpx.post(f"{url}{path}", json=body, timeout=60)
        if body is not None
        else httpx.post(f"{url}{path}", timeout=60)
    )


def test_a_full_weight_update_changes_the_outputs_and_bumps_the_version(served):
    proc, tmp = served
    before = greedy_top(proc.url)
    other = build_tiny_model(tmp / "other", seed=7)
    save_weights(other, tmp / "v1.safetensors")
    assert httpx.get(f"{proc.url}/weight_info").json() == {"weight_version": "default"}

    assert post(proc.url, "/init_weight_transfer_engine", {"init_info": {}}).json() == {
        "message": "Weight transfer initialized"
    }
    assert post(proc.url, "/start_weight_update").json() == {"message": "Weight update started"}
    assert post(
        proc.url, "/update_weights", {"update_info": {"path": str(tmp / "v1.safetensors")}}
    ).json() == {"message": "Weights updated"}
    # the version changes only when the update finishes
    assert httpx.get(f"{proc.url}/weight_info").json() == {"weight_version": "default"}
    assert post(proc.url, "/finish_weight_update", {"weight_version": "1"}).json() == {
        "message": "Weight update finished"
    }
    assert httpx.get(f"{proc.url}/weight_info").json() == {"weight_version": "1"}

    after = greedy_top(proc.url)
    assert after != before
    token, logprob = direct_top(other)
    assert after[0] == token and after[1] == pytest.approx(logprob, abs=1e-4)
    assert post(proc.url, "/update_weight_version", {"new_version": "v-two"}).json() == {
        "success": True,
        "new_version": "v-two",
    }
    assert httpx.get(f"{proc.url}/weight_info").json() == {"weight_version": "v-two"}


def test_calls_out_of_order_and_bad_updates_are_client_errors(served):
    proc, tmp = served
    assert post(proc.url, "/start_weight_update").status_code == 409  # not initialised
    assert post(proc.url, "/init_weight_transfer_engine", {"init_info": {"bogus": 1}}).status_code == 400
    assert post(proc.url, "/init_weight_transfer_engine", {"init_info": {}}).status_code == 200
    missing = post(proc.url, "/update_weights", {"update_info": {"path": "/nonexistent"}})
    assert missing.status_code == 409 and missing.json()["error"]["type"] == "ConflictError"
    assert post(proc.url, "/finish_weight_update").status_code == 409
    assert post(proc.url, "/start_weight_update").status_code == 200
    assert post(proc.url, "/start_weight_update").status_code == 409
    before = greedy_top(proc.url)
    bad = post(proc.url, "/update_weights", {"update_info": {"path": str(tmp / "none.safetensors")}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "update_info"
    # a failed update clears the active flag (as vLLM), and changed nothing
    assert post(proc.url, "/finish_weight_update").status_code == 409
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(tmp / "wrong.safetensors"))
    assert post(proc.url, "/start_weight_update").status_code == 200
    wrong = post(proc.url, "/update_weights", {"update_info": {"path": str(tmp / "wrong.safetensors")}})
    assert wrong.status_code == 400 and "shape" in wrong.json()["error"]["message"]
    assert greedy_top(proc.url) == before
    assert httpx.get(f"{proc.url}/weight_info").json() == {"weight_version": "default"}


RL_ROUTES = [
    ("POST", "/pause?mode=keep", None),
    ("POST", "/resume", None),
    ("GET", "/is_paused", None),
    ("POST", "/init_weight_transfer_engine", {"init_info": {}}),
    ("POST", "/start_weight_update", None),
    ("POST", "/update_weights", {"update_info": {"path": "PATH"}}),
    ("POST", "/finish_weight_update", {"weight_version": "666"}),
    ("POST", "/update_weight_version", {"new_version": "666"}),
    ("GET", "/weight_info", None),
]


def test_without_dev_mode_the_rl_routes_are_404_and_change_nothing(tmp_path: Path):
    """As vLLM without VLLM_SERVER_DEV_MODE: the routes do not exist (FastAPI's 404, vLLM's answer too), so
    nobody can pause the server, replace its weights or set its version; with VLLM_SERVER_DEV_MODE=1 in
    its environment (vLLM's variable) they are served."""
    model = build_tiny_model(tmp_path / "tiny", seed=0)
    save_weights(build_tiny_model(tmp_path / "other", seed=7), tmp_path / "v1.safetensors")
    proc = start_rlgate_serve(model, tmp_path, "tiny")
    try:
        before = greedy_top(proc.url)
        for method, path, body in RL_ROUTES:
            if body and "update_info" in body:
                body = {"update_info": {"path": str(tmp_path / "v1.safetensors")}}
            answer = httpx.request(method, f"{proc.url}{path}", json=body, timeout=30)
            assert (answer.status_code, answer.json()) == (404, {"detail": "Not Found"}), (path, answer.text)
        assert greedy_top(proc.url) == before  # not paused (a kept pause would hang this), weights unchanged
    finally:
        proc.kill(signal.SIGTERM)
    dev = start_rlgate_serve(model, tmp_path, "tiny", env={"VLLM_SERVER_DEV_MODE": "1"})
    try:
        assert httpx.get(f"{dev.url}/weight_info").json() == {"weight_version": "default"}
    finally:
        dev.kill(signal.SIGTERM)


def test_a_weight_file_outside_the_root_is_answered_as_a_missing_one(tmp_path: Path):
    """A weight file is read only from under the weights root (default: the model's parent folder); one
    outside it, directly, through `..` or through a symlink, gets the same 400 as a path that does not
    exist, and the weights stay as they were."""
    models, elsewhere = tmp_path / "models", tmp_path / "elsewhere"
    proc = start_rlgate_serve(
        build_tiny_model(models / "tiny", seed=0), tmp_path, "tiny", env={"VLLM_SERVER_DEV_MODE": "1"}
    )
    try:
        elsewhere.mkdir()
        save_weights(build_tiny_model(tmp_path / "other", seed=7), elsewhere / "v1.safetensors")
        (models / "link.safetensors").symlink_to(elsewhere / "v1.safetensors")
        before = greedy_top(proc.url)
        assert post(proc.url, "/init_weight_transfer_engine", {"init_info": {}}).status_code == 200

        def refused(path: str) -> str:
            assert post(proc.url, "/start_weight_update").status_code == 200
            answer = post(proc.url, "/update_weights", {"update_info": {"path": path}})
            assert answer.status_code == 400, answer.text
            return answer.json()["error"]["message"].replace(path, "PATH")

        missing = refused(str(models / "none.safetensors"))
        assert missing == "no safetensors file at PATH"
        for outside in (
            elsewhere / "v1.safetensors",
            models / ".." / "elsewhere" / "v1.safetensors",
            models / "link.safetensors",
        ):
            assert refused(str(outside)) == missing
        assert greedy_top(proc.url) == before
    finally:
        proc.kill(signal.SIGTERM)


def test_paused_server_answers_503_with_retry_after_and_resumes(served):
    proc, _ = served
    assert post(proc.url, "/pause?mode=abort").json() == {"status": "paused"}
    assert httpx.get(f"{proc.url}/is_paused").json() == {"is_paused": True}
    refused = httpx.post(
        f"{proc.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}
    )
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "ServiceUnavailableError"
    assert post(proc.url, "/pause?mode=sideways").status_code == 400
    assert post(proc.url, "/resume").json() == {"status": "resumed"}
    assert httpx.get(f"{proc.url}/is_paused").json() == {"is_paused": False}
    greedy_top(proc.url)


def test_pause_keep_holds_new_requests_until_resume(served):
    proc, _ = served
    post(proc.url, "/pause?mode=keep")
    answers: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: answers.append(
            httpx.post(
                f"{proc.url}/v1/completions",
                json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                timeout=30,
            )
        )
    )
    thread.start()
    time.sleep(0.5)
    assert not answers  # held
    post(proc.url, "/resume")
    thread.join(timeout=30)
    assert answers and answers[0].status_code == 200


def test_pause_wait_lets_admitted_requests_finish_first(served):
    proc, _ = served
    answers: list[tuple[float, httpx.Response]] = []
    # two rows of 1,500 tokens: seconds on a quiet machine (one row alone can finish within the sleep below)
    body = {
        "model": "tiny",
        "prompt": "hi",
        "max_tokens": 1500,
        "n": 2,
        "logit_bias": {"256": -100, "258": -100},
    }

    def call() -> None:
        response = httpx.post(f"{proc.url}/v1/completions", json=body, timeout=120)
        answers.append((time.monotonic(), response))

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.5)  # admitted and generating
    t0 = time.monotonic()
    paused = post(proc.url, "/pause?mode=wait")
    t_paused = time.monotonic()
    thread.join(timeout=120)
    assert paused.status_code == 200 and answers
    answered_at, answer = answers[0]
    assert answer.status_code == 200, answer.text
    assert [c["finish_reason"] for c in answer.json()["choices"]] == ["length", "length"]
    assert answer.json()["usage"]["completion_tokens"] == 3000
    assert answered_at > t0  # it was still running when /pause came
    assert t_paused - t0 > 0.2  # /pause waited for the request ...
    assert answered_at - t_paused < 1.0  # ... until it was done (its answer followed at once)
    post(proc.url, "/resume")


def test_pause_abort_ends_the_queued_requests_of_every_scheduler():
    """Requests queued for the base model and for a LoRA adapter (each has its own scheduler) all end
    with finish_reason "abort" when the server pauses with mode=abort."""
    import asyncio

    from rlgate.inference.engine import SamplingParams
    from rlgate.inference.scheduler import Scheduler
    from rlgate.inference.weights import WeightSync

    async def go():
        base, adapter = Scheduler(engine=None), Scheduler(engine=None)  # not started: requests stay queued
        sync = WeightSync(torch.nn.Linear(1, 1), base, lambda: (base, adapter))
        queued = [
            asyncio.ensure_future(s.generate([1, 2], SamplingParams(max_tokens=2))) for s in (base, adapter)
        ]
        await asyncio.sleep(0)
        await sync.pause("abort")
        return [(await q).finish_reason for q in queued]

    assert asyncio.run(go()) == ["abort", "abort"]
