#!/usr/bin/env python3
"""Writes docs/configuration.md, the reference of every `rlgate` command's settings, from the settings
classes themselves (their fields, defaults, descriptions and environment variables), so the reference has
one owner: the code. tests/test_docs.py fails when the checked-in page differs from what this prints.

    .venv/bin/python scripts/config_reference.py > docs/configuration.md
"""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import SecretStr
from pydantic_core import PydanticUndefined

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pydantic_settings.sources.providers.cli import _CliPositionalArg  # noqa: E402

from rlgate._cli_parse import env_names, subcommands  # noqa: E402
from rlgate.cli import Rlgate  # noqa: E402


def _default(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None or value == "" or value == [] or value == {}:
        return "none" if value is None else f"`{value!r}`"
    if isinstance(value, SecretStr):
        return "(secret)"
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, Path):
        value = str(value)
    return f"`{value}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _commands(cls: Any, prefix: str) -> list[tuple[str, Any]]:
    out = []
    for name, sub in subcommands(cls).items():
        path = f"{prefix} {name}"
        children = subcommands(sub)
        if any(f for f in sub.model_fields if f.replace("_", "-") not in children):
            out.append((path, sub))
        out.extend(_commands(sub, path))
    return out


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from the settings classes by `scripts/config_reference.py` (tests/test_docs.py checks it is",
        "current): edit the code's descriptions, not this page. Every option is a flag of its command and, where",
        "named, an environment variable; a service-prefixed variable wins over the shared `RLGATE_*` name. Booleans",
        "are flags (`--resume` / `--no-resume`); an option in capitals is a positional argument (`rlgate reward",
        "ROLLOUT_ID VALUE`). `rlgate COMMAND --help` prints the same.",
        "",
    ]
    for path, cls in _commands(Rlgate, "rlgate"):
        lines += [
            f"## `{path}`",
            "",
            _cell((cls.__doc__ or "").strip().split("\n\n")[0]),
            "",
            "| option | environment | default | meaning |",
            "|---|---|---|---|",
        ]
        children = subcommands(cls)
        for name, field in cls.model_fields.items():
            if name.replace("_", "-") in children:
                continue
            env = ", ".join(f"`{e}`" for e in env_names(cls, name)) or "-"
            option = name.upper() if _CliPositionalArg in field.metadata else f"--{name.replace('_', '-')}"
            lines.append(
                f"| `{option}` | {env} | {_cell(_default(field))} | {_cell(field.description or '')} |"
            )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render())
