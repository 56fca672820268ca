"""Harnesses nobody here wrote, as a user runs them: the real Claude Code, Codex CLI and opencode (pinned,
from the npm registry: scripts/test installs them into .harnesses/), given only the environment `POST
/rollouts` returns, against the gateway. The upstream is the fake vLLM with a long context: both harnesses send
prompts of 20,000 (Codex) and 48,000 (Claude Code) tokens on its byte tokenizer, which the tiny models here
cannot hold. On chat it answers with a tool call whenever tools are offered and the last message is not a
tool result, so each harness's run has several turns: it runs the tool and sends its result back (the
Messages and Responses APIs are served as chat completions)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import Proc, recorded_calls, start_fake_vllm, start_gateway

MODEL = "fake-model"
OPERATOR = {"Authorization": "Bearer harness-test-operator"}


def harness(name: str) -> Path:
    """The installed harness's executable; skips without it (a failure under RLGATE_TEST_NO_SKIP)."""
    base = os.environ.get("RLGATE_HARNESSES_BIN") or str(
        Path(__file__).resolve().parent.parent / ".harnesses/node_modules/.bin"
    )
    path = Path(base) / name
    if not os.access(path, os.X_OK):
        pytest.skip(f"{name} is not installed at {path} (scripts/test installs it with npm)")
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """The fake vLLM with a 256k context, and a gateway that requires each rollout's own key."""
    tmp = tmp_path_factory.mktemp("harnesses")
    upstream = start_fake_vllm(tmp, "--model", MODEL, "--max-model-len", "262144")
    gateway = start_gateway(
        tmp,
        upstream.url,
        rollout_key_secret="harness-test-secret",
        require_rollout_keys="true",
        operator_token=OPERATOR["Authorization"].removeprefix("Bearer "),
    )
    yield gateway
    gateway.kill(signal.SIGTERM)
    upstream.kill(signal.SIGTERM)


def new_rollout(gateway: Proc) -> dict:
    answer = httpx.post(f"{gateway.url}/rollouts", json={"task_id": "harness"}, headers=OPERATOR, timeout=10)
    assert answer.status_code == 201, answer.text
    return answer.json()


def run(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """A harness with only the rollout's environment (plus PATH and a HOME of its own)."""
    base = {"PATH": os.environ["PATH"], "HOME": str(cwd / "home"), "LANG": "C.UTF-8"}
    (cwd / "home").mkdir(exist_ok=True)
    return subprocess.run(command, env={**base, **env}, cwd=cwd, capture_output=True, text=True, timeout=240)


def assert_trainable(call: dict) -> None:
    assert call["error"] is None, call["error"]
    assert call["prompt_token_ids"] and call["completion_token_ids"]
    assert len(call["completion_logprobs"]) == len(call["completion_token_ids"])


def recorded_turns(gateway: Proc, rollout: dict, result: subprocess.CompletedProcess, agent_api: str) -> list:
    """The calls of a harness that exited 0: at least two (the first answer is a tool call, which it runs
    and answers), each through `agent_api`, streamed and trainable."""
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    calls = recorded_calls(gateway, rollout["rollout_id"], OPERATOR)
    assert len(calls) >= 2, calls
    for call in calls:
        assert call["agent_api"] == agent_api and call["stream"]
        assert_trainable(call)
    return calls


def answers_tool_call(messages: list[dict], tool_call_id: str) -> bool:
    """Whether `messages` hold the tool result for the call `tool_call_id`."""
    return any(m.get("role") == "tool" and m.get("tool_call_id") == tool_call_id for m in messages)


@pytest.mark.slow
def test_claude_code_runs_unchanged_through_the_messages_api(stack: Proc, redis_client, tmp_path: Path):
    claude = harness("claude")
    rollout = new_rollout(stack)
    env = {k: v for k, v in rollout["agent_env"].items() if k.startswith("ANTHROPIC_")}
    env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] = "1"
    result = run([str(claude), "-p", "What is 2+2?", "--model", MODEL], env, tmp_path)
    # Claude Code offers its tools: the first answer is a tool call, which it runs and answers
    calls = recorded_turns(stack, rollout, result, "anthropic.messages")
    first, last = calls[0], calls[-1]
    assert first["response"]["message"]["tool_calls"] and len(first["request"]["tools"]) > 3
    tool_call_id = first["response"]["message"]["tool_calls"][0]["id"]
    assert answers_tool_call(calls[1]["request"]["messages"], tool_call_id)
    # what it printed is the last answer's text
    assert last["response"]["message"]["content"] and last["response"]["message"]["content"] in result.stdout


@pytest.mark.slow
def test_codex_cli_runs_unchanged_through_the_responses_api(stack: Proc, redis_client, tmp_path: Path):
    codex = harness("codex")
    rollout = new_rollout(stack)
    env = {k: v for k, v in rollout["agent_env"].items() if k.startswith("OPENAI_")}
    home = tmp_path / "codex"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "rlgate"\n\n[model_providers.rlgate]\nname = "rlgate"\n'
        f'base_url = "{env["OPENAI_BASE_URL"]}"\nwire_api = "responses"\nenv_key = "OPENAI_API_KEY"\n'
    )
    env["CODEX_HOME"] = str(home)
    result = run([str(codex), "exec", "--skip-git-repo-check", "What is 2+2?"], env, tmp_path)
    # Codex offers its tools: the first answer is a call of its shell tool, which it runs and answers with
    # a function_call_output; every call is a streamed Responses call served as a chat completion
    calls = recorded_turns(stack, rollout, result, "openai.responses")
    first, last = calls[0], calls[-1]
    [tool_call] = first["response"]["message"]["tool_calls"]
    shown = [t["function"]["name"] for t in first["request"]["tools"]]
    assert tool_call["function"]["name"] in shown and len(shown) > 3
    # its namespaced tools as vLLM shows them; its web_search (a server tool) not shown
    assert any("__" in name for name in shown) and "web_search" not in shown
    assert answers_tool_call(calls[1]["request"]["messages"], tool_call["id"])
    text = last["response"]["message"]["content"]
    assert text and text in result.stdout


# opencode's own configuration (opencode.json in the project folder), as its docs write a provider for an
# OpenAI-compatible server: everything it needs comes from the rollout's environment
OPENCODE_CONFIG = {
    "$schema": "https://opencode.ai/config.json",
    "provider": {
        "rlgate": {
            "npm": "@ai-sdk/openai-compatible",
            "name": "rlgate",
            "options": {"baseURL": "{env:OPENAI_BASE_URL}", "apiKey": "{env:OPENAI_API_KEY}"},
            "models": {MODEL: {"name": MODEL}},
        }
    },
    "model": f"rlgate/{MODEL}",
}


@pytest.mark.slow
def test_opencode_runs_unchanged_through_chat_completions(stack: Proc, redis_client, tmp_path: Path):
    """opencode (`opencode run`), configured once with a provider that reads the rollout's OPENAI_BASE_URL
    and OPENAI_API_KEY: it exits 0 after running the tool the first answer asked for, and every call it
    made (a title call, then the agent's turns: streamed chat completions with its tools) is recorded with
    ids and every token's log-prob."""
    import json

    opencode = harness("opencode")
    rollout = new_rollout(stack)
    env = {k: v for k, v in rollout["agent_env"].items() if k.startswith("OPENAI_")}
    (tmp_path / "opencode.json").write_text(json.dumps(OPENCODE_CONFIG))
    # nothing from the network but the gateway: no model catalogue fetch, no update check
    env |= {"OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1"}
    result = run([str(opencode), "run", "What is 2+2?"], env, tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    calls = recorded_calls(stack, rollout["rollout_id"], OPERATOR)
    assert calls and all(c["endpoint"] == "chat.completions" and c["stream"] for c in calls)
    for call in calls:
        assert_trainable(call)
    agent_turns = [c for c in calls if c["request"].get("tools")]
    assert len(agent_turns) >= 2, [len(c["request"].get("tools") or []) for c in calls]
    first, last = agent_turns[0], agent_turns[-1]
    tool_call_id = first["response"]["message"]["tool_calls"][0]["id"]
    assert answers_tool_call(last["request"]["messages"], tool_call_id)
    assert last["response"]["message"]["content"] and last["response"]["message"]["content"] in result.stdout
