"""The `rlgate` command: one subcommand per service. Flags or RLGATE_* environment variables.

    rlgate gateway --upstream-url http://127.0.0.1:8000/v1 --port 8100

`serve`, `worker`, `learner`, `demo` and `export` arrive with the issues that build them.
"""

from __future__ import annotations

import sys

from pydantic import Field
from pydantic_settings import BaseSettings, CliApp, CliSubCommand, SettingsConfigDict

from gateway import GatewaySettings
from rlgate._logging import configure_logging


class GatewayCommand(GatewaySettings):
    """Run the recording gateway: an OpenAI-compatible proxy in front of the inference server that records
    every completion (token ids, log-probs, policy version) in Redis, keyed by rollout id."""

    def cli_cmd(self) -> None:
        from gateway import serve

        configure_logging(self.log_level, self.log_format)
        serve(GatewaySettings.model_validate(self.model_dump()))


class Rlgate(BaseSettings):
    """rlgate: any agent gets better through reinforcement learning by pointing OPENAI_BASE_URL at it."""

    model_config = SettingsConfigDict(cli_prog_name="rlgate", cli_kebab_case=True)

    gateway: CliSubCommand[GatewayCommand] = Field(description="Run the recording gateway.")

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        args = ["--help"]
    CliApp.run(Rlgate, cli_args=args)
