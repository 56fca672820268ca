"""From credited calls to training samples and padded micro-batches (action -> token level).

A `Transition` is one trainable LLM call with its advantage: the exact prompt and completion token ids
and sampling log-probs the inference server returned (never re-tokenized), and the sampling processing
the server applied (logit_bias, temperature, top-k, top-p), so the learner's log-probs describe the same
distribution.

Sample shapes:
- `transition` (default, LightningRL): one sample per call, `prompt + completion`, the action mask on
  the completion only. No other turn is masked, because no other turn is in the sample.
- `trajectory` (Agent Lightning's alternative): consecutive calls of one episode are merged while the
  next call's prompt starts with the previous sample's tokens (the previous prompt + completion), the
  next call's new prompt tokens masked out (not generated); a call whose prompt does not extend the
  sample, or that was sampled with other processing (temperature, logit_bias), starts a new sample.

Every action token carries its call's advantage and its rollout log-prob.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

SampleShape = Literal["transition", "trajectory"]
MIN_SHARED = 8  # a common prefix shorter than this is not run apart (`learner.forward`): nothing to save


@dataclass(frozen=True, slots=True)
class Transition:
    """One trainable call of an episode, credited."""

    rollout_id: str
    index: int  # the call's index in its rollout
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    rollout_logprobs: tuple[float, ...]
    advantage: float
    policy_version: int
    temperature: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    top_k: int = 0  # 0: no top-k truncation
    top_p: float = 1.0


@dataclass(slots=True)
class Sample:
    """One training sequence. `action_mask`, `advantages` and `rollout_logprobs` are aligned with
    `tokens[1:]` (position j predicts token j + 1), as OpenRLHF's action tensors are."""

    tokens: list[int]
    action_mask: list[bool]
    advantages: list[float]
    rollout_logprobs: list[float]
    temperature: float
    logit_bias: tuple[tuple[int, float], ...]
    calls: list[tuple[str, int]] = field(default_factory=list)
    top_k: int = 0
    top_p: float = 1.0

    @property
    def num_actions(self) -> int:
        return sum(self.action_mask)


def _new_sample(call: Transition) -> Sample:
    prompt, completion = list(call.prompt_ids), list(call.completion_ids)
    context = len(prompt) - 1  # positions that predict prompt tokens 1.. and not completion tokens
    return Sample(
        tokens=prompt + completion,
        action_mask=[False] * context + [True] * len(completion),
        advantages=[0.0] * context + [call.advantage] * len(completion),
        rollout_logprobs=[0.0] * context + list(call.rollout_logprobs),
        temperature=call.temperature,
        logit_bias=call.logit_bias,
        calls=[(call.rollout_id, call.index)],
        top_k=call.top_k,
        top_p=call.top_p,
    )


def _extend(sample: Sample, call: Transition) -> bool:
    """Append `call` to `sample` if its prompt continues the sample with the same processing."""
    n = len(sample.tokens)
    if (
        call.temperature != sample.temperature
        or call.logit_bias != sample.logit_bias
        or call.top_k != sample.top_k
        or call.top_p != sample.top_p
        or len(call.prompt_ids) < n
        or tuple(sample.tokens) != call.prompt_ids[:n]
    ):
        return False
    new_prompt = list(call.prompt_ids[n:])
    completion = list(call.completion_ids)
    sample.tokens += new_prompt + completion
    sample.action_mask += [False] * len(new_prompt) + [True] * len(completion)
    sample.advantages += [0.0] * len(new_prompt) + [call.advantage] * len(completion)
    sample.rollout_logprobs += [0.0] * len(new_prompt) + list(call.rollout_logprobs)
    sample.calls.append((call.rollout_id, call.index))
    return True


def build_samples(
    episodes: Iterable[Sequence[Transition]], shape: SampleShape = "transition"
) -> list[Sample]:
    """Samples from the trainable calls of each episode (in call order)."""
    if shape not in ("transition", "trajectory"):
        raise ValueError(f"unknown sample shape {shape!r}")
    samples: list[Sample] = []
    for calls in episodes:
        current: Sample | None = None
        for call in calls:
            if not call.completion_ids or not call.prompt_ids:
                continue
            if shape == "trajectory" and current is not None and _extend(current, call):
                continue
            current = _new_sample(call)
            samples.append(current)
    return samples


def history_splits(samples: Sequence[Sample]) -> int:
    """Samples that start a second (third, ...) trajectory of their episode: in `trajectory` shape, a call
    whose prompt is not the previous sample plus its answer (a harness compacted or edited its history,
    dropped earlier thinking), or that was sampled with other settings, trains as a sample of its own,
    never merged as if it continued the other."""
    seen: set[str] = set()
    splits = 0
    for sample in samples:
        rollout_id = sample.calls[0][0]
        splits += rollout_id in seen
        seen.add(rollout_id)
    return splits


@dataclass(slots=True)
class MicroBatch:
    """Right-padded tensors of some samples. Shapes: sequences/attention_mask [B, L], the action tensors
    [B, L-1], temperature, top_k and top_p [B]; `logit_bias` as (row, token id, bias) triples."""

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    advantages: torch.Tensor
    rollout_logprobs: torch.Tensor
    temperature: torch.Tensor
    logit_bias: list[tuple[int, int, float]]
    samples: list[Sample]
    top_k: torch.Tensor
    top_p: torch.Tensor

    @property
    def num_actions(self) -> int:
        return int(self.action_mask.sum())


def collate(samples: Sequence[Sample], pad_token_id: int) -> MicroBatch:
    width = max(len(s.tokens) for s in samples)
    rows = len(samples)
    sequences = torch.full((rows, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((rows, width), dtype=torch.long)
    action = torch.zeros((rows, width - 1), dtype=torch.bool)
    advantages = torch.zeros((rows, width - 1), dtype=torch.float32)
    rollout = torch.zeros((rows, width - 1), dtype=torch.float32)
    bias: list[tuple[int, int, float]] = []
    for r, s in enumerate(samples):
        n = len(s.tokens)
        sequences[r, :n] = torch.tensor(s.tokens, dtype=torch.long)
        attention[r, :n] = 1
        action[r, : n - 1] = torch.tensor(s.action_mask, dtype=torch.bool)
        advantages[r, : n - 1] = torch.tensor(s.advantages, dtype=torch.float32)
        rollout[r, : n - 1] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        bias.extend((r, token, value) for token, value in s.logit_bias)
    temperature = torch.tensor([s.temperature for s in samples], dtype=torch.float32)
    top_k = torch.tensor([s.top_k for s in samples], dtype=torch.long)
    top_p = torch.tensor([s.top_p for s in samples], dtype=torch.float32)
    return MicroBatch(
        sequences, attention, action, advantages, rollout, temperature, bias, list(samples), top_k, top_p
    )


def shard(samples: Sequence[Sample], ranks: int) -> list[list[Sample]]:
    """The step's samples split among `ranks` data-parallel ranks, balanced by tokens: longest first (ties
    in the given order), each to the rank with the fewest tokens so far (the lowest rank on a tie). Each
    share keeps the given order. Fewer samples than ranks leave some shares empty."""
    if ranks < 1:
        raise ValueError("ranks must be at least 1")
    load = [0] * ranks
    owner = [0] * len(samples)
    for i in sorted(range(len(samples)), key=lambda i: (-len(samples[i].tokens), i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += len(samples[i].tokens)
    return [[s for s, o in zip(samples, owner, strict=True) if o == r] for r in range(ranks)]


def micro_batches(
    samples: Sequence[Sample], token_budget: int, pad_token_id: int, share_prefix: bool = False
) -> list[MicroBatch]:
    """Split samples into micro-batches of at most `token_budget` padded tokens (rows x longest row),
    similar lengths together (sorted by length, then filled greedily). A sample longer than the budget
    gets a micro-batch of its own.

    `share_prefix` (for `learner.forward`'s shared-prefix pass, which runs the rows' common prefix once):
    samples in token order instead, so that rows sharing a prefix (one system prompt, one task's question)
    sit together, and a micro-batch costs its common prefix once plus each row's tokens after it
    (`prefix_cost`), what that pass holds in memory."""
    if token_budget <= 0:
        raise ValueError("token_budget must be positive")
    if share_prefix:
        ordered = sorted(samples, key=lambda s: s.tokens)
        cost = prefix_cost
    else:
        ordered = sorted(samples, key=lambda s: len(s.tokens))
        cost = _padded_cost
    batches: list[list[Sample]] = []
    current: list[Sample] = []
    for sample in ordered:
        if current and cost([*current, sample]) > token_budget:
            batches.append(current)
            current = []
        current.append(sample)
    if current:
        batches.append(current)
    return [collate(batch, pad_token_id) for batch in batches]


def _padded_cost(rows: Sequence[Sample]) -> int:
    return max(len(s.tokens) for s in rows) * len(rows)


def prefix_cost(rows: Sequence[Sample]) -> int:
    """Tokens the shared-prefix pass computes for `rows` in token order: their common prefix (as
    `learner.forward.shared_prefix` takes it: at most each row's first action position) once, then every
    row padded to the longest from there."""
    first, last = rows[0].tokens, rows[-1].tokens  # in token order, the common prefix of all is theirs
    first_actions = [s.action_mask.index(True) for s in rows if any(s.action_mask)]
    limit = min([min(len(s.tokens) for s in rows) - 1, *first_actions])
    shared = 0
    while shared < limit and first[shared] == last[shared]:
        shared += 1
    if len(rows) < 2 or shared < MIN_SHARED:  # as `learner.forward.action_forward` splits it off
        shared = 0
    return shared + len(rows) * (max(len(s.tokens) for s in rows) - shared)
