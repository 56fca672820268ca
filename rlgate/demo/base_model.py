"""The calc-chat demo's base model: a tiny Qwen2 "pretrained" in code, the stand-in for a downloaded base.

Real pipelines start from a pretrained model, which among much else can copy text it has seen (the
expression from the question into a tool call, the tool's result into the answer). No model can be
downloaded here and a randomly initialised one cannot copy: measured on this machine, a 64-wide 2-layer
model fine-tuned on Calc-X traces alone stays at chance on the digits it must copy after 700 steps, and so
does a 64-wide 2-layer model trained on copying alone after 1,500. So this module builds the base the way
base models are built, at toy scale:

1. a tokenizer: byte-level BPE with merges learned from chat text (`rlgate.inference.tiny_model`, Qwen2's
   split, digits one token each), so that a Calc-X prompt of about 970 characters is about 220 tokens;
2. a model: `rlgate.inference.tiny_model` (Qwen2 architecture) `WIDTH` wide and `LAYERS` deep;
3. pretraining: next-token prediction on a synthetic corpus in which text repeats (`copy_text`:
   words, digits and operators, then the same again), the skill every web-text model has: `PRETRAIN_STEPS`
   AdamW steps of `PRETRAIN_BATCH` texts, lr `PRETRAIN_LR` with a cosine decay (about 3 minutes here).

The learning rate decides whether copying is learned at all (measured on this machine, teacher-forced
accuracy on the copied tokens of fresh texts): at 3e-3 the model never forms the attention that copies
(35% of the copied tokens after the first right after 2,000 steps, digits 43%: it guesses); at 1e-3 it
copies digits 99.6% right after 1,000. After the same warm start on tool-only traces, the sampled answer
(T=0.7) copies the tool's result right 76% of the time from the first base and 97% from the second, whose
only misses were one-digit negative results.

Nothing in the pretraining corpus is a Calc-X conversation, a tool call or an answer: the task's format
is what the warm start (`rlgate.demo.warm_start`) teaches, from teacher traces recorded through the gateway.

Built once per machine and kept (`cached_base_model`), as a downloaded base would be.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
from pathlib import Path
from typing import Any

from rlgate.demo.calc_chat import SYSTEM, TOOL_NAME, TOOLS, random_question

WIDTH = 128
LAYERS = 3
HEADS = 4
MERGES = 400
PRETRAIN_STEPS = 1000
PRETRAIN_BATCH = 32
PRETRAIN_LR = 1e-3
SPAN_PARTS = (2, 6)
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_WORDS = ("the", "is", "what", "a", "of", "x", "=", "and", "value", "result", "number", "say", "then", "it")
_SOURCES = ("is {}?", "({})", "x = {};", "<{}>", "\n{}\n", "say {}.", "'{}'", "[{}]", '"{}"')
_COPIES = (' "', " [", ": ", "\n", " = ", "(", ' {"v": "', " echo ")
_CLOSE = {'"': '"', "[": "]", "(": ")"}


def tokenizer_corpus(rng: random.Random, n: int = 300) -> list[str]:
    """Chat text the tokenizer's merges are learned from: Calc-X-like conversations rendered by the
    model's chat template (the system prompt, the tool schema, questions and tool turns): the text the
    tokenizer will mostly see, as a real tokenizer is trained on text like its model's."""
    from rlgate.inference.tiny_model import build_tokenizer

    template = build_tokenizer()
    texts = []
    for _ in range(n):
        question = random_question(rng)
        arguments = json.dumps({"expression": question.expression})
        call = {"id": "call_0", "type": "function", "function": {"name": TOOL_NAME, "arguments": arguments}}
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question.text},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": str(question.answer)},
            {"role": "assistant", "content": f"ANSWER: {question.answer}"},
        ]
        texts.append(template.apply_chat_template(messages, tools=TOOLS, tokenize=False))
    return texts


def _number(rng: random.Random) -> str:
    """A number of 1-6 digits whose digits come from a few (2-10) so that digits repeat, as in the
    results a calculator returns (2112, 7623): copying them takes where a digit stands, not only which
    digit follows which."""
    pool = rng.sample("0123456789", rng.randint(2, 10))
    digits = rng.choice("123456789") + "".join(rng.choice(pool) for _ in range(rng.randint(0, 5)))
    return ("-" if rng.random() < 0.15 else "") + digits


def copy_text(rng: random.Random) -> tuple[str, int]:
    """One pretraining text and the length of its part before the copy (the loss is on the copy: the
    copying is what the base must learn; the rest is noise). The span is words or numbers joined by
    operators; it appears once after one marker and then again after another (`say 37 + 5 and then: "37
    + 5"`), so the model learns to find where a span starts from what precedes it, not only to continue
    a repeat it has begun."""
    parts = []
    for _ in range(rng.randint(*SPAN_PARTS)):
        if rng.random() < 0.75:
            parts.append(_number(rng))
        else:
            parts.append("".join(rng.choice(_LETTERS) for _ in range(rng.randint(1, 6))))
    span = parts[0]
    for part in parts[1:]:
        span += rng.choice([" + ", " - ", " * ", "+", "*", " ", ", "]) + part
    words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(0, 8)))
    source = rng.choice(_SOURCES).format(span)
    filler = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(0, 12)))
    marker = rng.choice(_COPIES)
    head = f"{words} {source} {filler}{marker}"
    return f"{head}{span}{_CLOSE.get(marker[-1], '')}", len(head)


def build_base_model(
    path: Path, *, seed: int = 0, steps: int = PRETRAIN_STEPS, log: Any = print
) -> dict[str, Any]:
    """Write the base model (weights and tokenizer) to `path` (created, must be empty)."""
    from transformers import AutoTokenizer

    from rlgate.demo.warm_start import supervised_training
    from rlgate.inference.tiny_model import build_tiny_model

    rng = random.Random(seed)
    build_tiny_model(
        path,
        seed=seed,
        hidden_size=WIDTH,
        num_layers=LAYERS,
        num_heads=HEADS,
        vocab_corpus=tokenizer_corpus(rng),
        merges=MERGES,
    )
    tokenizer = AutoTokenizer.from_pretrained(path)

    def batch() -> list[tuple[list[int], list[bool]]]:
        rows = []
        for _ in range(PRETRAIN_BATCH):
            text, head = copy_text(rng)
            encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            # trained: every token that ends inside the copy (one that straddles its start included)
            rows.append((encoded["input_ids"], [end > head for _, end in encoded["offset_mapping"]]))
        return rows

    def lr(step: int) -> float:  # warm-up over 30 steps, then a cosine to 0
        return PRETRAIN_LR * min(1.0, (step + 1) / 30) * 0.5 * (1 + math.cos(math.pi * step / steps))

    def report(step: int, loss: float, seconds: float) -> None:
        if step % 100 == 0 or step == steps:
            log(f"base model: pretraining step {step}/{steps}  loss {loss:.3f}  {seconds:.0f} s")

    model, loss_value, seconds = supervised_training(
        path, tokenizer.pad_token_id, seed, steps, batch, lr, report
    )
    model.save_pretrained(path)
    return {"steps": steps, "loss": round(loss_value, 4), "seconds": round(seconds, 1)}


def cached_base_model(seed: int = 0, steps: int = PRETRAIN_STEPS, log: Any = print) -> Path:
    """The base model, built once and kept under `$RLGATE_CACHE` (default `~/.cache/rlgate`) in a folder
    named by a hash of the code that builds it, the arguments and torch's version."""
    import torch

    import rlgate.inference.tiny_model as tiny

    digest = hashlib.sha256()
    here = Path(__file__)  # the build, the tokenizer, the task's texts and the training loop
    for source in (
        here,
        Path(tiny.__file__),
        here.with_name("calc_chat.py"),
        here.with_name("warm_start.py"),
    ):
        digest.update(source.read_bytes())
    digest.update(f"{seed}|{steps}|{torch.__version__}".encode())
    root = Path(os.environ.get("RLGATE_CACHE") or Path.home() / ".cache" / "rlgate")
    target = root / f"calc-chat-base-{digest.hexdigest()[:16]}"
    if (target / "model.safetensors").exists():
        return target
    building = root / f"{target.name}.building-{os.getpid()}"
    shutil.rmtree(building, ignore_errors=True)
    log(f"base model: building {target} (once per machine)")
    try:
        build_base_model(building, seed=seed, steps=steps, log=log)
        building.rename(target)  # atomic: a concurrent builder's copy wins, this one is dropped
    except OSError:
        if not (target / "model.safetensors").exists():
            raise
    finally:
        shutil.rmtree(building, ignore_errors=True)  # what a failed or a losing build left
    return target
