"""Who may post to the webhook routes: the one check every route runs before it reads anything else.

`WebhookAuth` is a FastAPI dependency that reads the body (bounded) and, with a webhook secret set,
verifies the request's signature (`reward_hooks.signing`) against its method, raw path and body. It
returns the raw body the route then parses, and leaves the verified `webhook-id` in
`request.state.webhook_id`: the routes then accept each id once (`reward_hooks.routes`), so a signed
request cannot be sent again within the tolerance window. With `is_operator` (a check of the operator's
credential, given the request's Authorization header value), a request it accepts needs no signature, and
any other needs a valid one, secret or not. `Webhooks(..., check=...)` takes another callable of the same shape
(request -> raw body, raising an `ApiError`) to change who may post.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request

from reward_hooks import errors, signing
from reward_hooks.settings import RewardSettings

MAX_BODY_BYTES = 1 << 20


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The raw body, refused with 413 once it passes `limit` bytes (before anything is hashed or parsed)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise errors.PayloadTooLarge(f"reward requests are limited to {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def request_path(request: Request) -> str:
    """The path as the client sent it, which is what it signed: the server's `raw_path` (the decoded path
    where the server does not provide it)."""
    raw = request.scope.get("raw_path")
    return raw.decode("latin-1") if raw else request.url.path


class WebhookAuth:
    """Reads and authenticates a webhook request. Without a secret and without `is_operator`, every
    request passes (the open development mode)."""

    def __init__(
        self, settings: RewardSettings, is_operator: Callable[[str | None], bool] | None = None
    ) -> None:
        settings.check_webhook_secret()  # an empty or short secret: refused before anything is served
        self.secret = (
            settings.webhook_secret.get_secret_value() if settings.webhook_secret is not None else None
        )
        self.tolerance_s = settings.webhook_tolerance_s
        self.is_operator = is_operator

    async def __call__(self, request: Request) -> bytes:
        if request.scope.get("query_string"):  # unsigned, and nothing to say: refused rather than ignored
            raise errors.BadRequest("the webhook routes take no query string", code="query_not_allowed")
        body = await read_body(request)
        if self.is_operator is not None and self.is_operator(request.headers.get("authorization")):
            return body
        if self.secret is None and self.is_operator is not None:
            raise errors.Unauthorized(
                "this route needs the operator token or a webhook signature, and no "
                "webhook secret is configured",
                code="missing_operator_token",
            )
        if self.secret is not None:
            try:
                request.state.webhook_id = signing.verify(
                    self.secret,
                    request.method,
                    request_path(request),
                    body,
                    request.headers,
                    tolerance_s=self.tolerance_s,
                )
            except signing.SignatureError as exc:
                raise errors.Unauthorized(str(exc), code=exc.code) from exc
        return body
