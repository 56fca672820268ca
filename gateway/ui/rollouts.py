"""The rollouts pages: a filtered listing a page at a time, and one rollout with its calls in order.

What an agent sent is shown as text (`gateway.ui.html` escapes it) and cut to `TEXT_MAX` characters per
field, a completion to `TOKENS_MAX` tokens: a page of calls stays small however large its records are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import orjson

from gateway.ui.html import Html, join, num, tag, truncate, when
from gateway.ui.overview import ROLLOUT_HEADER, rollout_rows
from rlgate.episodes.records import IndexedCall, RolloutStatus, RolloutSummary, RolloutView

TEXT_MAX = 4000  # characters of one message, argument list or answer shown
TOKENS_MAX = 4096  # completion tokens shown per call


@dataclass
class Filters:
    task: str | None = None
    status: RolloutStatus | None = None
    mode: str | None = None
    agent: str | None = None
    version: int | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    since: float | None = None
    until: float | None = None
    limit: int = 50

    def keep(self, row: RolloutSummary) -> bool:
        """The filters `EpisodeStore.list_rollouts` does not apply itself."""
        if self.mode is not None and row.mode != self.mode:
            return False
        if self.agent is not None and row.agent_name != self.agent:
            return False
        if self.version is not None and not (
            row.first_version is not None
            and row.last_version is not None
            and row.first_version <= self.version <= row.last_version
        ):
            return False
        if self.min_reward is not None and (row.reward is None or row.reward < self.min_reward):
            return False
        return not (self.max_reward is not None and (row.reward is None or row.reward > self.max_reward))

    def query(self, **extra: Any) -> str:
        params = {
            "task": self.task,
            "status": self.status.value if self.status else None,
            "mode": self.mode,
            "agent": self.agent,
            "version": self.version,
            "min_reward": self.min_reward,
            "max_reward": self.max_reward,
            "since": self.since,
            "until": self.until,
            "limit": self.limit if self.limit != 50 else None,
            **extra,
        }
        return urlencode({k: v for k, v in params.items() if v is not None})


def _field(name: str, label: str, value: Any, kind: str = "text", **attrs: Any) -> Html:
    return tag(
        "label", label, tag("input", name=name, type=kind, value="" if value is None else value, **attrs)
    )


def _select(name: str, label: str, value: str | None, options: Sequence[str]) -> Html:
    return tag(
        "label",
        label,
        tag(
            "select",
            tag("option", "any", value=""),
            [tag("option", o, value=o, selected=o == value) for o in options],
            name=name,
        ),
    )


def listing(
    f: Filters,
    rows: Sequence[RolloutSummary],
    next_cursor: str | None,
    scanned: int,
) -> Html:
    form = tag(
        "form",
        _field("task", "task", f.task),
        _select("status", "status", f.status.value if f.status else None, [s.value for s in RolloutStatus]),
        _select("mode", "mode", f.mode, ["train", "val"]),
        _field("agent", "agent", f.agent),
        _field("version", "policy version", f.version, "number", min=0),
        _field("min_reward", "reward ≥", f.min_reward, "number", step="any"),
        _field("max_reward", "reward ≤", f.max_reward, "number", step="any"),
        _field("since", "created since (unix s)", f.since, "number", step="any"),
        tag("button", "Filter", type="submit"),
        method="get",
        action="/ui/rollouts",
        class_="filters",
        id="filters",
    )
    kept = [r for r in rows if f.keep(r)]
    nav = [tag("a", "First page", href="/ui/rollouts?" + f.query())]
    if next_cursor:
        nav.append(tag("a", "Next page", href="/ui/rollouts?" + f.query(cursor=next_cursor), id="next-page"))
    return join(
        [
            tag("h1", "Rollouts"),
            form,
            tag(
                "p",
                f"{len(kept)} shown of {scanned} rollouts read from the index, newest first; the filters "
                "apply to each page, so a page may be short.",
                class_="note",
                id="listing-note",
            ),
            tag("table", ROLLOUT_HEADER, rollout_rows(kept), id="rollouts", class_="rollouts"),
            tag("p", nav, class_="pager"),
        ]
    )


# ---------------------------------------------------------------------------------------------------------
# One rollout


def _text_block(value: Any, class_: str = "text") -> Html:
    if value is None:
        return tag("pre", "—", class_=class_)
    text = value if isinstance(value, str) else orjson.dumps(value, option=orjson.OPT_INDENT_2).decode()
    shown, cut = truncate(text, TEXT_MAX)
    return tag("pre", shown, tag("em", f" … {cut} more characters") if cut else None, class_=class_)


def _content(content: Any) -> Html:
    """A message's content: text, or its parts (text parts as text, others as JSON)."""
    if isinstance(content, list):
        return join(
            _text_block(p.get("text") if isinstance(p, dict) and p.get("type") == "text" else p)
            for p in content
        )
    return _text_block(content)


def _tool_calls(calls: Any) -> Html | None:
    if not isinstance(calls, list) or not calls:
        return None
    items = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        fn = fn if isinstance(fn, dict) else {}  # the agent's own request: any shape
        items.append(
            tag(
                "li",
                tag("code", str(fn.get("name", "?"))),
                tag("small", f" id {call.get('id')}" if isinstance(call, dict) and call.get("id") else ""),
                _text_block(fn.get("arguments")),
                class_="tool-call",
            )
        )
    return tag("ul", items, class_="tool-calls")


def _message(m: Any) -> Html:
    if not isinstance(m, dict):
        return tag("div", _text_block(m), class_="msg")
    role = str(m.get("role", "?"))
    extra = f" · tool_call_id {m['tool_call_id']}" if m.get("tool_call_id") else ""
    return tag(
        "div",
        tag("div", role + extra, class_="role"),
        _content(m.get("content")),
        _tool_calls(m.get("tool_calls")),
        class_=f"msg role-{role if role.isalnum() else 'other'}",
    )


MESSAGES_SHOWN = 20  # per call: of the messages before its last assistant turn, and of those after


def _request(request: dict[str, Any]) -> Html:
    """The messages (or prompt, or input) the call saw: what came after the last assistant message openly
    (the user's turn, tool results), all of them folded."""
    messages = request.get("messages")
    if isinstance(messages, list):
        last = max(
            (i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
            default=-1,
        )
        new = messages[last + 1 :][-MESSAGES_SHOWN:]
        earlier = messages[max(0, last + 1 - MESSAGES_SHOWN) : last + 1]  # a page's size stays bounded
        return join(
            [
                tag(
                    "details",
                    tag(
                        "summary",
                        f"earlier messages ({last + 1} of {len(messages)}; the last {len(earlier)} shown)",
                    ),
                    [_message(m) for m in earlier],
                )
                if last >= 0
                else None,
                [_message(m) for m in new],
            ]
        )
    for key in ("prompt", "input"):
        if key in request:
            return tag("div", tag("div", key, class_="role"), _text_block(request[key]), class_="msg")
    return _text_block(request)


def _token_text(text: str) -> Any:
    """A token's text as shown (escaped by `tag`): line ends marked (↵) before they break the line, an
    empty token as ∅."""
    if not text:
        return tag("span", "∅", class_="mark")
    if "\n" not in text:
        return text
    lines = text.split("\n")
    return [lines[0], *([tag("span", "↵", class_="mark"), "\n", line] for line in lines[1:])]


def _tokens(call: IndexedCall) -> Html | None:
    """The completion's tokens shaded by sampling probability: as text where the record kept each token's
    text (`RLGATE_RECORD_TOKEN_TEXT`), else as token ids; the id, log-prob and probability in the tooltip."""
    ids = call.completion_token_ids
    if not ids:
        return None
    logprobs = call.completion_logprobs or []
    texts = (
        call.completion_token_texts
        if call.completion_token_texts and len(call.completion_token_texts) == len(ids)
        else None
    )
    spans = []
    for i, token in enumerate(ids[:TOKENS_MAX]):
        shown: Any = token if texts is None else _token_text(texts[i])
        lp = logprobs[i] if i < len(logprobs) else None
        if lp is None or not math.isfinite(lp):
            spans.append(
                tag("span", shown, class_="t lpn", title=f"token {token}: no log-prob", data_id=token)
            )
            continue
        p = math.exp(lp)
        spans.append(
            tag(
                "span",
                shown,
                class_=f"t lp{min(9, int(p * 10))}",
                title=f"token {token} · log-prob {lp:.4f} · p {p:.3f}",
                data_id=token,
            )
        )
    more = len(ids) - TOKENS_MAX
    kind = "text" if texts is not None else "ids"
    return tag(
        "div",
        tag("div", f"completion: {len(ids)} tokens ({kind}), shaded by sampling probability", class_="role"),
        tag(
            "div",
            spans,
            tag("em", f" … {more} more tokens") if more > 0 else None,
            class_=f"tokens {kind}",
        ),
        class_="msg",
    )


def _call(call: IndexedCall) -> Html:
    r = call.response
    facts = [
        ("endpoint", call.endpoint),
        ("model", call.model),
        ("policy version", call.policy_version),
        ("agent", call.agent_name),
        ("stream", call.stream),
        ("started (UTC)", when(call.started_at)),
        ("latency ms", call.latency_ms),
        ("TTFB ms", call.ttfb_ms),
        ("finish", r.finish_reason if r else None),
        ("prompt tokens", len(call.prompt_token_ids) if call.prompt_token_ids is not None else None),
        ("reward", call.reward),
        ("AIR reward", call.air_reward),
    ]
    answer = None
    if r is not None:
        if r.message is not None:
            answer = _message(r.message)
        elif r.text is not None:
            answer = tag("div", tag("div", "text", class_="role"), _text_block(r.text), class_="msg")
        elif r.output is not None:
            answer = tag("div", tag("div", "output", class_="role"), _text_block(r.output), class_="msg")
    error = (
        tag("p", f"error {call.error.status} {call.error.type}: {call.error.message}", class_="error")
        if call.error
        else None
    )
    return tag(
        "section",
        tag("h3", f"call {call.index}" + (f" (choice {call.choice_index})" if call.choice_index else "")),
        tag(
            "dl",
            [tag("div", tag("dt", k), tag("dd", num(v), data_fact=k), class_="fact") for k, v in facts],
            class_="facts",
        ),
        error,
        tag("div", tag("h4", "request"), _request(call.request), class_="request"),
        tag("div", tag("h4", "answer"), answer, _tokens(call), class_="answer"),
        class_="call",
        id=f"call-{call.index}",
        data_index=call.index,
    )


def rollout(view: RolloutView, offset: int, limit: int, total: int) -> Html:
    facts = [
        ("task", "task", view.task_id),
        ("status", "status", view.status.value),
        ("mode", "mode", view.mode),
        ("created", "created (UTC)", when(view.created_at)),
        ("closed", "closed (UTC)", when(view.closed_at) if view.closed_at else None),
        ("reward", "reward", view.reward),
        ("calls", "calls", total),
        ("error", "error", view.error),
        ("reward-fn", "reward function", view.finish.reward_fn if view.finish else None),
    ]
    pager = []
    base = f"/ui/rollouts/{view.rollout_id}"
    if offset > 0:
        pager.append(tag("a", "Previous calls", href=f"{base}?offset={max(0, offset - limit)}&limit={limit}"))
    if offset + limit < total:
        pager.append(
            tag("a", "Next calls", href=f"{base}?offset={offset + limit}&limit={limit}", id="next-calls")
        )
    shown = (
        f"calls {offset}–{offset + len(view.calls) - 1} of {total}" if view.calls else f"no calls at {offset}"
    )
    return join(
        [
            tag("h1", "Rollout ", tag("code", view.rollout_id, id="rollout-id")),
            tag(
                "dl",
                [
                    tag("div", tag("dt", label), tag("dd", num(v), id=f"r-{key}"), class_="fact")
                    for key, label, v in facts
                ],
                class_="facts",
            ),
            tag("details", tag("summary", "reward metadata"), _text_block(view.reward_metadata))
            if view.reward_metadata
            else None,
            tag("details", tag("summary", "metadata"), _text_block(view.metadata)) if view.metadata else None,
            tag(
                "details",
                tag("summary", f"{len(view.events)} events"),
                _text_block([e.model_dump() for e in view.events]),
            )
            if view.events
            else None,
            tag("p", shown, " ", pager, class_="pager"),
            [_call(c) for c in view.calls],
            tag("p", pager, class_="pager"),
        ]
    )
