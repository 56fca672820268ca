"""The machinery of `rlgate`'s command line (pydantic-settings' CLI, told a little more): help that names
each option's environment variables and shows placeholders instead of Python types, booleans given a
value as before they became flags, mistakes as one line naming the option, and times as dates.

Everything here takes the root command class (`rlgate.cli.Rlgate`) as an argument, so it knows no command.
"""

from __future__ import annotations

import types
import typing
from argparse import RawDescriptionHelpFormatter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import SecretStr
from pydantic_core import core_schema
from pydantic_settings import BaseSettings, CliSettingsSource, EnvSettingsSource
from pydantic_settings.sources.providers.cli import _CliInternalArgParser, _CliPositionalArg, _CliSubCommand

from rlgate._errors import EXIT_USAGE
from rlgate.episodes.settings import SharedSettings


def parse_time(value: Any) -> Any:
    """Unix seconds, an ISO date (2026-11-30: midnight UTC) or date and time (UTC unless it names its
    offset), as unix seconds."""
    if value is None or isinstance(value, int | float):
        return value
    text = str(value).strip()
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            "use unix seconds, a date (2026-11-30) or a date and time (2026-11-30T12:00, UTC "
            "unless it names its offset, e.g. +02:00)"
        ) from None
    return (moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)).timestamp()


class Timestamp(float):
    """A point in time: unix seconds, or an ISO 8601 date or date and time (`parse_time`)."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.no_info_before_validator_function(parse_time, core_schema.float_schema())


PLACEHOLDERS: dict[Any, str] = {
    str: "TEXT",
    int: "INT",
    float: "NUMBER",
    Path: "PATH",
    SecretStr: "SECRET",
    Timestamp: "TIME",
    bool: "bool",
}


def subcommands(cls: type[BaseSettings]) -> dict[str, type[BaseSettings]]:
    """A command's subcommands by their command-line names."""
    found = {}
    for name, field in cls.model_fields.items():
        if _CliSubCommand in field.metadata:
            sub = next(
                a for a in typing.get_args(field.annotation) or (field.annotation,) if a is not type(None)
            )
            found[name.replace("_", "-")] = sub
    return found


def env_names(model: type[BaseSettings], name: str) -> tuple[str, ...]:
    field = model.model_fields[name]
    if not getattr(model, "reads_env", True) or _CliPositionalArg in field.metadata:
        return ()
    if issubclass(model, SharedSettings):
        return model.env_names(name)
    return tuple(env.upper() for _, env, _ in EnvSettingsSource(model)._extract_field_info(field, name))


class Parser(_CliInternalArgParser):
    def error(self, message: str) -> typing.NoReturn:  # one line, not the usage block
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class Cli(CliSettingsSource):
    """pydantic-settings' command line, with each option's environment variables in its help (the ones its
    settings class really reads, shared names included) and placeholders instead of Python types."""

    def __init__(self, root: type[BaseSettings]) -> None:
        self._models: list[type[BaseSettings]] = []
        super().__init__(
            root,
            cli_implicit_flags=True,
            cli_hide_none_type=True,
            cli_kebab_case=True,
            root_parser=Parser(
                prog="rlgate",
                description=root.__doc__,
                allow_abbrev=False,
                add_help=False,
                formatter_class=RawDescriptionHelpFormatter,
            ),
        )

    def _add_parser_args(self, parser: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        self._models.append(model)
        try:
            return super()._add_parser_args(parser, model, *args, **kwargs)
        finally:
            self._models.pop()

    def _get_field_env_var_names(self, field_name: str, field_info: Any, *args: Any) -> tuple[str, ...]:
        model = self._models[-1] if self._models else None
        if model is None or _CliSubCommand in field_info.metadata or field_name not in model.model_fields:
            return ()
        return env_names(model, field_name)

    def _help_format(self, field_name: str, field_info: Any, *args: Any, **kwargs: Any) -> str:
        text = super()._help_format(field_name, field_info, *args, **kwargs)
        factory = field_info.default_factory
        if (
            factory is not None
            and "(default factory:" in text
            and not field_info.default_factory_takes_validated_data
        ):
            value = str(factory()).replace("%", "%%")
            start = text.index("(default factory:")
            text = f"{text[:start]}(default: {value}){text[text.index(')', start) + 1 :]}"
        return text

    def _metavar_format(self, obj: Any) -> str:
        origin, args = typing.get_origin(obj), typing.get_args(obj)
        if origin in (typing.Union, types.UnionType):
            rest = [a for a in args if a is not type(None)]
            if len(rest) == 1:
                return self._metavar_format(rest[0])
        if obj in PLACEHOLDERS:
            return PLACEHOLDERS[obj]
        if origin is list:
            return "LIST"
        if origin is dict:
            return "JSON"
        return super()._metavar_format(obj)


TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def command_path(root: type[BaseSettings], args: list[str]) -> list[tuple[str, type[BaseSettings]]]:
    """The (sub)commands named on the command line, outermost first."""
    path, cls = [], root
    for arg in args:
        subs = subcommands(cls)
        if arg in subs:
            cls = subs[arg]
            path.append((arg, cls))
    return path


def flag_values(root: type[BaseSettings], args: list[str]) -> list[str]:
    """Booleans given a value, as before they became flags: `--resume true` -> `--resume`, `--fork false`
    (or `--fork=false`) -> `--no-fork`."""
    path = command_path(root, args)
    if not path:
        return args
    cls = path[-1][1]
    flags = {
        name.replace("_", "-")
        for name, field in cls.model_fields.items()
        if bool in (field.annotation, *typing.get_args(field.annotation))
    }
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg[2:].partition("=")
        if arg.startswith("--") and name in flags:
            if not eq and i + 1 < len(args) and args[i + 1].lower() in TRUE + FALSE:
                value, i = args[i + 1], i + 1
            if value:
                arg = (
                    f"--{name}"
                    if value.lower() in TRUE
                    else f"--no-{name}"
                    if value.lower() in FALSE
                    else arg
                )
        out.append(arg)
        i += 1
    return out


def option_namer(
    root: type[BaseSettings], path: list[tuple[str, type[BaseSettings]]]
) -> typing.Callable[[tuple[Any, ...]], str]:
    """Names the option of a validation error's location: its flag and variables."""
    names = [name.replace("-", "_") for name, _ in path]
    cls = path[-1][1] if path else root

    def option(loc: tuple[Any, ...]) -> str:
        rest = [str(part) for part in loc]
        while rest and names and rest[0] in names:
            rest.pop(0)
        if not rest or rest[0] not in cls.model_fields:
            return ".".join(rest)
        field = rest[0]
        if _CliPositionalArg in cls.model_fields[field].metadata:
            return field.upper()
        env = env_names(cls, field)
        return f"--{field.replace('_', '-')}" + (f" ({' or '.join(env)})" if env else "")

    return option


def settings_titles() -> set[str]:
    """The names of every settings class: a validation error of one of them is a refused setting."""
    seen, todo = set(), [BaseSettings]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__name__ not in seen:
                seen.add(sub.__name__)
                todo.append(sub)
    return seen
