"""The reward webhook: routes the gateway process serves (mounted by `rlgate gateway`), so users have one URL.

    POST /rollouts/{rollout_id}/reward               {"reward": R, "metadata": {...}}  close with R
    POST /rollouts/{rollout_id}/calls/{index}/reward {"reward": r}                     intermediate r_t
    POST /rollouts/{rollout_id}/finish               {"reward_fn", "ground_truth", "params"}  reward job

With a webhook secret configured, every request must be signed (`reward_hooks.signing`); the signature
is checked before anything else, and a bad request changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from redis.exceptions import RedisError
from starlette.concurrency import run_in_threadpool

import episodes
from episodes import EpisodeLifecycle, EpisodeStore, FinishRequest
from reward_hooks import errors, signing
from reward_hooks.queue import RewardQueue
from reward_hooks.rewards import UnknownRewardFn, get_allowed_reward_fn
from reward_hooks.settings import RewardSettings


MAX_BODY_BYTES = 1 << 20


class RewardPost(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    reward: float = Field(allow_inf_nan=False, description="The episode's final return: a finite number.")
    metadata: dict[str, Any] = Field(default_factory=dict)


class CallRewardPost(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    reward: float = Field(allow_inf_nan=False, description="The call's intermediate reward r_t.")


class FinishPost(FinishRequest):
    model_config = ConfigDict(extra="forbid")


class RewardAccepted(BaseModel):
    rollout_id: str
    status: str
    reward: float
    outcome: str = Field(description="closed: this request closed it; unchanged: it already had this reward.")


def build_router(store: EpisodeStore, settings: RewardSettings, queue: RewardQueue | None) -> APIRouter:
    """The webhook routes. Without `queue`, /finish answers 503 (no reward worker configured)."""
    router = APIRouter()
    lifecycle = EpisodeLifecycle(store)
    secret = settings.webhook_secret.get_secret_value() if settings.webhook_secret is not None else None

    async def parse(request: Request, model: type[BaseModel], rollout_id: str) -> Any:
        chunks, size = [], 0
        async for chunk in request.stream():  # bounded before anything is hashed or parsed
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise errors.PayloadTooLarge(f"reward requests are limited to {MAX_BODY_BYTES} bytes")
            chunks.append(chunk)
        raw = b"".join(chunks)
        if secret is not None and not signing.verify(raw, secret, request.headers.get(signing.HEADER)):
            raise errors.Unauthorized(f"missing or wrong {signing.HEADER} signature")
        try:
            episodes.validate_id(rollout_id, "rollout id")
        except episodes.InvalidId as exc:
            raise errors.NotFound(str(exc), code="rollout_not_found") from exc
        try:
            return model.model_validate_json(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or None
            raise errors.Unprocessable(f"{where or 'body'}: {first['msg']}", param=where) from exc

    @router.post("/rollouts/{rollout_id}/reward", response_model=RewardAccepted)
    async def post_reward(rollout_id: str, request: Request) -> Response:
        body: RewardPost = await parse(request, RewardPost, rollout_id)
        with _store_errors():
            try:
                result = await lifecycle.close(rollout_id, body.reward, body.metadata)
            except ValueError as exc:  # metadata that is not JSON (e.g. integers over 64 bits)
                raise errors.Unprocessable(str(exc), param="metadata") from exc
        answer = RewardAccepted(rollout_id=rollout_id, status="closed", reward=result.reward, outcome=result.outcome)
        return Response(answer.model_dump_json(), media_type="application/json")

    @router.post("/rollouts/{rollout_id}/calls/{index}/reward")
    async def post_call_reward(rollout_id: str, index: int, request: Request) -> Response:
        body: CallRewardPost = await parse(request, CallRewardPost, rollout_id)
        if index < 0:
            raise errors.NotFound(f"no call {index}", code="call_not_found")
        with _store_errors():
            await lifecycle.set_call_reward(rollout_id, index, body.reward)
        return Response(orjson.dumps({"rollout_id": rollout_id, "index": index, "reward": body.reward}),
                        media_type="application/json")

    @router.post("/rollouts/{rollout_id}/finish", status_code=202)
    async def post_finish(rollout_id: str, request: Request) -> Response:
        body: FinishPost = await parse(request, FinishPost, rollout_id)
        try:
            get_allowed_reward_fn(body.reward_fn, settings.reward_fn_modules)
        except UnknownRewardFn as exc:
            raise errors.Unprocessable(str(exc), param="reward_fn") from exc
        if queue is None:
            raise errors.StoreUnavailable("no reward queue is configured", code="no_reward_queue")
        with _store_errors():
            await lifecycle.set_finish(rollout_id, FinishRequest(**body.model_dump()))
        try:
            job_id = await run_in_threadpool(queue.enqueue, rollout_id)
        except RedisError as exc:
            raise errors.StoreUnavailable(f"the reward job could not be queued: {exc}") from exc
        return Response(orjson.dumps({"rollout_id": rollout_id, "job_id": job_id}), status_code=202,
                        media_type="application/json")

    return router


@contextmanager
def _store_errors() -> Iterator[None]:
    """Store outcomes as webhook errors, in one place."""
    try:
        yield
    except episodes.RolloutNotFound as exc:
        raise errors.NotFound(str(exc), code="rollout_not_found") from exc
    except episodes.CallNotFound as exc:
        raise errors.NotFound(str(exc), code="call_not_found") from exc
    except episodes.RolloutExpired as exc:
        raise errors.Gone(str(exc)) from exc
    except episodes.RewardConflict as exc:
        raise errors.Conflict(str(exc), code="reward_conflict") from exc
    except episodes.RolloutNotOpen as exc:
        raise errors.Conflict(str(exc), code="rollout_not_open") from exc
    except episodes.StoreUnavailable as exc:
        raise errors.StoreUnavailable(str(exc)) from exc
