"""The policy's forward pass over a micro-batch, computing only what the loss reads.

A real model's step is dominated by two costs that the loss does not need:

- the output head and log-softmax at every position: [B, L, V] logits (V = 49,152 for SmolLM2: 0.8 GB for
  16 x 250 tokens in float32), of which only the action positions (the completions) are read;
- the prompt shared by every sample: an agent's system message and tool definitions open every call of
  every task, and a GRPO group's rollouts share their task's question too. Each row computes it again.

`action_forward` runs the decoder once over the longest prefix all rows of the micro-batch share (one row,
with gradients), repeats its key/value cache for every row, runs the rest of each row on top of it, and
applies the output head to the hidden states of the action positions only. The gradients are exact: the
shared prefix's keys and values are one tensor each in the autograd graph, so every row's gradient flows
back into them and through the prefix's layers once. The log-probs equal the full pass's up to float
rounding (the same sums in another order; `tests/test_learner_forward.py` bounds the difference).

The prefix stops before the first action position of any row, so every action's hidden state comes from
the second pass. A prefix shorter than `MIN_SHARED` tokens is not split off (nothing to save).

Processing (logit_bias, temperature, top-k, top-p) is the server's, per action row, as in
`learner.policy.processed_log_probs`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from learner.samples import MIN_SHARED, MicroBatch

TRUNCATE_ROWS = 256  # positions truncated at once (each sorts a row of the vocabulary)


@dataclass
class ActionForward:
    """`log_probs` [B, L-1] (zero off the action mask), the processed logits `z` of the action positions
    [N, V] in `action_mask.nonzero()` order, the shared prefix's length."""

    log_probs: torch.Tensor
    z: torch.Tensor
    shared: int


def shared_prefix(batch: MicroBatch) -> int:
    """The number of leading tokens every row holds alike, at most each row's first action position (the
    position whose hidden state predicts the row's first completion token) and never a padded one."""
    seq, attention, actions = batch.sequences, batch.attention_mask, batch.action_mask
    rows = seq.shape[0]
    if rows < 2:
        return 0
    lengths = attention.sum(-1)
    first_action = torch.where(actions.any(-1), actions.float().argmax(-1), lengths - 1)
    limit = int(torch.minimum(first_action, lengths - 1).min())
    same = (seq[:, :limit] == seq[:1, :limit]).all(0)
    differs = (~same).nonzero()
    return int(differs[0]) if len(differs) else limit


def _cache_argument(decoder: Any) -> str:
    """The decoder's name for a key/value cache: `cache` (transformers 5.25 on), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"


def _cache_of(output: Any) -> Any:
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def _parts(model: Any) -> tuple[Any, Any]:
    """The decoder (no output head) and the output head of a causal LM, inside peft and DeepSpeed wrappers."""
    inner = getattr(model, "module", model)  # DeepSpeed's engine
    if hasattr(inner, "get_base_model"):  # peft
        inner = inner.get_base_model()
    return inner.get_decoder(), inner.get_output_embeddings()


def action_forward(
    model: Any, batch: MicroBatch, device: torch.device, *, share_prefix: bool = True
) -> ActionForward:
    """The module docstring's pass (without `share_prefix`: every row whole, the head on the action
    positions only). `model` is the Hugging Face causal LM (peft- or DeepSpeed-wrapped or not)."""
    decoder, head = _parts(model)
    seq = batch.sequences.to(device)
    attention = batch.attention_mask.to(device)
    actions = batch.action_mask.to(device)
    rows, length = seq.shape
    shared = shared_prefix(batch) if share_prefix else 0
    if shared < MIN_SHARED:
        shared = 0
    positions = torch.arange(length, device=device)
    cached: dict[str, Any] = {}
    if shared:
        prefix = decoder(input_ids=seq[:1, :shared], position_ids=positions[None, :shared], use_cache=True)
        cache = _cache_of(prefix)
        cache.batch_repeat_interleave(rows)  # the same tensors, repeated in the graph: gradients sum back
        cached = {_cache_argument(decoder): cache, "use_cache": True}
    hidden = decoder(
        input_ids=seq[:, shared:],
        attention_mask=attention,
        position_ids=positions[None, shared:].expand(rows, -1),
        **cached,
    ).last_hidden_state  # [B, L - shared, H]
    if shared and cache.get_seq_length() != length:  # a decoder that ignored the cache: wrong positions
        raise RuntimeError(
            f"the decoder did not extend the shared prefix's cache ({_cache_argument(decoder)})"
        )
    row, col = actions.nonzero(as_tuple=True)  # col: the position predicting token col + 1
    logits = head(hidden[row, col - shared]).float()  # [N, V]
    z = _processed(logits, batch, row, device)
    targets = seq[row, col + 1]
    log_probs = torch.zeros(actions.shape, dtype=z.dtype, device=device)
    picked = torch.log_softmax(z, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    log_probs = log_probs.index_put((row, col), picked)
    return ActionForward(log_probs, z, shared)


def _processed(
    logits: torch.Tensor, batch: MicroBatch, row: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """z' = truncate((z + logit_bias) / T) per action row (`learner.policy.processed_log_probs`)."""
    z = logits
    if batch.logit_bias:
        bias = torch.zeros((batch.sequences.shape[0], z.shape[-1]), dtype=z.dtype, device=device)
        for r, token, value in batch.logit_bias:
            if 0 <= token < z.shape[-1]:
                bias[r, token] += value
        z = z + bias[row]
    z = z / batch.temperature.to(device=device, dtype=z.dtype)[row][:, None]
    top_k, top_p = batch.top_k.to(device)[row], batch.top_p.to(device)[row]
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        actions = batch.action_mask.to(device)
        row_, col = actions.nonzero(as_tuple=True)
        z = truncate(z, top_k, top_p, batch.sequences.to(device)[row_, col + 1])
    return z


def truncate(
    z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """Top-k, then top-p, per row of z [N, V] (`top_k`, `top_p`, `targets`: [N]), as the server truncates
    before sampling (`rlgate.inference.engine`, checked against vLLM's `apply_top_k_top_p`): the tokens cut
    get -inf, so the log-softmax renormalises over the kept ones. The token actually sampled (`targets`) is
    never cut (a float difference from the server must not turn its log-prob into -inf). Rows with the same
    (k, p) are truncated together."""
    cut = torch.zeros(z.shape, dtype=torch.bool, device=z.device)
    with torch.no_grad():
        settings = torch.stack([top_k.to(z.dtype), top_p.to(z.dtype)], -1)
        for k_value, p_value in torch.unique(settings, dim=0).tolist():
            k, p = int(k_value), float(p_value)
            chosen = ((top_k == k) & (top_p.to(z.dtype) == p_value)).nonzero().squeeze(-1)
            for rows in chosen.split(TRUNCATE_ROWS):  # a sort of [rows, V] at a time: bounded memory
                cut[rows] = _cut(z[rows], k, p)
        cut[torch.arange(len(targets), device=z.device), targets] = False
    return z.masked_fill(cut, float("-inf"))


def _cut(zr: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """Which entries of zr [n, V] top-k (k > 0) then top-p (p < 1) cut."""
    cut = torch.zeros(zr.shape, dtype=torch.bool, device=zr.device)
    if 0 < k < zr.shape[-1]:
        kth = torch.topk(zr, k, dim=-1).values[..., -1:]
        cut |= zr < kth
    if p < 1:
        kept = zr.masked_fill(cut, float("-inf"))
        sorted_z, order = torch.sort(kept, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        drop = probs.cumsum(-1) - probs >= p  # the mass before this token already reaches p
        drop[..., 0] = False
        cut |= torch.zeros_like(drop).scatter(-1, order, drop)
    return cut
