"""The framework examples (plain OpenAI SDK, LangChain, OpenAI Agents SDK, AutoGen, and Anthropic's SDK on
the Messages API), each configured only through its base URL (OPENAI_BASE_URL, ANTHROPIC_BASE_URL), run as real processes against the gateway in front of `rlgate serve`. Every
LLM call must be recorded under the rollout with its token ids and log-probs, tool calls included.

The served model is the tiny model taught in code to call the calculator (`tool_model.py`): a random tiny
model never writes a tool call."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator

import httpx
import pytest
from conftest import ROOT, Proc, start_gateway, start_rlgate_serve

EXAMPLES = [
    "openai_sdk_agent",
    "langchain_agent",
    "openai_agents_sdk_agent",
    "autogen_agent",
    "anthropic_sdk_agent",
]


@pytest.fixture(scope="module")
def tool_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    pytest.importorskip("torch")
    from tool_model import cached_tool_calling_model

    tmp = tmp_path_factory.mktemp("examples")
    serve = start_rlgate_serve(cached_tool_calling_model(), tmp, "policy")
    gateway = start_gateway(tmp, serve.url + "/v1")
    yield gateway
    gateway.kill(signal.SIGTERM)
    serve.kill(signal.SIGTERM)


# the first example also builds the tool model (400 supervised steps: ~1 min on a quiet 2-core machine,
# several on a busy one); the fixture's set-up counts toward that test's timeout
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("example", EXAMPLES)
def test_example_agent_is_recorded_with_its_tool_calls(example: str, tool_stack: Proc, redis_client):
    pytest.importorskip(
        {
            "langchain_agent": "langchain_openai",
            "openai_agents_sdk_agent": "agents",
            "autogen_agent": "autogen_ext",
            "anthropic_sdk_agent": "anthropic",
        }.get(example, "openai")
    )
    gateway = tool_stack
    rid = uuid.uuid4().hex
    env = {
        **os.environ,
        "OPENAI_BASE_URL": f"{gateway.url}/tasks/calc-17-25/rollouts/{rid}/v1",
        "OPENAI_API_KEY": "unused",
        "OPENAI_MODEL": "policy",
        "ANTHROPIC_BASE_URL": f"{gateway.url}/tasks/calc-17-25/rollouts/{rid}",
        "ANTHROPIC_API_KEY": "unused",
    }
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / f"{example}.py")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert "42" in out["answer"] and out["reward"] == 1.0

    rollout = httpx.get(f"{gateway.url}/rollouts/{rid}", timeout=10).json()
    assert rollout["status"] == "closed" and rollout["reward"] == 1.0 and rollout["task_id"] == "calc-17-25"
    calls = rollout["calls"]
    assert len(calls) >= 2
    from rlgate.episodes import CallRecord

    for call in calls:
        assert call["error"] is None and call["prompt_token_ids"] and call["completion_token_ids"]
        assert CallRecord.model_validate(
            {k: v for k, v in call.items() if k not in ("index", "reward", "air_reward")}
        ).trainable
    if example == "openai_agents_sdk_agent":  # the Responses API, the SDK's default: served as chat
        assert {(c["endpoint"], c["agent_api"]) for c in calls} == {("chat.completions", "openai.responses")}
        assert [t["function"]["name"] for t in calls[0]["request"]["tools"]] == ["calculator"]
        [tool_call] = calls[0]["response"]["message"]["tool_calls"]
        assert tool_call["function"]["name"] == "calculator" and json.loads(
            tool_call["function"]["arguments"]
        ) == {"expression": "17 + 25"}
        # every token's log-prob, the tool call's too (vLLM's own /v1/responses has none for it)
        for call in calls:
            assert len(call["completion_logprobs"]) == len(call["completion_token_ids"]) > 0
        outputs = [m for m in calls[1]["request"]["messages"] if m.get("role") == "tool"]
        assert outputs and outputs[0]["content"] == "42" and outputs[0]["tool_call_id"] == tool_call["id"]
        assert "42" in calls[-1]["response"]["message"]["content"]
        return
    for call in calls:
        assert call["endpoint"] == "chat.completions"
        assert call["agent_api"] == ("anthropic.messages" if example == "anthropic_sdk_agent" else None)
        assert len(call["completion_logprobs"]) == len(call["completion_token_ids"])
    # the tool went to the model (AutoGen's reflection call after the tool ran offers no tools)
    assert [t["function"]["name"] for t in calls[0]["request"]["tools"]] == ["calculator"]
    [tool_call] = calls[0]["response"]["message"]["tool_calls"]
    assert tool_call["function"]["name"] == "calculator"
    assert json.loads(tool_call["function"]["arguments"]) == {"expression": "17 + 25"}
    assert calls[0]["response"]["finish_reason"] == "tool_calls"
    # the next call carries the tool's result back to the model
    tool_messages = [m for m in calls[1]["request"]["messages"] if m["role"] == "tool"]
    assert tool_messages and tool_messages[0]["content"] == "42"
    assert "42" in calls[-1]["response"]["message"]["content"]
