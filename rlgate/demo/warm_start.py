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
from collections.abc import Callable
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
    shared_prefix: bool = False,
    lora_rank: int = 0,
) -> dict[str, Any]:
    """Fine-tune every weight of the model in `base` on the conversations of `sft_jsonl`; write the
    result (weights and tokenizer) to `out`. AdamW, linear warm-up over 20 steps then linear decay to 0,
    gradient norm clipped at 1, mean loss over the trained tokens of a batch. `shared_prefix`: each batch
    through the learner's forward pass (`learner.forward`: the prefix the conversations share, an agent's
    system message and tools, run once; the output head on the trained tokens only), the same loss."""
    from transformers import AutoTokenizer

    rows = [json.loads(line) for line in sft_jsonl.read_text().splitlines() if line.strip()]
    tokenizer = AutoTokenizer.from_pretrained(base)
    data = [encode(tokenizer, messages, tools) for messages, tools in conversations(rows)]
    if not data:
        raise ValueError(f"{sft_jsonl} holds no chat conversations")
    rng = random.Random(seed)

    def batch() -> list[tuple[list[int], list[bool]]]:
        return [data[rng.randrange(len(data))] for _ in range(batch_size)]

    def lr(step: int) -> float:
        return learning_rate * min(1.0, (step + 1) / min(20, max(1, steps // 10))) * (1 - step / steps)

    def report(step: int, loss: float, seconds: float) -> None:
        if step % max(1, min(50, steps // 6)) == 0 or step == steps:
            log(f"warm start: step {step}/{steps}  loss {loss:.4f}  {seconds:.0f} s")

    model, loss_value, seconds = supervised_training(
        base,
        tokenizer.pad_token_id,
        seed,
        steps,
        batch,
        lr,
        report,
        shared_prefix=shared_prefix,
        lora_rank=lora_rank,
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for file in base.iterdir():  # the tokenizer and generation config as they were
        # (not rlgate-model.json: what `rlgate models pull` wrote describes the base, not this model)
        if file.is_file() and not file.name.startswith(("model", "config.json", "rlgate-model.json")):
            shutil.copy2(file, out / file.name)
    return {
        "conversations": len(data),
        "rows": len(rows),
        "steps": steps,
        "loss": round(loss_value, 4),
        "seconds": round(seconds, 1),
    }


def supervised_training(
    path: Path,
    pad_id: int,
    seed: int,
    steps: int,
    batch: Callable[[], list[tuple[list[int], list[bool]]]],
    lr: Callable[[int], float],
    log: Callable[[int, float, float], None],
    shared_prefix: bool = False,
    lora_rank: int = 0,
) -> tuple[Any, float, float]:
    """The model in `path` (float32, torch seeded with `seed`) trained for `steps` `supervised_step`s, each
    on `batch()` at `lr(step)`; `log(step, loss, seconds)` after each (steps count from 1).
    Returns the model (in eval mode), the last loss and the seconds the steps took. Shared by the warm start
    and the base model's pretraining (`rlgate.demo.base_model`). `lora_rank` > 0: a LoRA of that rank (alpha
    twice the rank) on every linear layer of the blocks trains instead of every weight, merged into the
    weights at the end (the model returned is a plain one)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if lora_rank:
        from peft import LoraConfig, TaskType, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        config = LoraConfig(
            task_type=TaskType.CAUSAL_LM, r=lora_rank, lora_alpha=2 * lora_rank, target_modules=targets
        )
        model = get_peft_model(model, config)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable)  # its learning rate is set at each step
    started = time.monotonic()
    loss = float("nan")
    for step in range(steps):
        loss = supervised_step(model, optimizer, batch(), pad_id, lr(step), shared_prefix=shared_prefix)
        log(step + 1, loss, time.monotonic() - started)
    if lora_rank:
        model = model.merge_and_unload()
    model.eval()
    return model, loss, time.monotonic() - started


def supervised_step(
    model: Any,
    optimizer: Any,
    batch: list[tuple[list[int], list[bool]]],
    pad_id: int,
    lr: float,
    shared_prefix: bool = False,
) -> float:
    """One AdamW step of next-token loss on the masked tokens of `batch` (token ids, trained-or-not per
    token), right-padded; gradient norm clipped at 1. Returns the loss. `shared_prefix`: `warm_start`'s."""
    import torch

    if shared_prefix:
        return _shared_prefix_step(model, optimizer, batch, pad_id, lr)

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


def _shared_prefix_step(
    model: Any, optimizer: Any, batch: list[tuple[list[int], list[bool]]], pad_id: int, lr: float
) -> float:
    """`supervised_step` through `learner.forward.action_forward`: the mean of -log p over the trained
    tokens (the same loss as the model's own), the rows' shared prefix run once."""
    import torch

    from learner.forward import action_forward
    from learner.samples import Sample, collate

    samples = [
        Sample(
            tokens=list(tokens),
            action_mask=list(mask[1:]),
            advantages=[0.0] * (len(tokens) - 1),
            rollout_logprobs=[0.0] * (len(tokens) - 1),
            temperature=1.0,
            logit_bias=(),
        )
        for tokens, mask in batch
    ]
    micro = collate(samples, pad_id)
    for group in optimizer.param_groups:
        group["lr"] = lr
    log_probs = action_forward(model, micro, torch.device("cpu")).log_probs
    loss = -log_probs[micro.action_mask].mean()
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.item()
