"""The dashboard's session cookie: a browser cannot send `Authorization: Bearer` on a link, so the operator
token is typed once (a login form, or `?token=` on any dashboard URL) and exchanged for a cookie.

The cookie is not the token: `<expires>.<hex HMAC-SHA256(operator token, "rlgate ui session v1\\0" +
expires)>`, checked in constant time, valid until `expires` (unix seconds, `LIFETIME_S` after login), on
every gateway that holds the same token, and on none once the token changes. It is sent for `/ui` only,
`HttpOnly` (no script reads it), `SameSite=Strict` (no other site's page makes the browser send it), and
`Secure` when the browser came over HTTPS (directly or through a TLS proxy that says so: `routes._secure`).
"""

from __future__ import annotations

import hmac
import time

COOKIE = "rlgate_ui"
LIFETIME_S = 12 * 3600
_CONTEXT = b"rlgate ui session v1\x00"


def _mac(token: bytes, expires: int) -> str:
    return hmac.digest(token, _CONTEXT + str(expires).encode(), "sha256").hex()


def issue(token: bytes, now: float | None = None) -> str:
    expires = int((time.time() if now is None else now) + LIFETIME_S)
    return f"{expires}.{_mac(token, expires)}"


def valid(token: bytes, cookie: str | None, now: float | None = None) -> bool:
    if not cookie:
        return False
    expires, dot, mac = cookie.partition(".")
    if not dot or not (expires.isascii() and expires.isdigit()) or len(expires) > 12:
        return False
    if int(expires) <= (time.time() if now is None else now):
        return False
    return hmac.compare_digest(mac.encode(), _mac(token, int(expires)).encode())


def set_cookie(value: str, secure: bool) -> str:
    """The `Set-Cookie` header value that stores a session."""
    return f"{COOKIE}={value}; Path=/ui; Max-Age={LIFETIME_S}; HttpOnly; SameSite=Strict" + (
        "; Secure" if secure else ""
    )


def clear_cookie(secure: bool) -> str:
    return f"{COOKIE}=; Path=/ui; Max-Age=0; HttpOnly; SameSite=Strict" + ("; Secure" if secure else "")


def token_matches(token: bytes, candidate: str) -> bool:
    """Whether a typed token is the operator token (constant time)."""
    return hmac.compare_digest(candidate.strip().encode(), token)
