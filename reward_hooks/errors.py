"""Errors of the reward hooks: the shared tree (`rlgate.episodes.api_error`), with the webhook's own code for a
bad credential."""

from __future__ import annotations

from rlgate.episodes import api_error
from rlgate.episodes.api_error import (
    ApiError,
    BadRequest,
    Conflict,
    Forbidden,
    Gone,
    NotFound,
    PayloadTooLarge,
    StoreUnavailable,
    Unprocessable,
)


class Unauthorized(api_error.Unauthorized):
    code = "invalid_signature"


__all__ = [
    "ApiError",
    "BadRequest",
    "Conflict",
    "Forbidden",
    "Gone",
    "NotFound",
    "PayloadTooLarge",
    "StoreUnavailable",
    "Unauthorized",
    "Unprocessable",
]
