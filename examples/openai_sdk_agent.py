"""The calculator agent with the plain OpenAI SDK: chat completions with a function tool, by hand."""

from __future__ import annotations

import json

from calculator import DESCRIPTION, PARAMETERS, QUESTION, calculator, model_name, post_reward
from openai import OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {"name": "calculator", "description": DESCRIPTION, "parameters": PARAMETERS},
    }
]


def main() -> None:
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    messages: list[dict] = [{"role": "user", "content": QUESTION}]
    for _ in range(3):
        reply = (
            client.chat.completions.create(
                model=model_name(), messages=messages, tools=TOOLS, temperature=0, max_tokens=128
            )
            .choices[0]
            .message
        )
        if not reply.tool_calls:
            break
        messages.append(reply.model_dump(exclude_none=True))
        for call in reply.tool_calls:
            result = calculator(json.loads(call.function.arguments)["expression"])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    print(json.dumps({"answer": reply.content, "reward": post_reward(reply.content or "")}))


if __name__ == "__main__":
    main()
