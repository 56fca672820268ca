"""Group-relative advantages (action level), after OpenRLHF's estimators, for groups of unequal episodes.

A group is every episode of one task in a step (the GRPO group). Episode e has per-call returns
g_e = (g_e0 .. g_e,T_e-1) from `credit.assign_credit`. The baseline statistics are taken either

- `over="episodes"` (default): each episode counts once however many calls it made. Each call gets the
  weight w = 1/T_e, so an episode's weights sum to 1; with N episodes,
      mean = sum_i w_i g_i / N,   std = sqrt( sum_i w_i (g_i - mean)^2 / (N - 1) )
  With identical credit (all g_e,t = R_e) these are exactly the mean and the Bessel-corrected std of the
  N episode returns, i.e. OpenRLHF's statistics with one sample per episode.
- `over="transitions"` (the paper's literal reading): every call counts once (w = 1, N = the number of
  calls): the mean and Bessel-corrected std over all calls of the group.

Estimators (OpenRLHF's names; eps = 1e-9 as in OpenRLHF):

| estimator            | advantage of call i of episode e                                          |
|----------------------|----------------------------------------------------------------------------|
| `group_norm` (GRPO)  | (g_i - mean) / (std + eps)                                                 |
| `rloo`               | g_i - baseline_e; baseline_e = mean of the other units' mean return          |
|                      | (episodes: the other episodes' mean call return; transitions: the other calls)|
| `reinforce_baseline` | g_i - mean, then whitened over all action tokens of the step (`whiten`)      |
| `dr_grpo`            | g_i - mean (no std division, no whitening)                                 |

A group whose returns are all equal gets exactly zero advantages under every estimator: it is answered
before any statistic (float32 per-call weights 1/T_e once left a std of ~1e-8, the size of eps, and
turned rounding noise into advantages of order 1). The statistics are computed in float64. A group with
one unit
(one episode, or one call for `transitions`) has no baseline: its advantages are None and the caller
decides (the learner drops it unless `singleton_groups="keep"`, which trains it with advantage g_i, as
REINFORCE without a baseline would).

Every token of a call's completion carries its call's advantage (`samples`).
"""

from __future__ import annotations

from typing import Literal

import torch

Estimator = Literal["group_norm", "rloo", "reinforce_baseline", "dr_grpo"]
Over = Literal["episodes", "transitions"]
EPS = 1e-9


def group_advantages(
    returns: list[torch.Tensor], estimator: Estimator = "group_norm", over: Over = "episodes"
) -> list[torch.Tensor] | None:
    """Advantages for one group: one [T_e] tensor per episode (same shapes as `returns`), or None for a
    group with a single unit. Episodes without calls (T_e = 0) do not count as units."""
    returns = [g.to(torch.float64) for g in returns]
    episodes = [g for g in returns if g.numel() > 0]
    if over == "episodes":
        units = len(episodes)
        weights = [torch.full_like(g, 1.0 / g.numel()) if g.numel() else g for g in returns]
    elif over == "transitions":
        units = sum(g.numel() for g in episodes)
        weights = [torch.ones_like(g) for g in returns]
    else:
        raise ValueError(f"unknown statistics unit {over!r}")
    if estimator not in ("group_norm", "rloo", "reinforce_baseline", "dr_grpo"):
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    if units < 2:
        return None
    flat, w = torch.cat(returns), torch.cat(weights)
    if bool(flat.max() == flat.min()):  # exactly zero, whatever the rounding of the sums below
        return [torch.zeros_like(g, dtype=torch.float32) for g in returns]
    total = (w * flat).sum()
    mean = total / units
    if estimator == "group_norm":
        std = ((w * (flat - mean) ** 2).sum() / (units - 1)).sqrt()
        out = [(g - mean) / (std + EPS) for g in returns]
    elif estimator in ("reinforce_baseline", "dr_grpo"):
        out = [g - mean for g in returns]
    else:  # rloo: leave one unit out of the baseline
        if over == "episodes":
            out = [g - (total - g.mean()) / (units - 1) if g.numel() else g for g in returns]
        else:
            out = [g - (total - g) / (units - 1) for g in returns]
    return [a.to(torch.float32) for a in out]


def whiten(advantages: list[torch.Tensor], token_counts: list[torch.Tensor]) -> list[torch.Tensor]:
    """OpenRLHF's global normalisation for `reinforce_baseline`: every action token of the step counts
    once. `advantages[s]` holds per-call values and `token_counts[s]` the number of completion tokens of
    each call (same shapes). With n tokens, mean = sum(count * a) / n, var = sum(count * (a - mean)^2) / n
    (population variance), and a' = (a - mean) * rsqrt(max(var, 1e-8))."""
    a, c = torch.cat(advantages), torch.cat(token_counts).to(torch.float32)
    n = c.sum()
    if n == 0:
        return advantages
    mean = (c * a).sum() / n
    rstd = (((c * (a - mean) ** 2).sum() / n).clamp(min=1e-8)).rsqrt()
    return [(x - mean) * rstd for x in advantages]
