"""The reward-function contract and the lookup from a name to a function.

A reward function scores a finished agent run: `fn(RewardInput) -> float`, pure (no side effects beyond
reading what `params` names), returning a finite float, most of them in [0, 1]. `get_reward_fn` resolves a
name, in this order:

1. a builtin (`BUILTINS`: exact_match, f1, format_and_f1, math_answer, sql_execution_match, llm_judge);
2. a function registered in this process with `register(name, fn)`;
3. an entry point of group `rlgate.rewards` in an installed distribution, e.g. in its pyproject.toml
   `[project.entry-points."rlgate.rewards"] my_reward = "my_pkg.rewards:score"`;
4. a dotted path to an importable callable, `pkg.mod:fn` (attribute path after the colon, may be dotted)
   or `pkg.mod.fn` (the last component is the attribute).

`register` only affects the process that calls it: rq workers are separate processes, so functions that
reward jobs must find belong in an entry point or a dotted path.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import Any, cast

from pydantic import BaseModel, ConfigDict, Field

from reward_hooks.rewards.judge import llm_judge
from reward_hooks.rewards.math import math_answer
from reward_hooks.rewards.sql import sql_execution_match
from reward_hooks.rewards.text import exact_match, f1, format_and_f1

ENTRY_POINT_GROUP = "rlgate.rewards"


class RewardInput(BaseModel):
    """What a reward function sees of a finished episode."""

    model_config = ConfigDict(extra="forbid")

    answer: str = Field(description="The agent's final answer: the last assistant message's text.")
    ground_truth: Any = Field(None, description="From the finish request; its shape is the function's.")
    question: str | None = Field(None, description="The first user message of the episode, when known.")
    params: dict[str, Any] = Field(
        default_factory=dict, description="Per-request options of the function (db_path, rubric, ...)."
    )


RewardFn = Callable[[RewardInput], float]


class UnknownRewardFn(LookupError):
    """No reward function goes by this name (nor is it an entry point or an importable dotted path)."""


BUILTINS: Mapping[str, RewardFn] = MappingProxyType(
    {
        "exact_match": exact_match,
        "f1": f1,
        "format_and_f1": format_and_f1,
        "math_answer": math_answer,
        "sql_execution_match": sql_execution_match,
        "llm_judge": llm_judge,
    }
)

_registered: dict[str, RewardFn] = {}


def register(name: str, fn: RewardFn) -> None:
    """Make `fn` available as `name` in this process. A later call with the same name replaces it;
    builtin names cannot be taken."""
    if not name:
        raise ValueError("a reward function needs a non-empty name")
    if name in BUILTINS:
        raise ValueError(f"{name!r} is a builtin reward function and cannot be replaced")
    if not callable(fn):
        raise TypeError(f"reward function {name!r} is not callable: {fn!r}")
    _registered[name] = fn


def get_reward_fn(name: str) -> RewardFn:
    """The reward function called `name` (see the module docstring for the lookup order).

    Raises `UnknownRewardFn` when nothing matches, the entry point is ambiguous, or the object found is
    not callable. Errors raised while importing a module that does exist propagate unchanged.
    """
    if name in BUILTINS:
        return BUILTINS[name]
    if name in _registered:
        return _registered[name]
    found = tuple(entry_points(group=ENTRY_POINT_GROUP, name=name))
    if len(found) > 1:
        sources = ", ".join(sorted(ep.value for ep in found))
        raise UnknownRewardFn(f"reward function {name!r} is ambiguous: entry points {sources}")
    if found:
        fn = found[0].load()
    elif ":" in name or "." in name:
        fn = _import_dotted(name)
    else:
        raise UnknownRewardFn(
            f"unknown reward function {name!r}: not a builtin ({', '.join(BUILTINS)}), not registered, "
            f"no {ENTRY_POINT_GROUP!r} entry point, and not a dotted path like 'pkg.mod:fn'"
        )
    if not callable(fn):
        raise UnknownRewardFn(f"reward function {name!r} resolves to {fn!r}, which is not callable")
    return cast(RewardFn, fn)


def _import_dotted(path: str) -> Any:
    """The object at `pkg.mod:attr.attr` or `pkg.mod.attr`."""
    module_name, _, attr_path = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr_path:
        raise UnknownRewardFn(f"reward function path {path!r} needs a module and an attribute")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise  # the module exists but one of its own imports is missing
        raise UnknownRewardFn(f"reward function {path!r}: no module named {module_name!r}") from exc
    for attr in attr_path.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError as exc:
            raise UnknownRewardFn(f"reward function {path!r}: {module_name!r} has no {attr_path!r}") from exc
    return obj


def get_allowed_reward_fn(name: str, modules: Sequence[str]) -> RewardFn:
    """`get_reward_fn` for names that come from requests: builtins, registered functions and entry points
    always; a dotted path only when the function it resolves to is defined in one of `modules` (checked on
    the function itself, so `allowed.mod:os.system` does not pass)."""
    if name in BUILTINS or name in _registered or entry_points(group=ENTRY_POINT_GROUP, name=name):
        return get_reward_fn(name)
    module = name.partition(":")[0] if ":" in name else name.rpartition(".")[0]
    if not _within(module, modules):
        raise UnknownRewardFn(
            f"reward function {name!r} is not a builtin or an entry point, and its module is "
            "not in RLGATE_REWARD_FN_MODULES"
        )
    fn = get_reward_fn(name)
    if not _within(getattr(fn, "__module__", None) or "", modules):
        raise UnknownRewardFn(
            f"reward function {name!r} resolves to {fn!r}, defined outside the allowed modules"
        )
    return fn


def _within(module: str, modules: Sequence[str]) -> bool:
    return any(module == allowed or module.startswith(allowed + ".") for allowed in modules)
