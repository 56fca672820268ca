"""The OpenAI error shape every rlgate service answers errors in: `{"error": {message, type, param, code}}`,
and the one class tree of those errors.

Each class carries its HTTP status, OpenAI error `type` and default `code`; a service raises them and maps
`ApiError` to a response in one handler (client faults are 4xx, never 5xx). The errors every service
answers alike live here; `gateway.errors` and `reward_hooks.errors` add only what is theirs (the gateway's
upstream errors, the webhook's signature code).
"""

from __future__ import annotations

from typing import Any

import orjson

from rlgate.episodes import errors as store


class ApiError(Exception):
    """An error answered as `{"error": ...}`; a subclass names its status, type and default code in its
    declaration: `class NotFound(ApiError, status=404, type="not_found_error")`."""

    status: int = 500
    type: str = "internal_error"
    code: str | None = None

    def __init_subclass__(
        cls, status: int | None = None, type: str | None = None, code: str | None = None, **kwargs: Any
    ) -> None:
        super().__init_subclass__(**kwargs)
        if status is not None:
            cls.status = status
        if type is not None:
            cls.type = type
        if code is not None:
            cls.code = code

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: Any = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


class BadRequest(ApiError, status=400, type="invalid_request_error"):
    pass


class Unauthorized(ApiError, status=401, type="authentication_error", code="invalid_api_key"):
    pass


class Forbidden(ApiError, status=403, type="permission_error", code="forbidden"):
    """A valid credential used where it does not open the door (another rollout, the other surface)."""


class NotFound(ApiError, status=404, type="not_found_error"):
    pass


class MethodNotAllowed(ApiError, status=405, type="invalid_request_error", code="method_not_allowed"):
    pass


class Conflict(ApiError, status=409, type="conflict_error"):
    pass


class Gone(ApiError, status=410, type="gone_error", code="rollout_expired"):
    pass


class PayloadTooLarge(ApiError, status=413, type="invalid_request_error", code="payload_too_large"):
    pass


class Unprocessable(ApiError, status=422, type="invalid_request_error", code="validation_error"):
    pass


class StoreUnavailable(ApiError, status=503, type="service_unavailable_error", code="store_unavailable"):
    """Redis cannot take the write (or answer the read) the request needs; nothing was changed."""


# The store's outcomes as API errors, for every route alike: class and code (also the calls metric's
# outcome label for a refused call).
STORE_ERRORS: dict[type[store.StoreError], tuple[type[ApiError], str]] = {
    store.InvalidId: (BadRequest, "invalid_id"),
    store.RolloutExists: (Conflict, "rollout_exists"),
    store.RolloutNotFound: (NotFound, "rollout_not_found"),
    store.CallNotFound: (NotFound, "call_not_found"),
    store.RolloutNotOpen: (Conflict, "rollout_not_open"),
    store.RolloutMissing: (Conflict, "rollout_data_lost"),
    store.RolloutFull: (Conflict, "rollout_full"),
    store.TooManyAttempts: (Conflict, "too_many_attempts"),
    store.ModeMismatch: (Conflict, "mode_mismatch"),
    store.TaskMismatch: (Conflict, "task_mismatch"),
    store.RecordTooLarge: (PayloadTooLarge, "record_too_large"),
    store.RolloutExpired: (Gone, "rollout_expired"),
    store.RewardConflict: (Conflict, "reward_conflict"),
    store.StoreUnavailable: (StoreUnavailable, "store_unavailable"),
    store.StoreError: (ApiError, "store_error"),  # one without an entry: a 500, never a client's fault
}


def from_store(exc: store.StoreError, message: str | None = None, **kwargs: Any) -> ApiError:
    """The API error for a store outcome (`STORE_ERRORS`), its message the store's unless given."""
    error, code = next(STORE_ERRORS[cls] for cls in type(exc).__mro__ if cls in STORE_ERRORS)
    return error(message or str(exc), code=code, **kwargs)
