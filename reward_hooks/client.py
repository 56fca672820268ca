"""A tiny client for harnesses: post an episode's reward to the gateway, or fail it (standard library only).

With `secret`, each request is signed as `reward_hooks.signing` describes: the timestamp, the method, the
path and the body, at the moment it is sent.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, cast
from urllib.parse import urlsplit

from reward_hooks import signing


class RewardRejected(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


def post_reward(
    gateway_url: str,
    rollout_id: str,
    reward: float,
    metadata: dict[str, Any] | None = None,
    secret: str | None = None,
    timeout_s: float = 10.0,
) -> dict[str, Any]:
    """POST /rollouts/{rollout_id}/reward, signed when `secret` is given. Returns the gateway's answer;
    raises `RewardRejected` with the status on a 4xx/5xx."""
    body = {"reward": reward, "metadata": metadata or {}}
    return _post(f"{gateway_url.rstrip('/')}/rollouts/{rollout_id}/reward", body, secret, timeout_s)


def fail_rollout(
    gateway_url: str,
    rollout_id: str,
    reason: str | None = None,
    secret: str | None = None,
    timeout_s: float = 10.0,
) -> dict[str, Any]:
    """POST /rollouts/{rollout_id}/fail: close the rollout as failed (never trained on)."""
    body = {} if reason is None else {"reason": reason}
    return _post(f"{gateway_url.rstrip('/')}/rollouts/{rollout_id}/fail", body, secret, timeout_s)


def _post(url: str, payload: dict[str, Any], secret: str | None, timeout_s: float) -> dict[str, Any]:
    body = json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"}
    if secret:
        headers.update(signing.sign(secret, "POST", urlsplit(url).path, body))
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return cast(dict[str, Any], json.loads(response.read()))
    except urllib.error.HTTPError as exc:
        raise RewardRejected(exc.code, exc.read().decode("utf-8", "replace")) from exc
