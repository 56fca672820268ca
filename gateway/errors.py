"""The gateway's errors: a shallow tree, each class with its HTTP status and OpenAI error `type`.

Handlers raise; `error_body` (shared, `episodes.api_error`) renders the OpenAI error shape `{"error": {message, type, param, code}}`.
Client faults are 4xx; only trouble on our side or upstream is 5xx.
"""

from __future__ import annotations

from typing import Any

import orjson

from episodes.api_error import ApiError


class GatewayError(ApiError):
    """Base of the gateway's errors (the shape and rendering are shared: `episodes.api_error`)."""


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(GatewayError):
    """A valid credential used where it does not open the door (another rollout, the other surface)."""

    status = 403
    type = "permission_error"
    code = "forbidden"


class NotFound(GatewayError):
    status = 404
    type = "not_found_error"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class Conflict(GatewayError):
    status = 409
    type = "conflict_error"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class PolicyPushing(GatewayError):
    """A full-weight push is under way and the gateway is set to refuse calls meanwhile (or waited too long)."""

    status = 429
    type = "rate_limit_error"
    code = "policy_push_in_progress"


class BacklogFull(GatewayError):
    """Too many episodes wait for rewards or training: a new rollout is refused for now (`max_backlog`)."""

    status = 429
    type = "rate_limit_error"
    code = "backlog_full"


class UpstreamError(GatewayError):
    """The inference server could not be reached or did not answer in time."""

    status = 502
    type = "upstream_error"


class BadUpstreamAnswer(GatewayError):
    """The inference server answered 200 with something that is not what its protocol promises."""

    status = 502
    type = "upstream_error"
    code = "bad_upstream_answer"


class NoUpstream(UpstreamError):
    """No inference server can take the call now: every one is down (`gateway.servers`)."""

    status = 503
    code = "no_upstream"


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"


class StoreUnavailable(GatewayError):
    """Redis cannot record the call, so the call is not released to the agent."""

    status = 503
    type = "service_unavailable_error"
    code = "store_unavailable"


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
