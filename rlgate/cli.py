"""The `rlgate` command: one subcommand per service. Flags or RLGATE_* environment variables.

    rlgate gateway --upstream-url http://127.0.0.1:8000/v1 --port 8100
    rlgate worker
    rlgate reward ROLLOUT_ID 1.0

This module is where the services meet: the gateway serves the reward webhook routes and runs the
sweeper, but neither package imports the other.

`serve`, `learner`, `demo` and `export` arrive with the issues that build them.
"""

from __future__ import annotations

import json
import sys

from pydantic import Field
from pydantic_settings import BaseSettings, CliApp, CliPositionalArg, CliSubCommand, SettingsConfigDict

from gateway import GatewaySettings
from reward_hooks.settings import RewardSettings
from rlgate._logging import configure_logging


class GatewayCommand(GatewaySettings, RewardSettings):
    """Run the recording gateway: an OpenAI-compatible proxy in front of the inference server that records
    every completion (token ids, log-probs, policy version) in Redis, keyed by rollout id. It also serves
    the reward webhook and expires open rollouts past their TTL."""

    def cli_cmd(self) -> None:
        from gateway import Gateway, serve
        from reward_hooks.queue import RewardQueue
        from reward_hooks.routes import build_router
        from reward_hooks.sweeper import sweep_forever

        configure_logging(self.log_level, self.log_format)
        gateway_settings = GatewaySettings.model_validate(self.model_dump())
        reward_settings = RewardSettings.model_validate(self.model_dump())
        app = Gateway(gateway_settings)  # the store the webhook routes share is the gateway's own
        app.add_routes(build_router(app.store, reward_settings, RewardQueue(reward_settings)))
        app.add_background(lambda store: sweep_forever(store, reward_settings))
        serve(gateway_settings, app)


class WorkerCommand(RewardSettings):
    """Run the reward worker: an rq worker that runs reward jobs (POST /rollouts/{id}/finish), each of which
    computes the episode's reward with the named reward function and closes the episode."""

    burst: bool = Field(False, description="Exit once the queue is empty.")
    log_level: str = Field("info", description="Log level.")
    log_format: str = Field("auto", description="auto, json or console.")

    def cli_cmd(self) -> None:
        from rq import Worker
        from rq.serializers import JSONSerializer

        from reward_hooks.queue import connect

        configure_logging(self.log_level, self.log_format)
        worker = Worker([self.reward_queue], connection=connect(self), serializer=JSONSerializer)
        worker.work(burst=self.burst, with_scheduler=True)


class RewardCommand(BaseSettings):
    """Post an episode's final reward to the gateway's webhook (signed when RLGATE_WEBHOOK_SECRET is set)."""

    model_config = SettingsConfigDict(env_prefix="RLGATE_", cli_kebab_case=True, extra="ignore")

    rollout_id: CliPositionalArg[str] = Field(description="The rollout to close.")
    value: CliPositionalArg[float] = Field(description="Its final reward.")
    gateway_url: str = Field("http://127.0.0.1:8100", description="The gateway's base URL.")
    webhook_secret: str | None = Field(None, description="The webhook secret (better: RLGATE_WEBHOOK_SECRET).")

    def cli_cmd(self) -> None:
        from reward_hooks.client import RewardRejected, post_reward

        try:
            answer = post_reward(self.gateway_url, self.rollout_id, self.value, secret=self.webhook_secret)
        except RewardRejected as exc:
            print(exc.body, file=sys.stderr)
            raise SystemExit(1) from exc
        print(json.dumps(answer))


class Rlgate(BaseSettings):
    """rlgate: any agent gets better through reinforcement learning by pointing OPENAI_BASE_URL at it."""

    model_config = SettingsConfigDict(cli_prog_name="rlgate", cli_kebab_case=True)

    gateway: CliSubCommand[GatewayCommand] = Field(description="Run the recording gateway (and reward webhook).")
    worker: CliSubCommand[WorkerCommand] = Field(description="Run the reward worker (rq).")
    reward: CliSubCommand[RewardCommand] = Field(description="Post an episode's reward to the gateway.")

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        args = ["--help"]
    CliApp.run(Rlgate, cli_args=args)
