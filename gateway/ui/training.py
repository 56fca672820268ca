"""The training page: the learner's per-step numbers from its capped stream (`Keys.learner_steps`),
charted against the step, and the newest steps as a table."""

from __future__ import annotations

from typing import Any

from gateway.ui.html import Html, join, num, tag, when
from gateway.ui.svg import line_chart

# (title, [(series label, metric key)]): what the learner writes per step (learner/loop.py, UpdateStats)
CHARTS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("Loss", (("loss", "loss"), ("policy loss", "policy_loss"))),
    ("KL", (("kl", "kl"), ("ppo kl", "ppo_kl"), ("rollout kl", "rollout_kl"))),
    ("Clip fraction", (("clip ratio", "clip_ratio"),)),
    ("Entropy", (("entropy", "entropy"),)),
    (
        "Importance weights",
        (
            ("mean", "is_weight_mean"),
            ("max", "is_weight_max"),
            ("outside bounds", "is_outside"),
            ("filtered", "is_filter_ratio"),
        ),
    ),
    ("Log-prob gap |learner - sampler|", (("mean abs gap", "logprob_gap"),)),
    ("Advantages' spread (reward std within groups)", (("group reward std", "group_reward_std"),)),
    (
        "Episodes per step",
        (("used", "episodes"), ("dropped stale", "dropped_stale"), ("dropped failed", "dropped_failed")),
    ),
    ("Push time (s)", (("push", "push_seconds"), ("train", "train_seconds"))),
    (
        "Rewards",
        (
            ("mean reward", "reward_mean"),
            ("success rate", "success_rate"),
            ("validation success", "val_success_rate"),
        ),
    ),
)
# the newest steps' table: (column, metric key)
COLUMNS = (
    ("step", "step"),
    ("version", "policy_version"),
    ("loss", "loss"),
    ("kl", "kl"),
    ("clip", "clip_ratio"),
    ("entropy", "entropy"),
    ("IS mean", "is_weight_mean"),
    ("IS max", "is_weight_max"),
    ("lp gap", "logprob_gap"),
    ("adv spread", "group_reward_std"),
    ("episodes", "episodes"),
    ("stale", "dropped_stale"),
    ("push s", "push_seconds"),
    ("reward", "reward_mean"),
    ("success", "success_rate"),
    ("val success", "val_success_rate"),
)
TABLE_ROWS = 20


def render(steps: list[dict[str, Any]], every_s: float, count: int) -> Html:
    return join(
        [
            tag("h1", "Training"),
            tag(
                "p",
                f"The newest {count} learner steps at most, from the learner's capped stream.",
                class_="note",
            ),
            tag(
                "div",
                live(steps),
                id="live",
                data_refresh=f"/ui/training?fragment=1&steps={count}",
                data_every=f"{every_s:g}",
            ),
        ]
    )


def live(steps: list[dict[str, Any]]) -> Html:
    if not steps:
        return tag("p", "No learner steps yet: the learner writes one per training step.", class_="empty")
    charts = [
        line_chart(
            title,
            [(label, [(s.get("step"), s.get(key)) for s in steps]) for label, key in series],
            x_label="step",
        )
        for title, series in CHARTS
    ]
    rows = [
        tag(
            "tr",
            [tag("td", num(s.get(key)), class_="num", data_key=key) for _, key in COLUMNS],
            tag("td", when(s.get("time"))),
            data_step=s.get("step"),
        )
        for s in reversed(steps[-TABLE_ROWS:])
    ]
    return join(
        [
            tag("div", charts, class_="charts"),
            tag("h2", "Newest steps"),
            tag(
                "table",
                tag("tr", [tag("th", name) for name, _ in COLUMNS], tag("th", "time (UTC)")),
                rows,
                id="steps",
            ),
        ]
    )
