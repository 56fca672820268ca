"""The gateway's errors: a shallow tree, each class with its HTTP status and OpenAI error `type`.

Handlers raise; `error_body` (shared, `rlgate.episodes.api_error`) renders the OpenAI error shape `{"error": {message, type, param, code}}`.
The errors every service answers alike (400, 401, 403, 404, 405, 409, 413, 503 store) are the shared tree's,
imported here; the rest are the gateway's own.
Client faults are 4xx; only trouble on our side or upstream is 5xx.
"""

from __future__ import annotations

from typing import Any

import orjson

from rlgate.episodes.api_error import (
    ApiError,
    BadRequest,
    Conflict,
    Forbidden,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    StoreUnavailable,
    Unauthorized,
)


class PolicyPushing(ApiError, status=429, type="rate_limit_error", code="policy_push_in_progress"):
    """A full-weight push is under way and the gateway is set to refuse calls meanwhile (or waited too long)."""


class BacklogFull(ApiError, status=429, type="rate_limit_error", code="backlog_full"):
    """Too many episodes wait for rewards or training: a new rollout is refused for now (`max_backlog`)."""


class UpstreamError(ApiError, status=502, type="upstream_error"):
    """The inference server could not be reached or did not answer in time."""


class BadUpstreamAnswer(ApiError, status=502, type="upstream_error", code="bad_upstream_answer"):
    """The inference server answered 200 with something that is not what its protocol promises."""


class NoUpstream(UpstreamError, status=503, code="no_upstream"):
    """No inference server can take the call now: every one is down (`gateway.servers`)."""


class UpstreamTimeout(UpstreamError, status=504, code="upstream_timeout"):
    pass


def upstream_error_payload(status: int, raw: bytes) -> dict[str, Any]:
    """The `error` object of an upstream error response, whatever shape the upstream used.

    vLLM and OpenAI send `{"error": {...}}`; older vLLM sent `{"object": "error", "message", "type", ...}`;
    anything else (an HTML page from a load balancer) is wrapped with its status.
    """
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError:
        payload = None
    if isinstance(payload, dict):
        inner = payload.get("error")
        if isinstance(inner, dict):
            return inner
        if "message" in payload:
            return {k: payload.get(k) for k in ("message", "type", "param", "code")}
    text = raw[:500].decode("utf-8", "replace")
    return {
        "message": f"upstream answered {status}: {text}",
        "type": "upstream_error",
        "param": None,
        "code": status,
    }


__all__ = [
    "ApiError",
    "BacklogFull",
    "BadRequest",
    "BadUpstreamAnswer",
    "Conflict",
    "Forbidden",
    "MethodNotAllowed",
    "NoUpstream",
    "NotFound",
    "PayloadTooLarge",
    "PolicyPushing",
    "StoreUnavailable",
    "Unauthorized",
    "UpstreamError",
    "UpstreamTimeout",
    "upstream_error_payload",
]
