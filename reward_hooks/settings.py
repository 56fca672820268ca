"""Settings of the reward hooks (webhook routes, reward worker, sweeper): flags or `RLGATE_*` variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class RewardSettings(BaseSettings):
    """Run the reward worker: an rq worker that computes rewards and closes episodes."""

    model_config = SettingsConfigDict(env_prefix="RLGATE_", cli_kebab_case=True, extra="ignore")

    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis holding rollouts, calls and the queue.")
    key_prefix: str = Field("rlgate", description="Prefix of every Redis key (lets deployments share a Redis).")
    redis_timeout_s: float = Field(5.0, description="Time limit of one Redis operation.")
    webhook_secret: SecretStr | None = Field(
        None,
        description="When set, every reward request must carry X-Signature-256: sha256=<hex HMAC-SHA256 of "
        "the raw body with this secret> (GitHub's webhook convention).",
    )
    reward_fn_modules: list[str] = Field(
        [],
        description="Modules whose functions a finish request may name by dotted path (JSON list, e.g. "
        '["mypkg.rewards"]). Builtins and rlgate.rewards entry points are always allowed; any other path is '
        "refused, so a reward request cannot make the worker call arbitrary code.",
    )
    reward_queue: str = Field("rlgate-rewards", description="The rq queue reward jobs go through.")
    reward_job_retries: int = Field(3, description="Retries of a reward job that raises, before the episode fails.")
    reward_job_backoff_s: list[int] = Field(
        [2, 10, 30], description="Waits before each retry (JSON list; needs the worker's scheduler).")
    reward_job_timeout_s: int = Field(300, description="Time limit of one reward job.")
    expired_fill_reward: float | None = Field(
        None, allow_inf_nan=False,
        description="Close expired rollouts with this reward instead of marking them expired.")
    reward_data_dir: Path | None = Field(
        None,
        description="Directory a reward job may read data files from (sql_execution_match's db_path is "
        "resolved inside it); without it, no reward request may name a file.")
    judge_model: str | None = Field(
        None, description="llm_judge: the judge model (a litellm model name). Set here, never by a request.")
    judge_api_base: str | None = Field(
        None, description="llm_judge: the judge's API base URL (its key comes from the provider's usual "
        "environment variable, e.g. OPENAI_API_KEY).")
    sweep_interval_s: float = Field(2.0, description="How often open rollouts are checked for expiry.")
    outbox_grace_s: float = Field(30.0, description="Age after which an unpublished closed episode is republished.")
