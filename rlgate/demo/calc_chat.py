"""Calc-X as agents write it (the paper's section 4.3): arithmetic questions, a `calculate` tool offered
through the OpenAI tools API, several turns.

    system     SYSTEM                                      (the agent's instructions)
    user       "What is 37 + 45?"
    assistant  <tool_call>{"name": "calculate", "arguments": {"expression": "37 + 45"}}</tool_call>
    tool       "82"                                        (the agent ran the tool)
    assistant  "ANSWER: 82"                                (graded by the `math_answer` reward job)

or the assistant answers at once, without the tool. The questions add, subtract or multiply two two-digit
numbers: a model this small cannot compute them, so answering without the tool is nearly always wrong and
answering through it is right as often as the model copies the expression and the result faithfully.

This module holds what the agent and the warm start share: the instructions, the tool's schema, the
questions, the tool itself and the synthetic traces the warm start learns from.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any

SYSTEM = "Solve the arithmetic problem. Use the calculate tool. End with ANSWER: <number>"
TOOL_NAME = "calculate"
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
OPERATORS = "+-*"
_EXPRESSION = re.compile(r"\s*(-?\d{1,12})\s*([+\-*])\s*(-?\d{1,12})\s*")


@dataclass(frozen=True)
class Question:
    a: int
    op: str
    b: int

    @property
    def expression(self) -> str:
        return f"{self.a} {self.op} {self.b}"

    @property
    def text(self) -> str:
        return f"What is {self.expression}?"

    @property
    def answer(self) -> int:
        return calculate_value(self.a, self.op, self.b)


def random_question(rng: random.Random) -> Question:
    return Question(rng.randint(10, 99), rng.choice(OPERATORS), rng.randint(10, 99))


def calculate_value(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def calculate(arguments: str) -> str:
    """The tool: `{"expression": "A op B"}` (integers, one of + - *) -> the result as text, or an error
    message the model sees (as a real tool would answer a bad call)."""
    try:
        expression = json.loads(arguments)["expression"]
    except (ValueError, TypeError, KeyError):
        return 'error: arguments must be {"expression": "<a> <op> <b>"}'
    match = _EXPRESSION.fullmatch(expression) if isinstance(expression, str) else None
    if match is None:
        return "error: cannot evaluate the expression"
    a, op, b = match.groups()
    return str(calculate_value(int(a), op, int(b)))


def final_answer(question: Question) -> str:
    return f"ANSWER: {question.answer}"


def warm_start_answer(
    messages: list[dict[str, Any]], rng: random.Random, tool_rate: float, broken_rate: float
) -> dict[str, Any]:
    """The assistant message a scripted teacher writes next in a Calc-X conversation: the imperfect
    demonstrations the warm start learns from (a real pipeline distills from a stronger model through
    the same gateway; here a program plays that part, wrong on purpose).

    First turn: with probability `tool_rate` a call of the tool (of those, a share `broken_rate` written
    as text that is not a well-formed hermes call: a brace or a quote missing), else a direct answer
    that is right only about one time in three (the teacher's mental arithmetic). After a tool result:
    `ANSWER: <the result>`."""
    question = _question_of(messages)
    if messages[-1]["role"] == "tool":
        return {"role": "assistant", "content": f"ANSWER: {messages[-1]['content']}"}
    if rng.random() < tool_rate:
        arguments = json.dumps({"expression": question.expression})
        if rng.random() < broken_rate:
            call = json.dumps({"name": TOOL_NAME, "arguments": {"expression": question.expression}})
            broken = rng.choice([call[:-1], call.replace('"expression"', "expression", 1)])
            return {"role": "assistant", "content": f"<tool_call>\n{broken}\n</tool_call>"}
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": f"call_{rng.getrandbits(32):08x}",
                    "type": "function",
                    "function": {"name": TOOL_NAME, "arguments": arguments},
                }
            ],
        }
    guess = question.answer if rng.random() < 1 / 3 else question.answer + rng.choice([-10, -2, -1, 1, 2, 10])
    return {"role": "assistant", "content": f"ANSWER: {guess}"}


def _question_of(messages: list[dict[str, Any]]) -> Question:
    text = next(m["content"] for m in messages if m["role"] == "user")
    match = re.fullmatch(r"What is (-?\d+) ([+\-*]) (-?\d+)\?", text)
    if match is None:
        raise ValueError(f"not a Calc-X question: {text!r}")
    return Question(int(match[1]), match[2], int(match[3]))
