"""The calculator agent with Anthropic's SDK: the Messages API with a tool, the tool loop by hand.

Configured as Claude Code is: ANTHROPIC_BASE_URL (the gateway's rollout base, without /v1: the SDK adds
/v1/messages) and ANTHROPIC_API_KEY, both in the `agent_env` that `POST /rollouts` returns. The gateway
serves the Messages API as a chat completion of the policy and records it like any chat call.
"""

from __future__ import annotations

import json
import os

from anthropic import Anthropic
from calculator import DESCRIPTION, PARAMETERS, QUESTION, calculator, model_name, post_reward

TOOLS = [{"name": "calculator", "description": DESCRIPTION, "input_schema": PARAMETERS}]


def main() -> None:
    client = Anthropic()  # ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY from the environment
    messages: list[dict] = [{"role": "user", "content": QUESTION}]
    text = ""
    for _ in range(3):
        # the 2.x SDK names no sampling fields: vLLM's are sent as extra body fields
        reply = client.messages.create(
            model=model_name(), max_tokens=128, messages=messages, tools=TOOLS, extra_body={"temperature": 0}
        )
        text = "".join(block.text for block in reply.content if block.type == "text")
        uses = [block for block in reply.content if block.type == "tool_use"]
        if not uses:
            break
        messages.append(
            {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in reply.content]}
        )
        messages.append(
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": use.id,
                        "content": calculator(use.input["expression"]),
                    }
                    for use in uses
                ],
            }
        )
    # the reward goes to the same rollout's webhook (calculator.post_reward reads OPENAI_BASE_URL)
    os.environ.setdefault("OPENAI_BASE_URL", os.environ["ANTHROPIC_BASE_URL"].rstrip("/") + "/v1")
    print(json.dumps({"answer": text, "reward": post_reward(text)}))


if __name__ == "__main__":
    main()
