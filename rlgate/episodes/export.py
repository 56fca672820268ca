"""Export episodes as training data: one row per transition (LLM call), JSONL or Parquet, loadable with HF
`datasets`; or, for supervised fine-tuning, chat-format rows.

A transition row carries the exact token ids and log-probs the server returned, the messages (or prompt)
it was sampled from, the episode's final return, its intermediate rewards, and who made it (task, agent,
policy version). Calls that failed are not transitions and are left out.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson

from rlgate.episodes.records import RolloutStatus, RolloutView
from rlgate.episodes.store import EpisodeStore
from rlgate.episodes.stream import ClosedEpisodes

Format = Literal["jsonl", "parquet", "sft"]


@dataclass(frozen=True, slots=True)
class ExportFilter:
    """Which episodes and calls to export; `None` means no limit."""

    statuses: tuple[str, ...] = (RolloutStatus.CLOSED, RolloutStatus.CONSUMED)
    since: float | None = None  # closed_at >= since (unix seconds)
    until: float | None = None  # closed_at < until
    task_id: str | None = None
    agent_name: str | None = None
    min_reward: float | None = None

    def keeps(self, view: RolloutView) -> bool:
        closed_at = view.closed_at if view.closed_at is not None else view.created_at
        return (
            view.status in self.statuses
            and (self.since is None or closed_at >= self.since)
            and (self.until is None or closed_at < self.until)
            and (self.task_id is None or view.task_id == self.task_id)
            and (self.min_reward is None or (view.reward is not None and view.reward >= self.min_reward))
        )


async def rollout_ids(store: EpisodeStore) -> AsyncIterator[str]:
    """Every rollout id in the store (SCAN over the rollout hashes; an offline operation)."""
    prefix = f"{store.keys.prefix}:rollout:{{"
    async with store.guard(600):
        async for key in store.redis.scan_iter(match=f"{prefix}*", count=1000):
            key = key.decode()
            if key.endswith("}"):
                yield key[len(prefix) : -1]


def transition_rows(view: RolloutView, agent_name: str | None = None) -> Iterable[dict[str, Any]]:
    for call in view.calls:
        if call.error is not None or (agent_name is not None and call.agent_name != agent_name):
            continue
        response = call.response
        yield {
            "rollout_id": view.rollout_id,
            "task_id": view.task_id,
            "index": call.index,
            "agent_name": call.agent_name,
            "policy_version": call.policy_version,
            "endpoint": call.endpoint,
            "model": call.model,
            "status": view.status.value,
            "messages": call.request.get("messages"),
            "prompt": _prompt(call.request),
            "tools": call.request.get("tools"),
            "response_message": response.message if response else None,
            "response_text": response.text if response else None,
            "finish_reason": response.finish_reason if response else None,
            "prompt_token_ids": call.prompt_token_ids,
            "completion_token_ids": call.completion_token_ids,
            "completion_logprobs": call.completion_logprobs,
            "reward": view.reward,
            "call_reward": call.reward,
            "air_reward": call.air_reward,
            "created_at": view.created_at,
            "closed_at": view.closed_at,
        }


def sft_rows(view: RolloutView, agent_name: str | None = None) -> Iterable[dict[str, Any]]:
    """Chat rows: the messages a call saw plus the assistant message it produced (completions: prompt and
    completion)."""
    for row in transition_rows(view, agent_name):
        meta = {"rollout_id": row["rollout_id"], "task_id": row["task_id"], "reward": row["reward"]}
        if row["messages"] is not None and row["response_message"] is not None:
            assistant = {
                k: v for k, v in row["response_message"].items() if v is not None and k != "reasoning"
            }
            yield {"messages": [*row["messages"], assistant], "tools": row["tools"], **meta}
        elif row["prompt"] is not None and row["response_text"] is not None:
            yield {"prompt": row["prompt"], "completion": row["response_text"], **meta}


def _prompt(request: dict[str, Any]) -> str | None:
    prompt = request.get("prompt", request.get("input"))
    return prompt if isinstance(prompt, str) else None


async def export(
    store: EpisodeStore, path: Path, fmt: Format = "jsonl", flt: ExportFilter | None = None
) -> int:
    """Write the filtered episodes' rows to `path`; returns the number of rows."""
    flt = flt or ExportFilter()
    rows: list[dict[str, Any]] = []
    make_rows = sft_rows if fmt == "sft" else transition_rows
    async for rollout_id in rollout_ids(store):
        view = await store.get_rollout_view(rollout_id)
        if view is not None and flt.keeps(view):
            rows.extend(make_rows(view, flt.agent_name))
    rows.sort(key=lambda r: (r.get("closed_at") or 0, r["rollout_id"], r.get("index", 0)))
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        # nested JSON values (messages, tools) as JSON strings: their shapes vary from call to call
        flat = [
            {
                k: orjson.dumps(v).decode() if isinstance(v, (dict, list)) and k in _JSON_COLUMNS else v
                for k, v in row.items()
            }
            for row in rows
        ]
        pq.write_table(pa.Table.from_pylist(flat), path)
    else:
        with path.open("wb") as out:
            for row in rows:
                out.write(orjson.dumps(row) + b"\n")
    return len(rows)


_JSON_COLUMNS = ("messages", "tools", "response_message")


@dataclass(slots=True)
class FollowCounts:
    episodes: int = 0  # stream entries handled (acknowledged)
    rows: int = 0  # rows written
    skipped: int = 0  # episodes the filter left out
    gone: int = 0  # episodes whose keys had expired before they could be exported
    unreadable: int = 0  # episodes whose records could not be read (acknowledged, so they do not block)


async def follow(
    store: EpisodeStore,
    path: Path,
    fmt: Format = "jsonl",
    flt: ExportFilter | None = None,
    *,
    group: str = "exporters",
    consumer: str = "export",
    stop: Any = None,
    batch: int = 256,
    block_ms: int = 1000,
    counts: FollowCounts | None = None,
) -> FollowCounts:
    """Append every closed episode to `path` as it is closed, until `stop` (an `asyncio.Event`) is set.

    Reads the closed-episode stream through a consumer group of its own (`group`, created at the stream's
    start: a first run exports what the stream still holds), so the learners' group is untouched, and the
    sweeper trims no entry this group has not acknowledged (`keys`: retention). One exporter per group
    (`consumer` is its name). Each batch's rows are written and fsynced before its entries are
    acknowledged: a crash exports them again when restarted (at least once: a row's `rollout_id` and
    `index` tell a copy), and a line a crash left half-written is cut off first. Episodes whose keys have
    expired already (the exporter was down longer than the retention) are counted in `gone`, those whose
    records cannot be read in `unreadable`. Counts go to
    `counts` when given (kept across a retry after `StoreUnavailable`).
    """
    if fmt == "parquet":
        raise ValueError("--follow appends JSONL (jsonl or sft), not parquet")
    flt = flt or ExportFilter()
    make_rows = sft_rows if fmt == "sft" else transition_rows
    stream = ClosedEpisodes(store, group=group)
    await stream.ensure_group()
    counts = counts if counts is not None else FollowCounts()
    path.parent.mkdir(parents=True, exist_ok=True)
    _cut_torn_line(path)
    own = True  # a restarted exporter's own pending entries first, until none is left
    with path.open("ab") as out:
        while True:
            if own:
                episodes, held = await stream.own_pending(consumer, count=batch)
                own = held == batch  # a full reply (deleted entries count): there may be more
            elif stop is not None and stop.is_set():
                return counts
            else:
                episodes = await stream.read(consumer, batch, block_ms)
            if not episodes:
                continue
            lines: list[bytes] = []
            for episode in episodes:
                try:
                    view = await store.get_rollout_view(episode.rollout_id)
                except ValueError:  # a record this version cannot read: counted, never a crash loop
                    counts.unreadable += 1
                    continue
                if view is None:
                    counts.gone += 1
                elif flt.keeps(view):
                    lines.extend(orjson.dumps(row) + b"\n" for row in make_rows(view, flt.agent_name))
                else:
                    counts.skipped += 1
            out.write(b"".join(lines))
            out.flush()
            os.fsync(out.fileno())
            for episode in episodes:
                await stream.drop(episode)  # XACK, the rollout is not marked consumed: that is the learner's
            counts.episodes += len(episodes)
            counts.rows += len(lines)


def _cut_torn_line(path: Path) -> None:
    """Cut a last line that has no newline (a crash or a full disk in the middle of a write) off `path`."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with path.open("rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        size = f.seek(0, os.SEEK_END)
        step = 1 << 16
        end = size
        while end > 0:
            start = max(0, end - step)
            f.seek(start)
            chunk = f.read(end - start)
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                f.truncate(start + cut + 1)
                return
            end = start
        f.truncate(0)
