"""Automatic intermediate rewards (AIR, Agent Lightning sec. 3.4): a system signal turned into a reward.

When a call's request carries a `tool` message that answers an earlier call's tool call and that tool
result reports an error (a configured pattern, or a JSON object with an "error" key), the earlier call
gets the configured intermediate reward. It is recorded apart from the final return
(`{prefix}:rollout:{<rid>}:air`), so the learner can choose whether to use it.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
import structlog

from rlgate import episodes
from rlgate.episodes import EpisodeLifecycle, EpisodeStore

log = structlog.get_logger("rlgate.gateway")


class AutomaticRewards:
    def __init__(self, store: EpisodeStore, reward: float, patterns: list[str]) -> None:
        self.store = store
        self.lifecycle = EpisodeLifecycle(store)
        self.reward = reward
        self.patterns = [re.compile(p, re.IGNORECASE | re.MULTILINE) for p in patterns]

    def failed_tool_calls(self, request: dict[str, Any]) -> list[str]:
        """Ids of the tool calls whose results in this request's messages report an error."""
        failed = []
        for message in request.get("messages") or ():
            if isinstance(message, dict) and message.get("role") == "tool" and message.get("tool_call_id"):
                if self.is_error(message.get("content")):
                    failed.append(message["tool_call_id"])
        return failed

    def is_error(self, content: Any) -> bool:
        if isinstance(content, list):  # content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            return False
        try:
            parsed = orjson.loads(content)
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict) and parsed.get("error"):
            return True
        return any(p.search(content) for p in self.patterns)

    async def apply(self, rollout_id: str, tool_call_ids: list[str]) -> dict[int, str]:
        """Give the calls that made these tool calls the AIR reward. Returns {call index: tool call id}."""
        wanted = set(tool_call_ids)
        given: dict[int, str] = {}
        calls = await self.store.get_calls(rollout_id)
        for index, call in enumerate(calls):
            message = call.response.message if call.response is not None else None
            for tool_call in (message or {}).get("tool_calls") or ():
                if tool_call.get("id") in wanted and index not in given:
                    try:
                        await self.lifecycle.set_call_reward(rollout_id, index, self.reward, automatic=True)
                    except episodes.StoreError as exc:
                        log.warning("air_not_recorded", rollout_id=rollout_id, index=index, error=str(exc))
                        continue
                    given[index] = tool_call["id"]
        if given:
            log.info("air", rollout_id=rollout_id, calls=sorted(given), reward=self.reward)
        return given
