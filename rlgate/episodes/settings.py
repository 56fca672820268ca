"""The settings every service shares, under one environment prefix.

Each service has its own `Settings` class and prefix (`RLGATE_` for the gateway and the reward worker,
`RLGATE_LEARNER_`, `RLGATE_SERVE_`, `RLGATE_DEMO_`). The settings several services share (where Redis is,
the key prefix, the secrets) are also read from one name for all of them, so one environment reaches every
service:

| setting              | shared variable              | also, and first, under the service's prefix     |
|----------------------|------------------------------|-------------------------------------------------|
| `redis_url`          | `RLGATE_REDIS_URL`           | e.g. `RLGATE_LEARNER_REDIS_URL`                 |
| `key_prefix`         | `RLGATE_KEY_PREFIX`          | e.g. `RLGATE_LEARNER_KEY_PREFIX`                |
| `redis_timeout_s`    | `RLGATE_REDIS_TIMEOUT_S`     | not the learner's: `RLGATE_LEARNER_REDIS_TIMEOUT_S` only (its reads are longer) |
| `operator_token`     | `RLGATE_OPERATOR_TOKEN`      |                                                 |
| `webhook_secret`     | `RLGATE_WEBHOOK_SECRET`      |                                                 |
| `rollout_key_secret` | `RLGATE_ROLLOUT_KEY_SECRET`  |                                                 |
| `retention_s`        | `RLGATE_RETENTION_S`         | e.g. `RLGATE_LEARNER_RETENTION_S`               |
| the inference key    | `RLGATE_INFERENCE_API_KEY`   | `RLGATE_UPSTREAM_API_KEY` (gateway), `RLGATE_LEARNER_INFERENCE_API_KEY`, `RLGATE_SERVE_API_KEY` |

Order, first wins: a command-line flag, the service-prefixed variable (so deployments that set
`RLGATE_LEARNER_REDIS_URL` keep working), the shared variable, the default.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import Field
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
)

SHARED_PREFIX = "RLGATE_"

# The store's settings, declared once here and used by every service and command that opens the store
# (the gateway, the reward worker, the learner, `rlgate export`, `rlgate worker`): one definition, one
# shared variable each (the table above)
RedisUrl = Annotated[
    str,
    Field(
        description="Redis holding rollouts, calls and the closed-episode stream (and, unless queue_redis_url "
        "is set, the reward-job queue). redis+cluster://host:port names a Redis Cluster by any of its nodes; "
        "?wait_replicas=N makes every recorded call wait until N replicas hold it (docs/deployment.md).",
    ),
]
KeyPrefix = Annotated[
    str,
    Field(
        description="Prefix of every Redis key (lets deployments share a Redis); the same for every service."
    ),
]
RedisTimeoutSeconds = Annotated[
    float,
    Field(
        gt=0,
        allow_inf_nan=False,
        description="Time limit of one Redis operation (blocking reads wait this much longer than they block).",
    ),
]
REDIS_URL = "redis://127.0.0.1:6379/0"

# `retention_s` of the gateway, the reward worker and the learner: one definition, one shared variable
RetentionSeconds = Annotated[
    float,
    Field(
        ge=0,
        le=10 * 365 * 86400,
        allow_inf_nan=False,
        description="How long a finished rollout is kept: once it is consumed by a learner, expired or "
        "failed, its keys expire after this many seconds, and closed-episode stream entries every learner "
        "group has acknowledged are trimmed once this old (by the gateway's sweeper). 0: kept forever. Export "
        "what you want to keep (rlgate export) within this time. Give every service the same value "
        "(RLGATE_RETENTION_S reaches them all).",
    ),
]

# `queue_redis_url` of the gateway and the reward worker: where rq's reward-job queue lives
QueueRedisUrl = Annotated[
    str | None,
    Field(
        description="Redis holding the reward-job queue (rq). Default: redis_url. rq does not run on a Redis "
        "Cluster: with a redis+cluster:// redis_url, reward jobs need a standalone Redis here (without one, "
        "POST /rollouts/{id}/finish answers 503 no_reward_queue and rlgate worker refuses to start).",
    ),
]

# field name -> the shared variable it is also read from
SHARED_ENV: dict[str, str] = {
    name: f"{SHARED_PREFIX}{name.upper()}"
    for name in (
        "redis_url",
        "key_prefix",
        "redis_timeout_s",
        "operator_token",
        "webhook_secret",
        "rollout_key_secret",
        "inference_api_key",
        "retention_s",
    )
}


class SharedEnvSource(EnvSettingsSource):
    """Reads the shared fields of a settings class (`SharedSettings.shared_env`) from their shared
    variables, whatever the class's own prefix."""

    def __init__(self, settings_cls: type[BaseSettings]) -> None:
        super().__init__(settings_cls, case_sensitive=False, env_prefix="")
        self.names = getattr(settings_cls, "shared_env", SHARED_ENV)

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        name = self.names.get(field_name)
        if name is None:
            return None, field_name, False
        return self.env_vars.get(name.lower()), field_name, False


class SharedSettings(BaseSettings):
    """Base of the services' settings: a field named in `shared_env` is read, after the service-prefixed
    variable, from its shared variable (module docstring)."""

    shared_env: ClassVar[dict[str, str]] = SHARED_ENV

    @classmethod
    def env_names(cls, field_name: str) -> tuple[str, ...]:
        """The environment variables a field is read from, first wins (for `--help`)."""
        field = cls.model_fields[field_name]
        source = EnvSettingsSource(cls)
        names = [env.upper() for _, env, _ in source._extract_field_info(field, field_name)]
        shared = cls.shared_env.get(field_name)
        if shared is not None and shared not in names:
            names.append(shared)
        return tuple(names)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (
            init_settings,
            env_settings,
            SharedEnvSource(settings_cls),
            dotenv_settings,
            file_secret_settings,
        )


class StoreSettings(SharedSettings):
    """Where the store is: the fields of every service and command that opens it (the gateway, the reward
    worker, the learner, `rlgate export`), declared here once."""

    redis_url: RedisUrl = REDIS_URL
    key_prefix: KeyPrefix = "rlgate"
    redis_timeout_s: RedisTimeoutSeconds = 5.0
