"""A tiny client for harnesses: post an episode's reward to the gateway (standard library only)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from reward_hooks import signing


class RewardRejected(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


def post_reward(gateway_url: str, rollout_id: str, reward: float, metadata: dict[str, Any] | None = None,
                secret: str | None = None, timeout_s: float = 10.0) -> dict[str, Any]:
    """POST /rollouts/{rollout_id}/reward, signed when `secret` is given. Returns the gateway's answer;
    raises `RewardRejected` with the status on a 4xx/5xx."""
    body = json.dumps({"reward": reward, "metadata": metadata or {}}).encode()
    headers = {"Content-Type": "application/json"}
    if secret:
        headers[signing.HEADER] = signing.sign(body, secret)
    request = urllib.request.Request(f"{gateway_url.rstrip('/')}/rollouts/{rollout_id}/reward", data=body,
                                     headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise RewardRejected(exc.code, exc.read().decode("utf-8", "replace")) from exc
