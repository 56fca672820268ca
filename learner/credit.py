"""Credit assignment: from an episode's rewards to one return per LLM call (episode -> action level).

An episode is the policy's transitions t = 0 .. T-1 in call order, a final return R (the reward that
closed it) and optional intermediate rewards r_t (posted per call through the webhook, or automatic
intermediate rewards from failed tool calls). Each rule gives every call t a return g_t:

| rule        | g_t                           | note                                                   |
|-------------|-------------------------------|--------------------------------------------------------|
| `identical` | R                             | LightningRL's rule and the default: every call gets R, not R/T |
| `discounted`| gamma^(T-1-t) * R             | the last call gets R, earlier ones less                |
| `last_only` | R if t == T-1 else 0          | only the final call is credited                        |

With `intermediate=True`, the discounted returns-to-go of the intermediate rewards are added:
g_t += sum_{k >= t} gamma^(k-t) * r_k (a missing r_k counts 0). The final return R is not one of the
r_k: it is credited by the rule above.

The learner may later keep only some calls (selective optimization): credit is assigned over all of an
episode's calls first, so calls of untrained agents still count for the episode's return.
"""

from __future__ import annotations

from typing import Literal

import torch

CreditRule = Literal["identical", "discounted", "last_only"]


def assign_credit(
    final_return: float,
    intermediate: torch.Tensor,
    rule: CreditRule = "identical",
    gamma: float = 1.0,
    add_intermediate: bool = False,
) -> torch.Tensor:
    """Per-call returns g, shape [T], float32.

    `intermediate` is [T] (0 where a call got no intermediate reward); it is only read when
    `add_intermediate`. T = 0 gives an empty tensor. A non-finite `final_return` raises ValueError.
    """
    steps = intermediate.shape[0]
    if not torch.isfinite(torch.tensor(final_return)):
        raise ValueError(f"an episode's return must be finite, not {final_return!r}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must lie in [0, 1], not {gamma}")
    t = torch.arange(steps, dtype=torch.float32)
    if rule == "identical":
        returns = torch.full((steps,), float(final_return))
    elif rule == "discounted":
        returns = float(final_return) * torch.pow(torch.tensor(gamma, dtype=torch.float32), (steps - 1) - t)
    elif rule == "last_only":
        returns = torch.zeros(steps)
        if steps:
            returns[-1] = float(final_return)
    else:
        raise ValueError(f"unknown credit rule {rule!r}")
    if add_intermediate and steps:
        returns = returns + returns_to_go(intermediate.to(torch.float32), gamma)
    return returns.to(torch.float32)


def returns_to_go(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{k >= t} gamma^(k-t) * r_k over a [T] tensor, computed backwards: G_t = r_t + gamma G_{t+1}."""
    out = torch.zeros_like(rewards)
    running = torch.zeros((), dtype=rewards.dtype)
    for k in range(rewards.shape[0] - 1, -1, -1):
        running = rewards[k] + gamma * running
        out[k] = running
    return out
