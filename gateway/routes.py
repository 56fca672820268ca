"""The gateway's management API (FastAPI): create and inspect rollouts, health, metrics.

The recorded completion endpoints do not go through here; they are served by `gateway.proxy` directly.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

import episodes
from episodes import RolloutView
from episodes.api_error import ApiError, error_body
from gateway import errors

if TYPE_CHECKING:
    from gateway.app import Gateway


class CreateRollout(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task_id: str | None = Field(None, description="The task this rollout is a run of (the GRPO group key).")
    rollout_id: str | None = Field(None, description="Choose the id yourself; default: a new random one.")
    metadata: dict[str, Any] = Field(default_factory=dict)


class RolloutCreated(BaseModel):
    rollout_id: str
    task_id: str | None
    status: str
    created_at: float
    metadata: dict[str, Any]
    base_url: str = Field(description="OPENAI_BASE_URL for the agent of this rollout.")


def _json(status: int, body: bytes, headers: dict[str, str] | None = None) -> Response:
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def build_api(gateway: Gateway) -> FastAPI:
    api = FastAPI(title="rlgate gateway", docs_url=None, redoc_url=None)
    store = gateway.store

    @api.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return _json(exc.status, exc.body(), exc.headers)

    @api.exception_handler(episodes.StoreUnavailable)
    async def _store_error(request: Request, exc: episodes.StoreUnavailable) -> Response:
        return _json(503, error_body(str(exc), errors.StoreUnavailable.type, code="store_unavailable"))

    @api.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(part) for part in first.get("loc", ()) if part != "body") or None
        message = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in exc.errors())
        return _json(422, error_body(message, "invalid_request_error", loc, "validation_error"))

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return _json(exc.status_code, error_body(message, type_, None, exc.status_code))

    @api.post("/rollouts", status_code=201, response_model=RolloutCreated)
    async def create_rollout(body: CreateRollout, request: Request) -> Response:
        rollout_id = body.rollout_id or uuid.uuid4().hex
        try:
            rollout = await store.create_rollout(rollout_id, body.task_id, body.metadata)
        except episodes.InvalidId as exc:
            raise errors.BadRequest(str(exc), code="invalid_id") from exc
        except episodes.RolloutExists as exc:
            raise errors.Conflict(str(exc), code="rollout_exists") from exc
        base = gateway.settings.public_url or str(request.base_url)
        base = base.rstrip("/")
        if rollout.task_id is not None:
            base_url = f"{base}/tasks/{rollout.task_id}/rollouts/{rollout.rollout_id}/v1"
        else:
            base_url = f"{base}/rollouts/{rollout.rollout_id}/v1"
        created = RolloutCreated(**rollout.model_dump(exclude={"schema_version"}), base_url=base_url)
        return _json(201, created.model_dump_json().encode())

    @api.get("/rollouts/{rollout_id}", response_model=RolloutView)
    async def get_rollout(rollout_id: str) -> Response:
        try:
            episodes.validate_id(rollout_id, "rollout id")
        except episodes.InvalidId as exc:
            raise errors.BadRequest(str(exc), code="invalid_id") from exc
        view = await store.get_rollout_view(rollout_id)
        if view is None:
            raise errors.NotFound(f"no rollout {rollout_id!r}", code="rollout_not_found")
        # the finish request's ground truth and options are for the reward job, not for agents
        return _json(200, view.model_dump_json(exclude={"finish": {"ground_truth", "params"}}).encode())

    @api.get("/healthz")
    async def healthz() -> Response:
        checks: dict[str, str] = {}
        try:
            await store.ping()
            checks["redis"] = "ok"
        except episodes.StoreUnavailable as exc:
            checks["redis"] = f"error: {exc}"
        try:
            async with gateway.upstream.request("GET", "/models", timeout_s=5.0) as response:
                checks["upstream"] = "ok" if response.status == 200 else f"error: HTTP {response.status}"
        except errors.GatewayError as exc:
            checks["upstream"] = f"error: {exc.message}"
        ok = all(value == "ok" for value in checks.values())
        status = 200 if ok else 503
        return _json(status, orjson.dumps({"status": "ok" if ok else "unhealthy", **checks,
                                           "policy_version": gateway.proxy.policy_version}))

    @api.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return api
