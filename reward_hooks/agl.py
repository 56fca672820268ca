"""Agent Lightning's store routes, so its agents and its controller use rlgate unchanged.

    POST /api/rollouts/{rollout_id}/attempt/{attempt_id}/events   {"event_type": "reward", "data": {"value": R}}
    GET  /api/rollouts?state_in=queuing&state_in=running&limit=N  its controller's poll: a JSON array
    POST /api/rollouts                                            a list of RolloutCreate: queued rollouts
    PATCH /api/rollouts/{rollout_id}                              {"status": {"state": ..., ...}}

The three rollout-queue routes (`rlgate.episodes.agl_queue`) are its controller's: they take the operator token or
the controller's key (`agl_controller_key`, which the controller also hands every agent it starts as
AGL_KEY, so it is an agent credential too); an agent's own credential is 403 there.

An Agent Lightning 1.x agent reads `AGL_EVENT_URL` and `AGL_KEY` and posts its reward there itself (its
`raise_for_status()` ends the agent on any error). The gateway serves this route on the agent surface
(`Gateway.add_agent_routes`): the request carries an agent credential valid for that rollout (Bearer or
`x-api-key`), or the operator token.

- A `reward` event closes the attempt's episode with `data.value` (exactly once, within `max_abs_reward`),
  or, with `data.call_index`, gives that call an intermediate reward. An agent that grades itself can post
  any reward it likes, so rewards from agent credentials are taken only with `agent_rewards` on (403
  otherwise); the operator token is always taken.
- Any other event is kept with the episode while it is open (at most `episodes.EVENTS_MAX`, each at most
  `episodes.EVENT_MAX_BYTES` of JSON) and shown by `GET /rollouts/{id}`.

The answer is Agent Lightning's: 200 with the event (`event_type`, `rollout_id`, `attempt_id`, `timestamp`,
`data`). Attempt 0 is the rollout itself; attempt N the episode `{rollout_id}~{N}` (as the gateway records
its calls: `rlgate.episodes.attempt_episode`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from reward_hooks import errors
from reward_hooks.limits import RewardOutOfRange, check_reward
from reward_hooks.routes import _store_errors, webhooks
from rlgate import episodes
from rlgate.episodes import RolloutEvent
from rlgate.episodes.agl_queue import ACTIVE, AglConflict, AglCreate, AglPatch

__all__ = ["router"]


class EventPost(BaseModel):
    """Agent Lightning's `EventCreate`."""

    model_config = ConfigDict(extra="forbid")

    event_type: str = Field(min_length=1, max_length=128)
    data: dict[str, Any] = Field(default_factory=dict)


class EventAccepted(BaseModel):
    """Agent Lightning's answer: the event as kept."""

    event_type: str
    rollout_id: str
    attempt_id: str
    timestamp: float
    data: dict[str, Any]


CREATE_MAX = 1000  # rollouts one POST /api/rollouts may queue


def _controller(request: Request) -> None:
    """The rollout queue is the controller's (or the operator's): an agent's own credential is 403."""
    if getattr(request.state, "open", False):  # the open development mode: nothing is checked anywhere
        return
    if getattr(request.state, "credential", "operator") not in ("operator", "controller"):
        raise errors.Forbidden(
            "Agent Lightning's rollout queue takes the operator token or the controller's key "
            "(RLGATE_AGL_CONTROLLER_KEY)",
            code="wrong_credential",
        )


def _validation(exc: ValidationError) -> errors.Unprocessable:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or None
    return errors.Unprocessable(f"{where or 'body'}: {first['msg']}", param=where)


router = APIRouter()


@router.get("/api/rollouts")
async def list_queue(
    request: Request,
    state_in: list[str] = Query(..., description="The states wanted: queuing, running."),
    limit: int = Query(100, ge=1, le=1000),
) -> Response:
    """Agent Lightning's rollouts in the given states, oldest first (a bare JSON array, as its server
    answers its controller). Only queuing and running rollouts are in the queue."""
    _controller(request)
    hooks = webhooks(request)
    unknown = set(state_in) - {"queuing", "running", "succeeded", "failed"}
    if unknown:
        raise errors.Unprocessable(f"state_in: unknown states {sorted(unknown)}", param="state_in")
    with _store_errors():
        found = await hooks.agl_queue.active(set(state_in) & set(ACTIVE), limit)
    return Response(orjson.dumps(found), media_type="application/json")


@router.post("/api/rollouts", status_code=201)
async def create_queued(request: Request) -> Response:
    """Queue rollouts for Agent Lightning's controller: a list of its `RolloutCreate`; an id already
    queued answers that rollout (idempotent, as its server is)."""
    _controller(request)
    hooks = webhooks(request)
    try:
        raw = orjson.loads(await request.body() or b"null")
    except orjson.JSONDecodeError as exc:
        raise errors.BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(raw, list) or not 1 <= len(raw) <= CREATE_MAX:
        raise errors.Unprocessable(f"body: a list of 1 to {CREATE_MAX} rollouts", param="body")
    try:
        creates = [AglCreate.model_validate(item) for item in raw]
    except ValidationError as exc:
        raise _validation(exc) from exc
    out = []
    for create in creates:
        rollout_id = create.rollout_id or f"ro-{uuid.uuid4().hex}"
        with _store_errors():
            try:
                out.append(await hooks.agl_queue.create(create, rollout_id))
            except episodes.InvalidId as exc:
                raise errors.Unprocessable(str(exc), param="rollout_id") from exc
            except episodes.RolloutExists as exc:
                raise errors.Conflict(str(exc), code="rollout_exists") from exc
    return Response(orjson.dumps(out), status_code=201, media_type="application/json")


@router.patch("/api/rollouts/{rollout_id}")
async def patch_queued(rollout_id: str, request: Request) -> Response:
    """Its controller's report: running when it started the agent, succeeded or failed when the agent
    exited. A failed one fails the rlgate rollout too (never trained), unless its reward closed it."""
    _controller(request)
    hooks = webhooks(request)
    try:
        episodes.validate_id(rollout_id, "rollout id")
    except episodes.InvalidId as exc:
        raise errors.NotFound(str(exc), code="rollout_not_found") from exc
    try:
        patch = AglPatch.model_validate_json(await request.body() or b"{}")
    except ValidationError as exc:
        raise _validation(exc) from exc
    if patch.status is None:
        with _store_errors():
            found = await hooks.agl_queue.get(rollout_id)
        if found is None:
            raise errors.NotFound(f"no Agent Lightning rollout {rollout_id!r}", code="rollout_not_found")
        return Response(orjson.dumps(found), media_type="application/json")
    with _store_errors():
        try:
            found = await hooks.agl_queue.patch(rollout_id, patch.status)
        except episodes.InvalidId as exc:
            raise errors.NotFound(str(exc), code="rollout_not_found") from exc
        except AglConflict as exc:
            raise errors.Conflict(str(exc), code="invalid_transition") from exc
        if found["status"]["state"] == "failed":
            await hooks.lifecycle.fail(rollout_id, patch.status.error_message or "the agent failed")
    return Response(orjson.dumps(found), media_type="application/json")


# the event route reads its body itself (an empty one is an empty event); its document says what it takes
EVENT_EXTRA = {
    "requestBody": {
        "required": False,
        "content": {"application/json": {"schema": EventPost.model_json_schema()}},
    },
    "parameters": [
        {
            "name": "x-api-key",
            "in": "header",
            "required": False,
            "schema": {"type": "string"},
            "description": "An agent credential (instead of Authorization: Bearer).",
        }
    ],
}


@router.post(
    "/api/rollouts/{rollout_id}/attempt/{attempt_id}/events",
    openapi_extra=EVENT_EXTRA,
    response_model=EventAccepted,
)
async def post_event(rollout_id: str, attempt_id: str, request: Request) -> Response:
    hooks = webhooks(request)
    raw = await request.body()
    try:
        episode = episodes.attempt_episode(rollout_id, attempt_id)
    except episodes.InvalidId as exc:
        raise errors.NotFound(str(exc), code="rollout_not_found") from exc
    try:
        body = EventPost.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or None
        raise errors.Unprocessable(f"{where or 'body'}: {first['msg']}", param=where) from exc
    try:
        orjson.dumps(body.data)
    except orjson.JSONEncodeError as exc:  # lone surrogates, integers past 64 bits, too deep
        raise errors.Unprocessable(f"data cannot be stored as JSON: {exc}", param="data") from exc
    now = time.time()
    credential = getattr(request.state, "credential", "operator")  # the control port: operator only
    if body.event_type == "reward":
        if credential != "operator" and not hooks.settings.agent_rewards:
            raise errors.Forbidden(
                "this gateway takes rewards from the operator only: an agent that grades "
                "itself can post any reward (turn on RLGATE_AGENT_REWARDS to accept "
                "Agent Lightning's self-reported rewards)",
                code="agent_rewards_off",
            )
        value = body.data.get("value")
        try:
            reward = check_reward(value, hooks.settings.max_abs_reward, "data.value")
        except RewardOutOfRange as exc:
            raise errors.Unprocessable(str(exc), param="data.value", code="reward_out_of_range") from exc
        index = body.data.get("call_index")
        with _store_errors():
            if index is None:
                details = {k: v for k, v in body.data.items() if k != "value"}
                source = (
                    "operator_event" if credential == "operator" else "agent_event"
                )  # never the agent's say
                try:
                    await hooks.lifecycle.close(episode, reward, {**details, "source": source})
                except ValueError as exc:  # details that cannot be stored as JSON
                    raise errors.Unprocessable(str(exc), param="data") from exc
            elif isinstance(index, int) and not isinstance(index, bool) and index >= 0:
                await hooks.lifecycle.set_call_reward(episode, index, reward)
            else:
                raise errors.Unprocessable(
                    "data.call_index must be a call's index (an integer >= 0)", param="data.call_index"
                )
    else:
        event = RolloutEvent(event_type=body.event_type, attempt_id=attempt_id, timestamp=now, data=body.data)
        try:
            size = len(event.model_dump_json())
        except ValueError as exc:
            raise errors.Unprocessable(f"data cannot be stored as JSON: {exc}", param="data") from exc
        if size > episodes.EVENT_MAX_BYTES:
            raise errors.Unprocessable(
                f"the event is {size} bytes of JSON; at most {episodes.EVENT_MAX_BYTES}", param="data"
            )
        with _store_errors():
            try:
                await hooks.store.append_event(episode, event)
            except episodes.RolloutFull as exc:
                raise errors.Conflict(str(exc), code="rollout_full") from exc
    answer = {
        "event_type": body.event_type,
        "rollout_id": rollout_id,
        "attempt_id": attempt_id,
        "timestamp": now,
        "data": body.data,
    }
    return Response(orjson.dumps(answer), media_type="application/json")
