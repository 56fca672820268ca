"""The gateway's two kinds of credential, never interchangeable.

Agent credentials open the agent surface (completions, chat, responses, messages, models), and nothing else:

- an API key from `api_keys`, valid on every rollout (unless rollout keys are required);
- Agent Lightning's controller key (`agl_controller_key`), valid on every rollout (its controller hands
  the one key to every agent it starts), and on that controller's rollout queue (`reward_hooks.agl`);
- a rollout key, which `POST /rollouts` returns with each rollout: valid for that rollout alone.
  Stateless: `rk-<rollout id>.<hex HMAC-SHA256(rollout_key_secret, "rlgate rollout key v1\\0" + rollout
  id)>`, recomputed and compared in constant time on each call, so any gateway holding the same secret
  accepts it and nothing about it is stored.

The operator token (a bearer token, `operator_token`) opens the operator surface (rollout reads and
creation, rewards, metrics, the OpenAPI schema) and nothing else: on the agent surface it is refused, as
agent credentials are refused on the operator surface. A credential used on the wrong surface is 403; an
unknown or missing one is 401.
"""

from __future__ import annotations

import hmac

from gateway import errors
from gateway.settings import GatewaySettings

ROLLOUT_KEY_PREFIX = "rk-"
_CONTEXT = b"rlgate rollout key v1\x00"


def bearer(authorization: bytes) -> bytes:
    """The token of an `Authorization: Bearer TOKEN` header value; b"" for anything else."""
    scheme, _, token = authorization.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


def rollout_key(secret: bytes, rollout_id: str) -> str:
    """The key that opens the agent surface of `rollout_id` alone."""
    mac = hmac.digest(secret, _CONTEXT + rollout_id.encode(), "sha256").hex()
    return f"{ROLLOUT_KEY_PREFIX}{rollout_id}.{mac}"


class Credentials:
    """Checks both kinds of credential against the settings; built once, shared by every listener."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.api_keys = [k.strip().encode() for k in (settings.api_keys or "").split(",") if k.strip()]
        self.rollout_secret = (
            settings.rollout_key_secret.get_secret_value().encode()
            if settings.rollout_key_secret is not None
            else None
        )
        self.require_rollout_keys = settings.require_rollout_keys
        # Agent Lightning's controller: its rollout queue, and (handed to its agents) every rollout's calls
        self.controller_key = (
            settings.agl_controller_key.get_secret_value().encode()
            if settings.agl_controller_key is not None
            else None
        )
        self.operator_token = (
            settings.operator_token.get_secret_value().encode()
            if settings.operator_token is not None
            else None
        )
        # Whether a call must be checked at all: nothing configured is the open development mode.
        self.agent_checked = bool(
            self.api_keys
            or self.require_rollout_keys
            or self.rollout_secret
            or self.operator_token
            or self.controller_key
        )

    # -----------------------------------------------------------------------------------------------------
    # Agent surface

    def rollout_key(self, rollout_id: str) -> str | None:
        return None if self.rollout_secret is None else rollout_key(self.rollout_secret, rollout_id)

    def authorize_agent(self, authorization: bytes, rollout_id: str | None) -> tuple[str | None, bool]:
        """The rollout id the call may be recorded under and whether a rollout key named it, or raise
        401/403.

        A rollout key names its rollout: a call that names none (no path prefix, no X-Rollout-Id) is
        recorded under the key's; a call that names another is 403. Only `POST /rollouts` hands out rollout
        keys, so a call with one continues a rollout that exists (or existed before Redis lost it)."""
        token = bearer(authorization)
        if token and self.operator_token is not None and hmac.compare_digest(token, self.operator_token):
            raise errors.Forbidden(
                "the operator token is not an agent credential: use an API key or the rollout's key",
                code="wrong_credential",
            )
        if self.rollout_secret is not None and token.startswith(b"rk-"):
            key_rollout = self._rollout_of(token)
            if key_rollout is None:
                raise errors.Unauthorized("invalid rollout key")
            if rollout_id is not None and rollout_id != key_rollout:
                raise errors.Forbidden(
                    "this rollout key is valid for its own rollout only", code="rollout_key_mismatch"
                )
            return key_rollout, True
        if self.is_controller(token):  # the one key Agent Lightning's controller gives all its agents
            return rollout_id, False
        if self.require_rollout_keys:
            raise errors.Unauthorized(
                "this gateway requires the rollout's key (Authorization: Bearer "
                "rk-...), as POST /rollouts returns it",
                code="rollout_key_required",
            )
        if (self.api_keys or self.controller_key) and not (
            token and any(hmac.compare_digest(token, key) for key in self.api_keys)
        ):
            raise errors.Unauthorized("missing or invalid API key (Authorization: Bearer KEY)")
        return rollout_id, False

    def _rollout_of(self, token: bytes) -> str | None:
        """The rollout a well-formed, authentic rollout key is for; None otherwise."""
        assert self.rollout_secret is not None
        rid, dot, mac = token[len(ROLLOUT_KEY_PREFIX) :].rpartition(b".")
        if not dot or not rid:
            return None
        expected = hmac.digest(self.rollout_secret, _CONTEXT + rid, "sha256").hex().encode()
        return rid.decode("latin-1") if hmac.compare_digest(mac, expected) else None

    def is_controller(self, token: bytes) -> bool:
        """Whether a bearer token is Agent Lightning's controller key (compared in constant time)."""
        return (
            bool(token)
            and self.controller_key is not None
            and hmac.compare_digest(token, self.controller_key)
        )

    def is_agent_credential(self, token: bytes) -> bool:
        if any(hmac.compare_digest(token, key) for key in self.api_keys) or self.is_controller(token):
            return True
        if self.rollout_secret is None or not token.startswith(b"rk-"):
            return False
        return self._rollout_of(token) is not None

    # -----------------------------------------------------------------------------------------------------
    # Operator surface

    def is_operator(self, authorization: bytes) -> bool:
        """True when the header carries the operator token (compared in constant time)."""
        token = bearer(authorization)
        if not token or self.operator_token is None:
            return False
        return hmac.compare_digest(token, self.operator_token)

    def authorize_operator(self, authorization: bytes, signed: bool) -> bool:
        """True for the operator; False for a request that may go on without a token (no token configured,
        or a signed route that checks its own signature); else raise 401/403."""
        token = bearer(authorization)
        if token:
            if self.operator_token is not None and hmac.compare_digest(token, self.operator_token):
                return True
            if self.is_agent_credential(token):
                raise errors.Forbidden(
                    "agent credentials (API keys, rollout keys) do not open the operator "
                    "surface: use the operator token",
                    code="wrong_credential",
                )
            if self.operator_token is not None:
                raise errors.Unauthorized("invalid operator token", code="invalid_operator_token")
        if self.operator_token is None or signed:
            return False
        raise errors.Unauthorized(
            "this route needs the operator token (Authorization: Bearer TOKEN)", code="missing_operator_token"
        )
