"""Settings of the gateway: flags of `rlgate gateway` or `RLGATE_*` environment variables."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class GatewaySettings(BaseSettings):
    """Run the recording gateway: an OpenAI-compatible proxy that records every completion in Redis."""

    model_config = SettingsConfigDict(
        env_prefix="RLGATE_", cli_kebab_case=True, cli_implicit_flags=True, extra="ignore"
    )

    upstream_url: str = Field(
        "http://127.0.0.1:8000/v1",
        description="Base URL of the inference server's OpenAI API (vLLM: http://HOST:8000/v1).",
    )
    upstream_kind: Literal["vllm", "openai"] = Field(
        "vllm",
        description="vllm: ask the upstream for token ids and log-probs (return_token_ids, logprobs) and "
        "strip what the agent did not ask for. openai: forward unchanged (calls are recorded without "
        "token ids and are not trainable).",
    )
    upstream_api_key: SecretStr | None = Field(
        None, description="Bearer token for the upstream. The agent's own Authorization is not forwarded."
    )
    upstream_timeout_s: float = Field(600.0, description="Total time limit of one upstream call.")
    upstream_max_connections: int = Field(256, description="Keep-alive connection pool size to the upstream.")
    upstream_keepalive_s: float = Field(
        4.0, description="How long an idle upstream connection is kept; below the server's own keep-alive "
        "(uvicorn's default, and vLLM's, is 5 s) so that the server rarely closes one under a request.")
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis holding rollouts and calls.")
    key_prefix: str = Field("rlgate", description="Prefix of every Redis key (lets deployments share a Redis).")
    redis_timeout_s: float = Field(5.0, description="Time limit of one Redis command.")
    host: str = Field("127.0.0.1", description="Interface to listen on.")
    port: int = Field(8100, description="Port to listen on.")
    public_url: str | None = Field(
        None,
        description="Base URL agents reach this gateway at, used in the base_url that POST /rollouts "
        "returns. Default: taken from the request's Host header.",
    )
    rollout_ttl_s: float = Field(3600.0, description="Open rollouts expire this long after they were created.")
    api_keys: str | None = Field(
        None,
        description="Comma-separated API keys agents must send (Authorization: Bearer KEY) on the completion "
        "endpoints. These keys cannot post rewards: those need the webhook secret.",
    )
    air: bool = Field(
        False,
        description="Automatic intermediate rewards: when a tool result sent back to the model reports an "
        "error, give the call that made the tool call the reward `air_reward`.",
    )
    air_reward: float = Field(-0.1, description="The automatic intermediate reward of a failed tool call.")
    air_error_patterns: list[str] = Field(
        [r"^\s*(error|exception)\b", r"Traceback \(most recent call last\)"],
        description="Regular expressions (case-insensitive, JSON list) that mark a tool result as an error; "
        'a JSON object with an "error" key always does.',
    )
    require_rollout_id: bool = Field(
        False, description="Reject calls without a rollout id (400) instead of recording them under a new one."
    )
    on_store_error: Literal["reject", "pass"] = Field(
        "reject",
        description="When Redis cannot record a call: reject (503 to the agent, never an unrecorded "
        "success) or pass (the agent gets the answer, the call is lost and logged as an error).",
    )
    max_body_bytes: int = Field(16 * 1024 * 1024, description="Largest request body accepted (413 above).")
    policy_poll_s: float = Field(
        0.2, description="How often the current policy version is read from Redis."
    )
    on_push: Literal["wait", "reject"] = Field(
        "wait", description="During a full-weight push: hold new calls until it is over (wait), or answer "
        "429 with Retry-After (reject).")
    push_wait_s: float = Field(120.0, description="The longest a call is held during a push before it gets 429.")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    log_format: Literal["auto", "json", "console"] = Field(
        "auto", description="auto: console on a terminal, JSON lines otherwise."
    )
