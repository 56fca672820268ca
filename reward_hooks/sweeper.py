"""The sweeper: expires open rollouts past their TTL (or closes them with the fill reward) and republishes
closed episodes whose closer died before publishing them. Safe to run in every gateway process at once:
each transition is an exactly-once script."""

from __future__ import annotations

import asyncio

import structlog

from episodes import EpisodeLifecycle, EpisodeStore, StoreUnavailable
from reward_hooks.settings import RewardSettings

log = structlog.get_logger("rlgate.sweeper")


async def sweep_once(
    lifecycle: EpisodeLifecycle, settings: RewardSettings
) -> tuple[dict[str, str], list[str]]:
    expired = await lifecycle.expire_due(fill_reward=settings.expired_fill_reward)
    repaired = await lifecycle.repair_outbox(grace_s=settings.outbox_grace_s)
    for rollout_id, outcome in expired.items():
        log.info("rollout_expired", rollout_id=rollout_id, outcome=outcome)
    for rollout_id in repaired:
        log.warning("episode_republished", rollout_id=rollout_id)
    return expired, repaired


async def sweep_forever(store: EpisodeStore, settings: RewardSettings) -> None:
    lifecycle = EpisodeLifecycle(store)
    while True:
        try:
            await sweep_once(lifecycle, settings)
        except StoreUnavailable as exc:
            log.warning("sweep_failed", error=str(exc))
        except Exception:  # a sweeper that dies silently would stop expiry and repair for good
            log.exception("sweep_crashed")
        await asyncio.sleep(settings.sweep_interval_s)
