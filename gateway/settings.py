"""Settings of the gateway: flags of `rlgate gateway` or `RLGATE_*` environment variables."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from rlgate.episodes.settings import (
    SHARED_ENV,
    QueueRedisUrl,
    RetentionSeconds,
    StoreSettings,
)
from rlgate.episodes.store import RETENTION_S


class GatewaySettings(StoreSettings):
    """Run the recording gateway: an OpenAI-compatible proxy that records every completion in Redis."""

    # the upstream is the inference server: its key is the one the learner and `rlgate serve` share
    shared_env: ClassVar[dict[str, str]] = {**SHARED_ENV, "upstream_api_key": "RLGATE_INFERENCE_API_KEY"}

    model_config = SettingsConfigDict(
        env_prefix="RLGATE_", cli_kebab_case=True, cli_implicit_flags=True, extra="ignore"
    )

    upstream_url: str = Field(
        "http://127.0.0.1:8000/v1",
        description="Base URL of the inference server's OpenAI API (vLLM: http://HOST:8000/v1).",
    )
    upstream_urls: list[str] | None = Field(
        None,
        description="Several inference servers (a JSON list of base URLs, each as upstream_url; it replaces "
        "upstream_url): each rollout's calls go to one server while it is healthy and has loaded the "
        "current policy version, new rollouts to the least loaded one (gateway/servers.py).",
    )
    upstream_health_interval_s: float = Field(
        1.0,
        gt=0,
        description="With several upstream_urls: how often each server's /health and /metrics are read; a "
        "server failing its check is out within this time.",
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
        4.0,
        description="How long an idle upstream connection is kept; below the server's own keep-alive "
        "(uvicorn's default, and vLLM's, is 5 s) so that the server rarely closes one under a request.",
    )
    host: str = Field("127.0.0.1", description="Interface to listen on.")
    port: int = Field(8100, description="Port to listen on (the agent port).")
    control_port: int | None = Field(
        None,
        description="Serve the operator surface (rollouts, rewards, metrics, health) on this second "
        "port instead; the agent port then serves only the completion endpoints (operator paths are 404 "
        "there). Publish only the agent port to agents.",
    )
    control_host: str = Field("127.0.0.1", description="Interface the control port listens on.")
    workers: int = Field(
        1,
        ge=1,
        le=256,
        description="Gateway processes serving the same port(s), one event loop each: each has its own "
        "SO_REUSEPORT socket of the agent port (the kernel spreads connections over them) and they share "
        "the control port. A worker that dies is started again; SIGTERM stops them all. Metrics are "
        "summed across them. 1: one process, no supervisor.",
    )
    public_url: str | None = Field(
        None,
        description="Base URL agents reach this gateway at, used in the base_url that POST /rollouts "
        "returns. Default: taken from the request's Host header.",
    )
    rollout_ttl_s: float = Field(
        3600.0, description="Open rollouts expire this long after they were created."
    )
    retention_s: RetentionSeconds = RETENTION_S
    api_keys: str | None = Field(
        None,
        description="Comma-separated API keys agents must send (Authorization: Bearer KEY) on the completion "
        "endpoints, valid on every rollout. They open nothing on the operator surface.",
    )
    rollout_key_secret: SecretStr | None = Field(
        None,
        description="Secret of the rollout keys: with it, POST /rollouts returns an api_key valid on "
        "that rollout's completion endpoints alone (an HMAC of the rollout id; gateways sharing the secret "
        "accept each other's keys). At least 16 characters.",
    )
    require_rollout_keys: bool = Field(
        False,
        description="Completion calls must carry their rollout's key: API keys are no longer "
        "accepted there, and a key of one rollout on another is 403. Needs rollout_key_secret.",
    )
    agl_controller_key: SecretStr | None = Field(
        None,
        description="The key of Agent Lightning's controller (agl-controller's agl_server.key): it opens "
        "Agent Lightning's rollout queue (GET and POST /api/rollouts, PATCH /api/rollouts/{id}), and, "
        "since the controller hands the same key to every agent it starts (AGL_KEY), the agent routes of "
        "every rollout, as an API key does (also where rollout keys are required); with it, as with "
        "api_keys, every agent needs a key. At least 16 characters.",
    )
    operator_token: SecretStr | None = Field(
        None,
        description="Bearer token of the operator surface (rollout reads and creation, rewards, "
        "metrics, OpenAPI schema); reward routes also take a valid webhook signature instead. Refused on "
        "the completion endpoints. At least 16 characters. Without it, agent credentials (api_keys, "
        "agl_controller_key, require_rollout_keys) need a control_port, which then serves the operator surface to whoever "
        "reaches it.",
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
    model_aliases: dict[str, str] = Field(
        {},
        description='Model names agents send mapped to the served model, as JSON: {"auto": "Qwen/Qwen2.5-1.5B-'
        'Instruct"} (Agent Lightning\'s agents send "auto"). Applied before adapter routing; the call is '
        "recorded with both names (the request as sent, the model it was served by).",
    )
    keep_token_ids: bool = Field(
        False,
        description="Leave the token ids the gateway asked the upstream for in the answers (vLLM's "
        "prompt_token_ids and token_ids in chat and completions answers; the translated Messages and Responses "
        "answers have no place for them), for agents that read them; per request: header X-Rlgate-Keep-Token-Ids: true. Always on for Agent Lightning's proxy URLs.",
    )
    record_token_text: bool = Field(
        False,
        description="Keep each completion token's text (the `token` of the server's log-probs) in the call "
        "records, so the dashboard's rollout page shows the completion as text shaded by log-prob rather "
        "than as token ids. Adds about 7 bytes per completion token to every record (docs/performance.md, "
        "Token text); the learner never reads it. A record that would be over RLGATE_MAX_RECORD_BYTES with "
        "the text is kept without it.",
    )
    require_rollout_id: bool = Field(
        False,
        description="Reject calls without a rollout id (400) instead of recording them under a new one.",
    )
    on_store_error: Literal["reject", "pass"] = Field(
        "reject",
        description="When Redis cannot record a call: reject (503 to the agent, never an unrecorded "
        "success) or pass (the agent gets the answer, the call is lost and logged as an error).",
    )
    max_body_bytes: int = Field(16 * 1024 * 1024, description="Largest request body accepted (413 above).")
    max_calls_per_rollout: int = Field(
        10_000,
        ge=0,
        description="Most call records (one per choice) one rollout may hold; a call above it is "
        "409 rollout_full, recorded nowhere (its answer dropped). 0: no limit.",
    )
    max_attempts_per_rollout: int = Field(
        16,
        ge=1,
        description="Most later attempts one rollout may have through Agent Lightning's proxy URLs "
        "(/attempt/N/, each an episode of its own, ROLLOUT~N); one more is 409 too_many_attempts.",
    )
    max_n: int = Field(
        16,
        ge=1,
        description="Most choices one call may ask for (`n`, chat and completions; a completions request "
        "gets n for each of its prompts, bounded together by max_tokens_per_call). More is 400 "
        "limit_exceeded before the upstream is called.",
    )
    max_tokens_per_choice: int = Field(
        65_536,
        ge=1,
        description="The largest token bound one choice may name (max_tokens, max_completion_tokens, "
        "min_tokens, the Responses API's max_output_tokens). More is 400 limit_exceeded before the "
        "upstream is called. A request that names none is bounded by the model's context and by "
        "max_record_bytes.",
    )
    max_tokens_per_call: int = Field(
        262_144,
        ge=1,
        description="The most tokens one call's answer may have asked for: n x the token bound it names "
        "(x the prompts of a batched completions request, whose token bound is 16 unless named). More is "
        "400 limit_exceeded before the upstream is called.",
    )
    max_record_bytes: int = Field(
        32 * 1024 * 1024,
        ge=1024,
        description="Largest record of one call kept in Redis: its request, stored "
        "once, plus every choice's answer, token ids and log-probs. A request already above it is 413 before "
        "the upstream is called; an answer that takes the record above it is dropped, the call recorded as "
        "failed and the agent told 413 (code record_too_large).",
    )
    max_answer_bytes: int = Field(
        128 * 1024 * 1024,
        ge=1024,
        description="The most bytes of one upstream answer the gateway reads (JSON or event stream, with "
        "the log-probs and token ids it asks for, which the record keeps more compactly: an answer is "
        "about 2-4 times its record). Past them it stops reading and closes the connection (vLLM aborts the "
        "request), records the call as failed and tells the agent 413 record_too_large, so no answer takes "
        "more of the gateway's memory. An announced Content-Length above it is refused at the headers.",
    )
    max_rollout_bytes: int = Field(
        256 * 1024 * 1024,
        ge=0,
        description="The most bytes of call records and events one rollout may write to Redis over its "
        "life, all its attempts' included (counted in the record script, so every gateway process counts "
        "together; an attempt's bytes stay counted after it ends). A call that would take it above is 409 "
        "rollout_full, its answer dropped and nothing written; the check is made when the answer is "
        "recorded, so the upstream has done the work. 0: no limit.",
    )
    redis_memory_high: float = Field(
        0.9,
        gt=0,
        le=1,
        description="Hold new rollouts back (as for max_backlog: held up to backlog_wait_s, then 429 with "
        "Retry-After) while Redis uses more than this share of its maxmemory, before it refuses writes; "
        "calls of rollouts under way go on. Read with the backlog; without a maxmemory set there is "
        "nothing to compare with (docs/deployment.md: set one, with maxmemory-policy noeviction). Released "
        "once it is below 95% of this share again.",
    )
    policy_poll_s: float = Field(
        0.2,
        description="How often the policy pointer, the store's epoch marker and the backlog are read from "
        "Redis.",
    )
    on_push: Literal["wait", "reject"] = Field(
        "wait",
        description="During a full-weight push: hold new calls until it is over (wait), or answer "
        "429 with Retry-After (reject).",
    )
    push_wait_s: float = Field(
        120.0, description="The longest a call is held during a push before it gets 429."
    )
    max_backlog: int = Field(
        10_000,
        ge=0,
        description="Hold new rollouts back while more episodes than this wait between the agents "
        "and the learners: closed and not yet acknowledged by a learner, plus reward jobs queued. Calls of "
        "rollouts under way go on. Keep it above two learner steps' worth (tasks_per_step x rollouts_per_task x 2): "
        "the learner holds a step's episodes until it has trained them. 0: no limit.",
    )
    backlog_wait_s: float = Field(
        30.0,
        ge=0,
        description="The longest a new rollout's first call is held for the "
        "backlog before it gets 429 with Retry-After.",
    )
    reward_queue: str = Field(
        "rlgate-rewards",
        description="The rq queue reward jobs go through (its waiting "
        "jobs count toward max_backlog; the reward worker's RLGATE_REWARD_QUEUE).",
    )
    queue_redis_url: QueueRedisUrl = None
    learner_group: str = Field(
        "learners",
        description="The learners' consumer group of the closed-episode "
        "stream (the learner's RLGATE_LEARNER_GROUP): what it has not acknowledged counts "
        "toward max_backlog; without that group (no learner yet) only reward jobs count.",
    )
    rollout_index_max: int = Field(
        1_000_000,
        ge=1,
        description="How many rollouts the listing index (GET /rollouts) keeps: the newest; "
        "older ones stay readable by id, they are just no longer listed.",
    )
    recent_rollouts: int = Field(
        100_000,
        ge=1,
        description="How many rollouts this gateway remembers having "
        "recorded, to refuse calls into them after Redis lost its data.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    log_format: Literal["auto", "json", "console"] = Field(
        "auto", description="auto: console on a terminal, JSON lines otherwise."
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="A connection must send a request's line and headers within this long of "
        "opening (for a later request on a kept-alive connection: of its first byte); otherwise it is "
        "closed (408 if a request had begun). On every listener.",
    )
    body_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Once the headers are in, the body must arrive within this long, plus one "
        "second per body_min_bytes_per_s bytes received; otherwise the connection is closed (408).",
    )
    body_min_bytes_per_s: int = Field(
        16 * 1024,
        ge=0,
        description="The slowest upload that still extends the body deadline (bytes per "
        "second, as Apache's mod_reqtimeout MinRate); 0: body_timeout_s is a fixed limit.",
    )
    max_header_bytes: int = Field(
        64 * 1024,
        ge=1024,
        description="Largest request line plus headers accepted (431 and the connection closed above).",
    )
    max_connections: int = Field(
        4096,
        ge=1,
        description="Open connections per listener. Above it a new connection closes the one "
        "that has waited longest without a whole request in service (still sending, or idle between "
        "requests); when every connection has one, the new one is closed. Lowered to what the process's "
        "open-file limit allows.",
    )

    def check_layout(self) -> None:
        """Raise ValueError for a layout where an agent's credential or network would reach the operator
        surface, or where credentials could be taken for one another. (Not a validator: its error would
        echo the settings, secrets included.)"""
        keys = [k.strip() for k in (self.api_keys or "").split(",") if k.strip()]
        operator = self.operator_token.get_secret_value() if self.operator_token is not None else None
        secret = self.rollout_key_secret.get_secret_value() if self.rollout_key_secret is not None else None
        controller = (
            self.agl_controller_key.get_secret_value() if self.agl_controller_key is not None else None
        )
        for name, value in (
            ("operator_token", operator),
            ("rollout_key_secret", secret),
            ("agl_controller_key", controller),
        ):
            if value is not None and len(value) < 16:
                raise ValueError(f"{name} must be at least 16 characters")
        if controller is not None:
            if controller in (operator, secret) or controller in keys or controller.startswith("rk-"):
                raise ValueError(
                    "agl_controller_key must differ from the operator token, the API keys and "
                    "rollout_key_secret, and must not start with 'rk-'"
                )
            keys = [*keys, controller]  # an agent credential too
        if self.require_rollout_keys and secret is None:
            raise ValueError("require_rollout_keys needs rollout_key_secret (RLGATE_ROLLOUT_KEY_SECRET)")
        if operator is not None and (operator in keys or operator == secret):
            raise ValueError("operator_token must differ from every API key and from rollout_key_secret")
        if any(k.startswith("rk-") for k in keys):
            raise ValueError("API keys must not start with 'rk-' (the rollout keys' prefix)")
        if (keys or self.require_rollout_keys) and operator is None and self.control_port is None:
            raise ValueError(
                "agents need credentials here (api_keys, agl_controller_key or require_rollout_keys) but "
                "the operator surface "
                "would be open on their port: set operator_token (RLGATE_OPERATOR_TOKEN) or serve it on a "
                "control_port (RLGATE_CONTROL_PORT)"
            )
        if self.control_port is not None and self.control_port == self.port:
            raise ValueError("control_port must differ from port")
