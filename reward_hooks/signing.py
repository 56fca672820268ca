"""Webhook signatures, GitHub's convention: `X-Signature-256: sha256=<hex HMAC-SHA256 of the raw body>`."""

from __future__ import annotations

import hashlib
import hmac

HEADER = "X-Signature-256"


def sign(body: bytes, secret: str) -> str:
    """The header value for `body`."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def verify(body: bytes, secret: str, header: str | None) -> bool:
    """True when `header` is the signature of `body` (compared in constant time)."""
    if not header:
        return False
    return hmac.compare_digest(sign(body, secret).encode(), header.strip().encode())
