"""The overview page: throughput, backlog, the policy, success by policy version, errors, recent rollouts.

Store-wide numbers come from `episodes.overview.StoreOverview.counts` (no SCAN); this gateway's calls and
errors from its Prometheus counters. Rates are deltas between polls (`Rates`), so they need two polls;
episodes started per second is counted on the listing index over the last minute and needs one.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from prometheus_client import CollectorRegistry, Counter

from gateway.ui.html import Html, join, num, tag, when
from gateway.ui.svg import line_chart
from rlgate.episodes.overview import StoreCounts
from rlgate.episodes.records import RolloutSummary


def counter_values(
    registry: CollectorRegistry, counter: Counter, label: str | None = None
) -> dict[str, float]:
    """A labelled Prometheus counter's totals (summed over other labels), by the value of `label`; one
    entry, "total", without a label. Read from the registry /metrics serves, so that with several
    worker processes (multiprocess mode) the totals are every worker's, not the answering one's."""
    name = list(counter.describe())[0].name
    totals: dict[str, float] = {}
    for metric in registry.collect():
        if metric.name != name:
            continue
        for sample in metric.samples:
            if not sample.name.endswith("_total"):
                continue
            key = sample.labels.get(label, "") if label else "total"
            totals[key] = totals.get(key, 0.0) + sample.value
    return totals


class Rates:
    """Per-second rates of counters from their deltas between polls, over the last `horizon_s`."""

    def __init__(self, horizon_s: float = 60.0, max_samples: int = 256) -> None:
        self.horizon_s = horizon_s
        self.samples: deque[tuple[float, dict[str, float]]] = deque(maxlen=max_samples)

    def add(self, values: dict[str, float], now: float | None = None) -> dict[str, float]:
        """Remember `values` and return the rate of each since the oldest sample in the horizon; a name
        absent before counts from 0. Empty until two polls at least 0.5 s apart."""
        now = time.monotonic() if now is None else now
        self.samples.append((now, dict(values)))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.horizon_s:
            self.samples.popleft()
        then, before = self.samples[0]
        if now - then < 0.5:
            return {}
        return {k: max(0.0, (v - before.get(k, 0.0)) / (now - then)) for k, v in values.items()}


@dataclass
class Snapshot:
    counts: StoreCounts
    steps: list[dict[str, Any]]  # recent learner steps, oldest first
    calls: dict[str, float]  # this gateway's calls by outcome
    errors: dict[str, float]  # this gateway's errors by kind
    rates: dict[str, float]
    recent: Sequence[RolloutSummary]
    gateway_backlog: int
    holding: bool
    servers: Sequence[dict[str, Any]] = ()  # with several inference servers: each one's health and load


def _stat(key: str, label: str, value: Any, note: str = "") -> Html:
    return tag(
        "div",
        tag("dt", label),
        tag("dd", num(value), id=key),
        tag("small", note) if note else None,
        class_="stat",
    )


def _rate(rates: dict[str, float], key: str) -> str:
    return f"{rates[key]:.2f}" if key in rates else "—"


def pushed_at(counts: StoreCounts, steps: list[dict[str, Any]]) -> float | None:
    """When the current policy version was pushed: the time of the learner step that made it."""
    version = counts.policy.version
    for step in reversed(steps):
        if step.get("policy_version") == version:
            return cast(float | None, step.get("time"))
    return None


def by_version(steps: Sequence[dict[str, Any]], key: str) -> list[tuple[int, tuple[float, float, float]]]:
    """The learner steps' tallies per serving policy version (`key`: `by_version` or `val_by_version`,
    version -> [episodes, successes, reward sum]) summed over `steps`, in version order; versions with no
    episode and malformed entries left out."""
    total: dict[int, list[float]] = {}
    for step in steps:
        rows = step.get(key)
        if not isinstance(rows, dict):
            continue
        for name, row in rows.items():
            try:
                version = int(name)
                n, ok, reward = (float(x) for x in row)
            except (TypeError, ValueError):
                continue
            into = total.setdefault(version, [0.0, 0.0, 0.0])
            into[0] += n
            into[1] += ok
            into[2] += reward
    return [(v, (n, ok, r)) for v, (n, ok, r) in sorted(total.items()) if n > 0]


def rollout_rows(rows: Sequence[RolloutSummary]) -> Html:
    """The rows of a rollout table (the overview's recent rollouts and the rollouts page)."""
    out = []
    for r in rows:
        versions = (
            "—"
            if r.first_version is None
            else str(r.first_version)
            if r.first_version == r.last_version
            else f"{r.first_version}–{r.last_version}"
        )
        out.append(
            tag(
                "tr",
                tag("td", tag("a", r.rollout_id, href=f"/ui/rollouts/{r.rollout_id}", class_="rollout-link")),
                tag("td", r.task_id or "—"),
                tag("td", r.status.value, class_=f"status {r.status.value}"),
                tag("td", r.mode),
                tag("td", r.agent_name or "—"),
                tag("td", versions, class_="num"),
                tag("td", num(r.reward), class_="num"),
                tag("td", num(r.calls), class_="num"),
                tag("td", when(r.created_at)),
                data_rollout=r.rollout_id,
            )
        )
    return join(out)


ROLLOUT_HEADER = tag(
    "tr",
    *(
        tag("th", name)
        for name in (
            "rollout",
            "task",
            "status",
            "mode",
            "agent",
            "version",
            "reward",
            "calls",
            "created (UTC)",
        )
    ),
)


def _stats(s: Snapshot) -> Html:
    """The numbers at the top: rates, backlog, the policy."""
    c = s.counts
    started = c.started_recently / c.window_s
    pushed = pushed_at(c, s.steps)
    return tag(
        "dl",
        _stat("episodes-started-per-s", "episodes started / s", f"{started:.2f}", f"last {c.window_s:g} s"),
        _stat("episodes-closed-per-s", "episodes closed / s", _rate(s.rates, "closed")),
        _stat("calls-per-s", "calls / s", _rate(s.rates, "calls"), "this gateway"),
        _stat("open", "open", c.open, "agents at work"),
        _stat("reward-jobs", "awaiting reward", c.reward_jobs, "reward jobs queued"),
        _stat(
            "closed-waiting",
            "closed, not yet trained",
            c.closed_waiting,
            "learners' lag + pending" if c.has_group else "no learner group yet: stream length",
        ),
        _stat("policy-version", "policy version", c.policy.version, f"pushed {when(pushed)} UTC"),
        _stat("indexed", "rollouts listed", c.indexed),
        class_="stats",
    )


def _charts(steps: list[dict[str, Any]]) -> Html:
    """Success rate and mean reward by serving policy version: training episodes, validation episodes."""
    train, val = by_version(steps, "by_version"), by_version(steps, "val_by_version")
    reward_chart = line_chart(
        "Training episodes by the policy version that served them",
        [
            ("success rate", [(v, ok / n) for v, (n, ok, _) in train]),
            ("mean reward", [(v, total / n) for v, (n, _, total) in train]),
        ],
        x_label=f"oldest policy version that served the episode (last {len(steps)} learner steps)",
        chart_id="chart-success",
    )
    val_chart = line_chart(
        "Validation episodes (never trained on)",
        [
            ("success rate", [(v, ok / n) for v, (n, ok, _) in val]),
            ("mean reward", [(v, total / n) for v, (n, _, total) in val]),
        ],
        x_label="oldest policy version that served the episode",
        chart_id="chart-validation",
    )
    return tag("div", reward_chart, val_chart, class_="charts")


def _errors(errors: dict[str, float], rates: dict[str, float]) -> Html:
    """This gateway's errors by kind: total and rate (a kind seen only in the rates counts too)."""
    kinds = sorted((set(errors) | {k.removeprefix("error:") for k in rates if k.startswith("error:")}) - {""})
    return tag(
        "table",
        tag("tr", tag("th", "error kind"), tag("th", "total"), tag("th", "per s")),
        [
            tag(
                "tr",
                tag("td", kind),
                tag("td", num(int(errors.get(kind, 0))), class_="num"),
                tag("td", _rate(rates, f"error:{kind}"), class_="num"),
                data_kind=kind,
            )
            for kind in kinds
        ]
        or tag("tr", tag("td", "no errors", colspan=3)),
        id="errors",
    )


def _outcomes(calls: dict[str, float]) -> Html:
    """This gateway's calls by outcome."""
    return tag(
        "table",
        tag("tr", tag("th", "call outcome"), tag("th", "total")),
        [tag("tr", tag("td", k), tag("td", num(int(v)), class_="num")) for k, v in sorted(calls.items())],
        id="outcomes",
    )


def _servers(servers: Sequence[dict[str, Any]]) -> Html | None:
    """With several inference servers, each one's health and load as this gateway sees it; else nothing."""
    if not servers:
        return None
    rows = [
        tag(
            "tr",
            tag("td", str(server["server"])),
            tag("td", "up" if server["healthy"] else "down"),
            tag("td", num(server["in_flight"]), class_="num"),
            tag("td", num(server["queue"]), class_="num"),
            tag(
                "td", "—" if server["loaded_version"] is None else num(server["loaded_version"]), class_="num"
            ),
            data_server=str(server["server"]),
        )
        for server in servers
    ]
    header = tag(
        "tr",
        tag("th", "server"),
        tag("th", "health"),
        tag("th", "calls in flight"),
        tag("th", "queue"),
        tag("th", "loaded version"),
    )
    return tag(
        "section",
        tag("h2", "Inference servers (this gateway's view)"),
        tag("table", header, rows, id="servers"),
    )


def live(s: Snapshot) -> Html:
    """The part of the overview that refreshes itself."""
    held = " (holding new rollouts)" if s.holding else ""
    return join(
        [
            _stats(s),
            _charts(s.steps),
            tag(
                "div",
                tag("section", tag("h2", "Errors (this gateway)"), _errors(s.errors, s.rates)),
                tag("section", tag("h2", "Calls (this gateway)"), _outcomes(s.calls)),
                tag(
                    "section",
                    tag("h2", "Backpressure"),
                    tag("p", f"backlog {s.gateway_backlog}{held}", id="gateway-backlog"),
                ),
                class_="columns",
            ),
            _servers(s.servers),
            tag("h2", "Recent rollouts"),
            tag("table", ROLLOUT_HEADER, rollout_rows(s.recent), id="recent", class_="rollouts"),
            tag("p", tag("a", "All rollouts", href="/ui/rollouts")),
        ]
    )


def render(s: Snapshot, every_s: float) -> Html:
    return join(
        [
            tag("h1", "Overview"),
            tag("div", live(s), id="live", data_refresh="/ui?fragment=1", data_every=f"{every_s:g}"),
        ]
    )
