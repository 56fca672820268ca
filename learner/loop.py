"""`rlgate learner`: the training loop, top to bottom.

resume?  -> re-push the checkpoint's version, acknowledge the episodes it trained
loop:
  groups      <- the closed-episode stream (collect.Collector)
  episodes    <- each claimed (a lease of 2 x reclaim_idle_s), then read with its calls; episodes
                 already consumed are acknowledged, second copies dropped, non-finite rewards skipped
  transitions <- credit per call, group advantages, filters (transitions.credited_transitions)
  samples     <- transition or trajectory samples, micro-batches by token budget (samples)
  check       <- once: the server's log-probs against the learner's (_check_logprobs; LogprobMismatch)
  update      <- OpenRLHF's PolicyLoss on the Actor, epochs_per_step optimizer steps (policy.Policy)
  renew       <- the claims, before the checkpoint
  version += 1; checkpoint saved (weights, optimizer, step, version, trained entries)
  push        <- policy-v{version} as a LoRA adapter (push.LoraPusher) or full weights through the
                 weight-transfer phases (push.FullPusher); the policy pointer moves
  ack         <- every episode of the step: consumed exactly once, XACK
  log         <- one structlog line, TensorBoard scalars, a line of output_dir/steps.jsonl

With several data-parallel ranks (`learner.ranks`, started by torchrun or DeepSpeed's launcher) the
above is rank 0's loop; the samples are split among the ranks before the update (`Order`), every rank
trains its share and saves its part of the checkpoint, and all agree that the step succeeded before rank
0 pushes and acknowledges. The other ranks run `_follow`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

import structlog
import torch

from learner import checkpoint
from learner.collect import Collector, Group, Tally
from learner.policy import Policy
from learner.push import FullPusher, LoraPusher, PushError
from learner.ranks import Order, Ranks, RanksMisconfigured
from learner.samples import Sample, Transition, build_samples, history_splits, micro_batches, shard
from learner.settings import LearnerSettings
from learner.transitions import credited_transitions
from rlgate.episodes import (
    ClosedEpisode,
    ClosedEpisodes,
    EpisodeStore,
    RolloutStatus,
    RolloutView,
    StoreUnavailable,
)

log = structlog.get_logger("rlgate.learner")


class LogprobMismatch(RuntimeError):
    """The server's recorded log-probs are not the learner's (see `Learner._check_logprobs`)."""


class Learner:
    def __init__(self, settings: LearnerSettings) -> None:
        self.settings = settings
        if settings.threads:
            torch.set_num_threads(settings.threads)
        self.ranks = Ranks.start(settings)  # before the policy: it sets this rank's device
        if self.ranks.size > 1:
            structlog.contextvars.bind_contextvars(rank=self.ranks.rank)
        self.output_dir = settings.output_dir
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.store = EpisodeStore.from_url(
            settings.redis_url,
            prefix=settings.key_prefix,
            timeout_s=settings.redis_timeout_s,
            retention_s=settings.retention_s,
        )
        self.stream = ClosedEpisodes(self.store, settings.group)
        self.collector = Collector(
            self.stream,
            settings.consumer,
            tasks_per_step=settings.tasks_per_step,
            rollouts_per_task=settings.rollouts_per_task,
            max_group_wait_s=settings.max_group_wait_s,
            singleton_groups=settings.singleton_groups,
            success_threshold=settings.success_threshold,
            dynamic_filtering=settings.dynamic_filtering,
        )
        self.policy = Policy(settings, self.ranks)
        base_model = self.base_model = settings.served_model_name or str(settings.model)
        self.logprobs_checked = settings.logprob_check_tolerance <= 0
        # a claim outlives the time another learner waits before it reclaims a pending entry
        self._lease_s = 2 * self.collector.reclaim_idle_s
        self.pusher: LoraPusher | FullPusher
        api_key = settings.inference_api_key.get_secret_value() if settings.inference_api_key else None
        if settings.push == "lora":
            self.pusher = LoraPusher(
                settings.inference_urls, self.output_dir / "adapters", self.store, base_model, api_key=api_key
            )
        else:
            self.pusher = FullPusher(
                settings.inference_urls,
                self.output_dir / "weights",
                self.store,
                base_model,
                settings.push_drain_s,
                transport=settings.push_transport,
                nccl_address=settings.push_nccl_address,
                nccl_port=settings.push_nccl_port,
                api_key=api_key,
            )
        self.step = 0
        self.version = 0
        # a checkpointed step not finished yet (`_recover` finishes it): its version not pushed, its
        # episodes not acknowledged
        self.unpushed = False
        self.unsettled: list[ClosedEpisode] = []
        self.writer = None
        if settings.tensorboard and self.ranks.leader:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.output_dir / "tensorboard"))
        self.started = time.monotonic()
        self.episodes_trained = 0
        self.progress = None
        if sys.stderr.isatty() and self.ranks.leader:  # a progress bar on a terminal; the log lines go on
            from tqdm import tqdm

            self.progress = tqdm(
                total=settings.max_steps or None, desc="learner", unit="step", file=sys.stderr
            )

    async def run(self) -> None:
        try:
            if not self.ranks.leader:
                await self._follow()
                self.ranks.close()
                return
            try:
                if self.settings.resume:
                    await self._resume()
                await self.collector.start()
            except (StoreUnavailable, PushError) as exc:  # the resume's push or acknowledgements
                await self._recover(exc)
            checker = asyncio.ensure_future(self._check_servers())
            try:
                while not self.settings.max_steps or self.step < self.settings.max_steps:
                    try:
                        groups = await self.collector.next_step(deadline_s=self.ranks.keepalive_s)
                        if not groups:  # several ranks: the others hear from rank 0 in time
                            self.ranks.send(Order("wait"))
                            continue
                        await self.train_step(groups)
                    except (StoreUnavailable, PushError) as exc:
                        await self._recover(exc)
            finally:
                checker.cancel()
                await asyncio.gather(checker, return_exceptions=True)
            self.ranks.send(Order("stop"))
            self.ranks.close()
        finally:
            if self.writer is not None:
                self.writer.close()
            if self.progress is not None:
                self.progress.close()
            await self.store.aclose()

    async def _recover(self, error: Exception) -> None:
        """Redis, or every inference server, unreachable mid-loop (restarting): wait, then do what a
        restarted learner does, without the restart (a model's reload): push the checkpoint's version
        again and acknowledge its episodes if the step had not got that far, and take back this consumer's
        pending entries (those of groups whose read failed). The weights in memory are the checkpoint's:
        nothing between the update and the checkpoint fails on Redis or a server. After `outage_s` of
        failures the error stands (a restart resumes from the checkpoint)."""
        deadline = time.monotonic() + self.settings.outage_s
        wait = 0.5
        while True:
            if time.monotonic() + wait > deadline:
                raise error
            log.warning("outage", error=str(error), step=self.step, retry_in_s=wait)
            await self._keeping_ranks(asyncio.sleep(wait))
            wait = min(wait * 2, 10.0)
            try:
                if self.unpushed:
                    await self._keeping_ranks(self.pusher.push(self.version, self.policy))
                    self.unpushed = False
                if self.unsettled:
                    await self._ack(self.unsettled)
                    self.episodes_trained += len(self.unsettled)
                    self.unsettled = []
                # what this learner held in memory is pending in Redis under its name: read it back afresh
                # (an entry half-handled when Redis went away stays in neither place otherwise)
                self.collector.waiting.clear()
                self.collector.seen.clear()
                await self.collector.start()
            except (StoreUnavailable, PushError) as exc:
                error = exc
                continue
            log.info("recovered", step=self.step, policy_version=self.version)
            return

    async def _check_servers(self) -> None:
        """LoRA pushes: reload the pointer's adapter on a server that lost it (`LoraPusher.reload_missing`),
        every `server_check_s`, between and during steps."""
        interval = self.settings.server_check_s
        if not interval or not isinstance(self.pusher, LoraPusher):
            return
        while True:
            await asyncio.sleep(interval)
            try:
                await self.pusher.reload_missing()
            except Exception as exc:  # noqa: BLE001 (a check must never end the learner)
                log.warning("server_check_failed", error=repr(exc))

    async def _resume(self) -> None:
        saved = checkpoint.load(self.output_dir)
        if saved is None:
            log.info("no_checkpoint", output_dir=str(self.output_dir))
            return
        if saved.ranks is not None and saved.ranks != self.ranks.size:
            self.ranks.send(Order("stop"))  # the other ranks end cleanly rather than on a closed connection
            self.ranks.close()  # they close on "stop" (its barrier is theirs)
            raise RanksMisconfigured(
                f"the checkpoint in {self.output_dir} was saved by {saved.ranks} rank(s), this learner runs "
                f"{self.ranks.size}: resume it with {saved.ranks} (ZeRO partitions the optimizer state by "
                "rank), or start afresh with another --output-dir or --no-resume"
            )
        self.ranks.send(Order("resume", policy_dir=str(saved.policy_dir)))
        self.ranks.guard("loading the checkpoint", self.policy.load, saved.policy_dir)
        self.step, self.version = saved.step, saved.version
        # pushed and acknowledged below (or by `_recover` if a server or Redis is down)
        self.unpushed, self.unsettled = self.version > 0, saved.trained
        self._provenance(saved.trained)  # (if the learner died before writing it)
        if self.unpushed:
            # harmless if it had already been pushed
            await self._keeping_ranks(self.pusher.push(self.version, self.policy))
            self.unpushed = False
        await self._ack(saved.trained)  # trained in the checkpoint, perhaps never acknowledged
        self.unsettled = []
        log.info("resumed", step=self.step, policy_version=self.version, acknowledged=len(saved.trained))

    async def train_step(self, groups: list[Group]) -> dict[str, Any] | None:
        """Train on `groups`, push, acknowledge. Returns the step's metrics (None if nothing was trained)."""
        t0 = time.perf_counter()
        s = self.settings
        views, entries, read_counts = await self._read_episodes(groups)
        per_episode, counts = credited_transitions(views, s, self.version, self.base_model)
        samples = build_samples(per_episode, s.sample_shape)
        if not samples:
            await self._ack(entries)
            log.info("step_skipped", episodes=len(entries), **dict(read_counts), **dict(counts))
            return None
        if not self.logprobs_checked:
            self.logprobs_checked = await asyncio.to_thread(self._check_logprobs, per_episode)

        # every rank trains its share of the samples (one rank: all of them)
        shares = shard(samples, self.ranks.size)
        order = self.ranks.send([Order("step", self.step + 1, self.version + 1, share) for share in shares])
        stats = await self._update(order.samples)
        train_s = time.perf_counter() - t0

        lost = 0
        for entry in entries:  # renew the claims: the step may have run long
            try:
                if await self.stream.claim(entry, s.consumer, self._lease_s) != "claimed":
                    lost += 1
            except StoreUnavailable as exc:  # the step is trained: go on; the ack is the exactly-once point
                log.warning("claim_renewal_failed", error=str(exc))
        if lost:
            log.warning(
                "claims_lost_during_step",
                episodes=lost,
                lease_s=self._lease_s,
                hint="the step ran longer than the lease: another learner may train these too",
            )
        self.version += 1
        self.step += 1
        self.ranks.guard(
            "saving the checkpoint",
            checkpoint.save,
            self.output_dir,
            self.step,
            self.version,
            self.policy,
            entries,
            self.ranks,
        )
        self._provenance(entries)
        self.unpushed, self.unsettled = True, entries  # checkpointed; finished below (or by `_recover`)
        self.ranks.agree()  # every rank trained and saved its part: only now push and acknowledge
        push_s = await self._keeping_ranks(self.pusher.push(self.version, self.policy))
        self.unpushed = False
        await self._ack(entries)
        self.episodes_trained += len(entries)
        self.unsettled = []

        val, train = self.collector.validation, self.collector.uniform
        self.collector.validation = Tally(s.success_threshold)
        self.collector.uniform = Tally(s.success_threshold)
        # the step's episodes: those of uniform groups dropped for it (dynamic filtering) and those trained
        dropped_uniform = train.episodes
        for v in (v for g in views for v in g):  # (recorded before the hash kept it: read from the calls)
            first = v.first_version
            train.add(
                cast(float, v.reward),  # a claimed episode is closed, its reward finite
                first if first is not None else min((c.policy_version for c in v.calls), default=None),
            )
        metrics = {
            "step": self.step,
            "time": time.time(),
            "policy_version": self.version,
            "ranks": self.ranks.size,
            "episodes": len(entries) + dropped_uniform,
            "groups": len(views),
            "reward_mean": train.reward_sum / train.episodes if train.episodes else math.nan,
            "success_rate": train.successes / train.episodes if train.episodes else math.nan,
            # per oldest policy version that served each episode: [episodes, successes, reward sum]
            "by_version": train.versions(),
            "val_episodes": val.episodes,
            "val_reward_mean": val.reward_sum / val.episodes if val.episodes else math.nan,
            "val_success_rate": val.successes / val.episodes if val.episodes else math.nan,
            "val_by_version": val.versions(),
            "group_reward_std": statistics.fmean(
                statistics.stdev([cast(float, v.reward) for v in g]) if len(g) > 1 else 0.0 for g in views
            ),
            "samples": stats.samples,
            # trajectory shape: calls trained apart because their prompt did not extend the sample before
            "history_splits": history_splits(samples) if s.sample_shape == "trajectory" else 0,
            "tokens": stats.tokens,
            "calls": counts["calls"],
            "calls_without_server_logprobs": counts["no_server_logprobs"],
            "dropped_failed": counts["failed"],
            "dropped_other_agent": counts["other_agent"],
            "dropped_stale": counts["stale"],
            "dropped_other_model": counts["other_model"],
            "dropped_constrained": counts["constrained"],
            "dropped_invalid_reward": read_counts["invalid_rewards"],
            "duplicates": read_counts["duplicates"],
            "claimed_elsewhere": read_counts["claimed_elsewhere"],
            "claims_lost": lost,
            "dropped_singleton": counts["singleton_episodes"] + self.collector.dropped_singletons,
            "dropped_uniform": dropped_uniform,
            "already_trained": read_counts["already_trained"],
            "staleness_mean": counts["staleness_sum"] / max(1, counts["trained"]),
            **{k: v for k, v in asdict(stats).items() if k not in ("samples", "tokens")},
            "train_seconds": train_s,
            "push_seconds": push_s,
            "tokens_per_second": stats.tokens * s.epochs_per_step / max(train_s, 1e-9),
            "episodes_per_second": self.episodes_trained / max(time.monotonic() - self.started, 1e-9),
            "waiting_episodes": self.collector.waiting_episodes(),
        }
        self._log(metrics)
        try:  # for dashboards: the step's numbers in Redis too (a capped stream); the files above are kept
            await self.store.add_learner_step(metrics)
        except StoreUnavailable as exc:
            log.warning("step_not_published", step=self.step, error=str(exc))
        return metrics

    async def _update(self, samples: list[Sample]) -> Any:
        """This rank's update on its share of the step's samples: `epochs_per_step` optimizer steps over
        its micro-batches, padded to the other ranks' number (`Ranks.pad`)."""
        s = self.settings
        batches = (
            micro_batches(
                samples, s.micro_batch_tokens, self.policy.pad_token_id, s.forward == "shared-prefix"
            )
            if samples
            else []
        )
        batches = self.ranks.pad(batches, self.policy.pad_token_id)
        # Every epoch's ratio is against the policy before this step's first update; with one epoch those
        # are the current log-probs, detached, and need no extra forward pass.
        old = [self.policy.log_probs(b) for b in batches] if s.epochs_per_step > 1 else None
        for _ in range(s.epochs_per_step):
            stats = await asyncio.to_thread(self.ranks.guard, "the update", self.policy.update, batches, old)
        return stats

    async def _keeping_ranks(self, work: Any) -> Any:
        """Await rank 0's own `work` (a push: a large model's weights can take longer than the ranks'
        collective timeout) while the other ranks wait for their next order: a "wait" order every
        `keepalive_s` keeps their receive from timing out."""
        keepalive_s = self.ranks.keepalive_s
        if keepalive_s is None:
            return await work
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=keepalive_s)
                if done:
                    return task.result()
                self.ranks.send(Order("wait"))
        finally:
            if not task.done():  # a rank failed (or the learner stops): the push stops, its cleanup runs
                task.cancel()  # (a pusher's own rollback: resume the servers, the previous pointer) now,
                await asyncio.gather(task, return_exceptions=True)  # while the store is still open

    async def _follow(self) -> None:
        """A rank other than 0: train each step's share of the samples as rank 0 orders, save this rank's
        part of the checkpoint, agree; until rank 0 says stop. No Redis, no push, no log of the step."""
        log.info("rank_started", ranks=self.ranks.size)
        while True:
            order = self.ranks.receive()
            if order.kind == "stop":
                return
            if order.kind == "resume":
                self.ranks.guard("loading the checkpoint", self.policy.load, Path(order.policy_dir))
            elif order.kind == "step":
                await self._update(order.samples)
                self.ranks.guard(
                    "saving the checkpoint",
                    checkpoint.save,
                    self.output_dir,
                    order.step,
                    order.version,
                    self.policy,
                    [],
                    self.ranks,
                )
                self.ranks.agree()
                log.info(
                    "step_share", step=order.step, policy_version=order.version, samples=len(order.samples)
                )

    async def _read_episodes(
        self, groups: list[Group]
    ) -> tuple[list[list[RolloutView]], list[ClosedEpisode], Counter[str]]:
        """The groups' rollouts with their calls, each claimed by this learner before it trains on it, so
        that an episode trains at most once per step and once ever:

        - an entry whose rollout is not closed any more (consumed: trained before a redelivery; failed)
          is acknowledged and left out (`already_trained`);
        - a second entry of a rollout already in this step (published twice) is dropped from the stream
          without consuming the rollout (`duplicates`): the entry it is trained through is acknowledged
          after that training;
        - an entry whose rollout another learner's lease holds is left pending, untouched
          (`claimed_elsewhere`): that learner acknowledges it, or, if it died, the entry is reclaimed
          once idle and its lapsed claim taken over;
        - an episode whose rewards are not finite in float32 is logged, acknowledged and skipped
          (`invalid_rewards`): one bad episode never stops the learner.
        """
        views: list[list[RolloutView]] = []
        entries: list[ClosedEpisode] = []
        counts: Counter[str] = Counter()
        taken: set[str] = set()
        for group in groups:
            kept = []
            for entry in group.episodes:
                if entry.rollout_id in taken:
                    await self.stream.drop(entry)
                    counts["duplicates"] += 1
                    continue
                # the claim first: it also tells a rollout that is not closed any more, and an episode
                # another learner holds is not read for nothing
                claim = await self.stream.claim(entry, self.settings.consumer, self._lease_s)
                if claim == "held":
                    counts["claimed_elsewhere"] += 1
                    continue
                view = await self.store.get_rollout_view(entry.rollout_id) if claim == "claimed" else None
                if view is None or view.status != RolloutStatus.CLOSED or view.reward is None:
                    await self.stream.ack(entry)
                    counts["already_trained"] += 1
                    continue
                if not _finite_rewards(view):
                    log.warning(
                        "episode_skipped",
                        rollout_id=view.rollout_id,
                        problem="a reward is not finite in float32",
                        reward=view.reward,
                    )
                    await self.stream.ack(entry)
                    counts["invalid_rewards"] += 1
                    continue
                taken.add(entry.rollout_id)
                kept.append(view)
                entries.append(entry)
            if kept:
                views.append(kept)
        return views, entries, counts

    def _check_logprobs(self, per_episode: list[list[Transition]]) -> bool:
        """Once, on the first step with calls served by the weights the learner holds now: recompute their
        log-probs and compare with what the server recorded. True once checked (False: no such call yet).

        The learner's log-probs are those of the distribution sampled from (`processed_logprobs`); with
        `logprobs_mode=raw_logprobs` the server's are of the raw logits (no temperature, no logit_bias),
        and the comparison is made on those. A mean absolute gap above `logprob_check_tolerance` nats
        per token raises `LogprobMismatch` naming the likely causes."""
        s = self.settings
        fresh = [[t for t in episode if t.policy_version == self.version] for episode in per_episode]
        if s.logprobs_mode == "raw_logprobs":
            fresh = [
                [dataclasses.replace(t, temperature=1.0, logit_bias=(), top_k=0, top_p=1.0) for t in ep]
                for ep in fresh
            ]
        samples = build_samples(fresh, "transition")
        if not samples:
            return False
        gap = tokens = 0.0
        for batch in micro_batches(
            samples, s.micro_batch_tokens, self.policy.pad_token_id, s.forward == "shared-prefix"
        ):
            mask = batch.action_mask & ~torch.isnan(batch.rollout_logprobs)  # the server's own log-probs only
            ours = self.policy.log_probs(batch).cpu()
            gap += float((ours - batch.rollout_logprobs).abs()[mask].sum())
            tokens += int(mask.sum())
        if tokens == 0:  # only calls the server gave no log-probs for: nothing to compare yet
            return False
        mean_gap = gap / tokens
        log.info(
            "logprob_check",
            policy_version=self.version,
            tokens=int(tokens),
            mean_abs_gap=round(mean_gap, 6),
            tolerance=s.logprob_check_tolerance,
            logprobs_mode=s.logprobs_mode,
        )
        if mean_gap > s.logprob_check_tolerance:
            raise LogprobMismatch(
                f"the inference server's log-probs differ from the learner's by {mean_gap:.3f} nats per token "
                f"on average over {int(tokens)} tokens of calls served by policy version {self.version} "
                f"(tolerance {s.logprob_check_tolerance}). Likely causes: the server reports log-probs of "
                f"another processing than --logprobs-mode {s.logprobs_mode} says (vLLM's default is "
                f"raw_logprobs: start it with --logprobs-mode processed_logprobs, or set the learner's "
                f"logprobs_mode to the server's); or it serves other weights than the learner's (another "
                f"model path, a different --served-model-name, a resumed learner whose adapter was not "
                f"loaded). Set logprob_check_tolerance to 0 to skip this check."
            )
        return True

    async def _ack(self, entries: list[ClosedEpisode]) -> None:
        for entry in entries:
            await self.stream.ack(entry)

    def _provenance(self, entries: list[ClosedEpisode]) -> None:
        """`output_dir/trained.jsonl`: the episodes each step trained on, one line per step (`step`,
        `policy_version`, `rollouts`), written once the step's checkpoint is on disk, and on resume if the
        learner died before writing it. Which episodes made a version, and how a check (`scripts/chaos`)
        finds an episode trained twice. It grows by one line per step (about 40 bytes per episode)."""
        path = self.output_dir / "trained.jsonl"
        last, whole = _last_line(path)
        try:  # is this step written already?
            if json.loads(last or b"{}").get("step", -1) >= self.step:
                return
        except ValueError:  # a torn last line (a crash mid-write): a line of its own follows
            pass
        line = {
            "step": self.step,
            "policy_version": self.version,
            "rollouts": [e.rollout_id for e in entries],
        }
        with path.open("a") as f:
            f.write(("" if whole else "\n") + json.dumps(line) + "\n")

    def _log(self, metrics: dict[str, Any]) -> None:
        log.info("step", **{k: round(v, 6) if isinstance(v, float) else v for k, v in metrics.items()})
        if self.progress is not None:
            self.progress.update(1)
            self.progress.set_postfix_str(
                f"v{metrics['policy_version']} reward {metrics['reward_mean']:.3f} "
                f"success {metrics['success_rate']:.0%} {metrics['episodes_per_second']:.1f} episodes/s "
                f"loss {metrics['loss']:.4f}",
                refresh=True,
            )
        with (self.output_dir / "steps.jsonl").open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.writer is not None:
            for key, value in metrics.items():
                if key not in ("step", "time") and isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(f"learner/{key}", value, metrics["step"])
            self.writer.flush()


def _last_line(path: Path, block: int = 65536) -> tuple[bytes | None, bool]:
    """The file's last non-empty line (None: no file or nothing in it), read backwards block by block,
    and whether the file ends in a newline (a line cut short by a crash does not)."""
    if not path.is_file():
        return None, True
    with path.open("rb") as f:
        end = f.seek(0, 2)
        tail = b""
        while end > 0:
            start = max(0, end - block)
            f.seek(start)
            tail = f.read(end - start) + tail
            end = start
            stripped = tail.rstrip(b"\n")
            if b"\n" in stripped or end == 0:
                return stripped.rsplit(b"\n", 1)[-1] or None, tail.endswith(b"\n")
    return None, True


def _finite_rewards(view: RolloutView) -> bool:
    """The episode's return and per-call rewards are finite as the float32 the learner computes in."""
    values = [view.reward] + [r for c in view.calls for r in (c.reward, c.air_reward) if r is not None]
    return bool(torch.isfinite(torch.tensor(values, dtype=torch.float64).to(torch.float32)).all())


def run(settings: LearnerSettings) -> None:
    asyncio.run(Learner(settings).run())


__all__ = ["Learner", "LogprobMismatch", "run"]
