"""Batched sampling on a Hugging Face causal LM on the CPU: the core of `rlgate serve`.

`Engine.generate` runs a batch of prompts (token ids) to completion with one KV cache: prompts are
left-padded, positions follow each row's own tokens, and each row samples with its own parameters and
its own seeded generator. Per step, row r's logits z (float32, [V]) become the distribution it samples
from, in vLLM's order:

    z' = z + logit_bias                     (the request's bias, by token id)
    z' = z' / temperature                   (temperature > 0; temperature == 0 is greedy: argmax of z';
                                             0 < temperature < 0.01 is raised to 0.01, as vLLM's
                                             SamplingParams does, so that z / T stays finite)
    z' = mask(z', top_k)                    (keep the k largest; k <= 0 keeps all)
    z' = mask(z', top_p)                    (keep the smallest set of largest tokens whose probability,
                                             after top-k, reaches top_p; the most likely is always kept)
    p  = softmax(z')

What each sampled token's log-prob (and its `top_logprobs`) reports is the engine's `logprobs_mode`,
vLLM's `--logprobs-mode` with vLLM v1's semantics (`vllm/v1/sample/sampler.py`, `ops/topk_topp_sampler.py`):

    raw_logprobs        log softmax(z)      the model's own distribution: before logit_bias, temperature,
                                            top-k and top-p (vLLM's default, and the engine's)
    raw_logits          z
    processed_logprobs  log softmax(z')     the distribution actually sampled from; tokens cut by top-k or
                                            top-p are -inf (reported as -9999.0, as vLLM clamps them)
    processed_logits    z'

With temperature 0 (greedy) z' = z + logit_bias: vLLM neither scales nor truncates greedy rows. The
candidates of `top_logprobs` are ranked by the reported values. A learner that compares its own
log-probs with the server's needs processed_logprobs (which `Engine` uses only when told to).

A row whose sampling fails (an exception in its own step: its parameters, its stop callback) ends with
that error in `Completion.error`; the other rows of its batch go on.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

FinishReason = Literal["stop", "length", "abort", "error"]
LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
LOGPROBS_MODES: tuple[LogprobsMode, ...] = (
    "raw_logprobs",
    "raw_logits",
    "processed_logprobs",
    "processed_logits",
)
MIN_TEMPERATURE = (
    0.01  # vLLM's `_MAX_TEMP` (vllm/sampling_params.py): lower positive temperatures become this
)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop_token_ids: tuple[int, ...] = ()
    top_logprobs: int = 0
    # Called with a row's tokens after each one it samples: True ends the row ("stop"). The model sets it
    # for stop strings, so that a row stops where vLLM's would instead of running on to max_tokens.
    stop: Callable[[list[int]], bool] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        if 0 < self.temperature < MIN_TEMPERATURE:  # vLLM's SamplingParams.__post_init__
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)


@dataclass
class Completion:
    """One finished row: the sampled tokens, their log-probs, and why it stopped."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: FinishReason
    stop_token_id: int | None = None
    error: Exception | None = None  # finish_reason "error": why this row's sampling failed


class Engine:
    """Runs batches of prompts through `model` (eval mode, no gradients). Not thread-safe: one batch at a
    time (the server's scheduler serializes them)."""

    def __init__(
        self,
        model: nn.Module,
        pad_token_id: int,
        eos_token_ids: tuple[int, ...],
        logprobs_mode: LogprobsMode = "raw_logprobs",
    ) -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, not {logprobs_mode!r}")
        self.model = model.eval()
        self.logprobs_mode = logprobs_mode
        self.pad_token_id = pad_token_id
        self.eos_token_ids = eos_token_ids
        config = getattr(model, "config", None)
        self.max_positions = getattr(config, "max_position_embeddings", None) or 1 << 30
        # transformers 5.2x renamed `past_key_values` to `cache` (argument and output); take what is there
        self._cache_arg = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        if len(prompts) != len(params) or not prompts:
            raise ValueError("one SamplingParams per prompt, at least one prompt")
        rows = len(prompts)
        width = max(len(p) for p in prompts)
        input_ids = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((rows, width), dtype=torch.long)
        for r, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError("a prompt needs at least one token")
            input_ids[r, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention[r, width - len(prompt) :] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        generators = [_generator(p.seed) for p in params]
        budgets = [min(p.max_tokens, self.max_positions - len(prompts[r])) for r, p in enumerate(params)]
        stops = [set(p.stop_token_ids) | set(self.eos_token_ids) for p in params]
        out = [Completion([], [], [], "length") for _ in prompts]
        done = [budget <= 0 for budget in budgets]

        output = self.model(
            input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True
        )
        cache, logits = output[self._cache_arg], output.logits[:, -1, :].float()
        next_positions = positions[:, -1] + 1
        while not all(done):
            next_tokens = torch.full((rows,), self.pad_token_id, dtype=torch.long)
            for r in range(rows):
                if done[r]:
                    continue
                row = out[r]
                try:
                    token, logprob, top = sample(logits[r], params[r], generators[r], self.logprobs_mode)
                    row.token_ids.append(token)
                    row.logprobs.append(logprob)
                    row.top_logprobs.append(top)
                    next_tokens[r] = token
                    if token in stops[r]:
                        done[r], row.finish_reason, row.stop_token_id = True, "stop", token
                    elif len(row.token_ids) >= budgets[r]:
                        done[r] = True
                    elif params[r].stop is not None and params[r].stop(row.token_ids):
                        done[r], row.finish_reason = True, "stop"
                except Exception as exc:  # this row's fault: it ends, its batch-mates go on
                    done[r], row.finish_reason, row.error = True, "error", exc
            if all(done):
                break
            alive = torch.tensor([0 if d else 1 for d in done], dtype=torch.long)
            attention = torch.cat([attention, alive[:, None]], dim=1)
            output = self.model(
                input_ids=next_tokens[:, None],
                attention_mask=attention,
                position_ids=next_positions[:, None],
                use_cache=True,
                **{self._cache_arg: cache},
            )
            cache, logits = output[self._cache_arg], output.logits[:, -1, :].float()
            next_positions = next_positions + 1
        return out


def _generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def processed_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The logits of the distribution a row samples from (the module docstring's z'), shape [V]."""
    z = logits.float().clone()
    for token_id, bias in params.logit_bias.items():
        z[token_id] += bias
    if params.temperature == 0:
        return z
    z = z / params.temperature
    if 0 < params.top_k < z.numel():
        kth = torch.topk(z, params.top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    if params.top_p < 1:
        sorted_z, order = torch.sort(z, descending=True)
        cumulative = torch.softmax(sorted_z, dim=-1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_z, dim=-1) >= params.top_p  # mass before this token
        drop[0] = False
        z = z.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return z


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    logprobs_mode: LogprobsMode = "raw_logprobs",
) -> tuple[int, float, list[tuple[int, float]]]:
    """(token, its reported value, the top `params.top_logprobs` (token, value) pairs, sampled token first);
    the values are those `logprobs_mode` names (module docstring)."""
    z = processed_logits(logits, params)
    if params.temperature == 0:
        token = int(torch.argmax(z))
    else:
        token = int(torch.multinomial(torch.softmax(z, dim=-1), 1, generator=generator))
    reported = {
        "raw_logprobs": lambda: torch.log_softmax(logits.float(), dim=-1),
        "raw_logits": lambda: logits.float(),
        "processed_logprobs": lambda: torch.log_softmax(z, dim=-1),
        "processed_logits": lambda: z,
    }[logprobs_mode]()
    top: list[tuple[int, float]] = []
    if params.top_logprobs > 0:
        values, ids = torch.topk(reported, min(params.top_logprobs, reported.numel()))
        top = [(token, float(reported[token]))]
        top += [(int(i), float(v)) for v, i in zip(values, ids, strict=True) if int(i) != token][
            : params.top_logprobs - 1
        ]
    return token, float(reported[token]), top
