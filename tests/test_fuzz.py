"""Schemathesis, a property-based API fuzzer, against both servers' own OpenAPI documents (issue 18).

Each run is schemathesis's CLI (`st run`) against a running server: the gateway in front of the fake vLLM
(which answers 400, as vLLM's request models do, for a body vLLM's schema refuses: `--validate`), and
`rlgate serve` on the tiny model. Fixed seed, a bounded number of examples per operation, the phases
`examples`, `fuzzing` and (gateway) `stateful` (the document's links: create a rollout, call into it,
reward it, fail it), and the checks `not_a_server_error`, `status_code_conformance` and
`response_schema_conformance`. The coverage phase is left out: schemathesis 4.32 crashes walking vLLM's
request schemas on Python 3.11. docs/security.md, "Fuzzing", says what it covers and how long it takes.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import REDIS_URL, Proc, start_fake_vllm, start_gateway, start_rlgate_serve

pytestmark = pytest.mark.slow
pytest.importorskip("schemathesis")

SEED = "18"
CHECKS = "not_a_server_error,status_code_conformance,response_schema_conformance"


def st_run(url: str, tmp_path: Path, *args: str, timeout_s: float = 600) -> str:
    """`st run` against `url`/openapi.json; fails the test with its report unless every check passed."""
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or "st"
    command = [
        st,
        "run",
        f"{url}/openapi.json",
        "--checks",
        CHECKS,
        "--seed",
        SEED,
        "--generation-database",
        "none",
        "--request-timeout",
        "120",
        "--no-color",
        "--wait-for-schema",
        "30",
        *args,
    ]
    result = subprocess.run(
        command,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "SCHEMATHESIS_HOOKS": ""},
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, report[-20000:]
    assert "passed" in report.splitlines()[-1] or " passed" in report, report[-3000:]
    return report


@pytest.fixture
def fuzz_gateway(tmp_path: Path, redis_client):
    upstream = start_fake_vllm(tmp_path, "--validate")
    gateway = start_gateway(tmp_path, upstream.url, REDIS_URL)
    yield gateway
    gateway.kill(signal.SIGTERM)
    upstream.kill(signal.SIGTERM)
    assert "call_crashed" not in gateway.log()


def test_openapi_documents_every_gateway_route(fuzz_gateway):
    doc = httpx.get(f"{fuzz_gateway.url}/openapi.json", timeout=30).json()
    paths = doc["paths"]
    for prefix in (
        "/v1",
        "/rollouts/{rollout_id}/v1",
        "/tasks/{task_id}/rollouts/{rollout_id}/v1",
        "/proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/{mode}/openai/v1",
    ):
        for endpoint in ("/chat/completions", "/completions", "/responses"):
            body = paths[prefix + endpoint]["post"]["requestBody"]["content"]["application/json"]["schema"]
            assert body["$ref"].rsplit("/", 1)[1] in (
                "ChatCompletionRequest",
                "CompletionRequest",
                "ResponsesRequest",
            )
        assert "get" in paths[prefix + "/models"]
    mode = next(p for p in paths[prefix + "/models"]["get"]["parameters"] if p["name"] == "mode")
    assert mode["schema"]["enum"] == ["train", "val"]
    reward = paths["/rollouts/{rollout_id}/reward"]["post"]
    schema = reward["requestBody"]["content"]["application/json"]["schema"]
    assert schema["properties"]["reward"]["maximum"] == 1e6 and schema["additionalProperties"] is False
    assert {p["name"] for p in reward["parameters"]} >= {
        "webhook-id",
        "webhook-timestamp",
        "webhook-signature",
    }
    assert "links" in paths["/rollouts"]["post"]["responses"]["201"]
    assert doc["components"]["schemas"]["Error"]["required"] == ["error"]


@pytest.mark.timeout(900)
def test_fuzz_gateway(fuzz_gateway, tmp_path):
    report = st_run(
        fuzz_gateway.url,
        tmp_path,
        "--max-examples",
        "25",
        "--workers",
        "2",
        "--phases",
        "examples,fuzzing,stateful",
    )
    assert "Tested: 37" in report, report[-3000:]


@pytest.mark.timeout(900)
def test_fuzz_gateway_in_front_of_real_vllm(vllm: Proc, tmp_path: Path, redis_client):
    """The agent routes (`/v1/...`) fuzzed with real vLLM (its CPU build, on the tiny model) answering what
    passes the gateway: whatever the fuzzer sends, the gateway and the engine together answer in the
    documented shapes, never a server error, and the engine keeps serving."""
    gateway = start_gateway(tmp_path, vllm.url, REDIS_URL)
    try:
        report = st_run(
            gateway.url,
            tmp_path,
            "--max-examples",
            "10",
            "--workers",
            "2",
            "--phases",
            "examples,fuzzing",
            "--include-path-regex",
            "^/v1/",
        )
        assert "Tested: " in report, report[-3000:]
        assert "call_crashed" not in gateway.log()
    finally:
        gateway.kill(signal.SIGTERM)
    health = httpx.get(vllm.url.removesuffix("/v1") + "/health", timeout=30)
    assert health.status_code == 200  # the engine survived it


def test_gateway_refuses_unstorable_json(fuzz_gateway):
    """What Python's json takes and cannot be written back: a clear 4xx wherever it arrives."""
    url = fuzz_gateway.url
    lone = b'{"a": "\\udd49\\udb55"}'
    deep = b'{"a": ' + b"[" * 300 + b"]" * 300 + b"}"
    huge = b'{"a": 1' + b"0" * 30 + b"}"
    rid = httpx.post(f"{url}/rollouts", json={}, timeout=30).json()["rollout_id"]
    for body in (lone, deep, huge):
        for path in (
            "/rollouts",
            f"/rollouts/{rid}/reward",
            f"/rollouts/{rid}/finish",
            f"/api/rollouts/{rid}/attempt/0/events",
            "/v1/chat/completions",
        ):
            wrapped = {
                "/rollouts": b'{"metadata": %s}',
                f"/rollouts/{rid}/reward": b'{"reward": 1, "metadata": %s}',
                f"/rollouts/{rid}/finish": b'{"reward_fn": "math_answer", "ground_truth": %s}',
                f"/api/rollouts/{rid}/attempt/0/events": b'{"event_type": "note", "data": %s}',
                "/v1/chat/completions": b'{"model": "fake-model", "messages": [], "x": %s}',
            }[path]
            response = httpx.post(
                url + path, content=wrapped % body, timeout=30, headers={"content-type": "application/json"}
            )
            if body is huge and path == "/v1/chat/completions":
                continue  # orjson reads an integer past 64 bits as a float: stored and sent as that float
            assert response.status_code in (400, 422), (path, body[:20], response.status_code, response.text)
            assert "error" in response.json()


@pytest.fixture
def fuzz_serve(tmp_path: Path):
    pytest.importorskip("torch")
    from rlgate.inference.tiny_model import build_tiny_model

    proc = start_rlgate_serve(build_tiny_model(tmp_path / "tiny", seed=0), tmp_path, "tiny")
    yield proc
    proc.kill(signal.SIGTERM)
    assert "request failed" not in proc.log()


@pytest.mark.timeout(900)
def test_fuzz_rlgate_serve(fuzz_serve, tmp_path):
    report = st_run(
        fuzz_serve.url, tmp_path, "--max-examples", "15", "--workers", "1", "--phases", "examples,fuzzing"
    )
    assert "Tested: 9" in report, report[-3000:]


def test_rlgate_serve_refuses_unstorable_json(fuzz_serve):
    for raw in (
        b'{"model": "tiny", "prompt": "hi", "user": "\\udd49\\udb55"}',
        b'{"model": "tiny", "prompt": "hi", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        b'{"model": "tiny", "prompt": "hi", "seed": 1' + b"0" * 30 + b"}",
    ):
        response = httpx.post(
            f"{fuzz_serve.url}/v1/completions",
            content=raw,
            timeout=60,
            headers={"content-type": "application/json"},
        )
        assert response.status_code == 400, (raw[:60], response.text)
        assert response.json()["error"]["code"] == 400


def test_vllm_request_schemas_are_vllms():
    """gateway/vllm_requests.json is what vLLM 0.33's own OpenAPI document says (regenerated and compared)."""
    python = os.environ.get("RLGATE_VLLM_PYTHON")
    if not python:
        pytest.skip("RLGATE_VLLM_PYTHON (the vLLM oracle's Python) is not set")
    script = Path(__file__).resolve().parent.parent / "scripts" / "gen_vllm_request_schemas.py"
    result = subprocess.run([python, str(script), "--check"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
