"""Reward functions: score a finished agent run from its final answer.

`get_reward_fn(name)(RewardInput(answer=..., ground_truth=..., question=..., params={...}))` returns a
finite float. Builtins are in `BUILTINS`; `registry` documents how other names are found.
"""

from reward_hooks.rewards.errors import RewardInputError
from reward_hooks.rewards.registry import (
    BUILTINS,
    RewardFn,
    RewardInput,
    UnknownRewardFn,
    get_allowed_reward_fn,
    get_reward_fn,
    register,
)

__all__ = [
    "BUILTINS",
    "RewardFn",
    "RewardInput",
    "RewardInputError",
    "UnknownRewardFn",
    "get_allowed_reward_fn",
    "get_reward_fn",
    "register",
]
