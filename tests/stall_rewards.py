"""Reward functions that misbehave, for the reward-job tests: a worker must fail them clearly, in time, and
go on with the next job. Reached by dotted path (`stall_rewards:sleeps`), with this folder on the path and
`RLGATE_REWARD_FN_MODULES='["stall_rewards"]'`. Each counts its runs in Redis (`params["runs"]`: a Redis
URL and a key), so a test can tell a job that ran once from one that was retried."""

from __future__ import annotations

import time

import redis

from reward_hooks.rewards import RewardInputError


def _ran(inp) -> None:
    url, key = inp.params["runs"]
    with redis.Redis.from_url(url) as client:
        client.incr(key)


def sleeps(inp) -> float:
    """Sleeps `params["seconds"]` (default 30), then scores 1: longer than a short job timeout."""
    _ran(inp)
    time.sleep(float(inp.params.get("seconds", 30)))
    return 1.0


def huge(inp) -> float:
    """1e308: finite to Python, inf to a float32 learner."""
    _ran(inp)
    return 1e308


def not_a_number(inp) -> float:
    _ran(inp)
    return float("nan")


def nothing(inp) -> None:
    _ran(inp)
    return None


def bad_input(inp) -> float:
    """Refuses its input, as sql_execution_match refuses a broken gold query: a retry would fail the same way."""
    _ran(inp)
    raise RewardInputError("ground_truth is not what this function takes")


def unreachable(inp) -> float:
    """A judge's network error: a retry may fix it."""
    _ran(inp)
    raise ConnectionError("the judge did not answer")


def numpy_bool(inp):
    """What `float()` took before rewards were bounded: numpy's bool."""
    import numpy

    _ran(inp)
    return numpy.bool_(True)
