"""The calculator agent with LangChain: `ChatOpenAI` with a bound tool, the tool loop by hand."""

from __future__ import annotations

import json

import calculator as calc
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    return calc.calculator(expression)


def main() -> None:
    llm = ChatOpenAI(model=calc.model_name(), temperature=0, max_tokens=128)  # OPENAI_BASE_URL from env
    model = llm.bind_tools([calculator])
    messages = [HumanMessage(calc.QUESTION)]
    for _ in range(3):
        reply = model.invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            messages.append(ToolMessage(calculator.invoke(call["args"]), tool_call_id=call["id"]))
    answer = reply.content if isinstance(reply.content, str) else ""
    print(json.dumps({"answer": answer, "reward": calc.post_reward(answer)}))


if __name__ == "__main__":
    main()
