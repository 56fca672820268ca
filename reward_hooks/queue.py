"""The rq queue of reward jobs. Jobs carry ids only, serialized as JSON (never pickle across services)."""

from __future__ import annotations

import redis
from rq import Queue, Retry
from rq.serializers import JSONSerializer

from reward_hooks.settings import RewardSettings
from rlgate.episodes.store import is_cluster_url, standalone_url

JOB = "reward_hooks.jobs.compute_reward"  # referenced by name: the worker imports it, the web side need not


def queue_url(settings: RewardSettings) -> str | None:
    """Where the queue lives: `queue_redis_url`, else the episodes' Redis unless that is a cluster (rq
    needs a standalone Redis): then None, no queue."""
    if settings.queue_redis_url:
        return settings.queue_redis_url
    return None if is_cluster_url(settings.redis_url) else settings.redis_url


def connect(settings: RewardSettings) -> redis.Redis:
    """A synchronous Redis client for rq (by default the queue lives in the same Redis as the episodes).
    Raises `ValueError` (one line for the user) when there is no standalone Redis for it."""
    url = queue_url(settings)
    if url is None:
        raise ValueError(
            "rq does not run on a Redis Cluster: set RLGATE_QUEUE_REDIS_URL to a standalone Redis for the "
            "reward-job queue"
        )
    return redis.Redis.from_url(
        standalone_url(url),
        socket_timeout=settings.redis_timeout_s,
        socket_connect_timeout=settings.redis_timeout_s,
    )


class RewardQueue:
    def __init__(self, settings: RewardSettings, connection: redis.Redis | None = None) -> None:
        self.settings = settings
        self.connection = connection or connect(settings)
        self.queue = Queue(settings.reward_queue, connection=self.connection, serializer=JSONSerializer)

    def enqueue(self, rollout_id: str) -> str:
        """Enqueue the reward job of a rollout whose finish request is stored; returns the job id."""
        s = self.settings
        retry = (
            Retry(max=s.reward_job_retries, interval=s.reward_job_backoff_s) if s.reward_job_retries else None
        )
        job = self.queue.enqueue_call(
            JOB,
            args=[rollout_id, s.key_prefix],
            timeout=s.reward_job_timeout_s,
            retry=retry,
            description=f"reward for rollout {rollout_id}",
        )
        return job.id
