"""The Calc-X agent, written with AutoGen as the paper's Calc-X agent is (Agent Lightning's examples/calc_x):
an `AssistantAgent` with a calculator tool and `reflect_on_tool_use=True` on `OpenAIChatCompletionClient`.

Nothing in it is rlgate's. It reads the environment an rlgate rollout (or `rlgate run`) gives an agent:

    OPENAI_BASE_URL   where to send its calls (the gateway's per-rollout URL, or any OpenAI-compatible server)
    OPENAI_API_KEY    the key that URL wants
    OPENAI_MODEL      the model name to ask for (default: policy)
    QUESTION          the word problem (Agent Lightning's env_map name), or --question

It sends the question with Agent Lightning's output format, lets AutoGen run the tool calls the model
makes (AutoGen then asks the model once more to answer from the tool's result), and prints one JSON line:
the final message, the answer read from `### ANSWER: ... ###` (Agent Lightning's regular expression), the
tool calls made and the number of model calls. The reward is not its business: the harness grades the
rollout (`math_answer` against the ground truth).

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 QUESTION="What is 7 * 6?" python -m rlgate.demo.calc_x_agent
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
from typing import Any

from rlgate.demo.calc_x import OUTPUT_FORMAT, calculate

TEMPERATURE = 0.7  # Agent Lightning's calc_x default
MAX_TOKENS = 128
ANSWER = re.compile(r"###\s*ANSWER:\s*(.+?)(\s*###|$)")  # Agent Lightning's calc_x


def answer_of(text: str) -> str:
    """The answer between the sharps, or the whole text (as Agent Lightning's calc_x reads it)."""
    match = ANSWER.search(text)
    return match.group(1) if match else text


async def solve(
    question: str,
    *,
    base_url: str,
    api_key: str,
    model: str,
    temperature: float,
    extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One episode: the AutoGen agent on `question`; returns what happened (module docstring).
    `extra_body`: sent with every call (the tests hold vLLM's output to a form with it)."""
    from autogen_agentchat.agents import AssistantAgent
    from autogen_agentchat.messages import ToolCallExecutionEvent, ToolCallRequestEvent
    from autogen_core.models import ModelFamily
    from autogen_ext.models.openai import OpenAIChatCompletionClient

    client = OpenAIChatCompletionClient(
        model=model,
        base_url=base_url,
        api_key=api_key,
        temperature=temperature,
        max_tokens=MAX_TOKENS,
        model_info={
            "vision": False,
            "function_calling": True,
            "json_output": False,
            "family": ModelFamily.UNKNOWN,
            "structured_output": False,
        },
        **({"extra_body": extra_body} if extra_body else {}),
    )
    try:
        agent = AssistantAgent("calc", model_client=client, tools=[calculate], reflect_on_tool_use=True)
        result = await agent.run(task=f"{question} {OUTPUT_FORMAT}")
    finally:
        await client.close()
    last = result.messages[-1]
    final = last.content if isinstance(last.content, str) else json.dumps(last.content, default=str)
    calls = [
        {"arguments": call.arguments, "name": call.name}
        for message in result.messages
        if isinstance(message, ToolCallRequestEvent)
        for call in message.content
    ]
    results = [
        item.content
        for message in result.messages
        if isinstance(message, ToolCallExecutionEvent)
        for item in message.content
    ]
    return {
        "final": final,
        "answer": answer_of(final).strip(),
        "tool_calls": calls,
        "tool_results": results,
        "model_calls": sum(1 for m in result.messages if m.models_usage is not None),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", default=None, help="The problem (default: $QUESTION).")
    parser.add_argument("--temperature", type=float, default=TEMPERATURE)
    args = parser.parse_args(argv)
    question = args.question or os.environ.get("QUESTION")
    base_url = os.environ.get("OPENAI_BASE_URL")
    if not question or not base_url:
        parser.error("set OPENAI_BASE_URL and QUESTION (or --question)")
    outcome = asyncio.run(
        solve(
            question,
            base_url=base_url,
            api_key=os.environ.get("OPENAI_API_KEY", "unused"),
            model=os.environ.get("OPENAI_MODEL", "policy"),
            temperature=args.temperature,
        )
    )
    print(json.dumps(outcome))


if __name__ == "__main__":
    main()
