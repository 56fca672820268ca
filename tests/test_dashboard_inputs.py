"""The dashboard's handling of hostile input that needs no browser: cookies an attacker writes and agent
requests of any shape (tests/test_dashboard.py drives the pages in chromium)."""

from __future__ import annotations

import time

import pytest

from gateway.ui import rollouts, session


@pytest.mark.parametrize("cookie", ["\xb2.abc", "\u0661\u0662.abc", "1e9.abc", ".abc", "abc", "", None])
def test_a_malformed_session_cookie_is_refused_not_an_error(cookie: str | None) -> None:
    assert session.valid(b"operator-token", cookie) is False


def test_a_session_cookie_is_valid_only_under_its_token_and_until_it_expires() -> None:
    cookie = session.issue(b"operator-token")
    assert session.valid(b"operator-token", cookie)
    assert not session.valid(b"another-token", cookie)
    assert not session.valid(b"operator-token", cookie, now=time.time() + 10**7)


@pytest.mark.parametrize(
    "calls",
    [
        [{"function": "x"}],
        [{"function": None, "id": 3}],
        ["text"],
        [{"function": {"name": ["a"], "arguments": 1}}],
    ],
)
def test_tool_calls_of_any_shape_render_as_text(calls: list) -> None:
    html = str(rollouts._tool_calls(calls))
    assert "<script" not in html and "tool-call" in html


def _spans(html: str) -> list[tuple[str | None, str]]:
    """(data-id, text) of each token span, as the standard library's HTML parser reads the markup."""
    from html.parser import HTMLParser

    out: list[tuple[str | None, str]] = []

    class Parser(HTMLParser):
        depth = 0

        def handle_starttag(self, tag: str, attrs: list) -> None:
            attributes = dict(attrs)
            if tag == "span" and "t" in (attributes.get("class") or "").split():
                out.append((attributes.get("data-id"), ""))
                self.depth = 1
            elif self.depth:
                self.depth += 1

        def handle_endtag(self, tag: str) -> None:
            if self.depth:
                self.depth -= 1

        def handle_data(self, data: str) -> None:
            if self.depth:
                out[-1] = (out[-1][0], out[-1][1] + data)

    Parser(convert_charrefs=True).feed(html)
    return out


def _call(**kw):
    from rlgate.episodes import IndexedCall

    return IndexedCall(
        rollout_id="r",
        endpoint="chat.completions",
        policy_version=0,
        request={},
        started_at=0.0,
        latency_ms=1.0,
        index=0,
        completion_token_ids=[5, 6, 7, 8],
        completion_logprobs=[-0.01, -3.0, float("-inf"), -0.5],
        **kw,
    )


def test_token_text_is_text_with_line_ends_marked_and_ids_kept() -> None:
    html = str(rollouts._tokens(_call(completion_token_texts=["<script>", "a\nb", "", " &x"])))
    assert "<script>" not in html and 'class="tokens text"' in html
    assert _spans(html) == [("5", "<script>"), ("6", "a↵\nb"), ("7", "∅"), ("8", " &x")]
    assert 'class="t lp9"' in html and 'class="t lpn"' in html  # p 0.99, and -inf: no probability


@pytest.mark.parametrize("texts", [None, [], ["a", "b"]])
def test_without_the_text_of_every_token_the_ids_are_shown(texts: list | None) -> None:
    html = str(rollouts._tokens(_call(completion_token_texts=texts)))
    assert 'class="tokens ids"' in html
    assert _spans(html) == [("5", "5"), ("6", "6"), ("7", "7"), ("8", "8")]
