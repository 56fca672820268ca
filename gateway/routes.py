"""The gateway's management API (FastAPI): create and inspect rollouts, health, metrics.

All of it is the operator surface: `gateway.app` lets a request in only with the operator token (or on the
control port, for health and metrics). The recorded completion endpoints do not go through here; they are
served by `gateway.proxy` directly.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway import errors, openapi
from rlgate import episodes
from rlgate.episodes import RolloutView
from rlgate.episodes.api_error import ApiError, error_body, from_store
from rlgate.episodes.records import RolloutListing

if TYPE_CHECKING:
    from gateway.app import Gateway


class CreateRollout(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task_id: str | None = Field(None, description="The task this rollout is a run of (the GRPO group key).")
    rollout_id: str | None = Field(None, description="Choose the id yourself; default: a new random one.")
    mode: episodes.Mode = Field(
        "train",
        description="val: a validation run, recorded and scored, never trained "
        "on (the learner reports its success apart).",
    )
    metadata: dict[str, Any] = Field(
        default_factory=dict,
        description="Up to 64 KiB of JSON, stored with the "
        "rollout (nested at most 254 levels; no lone UTF-16 surrogates).",
    )

    @field_validator("metadata")
    @classmethod
    def _storable(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            size = len(orjson.dumps(value))
        except orjson.JSONEncodeError as exc:  # lone surrogates, integers beyond 64 bits, too deep
            raise ValueError(f"metadata cannot be stored as JSON: {exc}") from exc
        if size > METADATA_MAX_BYTES:
            raise ValueError(f"metadata is {size} bytes of JSON; at most {METADATA_MAX_BYTES}")
        return value


METADATA_MAX_BYTES = 64 * 1024


class RolloutCreated(BaseModel):
    rollout_id: str
    task_id: str | None
    status: str
    created_at: float
    metadata: dict[str, Any]
    base_url: str = Field(description="OPENAI_BASE_URL for the agent of this rollout.")
    api_key: str | None = Field(
        description="OPENAI_API_KEY for the agent of this rollout: valid on this "
        "rollout's completion endpoints alone. Null without a rollout key secret."
    )
    agent_env: dict[str, str] = Field(
        description="The environment to start this rollout's agent with: "
        "OPENAI_BASE_URL and OPENAI_API_KEY; ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY (the Messages API: "
        "Claude Code, the anthropic SDK); Agent Lightning's AGL_OPENAI_BASE_URL, AGL_EVENT_URL and AGL_KEY "
        "(attempt 0)."
    )


PAGE_DEFAULT, PAGE_MAX = 100, 1000


class RolloutPage(RolloutView):
    """`GET /rollouts/{id}?offset=&limit=`: the rollout with one page of its calls."""

    next_offset: int | None = Field(description="The offset of the next page; null on the last one.")


def _json(status: int, body: bytes, headers: dict[str, str] | None = None) -> Response:
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def _agent_base(request: Request, gateway: Gateway) -> str:
    """The agents' base URL when none is configured: the request's own, on the agent port when the request
    came to the control port (same host name: set public_url where agents reach it by another)."""
    base = request.base_url
    if gateway.control is not None and base.port == gateway.settings.control_port:
        base = base.replace(port=gateway.settings.port)
    return str(base)


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway  # set by build_api
    return gateway


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return _json(exc.status, exc.body(), exc.headers)


async def _store_error(request: Request, exc: Exception) -> Response:
    return _json(503, error_body(str(exc), errors.StoreUnavailable.type, code="store_unavailable"))


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    loc = ".".join(str(part) for part in first.get("loc", ()) if part != "body") or None
    message = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in exc.errors())
    return _json(422, error_body(message, "invalid_request_error", loc, "validation_error"))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return _json(exc.status_code, error_body(message, type_, None, exc.status_code))


# every error of the management API in the OpenAI error shape
EXCEPTION_HANDLERS = {
    ApiError: _api_error,
    episodes.StoreUnavailable: _store_error,
    RequestValidationError: _validation_error,
    StarletteHTTPException: _http_error,
}

router = APIRouter()


def build_api(gateway: Gateway) -> FastAPI:
    """The operator surface's app: `router`'s routes, which find the gateway at `app.state.gateway`."""
    api = FastAPI(title="rlgate gateway", docs_url=None, redoc_url=None)
    api.state.gateway = gateway
    openapi.install(api)  # the proxy routes, error shapes and links too (gateway.openapi)
    for exc_class, handler in EXCEPTION_HANDLERS.items():
        api.add_exception_handler(exc_class, handler)
    api.include_router(router)
    return api


@router.post("/rollouts", status_code=201, response_model=RolloutCreated)
async def create_rollout(body: CreateRollout, request: Request) -> Response:
    gateway = _gateway(request)
    store = gateway.store
    rollout_id = body.rollout_id or uuid.uuid4().hex
    watch = gateway.proxy.watch
    watch.refuse_lost(rollout_id)
    if watch.holding:  # as a new rollout's first call would be held (`max_backlog`, Redis memory)
        raise watch.backlog_full()
    try:
        rollout = await store.create_rollout(rollout_id, body.task_id, body.metadata, body.mode)
    except (episodes.InvalidId, episodes.RolloutExists) as exc:
        raise from_store(exc) from exc
    base = (gateway.settings.public_url or _agent_base(request, gateway)).rstrip("/")
    if rollout.task_id is not None:
        base_url = f"{base}/tasks/{rollout.task_id}/rollouts/{rollout.rollout_id}/v1"
    else:
        base_url = f"{base}/rollouts/{rollout.rollout_id}/v1"
    api_key = gateway.credentials.rollout_key(rollout.rollout_id)
    key = api_key or "none"  # SDKs want some key; an open gateway takes any
    agl = f"{base}/proxy/rollout/{rollout.rollout_id}/attempt/0/mode/{rollout.mode}/openai/v1"
    agent_env = {
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": key,
        # Anthropic's SDKs add /v1/messages to their base URL themselves
        "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"),
        "ANTHROPIC_API_KEY": key,
        "AGL_OPENAI_BASE_URL": agl,
        "AGL_EVENT_URL": f"{base}/api/rollouts/{rollout.rollout_id}/attempt/0/events",
        "AGL_KEY": key,
    }
    created = RolloutCreated(
        **rollout.model_dump(exclude={"schema_version"}),
        base_url=base_url,
        api_key=api_key,
        agent_env=agent_env,
    )
    return _json(201, created.model_dump_json().encode())


@router.get("/rollouts", response_model=RolloutListing)
async def list_rollouts(
    request: Request,
    task_id: str | None = Query(None, description="Only the rollouts of this task."),
    status: episodes.RolloutStatus | None = Query(None, description="Only rollouts in this state."),
    since: float | None = Query(None, description="Only rollouts created at or after (unix seconds)."),
    until: float | None = Query(None, description="Only rollouts created at or before (unix seconds)."),
    limit: int = Query(PAGE_DEFAULT, ge=1, le=PAGE_MAX, description="Index entries read for this page."),
    cursor: str | None = Query(None, max_length=64, description="The previous page's next_cursor."),
) -> Response:
    """Rollouts newest first, a page at a time (`EpisodeStore.list_rollouts`): a filtered page may hold
    fewer than `limit` rollouts, even none; go on with `cursor=next_cursor` until it is null."""
    try:
        listing = await _gateway(request).store.list_rollouts(
            task_id=task_id, status=status, since=since, until=until, limit=limit, cursor=cursor
        )
    except ValueError as exc:
        raise errors.BadRequest(str(exc), param="cursor", code="invalid_cursor") from exc
    body = await asyncio.to_thread(listing.model_dump_json) if limit > 100 else listing.model_dump_json()
    return _json(200, body.encode())


@router.get("/rollouts/{rollout_id}", response_model=RolloutPage)
async def get_rollout(
    request: Request,
    rollout_id: str,
    offset: int = Query(0, ge=0, le=2**62, description="First call index."),
    limit: int = Query(PAGE_DEFAULT, ge=1, le=PAGE_MAX, description="Calls per page."),
) -> Response:
    try:
        episodes.validate_episode_id(rollout_id)
    except episodes.InvalidId as exc:
        raise from_store(exc) from exc
    view = await _gateway(request).store.get_rollout_view(
        rollout_id, offset, limit + 1
    )  # one more: is there a next page?
    if view is None:
        raise errors.NotFound(f"no rollout {rollout_id!r}", code="rollout_not_found")
    more = len(view.calls) > limit
    page = RolloutPage.model_construct(
        **{**dict(view), "calls": view.calls[:limit]}, next_offset=offset + limit if more else None
    )
    # the finish request's ground truth and options are for the reward job alone; a page of large
    # calls is serialized off the event loop
    body = await asyncio.to_thread(page.model_dump_json, exclude={"finish": {"ground_truth", "params"}})
    return _json(200, body.encode())


@router.get("/healthz")
async def healthz(request: Request) -> Response:
    gateway = _gateway(request)
    checks: dict[str, str] = {}
    try:
        await gateway.store.check_writable()  # a Redis that answers but refuses writes cannot record calls
        checks["redis"] = "ok"
    except episodes.StoreUnavailable as exc:
        checks["redis"] = f"error: {exc}"
    servers = gateway.servers
    extra: dict[str, Any] = {}
    if servers.several:  # their health loop's view (gateway.servers): up while one is
        extra["servers"] = servers.report()
        up = any(s.healthy for s in servers.servers)
        checks["upstream"] = "ok" if up else "error: no inference server passes its health check"
    else:
        try:
            async with servers.first.upstream.request("GET", "/models", timeout_s=5.0) as response:
                checks["upstream"] = "ok" if response.status == 200 else f"error: HTTP {response.status}"
        except errors.ApiError as exc:
            checks["upstream"] = f"error: {exc.message}"
    ok = all(value == "ok" for value in checks.values())
    # degraded: the gateway works, but something an operator must look at happened (gateway.watch)
    watch = gateway.proxy.watch
    state = ("degraded" if watch.problems else "ok") if ok else "unhealthy"
    return _json(
        200 if ok else 503,
        orjson.dumps(
            {
                "status": state,
                **checks,
                "policy_version": gateway.proxy.policy_version,
                "backlog": watch.backlog,
                "holding_new_rollouts": watch.holding,
                "redis_memory": {"used": watch.memory[0], "max": watch.memory[1]},
                "problems": dict(watch.problems),
                **extra,
            }
        ),
    )


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(_gateway(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)
