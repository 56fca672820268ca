"""`rlgate serve --logprobs-mode`: vLLM's four modes, as real server processes on the tiny model, against a
direct forward pass. raw_* are of the model's own logits z (before logit_bias, temperature, top-k/top-p);
processed_* of the logits z' actually sampled from (vLLM v1 `sample/sampler.py`, `ops/topk_topp_sampler.py`;
tests/test_vllm_oracle.py checks z' against vLLM's own top-k/top-p code)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import Proc, rlgate, start_rlgate_serve  # noqa: E402

from rlgate.inference.engine import SamplingParams, processed_logits  # noqa: E402
from rlgate.inference.tiny_model import build_tiny_model  # noqa: E402

MODEL = "tiny"
MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
MESSAGES = [{"role": "user", "content": "Count to five."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("logprobs_mode") / "tiny", seed=0)


@pytest.fixture(scope="module")
def servers(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    """One `rlgate serve` per mode, started side by side; raw_logprobs is the one started without the flag
    (vLLM's default is the server's)."""
    logs = tmp_path_factory.mktemp("logprobs_mode_logs")
    procs: dict[str, Proc] = {}

    def start(mode: str) -> None:
        flag = None if mode == "raw_logprobs" else mode
        procs[mode] = start_rlgate_serve(model_dir, logs, MODEL, logprobs_mode=flag)

    threads = [threading.Thread(target=start, args=(mode,)) for mode in MODES]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert set(procs) == set(MODES), "a server did not start"
        yield procs
    finally:
        for proc in procs.values():
            proc.kill(signal.SIGTERM)


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()


def chat(proc: Proc, **fields) -> dict:
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 6,
        "return_token_ids": True,
        "logprobs": True,
        **fields,
    }
    response = httpx.post(f"{proc.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def logits_at(hf, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """z for each completion token: [len(completion), V], one unpadded forward pass."""
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([prompt + completion[:-1]])).logits[0].float()
    return out[len(prompt) - 1 :]


def expected(mode: str, z: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    if mode.startswith("raw"):
        values = z
    else:
        values = torch.stack([processed_logits(row, params) for row in z])
    return torch.log_softmax(values, -1) if mode.endswith("logprobs") else values


def reported(body: dict) -> tuple[list[int], list[float], list[list[tuple[bytes, float]]]]:
    [choice] = body["choices"]
    content = choice["logprobs"]["content"]
    return (
        choice["token_ids"],
        [c["logprob"] for c in content],
        [[(bytes(t["bytes"]), t["logprob"]) for t in c["top_logprobs"]] for c in content],
    )


SETTINGS = [
    # (request fields, the engine's parameters for the same)
    (
        {"temperature": 0.5, "logit_bias": {"101": 3.0}, "seed": 3},
        SamplingParams(temperature=0.5, logit_bias={101: 3.0}),
    ),
    ({"temperature": 1.0, "top_k": 4, "seed": 4}, SamplingParams(temperature=1.0, top_k=4)),
    (
        {"temperature": 0, "logit_bias": {"101": 2.0, "32": -5.0}},
        SamplingParams(temperature=0, logit_bias={101: 2.0, 32: -5.0}),
    ),
    ({"temperature": 1.3, "top_p": 0.8, "seed": 5}, SamplingParams(temperature=1.3, top_p=0.8)),
]


@pytest.mark.parametrize(("fields", "params"), SETTINGS)
def test_each_mode_reports_what_vllm_names(
    servers: dict[str, Proc], hf, fields: dict, params: SamplingParams
):
    bodies = {mode: chat(proc, **fields, top_logprobs=5) for mode, proc in servers.items()}
    ids = bodies["raw_logprobs"]["choices"][0]["token_ids"]
    prompt = bodies["raw_logprobs"]["prompt_token_ids"]
    z = logits_at(hf, prompt, ids)
    for mode, body in bodies.items():
        tokens, values, tops = reported(body)
        assert tokens == ids, f"{mode}: the mode changed what was sampled"
        want = expected(mode, z, params)
        got = torch.tensor(values)
        sampled = want[torch.arange(len(ids)), torch.tensor(ids)].clamp(min=-9999.0)
        assert torch.allclose(got, sampled, atol=2e-4), (mode, got, sampled)
        for pos, (row, top, token) in enumerate(zip(want, tops, ids, strict=True)):
            # the sampled token first, then the best others by the reported values
            others = sorted(
                (v for i, v in enumerate(row.clamp(min=-9999.0).tolist()) if i != token), reverse=True
            )
            assert [v for _, v in top] == pytest.approx([float(sampled[pos]), *others[:4]], abs=2e-4), mode


def test_raw_and_processed_differ_where_vllms_do(servers: dict[str, Proc]):
    """temperature != 1 or a logit_bias: raw != processed; neither (and no truncation): the same."""

    def values(mode: str, **fields) -> tuple[list[int], list[float]]:
        ids, logprobs, _ = reported(chat(servers[mode], **fields))
        return ids, logprobs

    for fields in (
        {"temperature": 0.5, "seed": 7},
        {"temperature": 1.0, "logit_bias": {"101": 3.0}, "seed": 7},
    ):
        (raw_ids, raw), (ids, processed) = (
            values("raw_logprobs", **fields),
            values("processed_logprobs", **fields),
        )
        assert raw_ids == ids
        assert max(abs(a - b) for a, b in zip(raw, processed, strict=True)) > 0.05, fields
    plain = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 8}
    (raw_ids, raw), (ids, processed) = values("raw_logprobs", **plain), values("processed_logprobs", **plain)
    assert raw_ids == ids and raw == pytest.approx(processed, abs=1e-5)
    (_, raw), (_, processed) = values("raw_logits", **plain), values("processed_logits", **plain)
    assert raw == pytest.approx(processed, abs=1e-5)
    assert any(v > 0 for v in raw)  # logits, not log-probs


def test_truncated_tokens_are_minus_9999_in_processed_modes_only(servers: dict[str, Proc]):
    """top_k=2 with top_logprobs=4: in processed modes the 3rd and 4th candidates were cut (-inf, which vLLM
    reports as -9999.0); raw modes rank the model's own logits, all finite."""
    for mode, proc in servers.items():
        _, _, tops = reported(chat(proc, temperature=1.0, top_k=2, seed=9, top_logprobs=4))
        for top in tops:
            assert len(top) == 4
            cut = [v for _, v in top if v == -9999.0]
            assert len(cut) == (2 if mode.startswith("processed") else 0), (mode, top)


def test_completions_report_the_mode_too(servers: dict[str, Proc]):
    body = {
        "model": MODEL,
        "prompt": "Once",
        "max_tokens": 4,
        "seed": 2,
        "temperature": 0.5,
        "logprobs": 1,
        "return_token_ids": True,
    }
    got = {
        mode: httpx.post(f"{proc.url}/v1/completions", json=body, timeout=120).json()["choices"][0]
        for mode, proc in servers.items()
    }
    assert len({tuple(c["token_ids"]) for c in got.values()}) == 1
    raw, processed = got["raw_logprobs"]["logprobs"], got["processed_logprobs"]["logprobs"]
    assert raw["tokens"] == processed["tokens"]
    assert raw["token_logprobs"] != pytest.approx(processed["token_logprobs"], abs=1e-3)


def test_an_unknown_mode_is_refused(model_dir: Path, tmp_path: Path):
    result = rlgate("serve", "--model", str(model_dir), "--port", "0", "--logprobs-mode", "softmax")
    assert result.returncode != 0 and "logprobs" in (result.stderr + result.stdout)
