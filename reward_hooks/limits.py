"""The range a reward must lie in, checked wherever one enters: the webhook routes and reward jobs.

A float32 learner overflows long before float64 does (1e308 is finite to Python, inf to the learner's
credit and advantage functions), so rewards are bounded by a setting (`max_abs_reward`, default 1e6).
"""

from __future__ import annotations

import math
from typing import Any


class RewardOutOfRange(ValueError):
    """A reward that is not a finite number in [-max_abs_reward, max_abs_reward]."""


def check_reward(value: Any, max_abs_reward: float, what: str = "reward") -> float:
    """`value` as a float when it converts to one and |value| <= max_abs_reward; else `RewardOutOfRange`
    naming `what`.

    Converts what `float()` converts, except text: Python numbers (a bool is 0 or 1, a Decimal, a
    Fraction), numpy scalars and one-element arrays, a one-element torch tensor (`__float__` or
    `__index__`). A string or bytes, None, or an array of several elements is refused as not a number."""
    convertible = hasattr(value, "__float__") or hasattr(value, "__index__")
    if isinstance(value, str | bytes | bytearray) or not convertible:
        raise RewardOutOfRange(f"{what} must be a number, got {type(value).__name__} {repr(value)[:100]}")
    try:
        reward = float(value)
    except OverflowError:  # an integer past float's range
        reward = math.inf if value > 0 else -math.inf
    except (TypeError, ValueError, RuntimeError) as exc:  # several elements, a signalling NaN, ...
        raise RewardOutOfRange(
            f"{what} must be a number, got {type(value).__name__} {repr(value)[:100]}: {exc}"
        ) from exc
    if math.isnan(reward):
        raise RewardOutOfRange(f"{what} must be a finite number, got nan")
    if not abs(reward) <= max_abs_reward:
        raise RewardOutOfRange(
            f"{what} must lie in [-{max_abs_reward:g}, {max_abs_reward:g}] (max_abs_reward), got {reward!r}"
        )
    return reward
