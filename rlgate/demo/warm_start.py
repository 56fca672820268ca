"""The warm start: a short supervised pass on chat traces exported by `rlgate export --format sft`.

Each exported row is one recorded call: the messages it was sent, the tools, and the assistant message
it produced. Rows of one rollout are the turns of one conversation, each row's messages a prefix of the
next's; the warm start keeps the longest row of each rollout and trains on every assistant turn in it
(the loss on the assistant tokens only, everything else masked), so a conversation of two turns costs one
sequence. The text is what the model's own chat template renders, so the policy later sees the same
layout from the inference server.

A real pipeline would run OpenRLHF's or TRL's SFT trainer on the same JSONL (`messages` and `tools`
columns); the demo's model is tiny and this loop is the few lines it needs.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path
from typing import Any


def conversations(rows: list[dict[str, Any]]) -> list[tuple[list[dict[str, Any]], list | None]]:
    """One (messages, tools) per rollout: its longest exported row."""
    longest: dict[str, dict[str, Any]] = {}
    for row in rows:
        if "messages" not in row:
            continue
        kept = longest.get(row["rollout_id"])
        if kept is None or len(row["messages"]) > len(kept["messages"]):
            longest[row["rollout_id"]] = row
    return [(row["messages"], row.get("tools")) for _, row in sorted(longest.items())]


def encode(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list | None
) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and, per token, whether it is trained on (the assistant
    turns' tokens through their end-of-turn token)."""
    render = tokenizer.apply_chat_template
    ids = tokenizer.encode(render(messages, tools=tools, tokenize=False), add_special_tokens=False)
    mask = [False] * len(ids)
    end_of_turn = tokenizer.eos_token
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = render(messages[:i], tools=tools, add_generation_prompt=True, tokenize=False)
        turn = render(messages[: i + 1], tools=tools, tokenize=False)
        turn = turn[: turn.rindex(end_of_turn) + len(end_of_turn)]
        start = len(tokenizer.encode(prefix, add_special_tokens=False))
        end = len(tokenizer.encode(turn, add_special_tokens=False))
        if ids[:start] != tokenizer.encode(prefix, add_special_tokens=False):
            raise ValueError("the chat template does not render the conversation as a sequence of turns")
        mask[start:end] = [True] * (end - start)
    return ids, mask


def warm_start(
    base: Path,
    sft_jsonl: Path,
    out: Path,
    *,
    steps: int,
    batch_size: int = 8,
    learning_rate: float = 5e-3,
    seed: int = 0,
    log: Any = print,
) -> dict[str, Any]:
    """Fine-tune every weight of the model in `base` on the conversations of `sft_jsonl`; write the
    result (weights and tokenizer) to `out`. AdamW, linear warm-up over 20 steps then linear decay to 0,
    gradient norm clipped at 1, mean loss over the trained tokens of a batch."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = [json.loads(line) for line in sft_jsonl.read_text().splitlines() if line.strip()]
    tokenizer = AutoTokenizer.from_pretrained(base)
    data = [encode(tokenizer, messages, tools) for messages, tools in conversations(rows)]
    if not data:
        raise ValueError(f"{sft_jsonl} holds no chat conversations")
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    started = time.monotonic()
    loss_value = float("nan")
    for step in range(steps):
        batch = [data[rng.randrange(len(data))] for _ in range(batch_size)]
        lr = learning_rate * min(1.0, (step + 1) / 20) * (1 - step / steps)
        loss_value = supervised_step(model, optimizer, batch, tokenizer.pad_token_id, lr)
        if (step + 1) % 50 == 0 or step + 1 == steps:
            log(
                f"warm start: step {step + 1}/{steps}  loss {loss_value:.4f}  {time.monotonic() - started:.0f} s"
            )
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for file in base.iterdir():  # the tokenizer and generation config as they were
        if file.is_file() and not file.name.startswith(("model", "config.json")):
            shutil.copy2(file, out / file.name)
    return {
        "conversations": len(data),
        "rows": len(rows),
        "steps": steps,
        "loss": round(loss_value, 4),
        "seconds": round(time.monotonic() - started, 1),
    }


def supervised_step(
    model: Any, optimizer: Any, batch: list[tuple[list[int], list[bool]]], pad_id: int, lr: float
) -> float:
    """One AdamW step of next-token loss on the masked tokens of `batch` (token ids, trained-or-not per
    token), right-padded; gradient norm clipped at 1. Returns the loss. Shared by the warm start and the
    base model's pretraining (`rlgate.demo.base_model`)."""
    import torch

    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id)
    labels = torch.full((len(batch), width), -100)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    for r, (tokens, mask) in enumerate(batch):
        ids[r, : len(tokens)] = torch.tensor(tokens)
        attention[r, : len(tokens)] = 1
        labels[r, : len(tokens)] = torch.where(torch.tensor(mask), torch.tensor(tokens), -100)
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.item()
