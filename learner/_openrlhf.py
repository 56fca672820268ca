"""OpenRLHF's parts, importable on a machine without flash-attn or vLLM (a CPU, or a GPU box without them).

Two import-time gaps in OpenRLHF 0.11.2 are closed here, and only when the real package is missing:

- `openrlhf.models` imports `flash_attn.bert_padding` (and `flash_attn.utils.distributed`) at module
  level, for its sample-packing path. Without flash-attn, while that package imports (and only then),
  small modules of our own stand under those names, implementing the four functions it uses with plain torch: `index_first_axis`,
  `unpad_input`, `pad_input` (the same contracts as flash-attn's) and `all_gather` (over
  torch.distributed). `rearrange` is einops' own. No `flash_attn.ops` is registered, so OpenRLHF's
  `log_probs_from_logits` takes its documented pure-torch fallback.
- `openrlhf.trainer.ray/__init__` imports vLLM eagerly (its engine helpers). Without vLLM the package is
  registered with its real path but without running that `__init__`, so its other modules (`launcher`,
  which `openrlhf.trainer.ppo_utils.experience_maker` needs) import normally and nothing touches vLLM.

Everything the learner takes from OpenRLHF is re-exported from here.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


def _index_first_axis(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """`tensor[indices]` along the first axis (flash-attn's autograd function has the same result)."""
    return tensor[indices]


def _unpad_input(
    hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """[batch, seqlen, ...] -> ([nnz, ...], indices, cu_seqlens, max_seqlen, seqused): the tokens whose
    mask is set (or `unused_mask`), row-major, with the cumulative sequence lengths of each row."""
    mask = attention_mask.bool() if unused_mask is None else (attention_mask.bool() | unused_mask.bool())
    seqlens = mask.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, int(seqlens.max().item()) if seqlens.numel() else 0, used


def _pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """The inverse of `unpad_input`: [nnz, ...] scattered back to [batch, seqlen, ...], zeros elsewhere."""
    out = hidden_states.new_zeros((batch * seqlen, *hidden_states.shape[1:]))
    out[indices] = hidden_states
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])


def _all_gather(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Concatenate `tensor` of every rank of `group` along the first axis."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


@contextlib.contextmanager
def _flash_attn_padding() -> Iterator[None]:
    """Our padding modules under flash-attn's names, only while OpenRLHF's models package imports.

    They are removed again right after, so that transformers and peft (imported first, and checking
    `find_spec("flash_attn")` when they choose an attention implementation) never mistake them for an
    installed flash-attn, and `log_probs_from_logits` keeps its pure-torch path.
    """
    if importlib.util.find_spec("flash_attn") is not None or "openrlhf.models" in sys.modules:
        yield
        return
    from einops import rearrange

    modules = {
        "flash_attn": _module("flash_attn"),
        "flash_attn.bert_padding": _module(
            "flash_attn.bert_padding",
            index_first_axis=_index_first_axis,
            unpad_input=_unpad_input,
            pad_input=_pad_input,
            rearrange=rearrange,
        ),
        "flash_attn.utils": _module("flash_attn.utils"),
        "flash_attn.utils.distributed": _module("flash_attn.utils.distributed", all_gather=_all_gather),
    }
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name, module in modules.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]


def close_import_gaps() -> None:
    """Make `openrlhf.models` and `openrlhf.trainer.ppo_utils` importable; idempotent."""
    import peft  # noqa: F401  (both decide about flash-attn here, before our modules exist)
    import transformers.modeling_utils  # noqa: F401

    with _flash_attn_padding():
        import openrlhf.models  # noqa: F401
    if importlib.util.find_spec("vllm") is None and "openrlhf.trainer.ray" not in sys.modules:
        import openrlhf.trainer

        package = types.ModuleType("openrlhf.trainer.ray")
        package.__path__ = [str(Path(openrlhf.trainer.__file__).parent / "ray")]
        package.__package__ = "openrlhf.trainer.ray"
        sys.modules["openrlhf.trainer.ray"] = package


close_import_gaps()

from openrlhf.models import Actor, PolicyLoss  # noqa: E402
from openrlhf.models.loss import aggregate_loss  # noqa: E402
from openrlhf.models.utils import compute_approx_kl, compute_entropy, log_probs_from_logits, masked_mean  # noqa: E402

__all__ = [
    "Actor",
    "PolicyLoss",
    "aggregate_loss",
    "close_import_gaps",
    "compute_approx_kl",
    "compute_entropy",
    "log_probs_from_logits",
    "masked_mean",
]
