"""Webhook signatures bound to the request they sign: Standard Webhooks' headers and HMAC, with the method
and the path added to the signed content (standard library only, so harnesses can copy it).

A signed request carries three headers:

    webhook-id: msg_2c1f...          unique per request: 1-128 characters from A-Z a-z 0-9 _ - (no '.')
    webhook-timestamp: 1767139200    when it was signed, integer unix seconds
    webhook-signature: v1,<base64>   HMAC-SHA256 with the webhook secret (its UTF-8 bytes) over

        {webhook-id}.{webhook-timestamp}.{METHOD}.{path}.{body}

METHOD is the request method in upper case (POST), path the request path exactly as sent
(`/rollouts/r-17/reward`; the webhook routes refuse query strings), body the raw request body (possibly
empty).
The signature header may hold several space-separated entries (Standard Webhooks' rotation); any `v1,`
entry that matches is enough. The receiver rejects a timestamp further than the tolerance (default 300 s)
from its clock, in either direction, so a captured request cannot be replayed later; the path binds it to
its rollout and route, so it cannot be replayed elsewhere either; and the routes accept each webhook-id
once (`reward_hooks.routes`), so it cannot be replayed within the window.

`.` separates the fields, so neither the id nor the timestamp may contain one. The path's own dots (rollout
ids may hold them) cannot move bytes between path and body: that would need two routes, one path a prefix
of the other followed by `.`, and every webhook route ends in a fixed segment (`reward`, `finish`, `fail`)
with no query string after it.

`X-Signature-256` (the old signature of the body alone) is refused with a message saying so.
"""

from __future__ import annotations

import base64
import hmac
import re
import secrets
import time
from collections.abc import Mapping

ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
SIGNATURE_HEADER = "webhook-signature"
LEGACY_HEADER = "X-Signature-256"
DEFAULT_TOLERANCE_S = 300

_ID = re.compile(r"[A-Za-z0-9_\-]{1,128}")
_TIMESTAMP = re.compile(r"[0-9]{1,12}")


class SignatureError(ValueError):
    """A request whose signature does not hold; `code` says why (the error code the webhook answers)."""

    def __init__(self, message: str, code: str = "invalid_signature") -> None:
        super().__init__(message)
        self.code = code


def signed_content(msg_id: str, timestamp: int | str, method: str, path: str, body: bytes) -> bytes:
    """The bytes the HMAC is computed over: `{id}.{timestamp}.{METHOD}.{path}.` followed by the body."""
    return f"{msg_id}.{timestamp}.{method.upper()}.{path}.".encode() + body


def signature(secret: str, msg_id: str, timestamp: int | str, method: str, path: str, body: bytes) -> str:
    """`v1,<base64 HMAC-SHA256>` of the signed content."""
    mac = hmac.digest(secret.encode(), signed_content(msg_id, timestamp, method, path, body), "sha256")
    return "v1," + base64.b64encode(mac).decode()


def sign(
    secret: str,
    method: str,
    path: str,
    body: bytes,
    *,
    msg_id: str | None = None,
    timestamp: int | None = None,
) -> dict[str, str]:
    """The three headers that sign a request to `path` (exactly as sent), now."""
    msg_id = msg_id or "msg_" + secrets.token_hex(16)
    timestamp = int(time.time()) if timestamp is None else timestamp
    return {
        ID_HEADER: msg_id,
        TIMESTAMP_HEADER: str(timestamp),
        SIGNATURE_HEADER: signature(secret, msg_id, timestamp, method, path, body),
    }


def verify(
    secret: str,
    method: str,
    path: str,
    body: bytes,
    headers: Mapping[str, str],
    *,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    now: float | None = None,
) -> str:
    """Check a request's signature headers (`headers` looked up by lower-case name); returns its
    webhook-id, or raises `SignatureError`. Signatures are compared in constant time, after the cheap
    checks of the id and the timestamp."""
    given = headers.get(SIGNATURE_HEADER)
    if not given:
        if headers.get(LEGACY_HEADER.lower()):
            raise SignatureError(
                f"{LEGACY_HEADER} (a signature of the body alone) is no longer accepted: sign the timestamp, "
                f"method, path and body, with the headers {ID_HEADER}, {TIMESTAMP_HEADER} and "
                f"{SIGNATURE_HEADER} (docs/security.md, 'Webhook signatures')",
                code="legacy_signature",
            )
        raise SignatureError(
            f"missing {SIGNATURE_HEADER} header: this route needs a signed request "
            "(docs/security.md, 'Webhook signatures')",
            code="missing_signature",
        )
    msg_id = headers.get(ID_HEADER) or ""
    if not _ID.fullmatch(msg_id):
        raise SignatureError(f"{ID_HEADER} must be 1-128 characters from A-Z a-z 0-9 _ -")
    stamp = headers.get(TIMESTAMP_HEADER) or ""
    if not _TIMESTAMP.fullmatch(stamp):
        raise SignatureError(f"{TIMESTAMP_HEADER} must be an integer of unix seconds")
    skew = (time.time() if now is None else now) - int(stamp)
    if abs(skew) > tolerance_s:
        how = "old" if skew > 0 else "ahead"
        raise SignatureError(
            f"{TIMESTAMP_HEADER} is {abs(skew):.0f} s {how}, more than the {tolerance_s:g} s "
            "allowed: sign each request when it is sent",
            code="signature_expired",
        )
    expected = signature(secret, msg_id, stamp, method, path, body).encode()
    for candidate in given.split():
        if hmac.compare_digest(candidate.encode(), expected):
            return msg_id
    raise SignatureError(
        f"{SIGNATURE_HEADER} does not match this request (method, path and body, signed with "
        "the webhook secret)"
    )
