"""Errors a reward function raises about its input, shared by the functions and the reward jobs."""

from __future__ import annotations


class RewardInputError(ValueError):
    """The finish request itself is wrong (its ground truth or params): the same input fails the same way
    again, so a reward job does not retry it."""
