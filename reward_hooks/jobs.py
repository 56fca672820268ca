"""Reward jobs, run by `rlgate worker` (rq). A job gets a rollout id, loads the episode and its finish
request from the store, computes the reward with the named function and closes the episode.

A job that raises is retried with backoff (rq's Retry); when no retry is left, or the error is one a retry
cannot fix (an unknown reward function, a forbidden file, a finish request a reward function refuses
(`RewardInputError`: a gold SQL query that fails), a result outside `max_abs_reward` or not a number, the
job's time limit `reward_job_timeout_s` passed), the rollout is marked `failed` with the
error, visible in `GET /rollouts/{id}`, it is never trained on, and the job is not retried. A rollout that
was closed or expired meanwhile ends the job quietly.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog
from rq import get_current_job
from rq.timeouts import JobTimeoutException

from reward_hooks.limits import RewardOutOfRange, check_reward
from reward_hooks.rewards import RewardInput, RewardInputError, UnknownRewardFn, get_allowed_reward_fn
from reward_hooks.settings import RewardSettings
from rlgate import episodes
from rlgate.episodes import EpisodeLifecycle, EpisodeStore, RolloutView

log = structlog.get_logger("rlgate.reward")


# Outcomes a retry cannot change: the job ends without retrying (and without failing a closed episode).
_FINAL = (episodes.RewardConflict, episodes.RolloutExpired, episodes.RolloutNotOpen, episodes.RolloutNotFound)
# Deterministic failures: the same input fails the same way again, so a retry only holds the worker longer.
_NOT_RETRIED = (
    UnknownRewardFn,
    PermissionError,
    LookupError,
    RewardInputError,
    RewardOutOfRange,
    JobTimeoutException,
)
MAX_TIMEOUT_S = 60.0  # the most a request may ask a reward function to wait (timeout_s)


_worker_settings: RewardSettings | None = None  # `use`: `rlgate worker`'s own, flags included


def use(settings: RewardSettings) -> None:
    """Run this process's reward jobs, and those of the work horses it forks, with `settings` (how
    `rlgate worker` hands them its flags); without it, each job reads RLGATE_* (a plain `rq worker`)."""
    global _worker_settings
    _worker_settings = settings


def compute_reward(rollout_id: str, key_prefix: str) -> float | None:
    """The rq job. Its settings (Redis, allowed modules, data directory, judge) are the worker's own
    (`use`, else RLGATE_* variables): a request cannot point the worker elsewhere."""
    job = get_current_job()
    settings = _worker_settings or RewardSettings()
    try:
        return asyncio.run(_compute(rollout_id, key_prefix, settings))
    except _FINAL as exc:
        log.info("reward_job_moot", rollout_id=rollout_id, outcome=type(exc).__name__, detail=str(exc))
        return None
    except Exception as exc:
        if job is not None and job.retries_left and not isinstance(exc, _NOT_RETRIED):
            log.warning(
                "reward_job_retry", rollout_id=rollout_id, error=repr(exc), retries_left=job.retries_left
            )
            raise
        if job is not None:
            job.retries_left = 0  # rq retries any job with retries left: this one is done
        asyncio.run(_fail(rollout_id, key_prefix, settings, f"{type(exc).__name__}: {exc}"))
        log.error("reward_job_failed", rollout_id=rollout_id, error=repr(exc))
        raise


def _store(key_prefix: str, settings: RewardSettings) -> EpisodeStore:
    return EpisodeStore.from_url(
        settings.redis_url,
        prefix=key_prefix,
        timeout_s=settings.redis_timeout_s,
        retention_s=settings.retention_s,
    )


async def _compute(rollout_id: str, key_prefix: str, settings: RewardSettings) -> float:
    store = _store(key_prefix, settings)
    try:
        view = await store.get_rollout_view(rollout_id)
        if view is None:
            raise episodes.RolloutNotFound(f"no rollout {rollout_id!r}")
        if view.status != episodes.RolloutStatus.OPEN:  # failed, closed or expired meanwhile: nothing to do
            raise episodes.RolloutNotOpen(rollout_id, view.status)
        if view.finish is None:
            raise LookupError(f"rollout {rollout_id!r} has no finish request")
        reward_fn = get_allowed_reward_fn(view.finish.reward_fn, settings.reward_fn_modules)
        inp = reward_input(view)
        inp.params = worker_params(inp.params, settings)
        reward = check_reward(
            reward_fn(inp),
            settings.max_abs_reward,
            f"the result of reward function {view.finish.reward_fn!r}",
        )
        result = await EpisodeLifecycle(store).close(rollout_id, reward, {"reward_fn": view.finish.reward_fn})
        log.info(
            "reward_job_done",
            rollout_id=rollout_id,
            task_id=view.task_id,
            reward=reward,
            reward_fn=view.finish.reward_fn,
            outcome=result.outcome,
        )
        return reward
    finally:
        await store.aclose()


async def _fail(rollout_id: str, key_prefix: str, settings: RewardSettings, error: str) -> None:
    store = _store(key_prefix, settings)
    try:
        await EpisodeLifecycle(store).fail(rollout_id, error)
    finally:
        await store.aclose()


def worker_params(params: dict[str, Any], settings: RewardSettings) -> dict[str, Any]:
    """A request's reward options, made safe: the judge's model, URL and key are the worker's (a request
    naming its own URL would receive the worker's provider key); files only inside the data directory;
    time limits capped."""
    params = {k: v for k, v in params.items() if k not in ("model", "api_base", "api_key")}
    if settings.judge_model:
        params["model"] = settings.judge_model
    if settings.judge_api_base:
        params["api_base"] = settings.judge_api_base
    if "db_path" in params:
        if settings.reward_data_dir is None:
            raise PermissionError("reward requests may not name files unless RLGATE_REWARD_DATA_DIR is set")
        root = settings.reward_data_dir.resolve()
        path = (root / str(params["db_path"])).resolve()
        if not path.is_relative_to(root):
            raise PermissionError(f"db_path {params['db_path']!r} is outside RLGATE_REWARD_DATA_DIR")
        params["db_path"] = str(path)
    if isinstance(params.get("timeout_s"), (int, float)):
        params["timeout_s"] = min(float(params["timeout_s"]), MAX_TIMEOUT_S)
    return params


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
    return RewardInput(
        answer=answer, ground_truth=view.finish.ground_truth, question=question, params=view.finish.params
    )


def _text_of(message: dict[str, Any] | None, text: str | None, output: list[Any] | None) -> str:
    if message is not None:
        return _content_text(message.get("content")) or ""
    if text is not None:
        return text
    parts = [
        c.get("text", "")
        for item in output or ()
        if isinstance(item, dict)
        for c in item.get("content") or ()
        if isinstance(c, dict) and c.get("type") == "output_text"
    ]
    return "".join(parts)


def _content_text(content: Any) -> str | None:
    """Chat content as text: a string, or the text parts of a list of content parts."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)
