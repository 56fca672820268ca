"""The calculator agent with AutoGen: an `AssistantAgent` on `OpenAIChatCompletionClient`."""

from __future__ import annotations

import asyncio
import json
import os

import calculator as calc
from autogen_agentchat.agents import AssistantAgent
from autogen_ext.models.openai import OpenAIChatCompletionClient


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    return calc.calculator(expression)


async def main() -> None:
    client = OpenAIChatCompletionClient(
        model=calc.model_name(),
        base_url=os.environ["OPENAI_BASE_URL"],
        api_key=os.environ.get("OPENAI_API_KEY", "unused"),
        temperature=0,
        max_tokens=128,
        model_info={
            "vision": False,
            "function_calling": True,
            "json_output": False,
            "family": "unknown",
            "structured_output": False,
        },
    )
    agent = AssistantAgent("calculator", model_client=client, tools=[calculator], reflect_on_tool_use=True)
    result = await agent.run(task=calc.QUESTION)
    answer = result.messages[-1].content if isinstance(result.messages[-1].content, str) else ""
    await client.close()
    print(json.dumps({"answer": answer, "reward": calc.post_reward(answer)}))


if __name__ == "__main__":
    asyncio.run(main())
