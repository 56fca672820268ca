"""Reward jobs, run by `rlgate worker` (rq). A job gets a rollout id, loads the episode and its finish
request from the store, computes the reward with the named function and closes the episode.

A job that raises is retried with backoff (rq's Retry); when no retry is left the rollout is marked
`failed` with the error, visible in `GET /rollouts/{id}`, and it is never trained on.
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis
import structlog
from rq import get_current_job

from episodes import EpisodeLifecycle, EpisodeStore, Keys, RolloutView
from reward_hooks.rewards import RewardInput, get_reward_fn

log = structlog.get_logger("rlgate.reward")


def compute_reward(rollout_id: str, key_prefix: str) -> float:
    """The rq job. Uses the worker's own Redis connection: the queue and the episodes share one Redis."""
    job = get_current_job()
    assert job is not None, "compute_reward runs inside an rq worker"
    kwargs = dict(job.connection.connection_pool.connection_kwargs)
    try:
        return asyncio.run(_compute(rollout_id, key_prefix, kwargs))
    except Exception as exc:
        if job.retries_left:  # rq will run it again
            log.warning("reward_job_retry", rollout_id=rollout_id, error=repr(exc), retries_left=job.retries_left)
            raise
        asyncio.run(_fail(rollout_id, key_prefix, kwargs, f"{type(exc).__name__}: {exc}"))
        log.error("reward_job_failed", rollout_id=rollout_id, error=repr(exc))
        raise


def _store(key_prefix: str, connection_kwargs: dict[str, Any]) -> EpisodeStore:
    allowed = ("host", "port", "db", "username", "password", "unix_socket_path", "ssl")
    client = aioredis.Redis(**{k: v for k, v in connection_kwargs.items() if k in allowed and v is not None})
    return EpisodeStore(client, Keys(key_prefix))


async def _compute(rollout_id: str, key_prefix: str, connection_kwargs: dict[str, Any]) -> float:
    store = _store(key_prefix, connection_kwargs)
    try:
        view = await store.get_rollout_view(rollout_id)
        if view is None:
            raise LookupError(f"no rollout {rollout_id!r}")
        if view.finish is None:
            raise LookupError(f"rollout {rollout_id!r} has no finish request")
        reward_fn = get_reward_fn(view.finish.reward_fn)
        reward = float(reward_fn(reward_input(view)))
        result = await EpisodeLifecycle(store).close(rollout_id, reward, {"reward_fn": view.finish.reward_fn})
        log.info("reward_job_done", rollout_id=rollout_id, task_id=view.task_id, reward=reward,
                 reward_fn=view.finish.reward_fn, outcome=result.outcome)
        return reward
    finally:
        await store.aclose()


async def _fail(rollout_id: str, key_prefix: str, connection_kwargs: dict[str, Any], error: str) -> None:
    store = _store(key_prefix, connection_kwargs)
    try:
        await EpisodeLifecycle(store).fail(rollout_id, error)
    finally:
        await store.aclose()


def reward_input(view: RolloutView) -> RewardInput:
    """What a reward function sees: the episode's final answer (the last successful call's text), its
    question (the first user message of the first call), the ground truth and the options."""
    assert view.finish is not None
    answer = ""
    for call in reversed(view.calls):
        if call.error is None and call.response is not None:
            answer = _text_of(call.response.message, call.response.text, call.response.output)
            break
    question = None
    if view.calls:
        request = view.calls[0].request
        messages = request.get("messages") or []
        question = next((_content_text(m.get("content")) for m in messages if m.get("role") == "user"), None)
        if question is None and isinstance(request.get("prompt"), str):
            question = request["prompt"]
        if question is None and isinstance(request.get("input"), str):
            question = request["input"]
    return RewardInput(answer=answer, ground_truth=view.finish.ground_truth, question=question,
                       params=view.finish.params)


def _text_of(message: dict[str, Any] | None, text: str | None, output: list[Any] | None) -> str:
    if message is not None:
        return _content_text(message.get("content")) or ""
    if text is not None:
        return text
    parts = [c.get("text", "") for item in output or () if isinstance(item, dict)
             for c in item.get("content") or () if isinstance(c, dict) and c.get("type") == "output_text"]
    return "".join(parts)


def _content_text(content: Any) -> str | None:
    """Chat content as text: a string, or the text parts of a list of content parts."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)
