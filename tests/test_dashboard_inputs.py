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
