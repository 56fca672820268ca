"""A tiny model taught in code to use the examples' calculator, for the framework tests.

A randomly initialised tiny model never writes a tool call. The framework examples must show tool calls
going through the gateway, so this fixture fine-tunes the tiny model (supervised, a few hundred Adam steps,
seconds on a CPU) on two behaviours of a greedy ChatML/hermes agent, whatever the system prompt and tool
schema look like:

- no tool result in the conversation yet: answer with `<tool_call>{"name": "calculator", "arguments":
  {"expression": "17 + 25"}}</tool_call>` (laid out as the chat template renders tool calls);
- a tool result present (with the tools offered again, or not, as AutoGen's reflection call does):
  answer `The answer is 42.`

It is a test fixture, not a feature: it knows one question.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlgate.inference.tiny_model import build_tiny_model

QUESTION = "What is 17 + 25? Use the calculator."
EXPRESSION = "17 + 25"
ANSWER = "The answer is 42."
TOOL_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 + 25"}}\n</tool_call>'


def _tools(rng: random.Random) -> list[dict]:
    description = rng.choice(
        [
            "Evaluate an arithmetic expression.",
            "Calculator.",
            "",
            "Compute a sum.",
            "Evaluate an arithmetic expression and return the result as text.",
        ]
    )
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    }
    if rng.random() < 0.5:
        parameters["additionalProperties"] = False
        parameters["properties"]["expression"]["description"] = rng.choice(["e.g. 2 + 3", "The expression"])
    if rng.random() < 0.3:
        parameters["title"] = "calculator_args"
    function = {"name": "calculator", "description": description, "parameters": parameters}
    if rng.random() < 0.3:
        function["strict"] = rng.random() < 0.5
    return [{"type": "function", "function": function}]


def _system(rng: random.Random) -> list[dict]:
    text = rng.choice(
        [
            None,
            "You are a helpful assistant.",
            "You are a helpful AI assistant. Solve tasks "
            "using your tools. Reply with TERMINATE when the task has been completed.",
            "Answer arithmetic questions with the calculator tool.",
            "You are terse.",
        ]
    )
    return [] if text is None else [{"role": "system", "content": text}]


def _examples(tokenizer, rng: random.Random) -> tuple[list[int], list[int]]:
    tools = _tools(rng)
    conversation = [*_system(rng), {"role": "user", "content": QUESTION}]
    if rng.random() < 0.5:
        target = TOOL_CALL
    else:
        call_id = rng.choice(["call_1", "call_abc", "tool_0", "8f1e"])
        arguments = json.dumps({"expression": EXPRESSION})
        conversation += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "calculator", "arguments": arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call_id, "content": rng.choice(["42", "42.0", "result: 42"])},
        ]
        target = ANSWER
        if rng.random() < 0.3:  # a reflection call after the tool ran may come without tools (AutoGen)
            tools = None
    prompt = tokenizer.apply_chat_template(
        conversation, tools=tools, add_generation_prompt=True, tokenize=False
    )
    return (
        tokenizer.encode(prompt, add_special_tokens=False),
        tokenizer.encode(target + "<|im_end|>", add_special_tokens=False),
    )


def build_tool_calling_model(path: Path, steps: int = 400, seed: int = 0) -> Path:
    build_tiny_model(path, seed=seed, hidden_size=64, num_layers=2)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    for _ in range(steps):
        batch = [_examples(tokenizer, rng) for _ in range(8)]
        width = max(len(p) + len(t) for p, t in batch)
        ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for r, (prompt, target) in enumerate(batch):
            n = len(prompt) + len(target)
            ids[r, :n] = torch.tensor(prompt + target)
            labels[r, len(prompt) : n] = torch.tensor(target)
            mask[r, :n] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    model.save_pretrained(path)
    return path


def cached_tool_calling_model(steps: int = 400, seed: int = 0) -> Path:
    """The taught model, built once and kept between test runs (a few minutes on a busy 2-core machine):
    under `$RLGATE_TEST_CACHE` (default `~/.cache/rlgate/tests`), in a folder named by a hash of the code
    that builds it, the arguments and torch's version, so a change to any of them builds it again."""
    import hashlib
    import os
    import shutil

    import rlgate.inference.tiny_model as tiny

    digest = hashlib.sha256()
    for source in (Path(__file__), Path(tiny.__file__)):
        digest.update(source.read_bytes())
    digest.update(f"{steps}|{seed}|{torch.__version__}".encode())
    root = Path(os.environ.get("RLGATE_TEST_CACHE") or Path.home() / ".cache" / "rlgate" / "tests")
    target = root / f"tool-model-{digest.hexdigest()[:16]}"
    if (target / "model.safetensors").exists():
        return target
    building = root / f"{target.name}.building-{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)
    build_tool_calling_model(building, steps, seed)
    try:
        building.rename(target)  # atomic: a concurrent builder's copy wins, this one is dropped
    except OSError:
        shutil.rmtree(building, ignore_errors=True)
    return target
