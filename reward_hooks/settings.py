"""Settings of the reward hooks (webhook routes, reward worker, sweeper): flags or `RLGATE_*` variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from rlgate.episodes.settings import (
    QueueRedisUrl,
    RetentionSeconds,
    StoreSettings,
)
from rlgate.episodes.store import RETENTION_S

MIN_SECRET_CHARS = 16  # as the gateway's operator token


class RewardSettings(StoreSettings):
    """Run the reward worker: an rq worker that computes rewards and closes episodes."""

    # hide_input_in_errors: a refused setting's error must not echo the settings, the webhook secret included
    model_config = SettingsConfigDict(
        env_prefix="RLGATE_", cli_kebab_case=True, extra="ignore", hide_input_in_errors=True
    )

    webhook_secret: SecretStr | None = Field(
        None,
        description="When set, every webhook request (reward, call reward, finish, fail) must be signed: "
        "webhook-id, webhook-timestamp and webhook-signature: v1,<base64 HMAC-SHA256 with this secret of "
        "'{id}.{timestamp}.{METHOD}.{path}.{body}'> (Standard Webhooks, plus method and path; "
        "docs/security.md). At least 16 characters (`openssl rand -hex 32` makes a good one): with an empty or "
        "short secret anyone could sign.",
    )
    webhook_tolerance_s: int = Field(
        300,
        gt=0,
        description="How far a signed request's webhook-timestamp may be from the gateway's clock, "
        "in seconds (either way): the window in which a captured request could be sent again.",
    )
    max_abs_reward: float = Field(
        1e6,
        gt=0,
        allow_inf_nan=False,
        description="Rewards must lie in [-max_abs_reward, max_abs_reward]: an episode reward, a call reward "
        "or a reward job's result outside is refused (422; a job fails) and changes nothing. The gateway checks "
        "webhook rewards, the worker job results: give both the same value.",
    )
    agent_rewards: bool = Field(
        False,
        description="Take reward events an agent posts with its own key on Agent Lightning's event route "
        "(POST /api/rollouts/{id}/attempt/{n}/events). Agent Lightning's agents grade themselves this way; an "
        "agent under training can then post any reward, so turn it on only for agents whose grading you "
        "trust. Off: 403, and only the operator token (or the signed reward routes) closes episodes.",
    )
    reward_fn_modules: list[str] = Field(
        [],
        description="Modules whose functions a finish request may name by dotted path (JSON list, e.g. "
        '["mypkg.rewards"]). Builtins and rlgate.rewards entry points are always allowed; any other path is '
        "refused, so a reward request cannot make the worker call arbitrary code.",
    )
    reward_queue: str = Field("rlgate-rewards", description="The rq queue reward jobs go through.")
    queue_redis_url: QueueRedisUrl = None
    reward_job_retries: int = Field(
        3,
        ge=0,
        description="Retries of a reward job that raises an error a retry may fix (a judge's network error), "
        "before the episode fails. Set where jobs are enqueued (the gateway): rq keeps it in the job.",
    )
    reward_job_backoff_s: list[int] = Field(
        [2, 10, 30], description="Waits before each retry (JSON list; needs the worker's scheduler)."
    )
    reward_job_timeout_s: int = Field(
        300,
        gt=0,
        description="Time limit of one reward job (rq's job timeout), in seconds; set where jobs are "
        "enqueued (the gateway): rq keeps it in the job. A job that passes it fails its episode and is not "
        "retried: the same input would time out again.",
    )
    expired_fill_reward: float | None = Field(
        None,
        allow_inf_nan=False,
        description="Close expired rollouts with this reward instead of marking them expired.",
    )
    reward_data_dir: Path | None = Field(
        None,
        description="Directory a reward job may read data files from (sql_execution_match's db_path is "
        "resolved inside it); without it, no reward request may name a file.",
    )
    judge_model: str | None = Field(
        None, description="llm_judge: the judge model (a litellm model name). Set here, never by a request."
    )
    judge_api_base: str | None = Field(
        None,
        description="llm_judge: the judge's API base URL (its key comes from the provider's usual "
        "environment variable, e.g. OPENAI_API_KEY).",
    )
    sweep_interval_s: float = Field(2.0, description="How often open rollouts are checked for expiry.")
    retention_s: RetentionSeconds = RETENTION_S
    outbox_grace_s: float = Field(
        30.0, description="Age after which an unpublished closed episode is republished."
    )

    def check_webhook_secret(self) -> None:
        """Raise ValueError for a webhook secret shorter than `MIN_SECRET_CHARS` (an empty one included:
        anyone could sign with it). Not a validator: its error would echo the settings, the secret
        included. `WebhookAuth` calls it, so a gateway with such a secret does not start."""
        secret = self.webhook_secret
        if secret is not None and len(secret.get_secret_value()) < MIN_SECRET_CHARS:
            raise ValueError(
                f"webhook_secret (RLGATE_WEBHOOK_SECRET) must be at least {MIN_SECRET_CHARS} "
                "characters: with an empty or short secret anyone could sign"
            )

    @model_validator(mode="after")
    def _fill_reward_in_range(self) -> RewardSettings:
        if self.expired_fill_reward is not None and abs(self.expired_fill_reward) > self.max_abs_reward:
            bound = f"{self.max_abs_reward:g}"
            raise ValueError(
                f"expired_fill_reward {self.expired_fill_reward} is outside [-max_abs_reward, "
                f"max_abs_reward] = [-{bound}, {bound}]"
            )
        return self
