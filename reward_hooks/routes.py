"""The reward webhook: routes the gateway process serves (mounted by `rlgate gateway`), so users have one URL.

    POST /rollouts/{rollout_id}/reward               {"reward": R, "metadata": {...}}  close with R
    POST /rollouts/{rollout_id}/calls/{index}/reward {"reward": r}                     intermediate r_t
    POST /rollouts/{rollout_id}/finish               {"reward_fn", "ground_truth", "params"}  reward job
    POST /rollouts/{rollout_id}/fail                 {"reason": "..."} or no body      close as failed

Every route first runs one check (`reward_hooks.auth.WebhookAuth`: with a webhook secret configured, the
request must be signed, `reward_hooks.signing`), then accepts a signed request's `webhook-id` once (SET NX
on `Keys.webhook`, kept twice the tolerance: a replayed request is 409 `webhook_replayed`); a request
refused by the check changes nothing, and one refused later (422, 404, 409, 503) changes nothing but its
spent webhook-id: a retry must be signed again with a new id.
Rewards must lie within `max_abs_reward` (422 otherwise). Per-call rewards are taken while the rollout is
open only: once it is closed the learner may already have read it, so a late one is 409, not ignored.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from redis.exceptions import RedisError
from starlette.concurrency import run_in_threadpool

from reward_hooks import errors, signing
from reward_hooks.auth import WebhookAuth
from reward_hooks.limits import RewardOutOfRange, check_reward
from reward_hooks.queue import RewardQueue
from reward_hooks.rewards import UnknownRewardFn, get_allowed_reward_fn
from reward_hooks.settings import RewardSettings
from rlgate import episodes
from rlgate.episodes import EpisodeLifecycle, EpisodeStore, FinishRequest
from rlgate.episodes.agl_queue import AglQueue
from rlgate.episodes.api_error import from_store

__all__ = ["Webhooks", "install", "webhooks"]

MAX_REASON_CHARS = 2000


class RewardPost(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    reward: float = Field(
        allow_inf_nan=False, description="The episode's final return: a finite number within max_abs_reward."
    )
    metadata: dict[str, Any] = Field(default_factory=dict)


class CallRewardPost(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    reward: float = Field(
        allow_inf_nan=False, description="The call's intermediate reward r_t, within max_abs_reward."
    )


class FinishPost(FinishRequest):
    model_config = ConfigDict(extra="forbid")


class FailPost(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    reason: str = Field(
        "failed by the operator",
        min_length=1,
        max_length=MAX_REASON_CHARS,
        description="Why the episode failed: stored as the rollout's error.",
    )


class RewardAccepted(BaseModel):
    rollout_id: str
    status: str
    reward: float
    outcome: str = Field(description="closed: this request closed it; unchanged: it already had this reward.")


class RolloutFailed(BaseModel):
    rollout_id: str
    status: str = Field(description="Always `failed`: never published for training.")
    error: str


class CallRewardAccepted(BaseModel):
    rollout_id: str
    index: int
    reward: float


class FinishAccepted(BaseModel):
    rollout_id: str
    job_id: str = Field(description="The reward job's rq id.")


Auth = Callable[[Request], Awaitable[bytes]]

# The signature headers (`reward_hooks.signing`), as the OpenAPI document lists them on every webhook route.
SIGNATURE_PARAMETERS = [
    {
        "name": signing.ID_HEADER,
        "in": "header",
        "required": False,
        "schema": {"type": "string", "pattern": r"^[A-Za-z0-9_\-]{1,128}$"},
        "description": "Unique per request; required with a webhook secret unless the operator token is sent.",
    },
    {
        "name": signing.TIMESTAMP_HEADER,
        "in": "header",
        "required": False,
        "schema": {"type": "string", "pattern": r"^[0-9]{1,12}$"},
        "description": "Unix seconds when signed.",
    },
    {
        "name": signing.SIGNATURE_HEADER,
        "in": "header",
        "required": False,
        "schema": {"type": "string"},
        "description": "v1,<base64 HMAC-SHA256> of {id}.{timestamp}.{METHOD}.{path}.{body} under the webhook "
        "secret (docs/security.md, 'Webhook signatures').",
    },
]


def openapi_extra(model: type[BaseModel], max_abs_reward: float, required: bool = True) -> dict[str, Any]:
    """A webhook route's request body and signature headers for the OpenAPI document (the routes read the
    raw body themselves, to check its signature): `model`'s schema, its `reward` bounded by
    `max_abs_reward`."""
    schema = model.model_json_schema()
    assert "$defs" not in schema, f"{model.__name__}: an inline body schema cannot hold $defs"
    if "reward" in schema.get("properties", {}):
        schema["properties"]["reward"].update(minimum=-max_abs_reward, maximum=max_abs_reward)
    return {
        "requestBody": {"required": required, "content": {"application/json": {"schema": schema}}},
        "parameters": SIGNATURE_PARAMETERS,
    }


@dataclass
class Webhooks:
    """What the webhook routes (and Agent Lightning's, `reward_hooks.agl`) work with: the app's
    `state.webhooks`, which `install` sets. `check` reads and authenticates each request and returns its
    raw body (default: `WebhookAuth(settings)`). Without `queue`, /finish answers 503 (no reward worker
    configured)."""

    store: EpisodeStore
    settings: RewardSettings
    queue: RewardQueue | None = None
    check: Auth | None = None
    auth: Auth = field(init=False)  # check, or WebhookAuth(settings)
    lifecycle: EpisodeLifecycle = field(init=False)
    agl_queue: AglQueue = field(init=False)

    def __post_init__(self) -> None:
        self.auth = self.check or WebhookAuth(self.settings)
        self.lifecycle = EpisodeLifecycle(self.store)
        self.agl_queue = AglQueue(self.store)


def webhooks(request: Request) -> Webhooks:
    hooks: Webhooks = request.app.state.webhooks  # set by install
    return hooks


def install(app: FastAPI, hooks: Webhooks) -> APIRouter:
    """Give `app` the webhooks' objects and return the webhook routes, their bodies documented with this
    deployment's reward bound (the caller includes them: `Gateway.add_routes`)."""
    app.state.webhooks = hooks

    def described(model: type[BaseModel], required: bool = True) -> dict[str, Any]:
        return openapi_extra(model, hooks.settings.max_abs_reward, required)

    router = APIRouter()
    for path, endpoint, answer, body, status in (
        ("/rollouts/{rollout_id}/reward", post_reward, RewardAccepted, described(RewardPost), 200),
        (
            "/rollouts/{rollout_id}/calls/{index}/reward",
            post_call_reward,
            CallRewardAccepted,
            described(CallRewardPost),
            200,
        ),
        ("/rollouts/{rollout_id}/finish", post_finish, FinishAccepted, described(FinishPost), 202),
        ("/rollouts/{rollout_id}/fail", post_fail, RolloutFailed, described(FailPost, required=False), 200),
    ):
        router.add_api_route(
            path, endpoint, methods=["POST"], status_code=status, response_model=answer, openapi_extra=body
        )
    return router


async def checked_body(request: Request) -> bytes:
    """Every route's first step: the raw body, authenticated, its webhook-id (if signed) never seen."""
    hooks = webhooks(request)
    body = await hooks.auth(request)
    msg_id = getattr(request.state, "webhook_id", None)
    if msg_id is not None:
        store = hooks.store
        replay_ttl_s = 2 * hooks.settings.webhook_tolerance_s  # a timestamp is accepted within ±tolerance
        with _store_errors():
            async with store.guard():
                fresh = await store.redis.set(store.keys.webhook(msg_id), b"1", nx=True, ex=replay_ttl_s)
        if not fresh:
            raise errors.Conflict(
                f"webhook-id {msg_id!r} was already accepted: a signed request is "
                "accepted once; sign each request with a new id",
                code="webhook_replayed",
            )
    return body


AUTHORIZED = Depends(checked_body)


def _parse(raw: bytes, model: type[BaseModel], rollout_id: str) -> Any:
    try:
        episodes.validate_episode_id(rollout_id)
    except episodes.InvalidId as exc:
        raise from_store(exc) from exc
    try:
        body = model.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or None
        raise errors.Unprocessable(f"{where or 'body'}: {first['msg']}", param=where) from exc
    try:  # what is stored must be written back as JSON: integers past 64 bits, nesting past 254 levels
        orjson.dumps(body.model_dump())
    except orjson.JSONEncodeError as exc:
        raise errors.Unprocessable(
            f"the body cannot be stored as JSON: {exc}", code="unstorable_json"
        ) from exc
    return body


def _bounded(reward: float, settings: RewardSettings) -> float:
    try:
        return check_reward(reward, settings.max_abs_reward, "reward")
    except RewardOutOfRange as exc:
        raise errors.Unprocessable(str(exc), param="reward", code="reward_out_of_range") from exc


async def post_reward(rollout_id: str, request: Request, raw: bytes = AUTHORIZED) -> Response:
    hooks = webhooks(request)
    body: RewardPost = _parse(raw, RewardPost, rollout_id)
    reward = _bounded(body.reward, hooks.settings)
    with _store_errors():
        try:
            result = await hooks.lifecycle.close(rollout_id, reward, body.metadata)
        except ValueError as exc:  # metadata that is not JSON (e.g. integers over 64 bits)
            raise errors.Unprocessable(str(exc), param="metadata") from exc
    answer = RewardAccepted(
        rollout_id=rollout_id, status="closed", reward=result.reward, outcome=result.outcome
    )
    return Response(answer.model_dump_json(), media_type="application/json")


async def post_call_reward(
    rollout_id: str, index: int, request: Request, raw: bytes = AUTHORIZED
) -> Response:
    hooks = webhooks(request)
    body: CallRewardPost = _parse(raw, CallRewardPost, rollout_id)
    reward = _bounded(body.reward, hooks.settings)
    if index < 0:
        raise errors.NotFound(f"no call {index}", code="call_not_found")
    with _store_errors():
        await hooks.lifecycle.set_call_reward(rollout_id, index, reward)
    return Response(
        orjson.dumps({"rollout_id": rollout_id, "index": index, "reward": reward}),
        media_type="application/json",
    )


async def post_finish(rollout_id: str, request: Request, raw: bytes = AUTHORIZED) -> Response:
    hooks = webhooks(request)
    body: FinishPost = _parse(raw, FinishPost, rollout_id)
    try:
        get_allowed_reward_fn(body.reward_fn, hooks.settings.reward_fn_modules)
    except UnknownRewardFn as exc:
        raise errors.Unprocessable(str(exc), param="reward_fn") from exc
    if hooks.queue is None:
        raise errors.StoreUnavailable("no reward queue is configured", code="no_reward_queue")
    with _store_errors():
        await hooks.lifecycle.set_finish(rollout_id, FinishRequest(**body.model_dump()))
    try:
        job_id = await run_in_threadpool(hooks.queue.enqueue, rollout_id)
    except RedisError as exc:
        raise errors.StoreUnavailable(f"the reward job could not be queued: {exc}") from exc
    return Response(
        orjson.dumps({"rollout_id": rollout_id, "job_id": job_id}),
        status_code=202,
        media_type="application/json",
    )


async def post_fail(rollout_id: str, request: Request, raw: bytes = AUTHORIZED) -> Response:
    """Close an open rollout as failed, exactly once: it is never published, so no learner trains on it
    (a second call, or one on a rollout that is closed, consumed or failed, is 409)."""
    hooks = webhooks(request)
    body: FailPost = _parse(raw or b"{}", FailPost, rollout_id)
    with _store_errors():
        await hooks.lifecycle.mark_failed(rollout_id, body.reason)
    answer = RolloutFailed(rollout_id=rollout_id, status="failed", error=body.reason)
    return Response(answer.model_dump_json(), media_type="application/json")


@contextmanager
def _store_errors() -> Iterator[None]:
    """Store outcomes as API errors (`rlgate.episodes.api_error.STORE_ERRORS`, the gateway's too)."""
    try:
        yield
    except episodes.StoreError as exc:
        raise from_store(exc) from exc
