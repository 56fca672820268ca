"""The `rlgate` command: one subcommand per service. Flags or RLGATE_* environment variables.

    rlgate gateway --upstream-url http://127.0.0.1:8000/v1 --port 8100
    rlgate worker
    rlgate reward ROLLOUT_ID 1.0
    rlgate export episodes.parquet --format parquet --min-reward 0.5
    rlgate make-tiny-model runs/tiny && rlgate serve --model runs/tiny --port 8000
    rlgate demo --quick
    rlgate learner --model runs/tiny --served-model-name tiny --inference-urls '["http://127.0.0.1:8000"]'

This module is where the services meet: the gateway serves the reward webhook routes and runs the
sweeper, but neither package imports the other.

`rlgate demo` starts all of them (and an agent) on one machine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import (
    BaseSettings, CliApp, CliImplicitFlag, CliPositionalArg, CliSubCommand, SettingsConfigDict,
)

from gateway import GatewaySettings
from learner.settings import LearnerSettings
from reward_hooks.settings import RewardSettings
from rlgate._logging import configure_logging


class GatewayCommand(GatewaySettings, RewardSettings):
    """Run the recording gateway: an OpenAI-compatible proxy in front of the inference server that records
    every completion (token ids, log-probs, policy version) in Redis, keyed by rollout id. It also serves
    the reward webhook and expires open rollouts past their TTL."""

    def cli_cmd(self) -> None:
        from gateway import Gateway, serve
        from reward_hooks.agl import build_agl_router
        from reward_hooks.auth import WebhookAuth
        from reward_hooks.queue import RewardQueue
        from reward_hooks.routes import build_router
        from reward_hooks.sweeper import sweep_forever

        configure_logging(self.log_level, self.log_format)
        gateway_settings = GatewaySettings.model_validate(self.model_dump())
        reward_settings = RewardSettings.model_validate(self.model_dump())
        try:  # both check their settings (layout, secrets) when built: a mistake is one line
            app = Gateway(gateway_settings)  # the store the webhook routes share is the gateway's own
            # Operator surface: the operator token, or for these routes a valid webhook signature instead
            # (without a token configured: a signature when a webhook secret is set, as before).
            operator = app.is_operator if gateway_settings.operator_token is not None else None
            auth = WebhookAuth(reward_settings, is_operator=operator)
        except ValueError as exc:
            sys.exit(f"rlgate gateway: error: {exc}")
        app.add_routes(build_router(app.store, reward_settings, RewardQueue(reward_settings), auth),
                       signed=reward_settings.webhook_secret is not None)
        app.add_agent_routes(build_agl_router(app.store, reward_settings))
        app.add_background(lambda store: sweep_forever(store, reward_settings))
        serve(gateway_settings, app)


class WorkerCommand(RewardSettings):
    """Run the reward worker: an rq worker that runs reward jobs (POST /rollouts/{id}/finish), each of which
    computes the episode's reward with the named reward function and closes the episode."""

    burst: bool = Field(False, description="Exit once the queue is empty.")
    fork: bool = Field(True, description="Run each job in a forked work horse (rq's default: a crashing or "
                       "leaking reward function cannot take the worker down). --fork false runs jobs in the "
                       "worker process (rq's SimpleWorker): several times more jobs per second for light "
                       "reward functions such as math_answer.")
    log_level: str = Field("info", description="Log level.")
    log_format: str = Field("auto", description="auto, json or console.")

    def cli_cmd(self) -> None:
        from rq import SimpleWorker, Worker
        from rq.serializers import JSONSerializer

        from reward_hooks.queue import connect

        configure_logging(self.log_level, self.log_format)
        worker = (Worker if self.fork else SimpleWorker)([self.reward_queue], connection=connect(self), serializer=JSONSerializer)
        worker.work(burst=self.burst, with_scheduler=True)


class RewardCommand(BaseSettings):
    """Post an episode's final reward to the gateway's webhook (signed when RLGATE_WEBHOOK_SECRET is set)."""

    model_config = SettingsConfigDict(env_prefix="RLGATE_", cli_kebab_case=True, extra="ignore")

    rollout_id: CliPositionalArg[str] = Field(description="The rollout to close.")
    value: CliPositionalArg[float] = Field(description="Its final reward.")
    gateway_url: str = Field("http://127.0.0.1:8100", description="The gateway's base URL.")

    def cli_cmd(self) -> None:
        from reward_hooks.client import RewardRejected, post_reward

        # the secret only from the environment: a command-line flag would show in the process list
        secret = RewardSettings().webhook_secret
        try:
            answer = post_reward(self.gateway_url, self.rollout_id, self.value,
                                 secret=secret.get_secret_value() if secret is not None else None)
        except RewardRejected as exc:
            print(exc.body, file=sys.stderr)
            raise SystemExit(1) from exc
        print(json.dumps(answer))


class ExportCommand(BaseSettings):
    """Export episodes as training data: one row per LLM call (JSONL or Parquet, loadable with HF datasets),
    or chat-format rows for supervised fine-tuning (--format sft)."""

    model_config = SettingsConfigDict(env_prefix="RLGATE_", cli_kebab_case=True, extra="ignore")

    out: CliPositionalArg[Path] = Field(description="File to write.")
    format: Literal["jsonl", "parquet", "sft"] = Field("jsonl", description="jsonl, parquet or sft (JSONL).")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis holding the episodes.")
    key_prefix: str = Field("rlgate", description="Prefix of every Redis key.")
    status: list[str] = Field(["closed", "consumed"], description="Episode statuses to export (JSON list).")
    since: float | None = Field(None, description="Only episodes closed at or after (unix seconds).")
    until: float | None = Field(None, description="Only episodes closed before (unix seconds).")
    task: str | None = Field(None, description="Only this task.")
    agent: str | None = Field(None, description="Only the calls of this agent (X-Agent-Name).")
    min_reward: float | None = Field(None, description="Only episodes whose final return is at least this.")

    def cli_cmd(self) -> None:
        import asyncio

        from episodes import EpisodeStore
        from episodes.export import ExportFilter, export

        async def run() -> int:
            store = EpisodeStore.from_url(self.redis_url, prefix=self.key_prefix)
            try:
                flt = ExportFilter(tuple(self.status), self.since, self.until, self.task, self.agent, self.min_reward)
                return await export(store, self.out, self.format, flt)
            finally:
                await store.aclose()

        rows = asyncio.run(run())
        print(json.dumps({"rows": rows, "path": str(self.out), "format": self.format}))


class ServeCommand(BaseSettings):
    """Serve a local Hugging Face causal LM on the CPU through an OpenAI-compatible API in vLLM's wire format
    (token ids, log-probs, hermes tool calls): the embedded inference backend, for small models. Prints
    READY <port> once listening. Needs `pip install rlgate[serve]`."""

    model_config = SettingsConfigDict(env_prefix="RLGATE_SERVE_", cli_kebab_case=True, extra="ignore")

    model: Path = Field(description="A local Hugging Face causal LM folder (rlgate make-tiny-model builds one).")
    host: str = Field("127.0.0.1", description="Interface to listen on.")
    port: int = Field(8000, description="Port to listen on (0: any free port).")
    served_model_name: str | None = Field(None, description="The model name clients use (default: --model).")
    batch_window_ms: float = Field(3.0, description="How long a batch waits for concurrent requests to join.")
    logprobs_mode: Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"] = Field(
        "raw_logprobs", description="What log-probs report, as vLLM's --logprobs-mode (and its default): raw = of "
        "the model's logits, processed = of the distribution sampled from (temperature, logit_bias, top-k/top-p). "
        "The learner needs processed_logprobs.")
    allow_runtime_lora_updating: bool | None = Field(
        None, description="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (else 404). Default: vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING (1 or true), else off.")
    dev_mode: bool | None = Field(
        None, description="Serve vLLM's RL routes: /pause, /resume, /is_paused, the weight-update phases, "
        "/update_weight_version, /weight_info (else 404). Default: vLLM's VLLM_SERVER_DEV_MODE (1), else off.")
    api_key: str | None = Field(
        None, description="Require this key (Authorization: Bearer KEY) on /v1/..., as vLLM's --api-key (not on "
        "/health, /tokenize or the dev-mode routes); prefer RLGATE_SERVE_API_KEY or VLLM_API_KEY to a flag "
        "that ps shows. Default: vLLM's VLLM_API_KEY, else none.")
    weights_root: Path | None = Field(
        None, description="Adapters (lora_path) and weight files (update_info.path) are read only from under this "
        "folder; any other path is answered as missing. Default: the parent folder of --model.")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    log_format: Literal["auto", "json", "console"] = Field("auto", description="auto, json or console.")

    def cli_cmd(self) -> None:
        from inference.access import VllmEnvironment, WeightsRoot
        from inference.server import serve

        configure_logging(self.log_level, self.log_format)
        try:
            vllm_env = VllmEnvironment()  # vLLM's variables for the same gates; the flags win
            root = WeightsRoot(self.weights_root or Path(self.model).resolve().parent).root
        except ValueError as exc:
            sys.exit(f"rlgate serve: error: {str(exc).splitlines()[0]}")
        lora = self.allow_runtime_lora_updating
        dev = self.dev_mode
        try:
            serve(self.model, self.host, self.port, served_model_name=self.served_model_name,
                  batch_window_s=self.batch_window_ms / 1000, logprobs_mode=self.logprobs_mode,
                  allow_runtime_lora_updating=vllm_env.ALLOW_RUNTIME_LORA_UPDATING if lora is None else lora,
                  dev_mode=vllm_env.SERVER_DEV_MODE if dev is None else dev,
                  api_keys=[self.api_key or vllm_env.API_KEY or ""], weights_root=root)
        except KeyboardInterrupt:
            pass


class MakeTinyModelCommand(BaseSettings):
    """Build, deterministically from a seed, a tiny causal LM (Qwen2 architecture) with a byte-level
    tokenizer and a ChatML chat template with hermes-style tool calls, as a normal Hugging Face folder."""

    model_config = SettingsConfigDict(cli_kebab_case=True)

    directory: CliPositionalArg[Path] = Field(description="Folder to create (must not exist or be empty).")
    seed: int = Field(0, description="Seed of the random initialisation.")
    hidden_size: int = Field(64, description="Width of the model.")
    num_layers: int = Field(2, description="Transformer layers.")
    num_heads: int = Field(4, description="Attention heads.")

    def cli_cmd(self) -> None:
        from inference.tiny_model import build_tiny_model

        try:
            path = build_tiny_model(self.directory, seed=self.seed, hidden_size=self.hidden_size,
                                    num_layers=self.num_layers, num_heads=self.num_heads)
        except FileExistsError as exc:
            print(f"rlgate make-tiny-model: {exc}", file=sys.stderr)
            raise SystemExit(1) from exc
        print(json.dumps({"path": str(path)}))


class LearnerCommand(LearnerSettings):
    """Train the policy on closed episodes: identical credit assignment (LightningRL), group advantages,
    OpenRLHF's policy loss; push each new version to the inference servers as a LoRA adapter and move the
    policy pointer the gateway reads. Needs `pip install rlgate[learner]` (and OpenRLHF: see README)."""

    model_config = SettingsConfigDict(env_prefix="RLGATE_LEARNER_", cli_kebab_case=True, extra="ignore")

    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    log_format: Literal["auto", "json", "console"] = Field("auto", description="auto, json or console.")

    def cli_cmd(self) -> None:
        from learner.loop import LogprobMismatch, run

        configure_logging(self.log_level, self.log_format)
        try:
            run(LearnerSettings.model_validate(self.model_dump(exclude={"log_level", "log_format"})))
        except KeyboardInterrupt:
            pass
        except LogprobMismatch as exc:
            sys.exit(f"rlgate learner: error: {exc}")


class DemoCommand(BaseSettings):
    """Run the whole loop on this machine: the tiny model served on the CPU, the gateway, the reward worker,
    the learner and parallel OpenAI-SDK agents learning to use a calculator (Calc-X in miniature). Shows
    live progress; writes summary.json and reward_curve.png into --workdir."""

    model_config = SettingsConfigDict(env_prefix="RLGATE_DEMO_", cli_kebab_case=True, extra="ignore",
                                      populate_by_name=True)

    workdir: Path = Field(Path("runs/demo"), description="Model, logs, adapters, summary and curve.")
    minutes: float = Field(10.0, description="Stop after this long at the latest.")
    target: float = Field(0.9, description="Stop once the success rate of the last 3 steps reaches this.")
    quick: CliImplicitFlag[bool] = Field(False, description="CI mode: stop after at most 3 minutes.")
    json_path: Path | None = Field(None, alias="json", description="Also write the JSON summary here.")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis to use (a redis-server is started "
                           "for the demo if none answers there).")
    concurrency: int = Field(16, description="Agent episodes in flight.")
    tasks_per_step: int = Field(16, description="Task groups per training step.")
    rollouts_per_task: int = Field(4, description="Episodes per task (the GRPO group).")
    learning_rate: float = Field(2e-3, description="The learner's AdamW learning rate (LoRA).")
    max_backlog: int = Field(0, ge=0, description="The gateway holds new rollouts back while more episodes "
                             "than this wait for rewards or training (0: two steps' worth).")
    seed: int = Field(0, description="Seed of the tiny model, the questions and the learner.")

    def cli_cmd(self) -> None:
        from demo.run import DemoConfig, run

        summary = run(DemoConfig(
            workdir=self.workdir, minutes=min(self.minutes, 3.0) if self.quick else self.minutes,
            target=self.target, quick=self.quick, redis_url=self.redis_url, concurrency=self.concurrency,
            tasks_per_step=self.tasks_per_step,
            rollouts_per_task=self.rollouts_per_task, learning_rate=self.learning_rate, seed=self.seed,
            json_path=self.json_path,
            max_backlog=self.max_backlog or 2 * self.tasks_per_step * self.rollouts_per_task))
        if not summary["curve"]:
            raise SystemExit(1)


class Rlgate(BaseSettings):
    """rlgate: any agent gets better through reinforcement learning by pointing OPENAI_BASE_URL at it."""

    model_config = SettingsConfigDict(cli_prog_name="rlgate", cli_kebab_case=True)

    gateway: CliSubCommand[GatewayCommand] = Field(description="Run the recording gateway (and reward webhook).")
    worker: CliSubCommand[WorkerCommand] = Field(description="Run the reward worker (rq).")
    reward: CliSubCommand[RewardCommand] = Field(description="Post an episode's reward to the gateway.")
    export: CliSubCommand[ExportCommand] = Field(description="Export episodes as training data.")
    learner: CliSubCommand[LearnerCommand] = Field(description="Train the policy on closed episodes.")
    demo: CliSubCommand[DemoCommand] = Field(description="Run the whole loop on this machine (tiny model).")
    serve: CliSubCommand[ServeCommand] = Field(description="Serve a small model on the CPU, in vLLM's wire format.")
    make_tiny_model: CliSubCommand[MakeTinyModelCommand] = Field(
        description="Build a tiny model and tokenizer in code (for the CPU server and tests).")

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        args = ["--help"]
    CliApp.run(Rlgate, cli_args=args)
