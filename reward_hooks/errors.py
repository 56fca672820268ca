"""Errors of the reward hooks, in the OpenAI error shape (`episodes.api_error`)."""

from __future__ import annotations

from episodes.api_error import ApiError


class WebhookError(ApiError):
    pass


class BadRequest(WebhookError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(WebhookError):
    status = 401
    type = "authentication_error"
    code = "invalid_signature"


class Forbidden(WebhookError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class NotFound(WebhookError):
    status = 404
    type = "not_found_error"


class Conflict(WebhookError):
    status = 409
    type = "conflict_error"


class Gone(WebhookError):
    status = 410
    type = "gone_error"
    code = "rollout_expired"


class PayloadTooLarge(WebhookError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class Unprocessable(WebhookError):
    status = 422
    type = "invalid_request_error"
    code = "validation_error"


class StoreUnavailable(WebhookError):
    status = 503
    type = "service_unavailable_error"
    code = "store_unavailable"
