"""The calculator agent with the OpenAI Agents SDK on its default model, the Responses API (`/v1/responses`),
through the client built from the environment (OPENAI_BASE_URL, OPENAI_API_KEY)."""

from __future__ import annotations

import asyncio
import json

import calculator as calc
from agents import (
    Agent,
    ModelSettings,
    Runner,
    function_tool,
    set_default_openai_client,
    set_tracing_disabled,
)
from openai import AsyncOpenAI


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    return calc.calculator(expression)


async def main() -> None:
    set_tracing_disabled(True)  # no trace upload to OpenAI; the gateway records the calls
    set_default_openai_client(AsyncOpenAI(), use_for_tracing=False)  # env config
    agent = Agent(
        name="calculator",
        instructions="Answer arithmetic questions with the calculator tool.",
        tools=[calculator],
        model=calc.model_name(),
        model_settings=ModelSettings(temperature=0, max_tokens=128),
    )
    result = await Runner.run(agent, calc.QUESTION, max_turns=3)
    answer = str(result.final_output or "")
    print(json.dumps({"answer": answer, "reward": calc.post_reward(answer)}))


if __name__ == "__main__":
    asyncio.run(main())
