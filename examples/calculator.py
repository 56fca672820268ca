"""What the example agents share: the calculator tool and its JSON schema, the question, and the reward post.

Every example is configured by the environment only:
    OPENAI_BASE_URL   the gateway, per rollout: http://HOST:8100/tasks/{task}/rollouts/{rollout}/v1
    OPENAI_MODEL      the model name to ask for (default: policy)
    OPENAI_API_KEY    whatever the gateway expects (default: unused)
The reward goes to the gateway's webhook for the same rollout, derived from OPENAI_BASE_URL.
"""

from __future__ import annotations

import ast
import operator
import os
import re

import httpx

QUESTION = "What is 17 + 25? Use the calculator."
EXPECTED = 42
DESCRIPTION = "Evaluate an arithmetic expression."
PARAMETERS = {  # the tool's arguments as JSON Schema: OpenAI's `parameters`, Anthropic's `input_schema`
    "type": "object",
    "properties": {"expression": {"type": "string"}},
    "required": ["expression"],
}

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers, + - * / and parentheses)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {expression!r}")

    result = value(ast.parse(expression, mode="eval").body)
    return str(int(result)) if float(result).is_integer() else str(result)


def model_name() -> str:
    return os.environ.get("OPENAI_MODEL", "policy")


def reward_for(answer: str) -> float:
    """1.0 if the final answer's last number is the right one."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", answer or "")
    return 1.0 if numbers and float(numbers[-1]) == EXPECTED else 0.0


def post_reward(answer: str) -> float:
    """Close this rollout: POST {"reward": r} to the gateway's webhook for it."""
    base = os.environ["OPENAI_BASE_URL"].rstrip("/")
    root, _, rest = base.partition("/rollouts/")
    if not rest:
        raise SystemExit("OPENAI_BASE_URL must name the rollout: http://HOST:PORT/rollouts/{id}/v1")
    rollout_id = rest.split("/")[0]
    gateway = root.split("/tasks/")[0]
    reward = reward_for(answer)
    httpx.post(
        f"{gateway}/rollouts/{rollout_id}/reward", json={"reward": reward}, timeout=30
    ).raise_for_status()
    return reward
