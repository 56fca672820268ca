"""Reward functions: table tests with hand-computed values, SQL on a real SQLite file, the LLM judge against
a local OpenAI-compatible server, and the registry's name lookup."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from decimal import Decimal
from fractions import Fraction
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy
import pydantic
import pytest
import torch
from rq.timeouts import JobTimeoutException, UnixSignalDeathPenalty

from reward_hooks.limits import RewardOutOfRange, check_reward
from reward_hooks.rewards import (
    BUILTINS,
    RewardInput,
    RewardInputError,
    UnknownRewardFn,
    get_reward_fn,
    register,
    registry,
)
from reward_hooks.rewards.judge import DEFAULT_RUBRIC, parse_score
from reward_hooks.rewards.text import exact_match, f1


def score(name: str, answer: str, ground_truth: Any = None, question: str | None = None, **params: Any):
    """The named reward, looked up like a reward job does."""
    inp = RewardInput(answer=answer, ground_truth=ground_truth, question=question, params=params)
    return get_reward_fn(name)(inp)


@pytest.mark.parametrize(
    "answer, truth, expected",
    [
        ("Paris", "paris", 1.0),
        ("The Eiffel Tower!", "eiffel tower", 1.0),  # article, punctuation, case
        ("the theater", "theater", 1.0),
        ("theater", "ater", 0.0),  # "the" is dropped only as a word
        ("Paris, France", "Paris", 0.0),
        ("  new   york ", "New York", 1.0),
        ("", "", 1.0),
        ("", "Paris", 0.0),
        ("NYC", ["New York City", "NYC"], 1.0),
        ("Boston", ["New York City", "NYC"], 0.0),
        ("\u201cZ\u00fcrich\u201d", "z\u00fcrich", 1.0),  # curly quotes are punctuation; umlaut kept
        ("Zu\u0308rich", "Z\u00fcrich", 1.0),  # decomposed vs composed umlaut (NFKC)
        ("\uff34\uff4f\uff4b\uff59\uff4f", "tokyo", 1.0),  # full-width letters (NFKC)
        ("Tokyo \u2014 Japan", "tokyo japan", 1.0),  # em dash
    ],
)
def test_exact_match(answer, truth, expected):
    assert score("exact_match", answer, truth) == expected


@pytest.mark.parametrize(
    "answer, truth, expected",
    [
        ("the cat sat", "cat sat on mat", 2 / 3),  # P = 2/2, R = 2/4
        ("cat cat cat", "cat", 0.5),  # overlap counted once: P = 1/3, R = 1
        ("Paris", "Paris", 1.0),
        ("London", "Paris", 0.0),
        ("a", "the", 1.0),  # both empty after normalization
        ("", "Paris", 0.0),
        ("Paris", "", 0.0),
        ("new york", ["New York City", "york"], 0.8),  # max of 0.8 (P 1, R 2/3) and 2/3 (P 1/2, R 1)
        ("S\u00e3o Paulo Brazil", "s\u00e3o paulo", 0.8),  # P = 2/3, R = 1
    ],
)
def test_f1(answer, truth, expected):
    assert score("f1", answer, truth) == pytest.approx(expected)


@pytest.mark.parametrize(
    "answer, truth, params, expected",
    [
        ("<answer>Paris</answer>", "Paris", {}, 1.0),
        ("I think <answer>the city of Paris</answer>", "Paris", {}, 0.55),  # F1 0.5 (P 1/3, R 1)
        ("<answer>London</answer>", "Paris", {}, 0.1),  # format only
        ("Paris", "Paris", {}, 0.0),  # no tags: nothing is graded
        ("<answer>  </answer>", "Paris", {}, 0.0),
        ("<answer>Paris", "Paris", {}, 0.0),  # unclosed
        ("<answer>London</answer> no, <answer>Paris</answer>", "Paris", {}, 1.0),  # the last pair counts
        ("<answer>\nParis\n</answer>", "Paris", {}, 1.0),
        ("<answer>NYC</answer>", ["New York", "NYC"], {}, 1.0),
        ("[[Paris]]", "Paris", {"answer_tags": ["[[", "]]"]}, 1.0),
        ("<answer>Paris</answer>", "Paris", {"answer_tags": ["[[", "]]"]}, 0.0),
    ],
)
def test_format_and_f1(answer, truth, params, expected):
    assert score("format_and_f1", answer, truth, **params) == pytest.approx(expected)


@pytest.mark.parametrize(
    "name, truth, params",
    [
        ("exact_match", None, {}),
        ("exact_match", [], {}),
        ("f1", 42, {}),
        ("f1", ["ok", 1], {}),
        ("format_and_f1", "x", {"answer_tags": ["<a>"]}),
        ("format_and_f1", "x", {"answer_tags": ["", "</a>"]}),
    ],
)
def test_text_rewards_reject_bad_configuration(name, truth, params):
    with pytest.raises(ValueError):
        score(name, "<answer>x</answer>", truth, **params)


@pytest.mark.parametrize(
    "answer, truth, params, expected",
    [
        ("The answer is 42.", 42, {}, 1.0),
        ("42", "42", {}, 1.0),
        ("First 41, corrected: 42", 42, {}, 1.0),  # the last number counts
        ("42, no wait, 41", 42, {}, 0.0),
        ("\\boxed{\\frac{3}{4}}", 0.75, {}, 1.0),
        ("\\boxed{-\\dfrac{1}{2}}", "-0.5", {}, 1.0),
        ("3/4", "0.75", {}, 1.0),
        ("3/0", 3, {}, 0.0),  # a zero denominator is no number
        ("The total is $1,234.50.", 1234.5, {}, 1.0),
        ("1,234,567", 1234567, {}, 1.0),
        ("-17", -17, {}, 1.0),
        ("\u221217", -17, {}, 1.0),  # Unicode minus
        ("It is 17", -17, {}, 0.0),
        ("10-3=7", 7, {}, 1.0),  # "-3" in "10-3" is not negative
        ("50%", 0.5, {}, 1.0),
        ("50 %", 50, {}, 1.0),
        ("50", 0.5, {}, 0.0),  # no percent sign, no second reading
        ("\\boxed{12} and later 13", 12, {}, 1.0),  # boxed wins over the last number
        ("\\boxed{A}, 12", 12, {}, 0.0),  # a boxed answer without a number
        ("\\boxed{x = \\{1\\} + 4}", 4, {}, 1.0),  # nested braces
        ("\\boxed{1{,}000}", 1000, {}, 1.0),
        ("5 + 3 = 8\n#### 8", 8, {}, 1.0),
        ("#### 72", "48/2 = 24 clips in May, 48 + 24 = 72\n#### 72", {}, 1.0),  # a GSM8K solution as truth
        ("\u7b54\u6848\u662f42", 42, {}, 1.0),  # digits right after CJK text
        ("\uff14\uff12", 42, {}, 1.0),  # full-width digits
        ("H2O", 2, {}, 0.0),
        ("3.3333333", "10/3", {}, 1.0),  # relative error 1e-8
        ("3.33", "10/3", {}, 0.0),
        ("3.33", "10/3", {"rel_tol": 0.01}, 1.0),
        ("0.1", 0.1, {"rel_tol": 0}, 1.0),  # exact: the float's decimal, not its binary value
        ("0.0000001", 0, {}, 0.0),  # relative tolerance around 0 is 0
        ("12345678901234567891", 12345678901234567891, {"rel_tol": 0}, 1.0),
        ("7", [5, "7"], {}, 1.0),
        ("I don't know", 5, {}, 0.0),
        ("", 5, {}, 0.0),
    ],
)
def test_math_answer(answer, truth, params, expected):
    assert score("math_answer", answer, truth, **params) == expected


# Answers an optimizer could find that must score 0 against the ground truth beside them: each reads a number
# that is not the truth (the exponent belongs to the number), or no number at all.
HOSTILE_MATH_ANSWERS = [
    ("1e999999999", "1"),  # scored 1.0: only what stood before the e was read
    ("1e999999999x", "1"),
    ("1E+999999999", 1),
    ("1e-999999999", 1),
    ("1/1e999999", 1),  # a denominator's exponent too
    ("1e1", 1),
    ("5e0e7", 5),  # "e7" is a word after 5e0: the number is 5... see the test below
    ("inf", 1),
    ("Infinity", 1),
    ("nan", 0),
    ("NaN", 0),
    ("-0", 1),
    ("\u0661", 1),  # Arabic-Indic digit one: not read as a number (NFKC keeps it)
    ("1" * 1001, 1),  # longer than any answer: no number
    ("\\boxed{}1", 1),  # a boxed answer without a number does not fall back to the text around it
]


@pytest.mark.parametrize("answer, truth", HOSTILE_MATH_ANSWERS)
def test_math_answer_scores_hostile_answers_zero(answer, truth):
    if answer == "5e0e7":  # 5e0 is 5: a correct answer written strangely still scores
        assert score("math_answer", answer, truth) == 1.0
        return
    assert score("math_answer", answer, truth) == 0.0


def test_math_answer_reads_scientific_notation_as_python_does():
    """Property: a number in scientific notation, with any sign, mantissa and exponent within the bound,
    is read exactly as `fractions.Fraction` reads the same literal (the reference), and scores 1.0
    against that value only; an exponent beyond the bound reads as no number."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from reward_hooks.rewards.math import MAX_EXPONENT, final_number

    @settings(max_examples=300, deadline=None)
    @given(
        sign=st.sampled_from(["", "-", "+"]),
        whole=st.integers(0, 10**12),
        fraction=st.one_of(st.just(""), st.integers(0, 10**6).map(lambda d: f".{d}")),
        e=st.sampled_from("eE"),
        exp_sign=st.sampled_from(["", "-", "+"]),
        power=st.integers(0, 2 * MAX_EXPONENT),
        before=st.sampled_from(["", "x = ", "The answer is ", "#### "]),
        after=st.sampled_from(["", ".", " apples", "!", "x"]),
    )
    def check(sign, whole, fraction, e, exp_sign, power, before, after):
        literal = f"{whole}{fraction}{e}{exp_sign}{power}"
        text = f"{before}{sign if sign != '+' else ''}{literal}{after}"
        readings = final_number(text)
        if power > MAX_EXPONENT:
            assert readings == []
            return
        expected = Fraction(("-" if sign == "-" else "") + literal)
        assert readings == [expected]

    check()


@pytest.mark.parametrize(
    "truth, params",
    [
        (None, {}),
        ("no number here", {}),
        (True, {}),
        (float("nan"), {}),
        ([], {}),
        (1, {"rel_tol": -1}),
        (1, {"rel_tol": "0.1"}),
        (1, {"rel_tol": float("nan")}),
    ],
)
def test_math_answer_rejects_bad_configuration(truth, params):
    with pytest.raises(ValueError):
        score("math_answer", "1", truth, **params)


@pytest.fixture
def singer_db(tmp_path: Path) -> Path:
    path = tmp_path / "concert singer.db"  # a space, to exercise URI quoting
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE singer (id INTEGER PRIMARY KEY, name TEXT, country TEXT, age INTEGER)")
        rows = [(1, "Ann", "US", 30), (2, "Bob", "UK", 25), (3, "Cid", "US", 41), (4, "Dee", "FR", 25)]
        db.executemany("INSERT INTO singer VALUES (?, ?, ?, ?)", rows)
    db.close()
    return path


US_NAMES = "SELECT name FROM singer WHERE country = 'US'"


@pytest.mark.parametrize(
    "predicted, gold, expected",
    [
        (US_NAMES, US_NAMES, 1.0),
        ("SELECT name FROM singer WHERE age > 29 AND country = 'US'", US_NAMES, 1.0),
        ("SELECT name FROM singer WHERE country = 'US' ORDER BY name DESC;", US_NAMES, 1.0),  # order free
        ("SELECT name FROM singer WHERE country = 'UK'", US_NAMES, 0.0),
        ("SELECT name, age FROM singer WHERE country = 'US'", US_NAMES, 0.0),
        ("SELECT name FROM singer ORDER BY age, name", "SELECT name FROM singer ORDER BY age, name", 1.0),
        (
            "SELECT name FROM singer ORDER BY age DESC, name",
            "SELECT name FROM singer ORDER BY age, name",
            0.0,
        ),
        ("SELECT name FROM singer ORDER BY age DESC, name", "SELECT name FROM singer", 1.0),
        ("SELECT DISTINCT age FROM singer", "SELECT age FROM singer", 0.0),  # duplicates count
        ("SELECT age FROM singer ORDER BY name DESC", "SELECT age FROM singer", 1.0),
        ("SELECT 30.0", "SELECT age FROM singer WHERE id = 1", 1.0),  # 30 == 30.0
        ("Here:\n```sql\nSELECT count(*) FROM singer\n```\nDone.", "SELECT COUNT(*) FROM singer", 1.0),
        ("```sql\nSELECT 1\n```\nbetter:\n```\nSELECT count(*) FROM singer\n```", "SELECT 4", 1.0),
        ("SELEC name FROM singer", US_NAMES, 0.0),  # syntax error
        ("SELECT nickname FROM singer", US_NAMES, 0.0),  # no such column
        ("SELECT name FROM singer; SELECT 1", US_NAMES, 0.0),  # two statements
        ("", "SELECT name FROM singer WHERE age > 100", 0.0),  # no rows either way, but no query
        ("-- nothing", "SELECT name FROM singer WHERE age > 100", 0.0),
        ("SELECT name FROM singer WHERE age > 99", "SELECT name FROM singer WHERE age > 100", 1.0),
    ],
)
def test_sql_execution_match(singer_db, predicted, gold, expected):
    assert score("sql_execution_match", predicted, gold, db_path=str(singer_db)) == expected


RUNAWAY = "WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r) SELECT count(*) FROM r"
LTRIM_BOMB = (
    "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r WHERE i < 150) "
    "SELECT count(ltrim(substr(x, i), y)) FROM r, "
    "(SELECT printf('%.*c', 60000, 'a') x, printf('%.*c', 5000, 'b') || 'a' y)"
)


def test_sql_runaway_query_hits_the_time_limit(singer_db):
    started = time.monotonic()
    assert score("sql_execution_match", RUNAWAY, "SELECT 1", db_path=str(singer_db), timeout_s=0.3) == 0.0
    assert time.monotonic() - started < 10  # generous (a loaded machine): the deadline is 0.3 s


def test_sql_row_limit(singer_db):
    cross = "SELECT * FROM singer a, singer b"  # 16 rows
    assert score("sql_execution_match", cross, cross, db_path=str(singer_db)) == 1.0
    assert score("sql_execution_match", cross, "SELECT 1", db_path=str(singer_db), max_rows=10) == 0.0


@pytest.mark.parametrize(
    "predicted",
    [
        "DROP TABLE singer",
        "DELETE FROM singer",
        "UPDATE singer SET age = 0",
        "INSERT INTO singer VALUES (5, 'Eve', 'US', 20)",
        "ATTACH DATABASE '{tmp}/evil.db' AS evil",
        "PRAGMA journal_mode = DELETE",
    ],
)
def test_sql_answers_cannot_change_anything(singer_db, predicted):
    predicted = predicted.format(tmp=singer_db.parent)
    before = singer_db.read_bytes()
    assert score("sql_execution_match", predicted, US_NAMES, db_path=str(singer_db)) == 0.0
    assert singer_db.read_bytes() == before
    assert not (singer_db.parent / "evil.db").exists()
    with sqlite3.connect(singer_db) as db:
        assert db.execute("SELECT count(*), sum(age) FROM singer").fetchone() == (4, 121)
    db.close()


@pytest.mark.parametrize(
    "gold, params",
    [
        ("SELECT nope FROM singer", {}),  # a broken gold query
        (RUNAWAY, {"timeout_s": 0.2}),  # a gold query that runs out of time
        (None, {}),
        ("  ", {}),
        (US_NAMES, {"db_path": None}),
        (US_NAMES, {"db_path": "/nonexistent/x.db"}),
        (US_NAMES, {"timeout_s": 0}),
    ],
)
def test_sql_rejects_bad_gold_or_configuration(singer_db, gold, params):
    params = {"db_path": str(singer_db), **params}
    with pytest.raises(RewardInputError):  # a ValueError that reward jobs do not retry
        score("sql_execution_match", US_NAMES, gold, **params)


class JudgeServer:
    """A real OpenAI-compatible HTTP server that answers every chat completion with `reply` and keeps
    each request it got."""

    def __init__(self) -> None:
        self.reply = "The answer matches.\nSCORE: 0.8"
        self.requests: list[dict[str, Any]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                headers = {key.lower(): value for key, value in self.headers.items()}
                server.requests.append({"path": self.path, "headers": headers, "body": body})
                payload = json.dumps(
                    {
                        "id": "chatcmpl-1",
                        "object": "chat.completion",
                        "created": 1,
                        "model": body["model"],
                        "choices": [
                            {
                                "index": 0,
                                "finish_reason": "stop",
                                "message": {"role": "assistant", "content": server.reply},
                            }
                        ],
                        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"


@pytest.fixture(scope="module")
def judge_server() -> Iterator[JudgeServer]:
    server = JudgeServer()
    thread = threading.Thread(target=server.httpd.serve_forever, daemon=True)
    thread.start()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


def judge(server: JudgeServer, reply: str, **params: Any) -> float:
    server.reply = reply
    server.requests.clear()
    params = {"model": "openai/judge-model", "api_base": server.url, "api_key": "judge-key", **params}
    return score("llm_judge", "It is Paris.", "Paris", question="What is the capital of France?", **params)


def test_llm_judge_scores_through_a_real_server(judge_server):
    rubric = "Full marks only for the exact city name."
    assert judge(judge_server, "The answer matches.\nSCORE: 0.8", rubric=rubric) == 0.8
    [request] = judge_server.requests
    assert request["path"] == "/v1/chat/completions"
    assert request["headers"]["authorization"] == "Bearer judge-key"
    body = request["body"]
    assert body["model"] == "judge-model" and body["temperature"] == 0
    prompt = "\n".join(message["content"] for message in body["messages"])
    for part in (
        rubric,
        "What is the capital of France?",
        "It is Paris.",
        "## Reference answer\nParis",
        "SCORE: <number between 0 and 1>",
    ):
        assert part in prompt
    assert DEFAULT_RUBRIC not in prompt


def test_llm_judge_default_rubric_and_no_ground_truth(judge_server):
    judge_server.reply = "SCORE: 1"
    assert (
        score("llm_judge", "Hi", model="openai/judge-model", api_base=judge_server.url, api_key="judge-key")
        == 1.0
    )
    prompt = judge_server.requests[-1]["body"]["messages"][1]["content"]
    assert DEFAULT_RUBRIC in prompt and "Reference answer" not in prompt and "Question" not in prompt


@pytest.mark.parametrize("reply", ["Looks right to me.", "SCORE: high", ""])
def test_llm_judge_unparsable_reply_raises(judge_server, reply):
    with pytest.raises(ValueError, match="SCORE"):
        judge(judge_server, reply)
    assert len(judge_server.requests) == 1


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("SCORE: 0.8", 0.8),
        ("First SCORE: 0.2, on reflection\nSCORE: 0.9", 0.9),  # the last one counts
        ("**SCORE:** 0.25", 0.25),
        ("score: .5", 0.5),
        ("SCORE: 1.7", 1.0),  # clamped
        ("SCORE: -0.3", 0.0),
        ("SCORE: 1e-1", 0.1),
    ],
)
def test_parse_score(reply, expected):
    assert parse_score(reply) == pytest.approx(expected)


def test_llm_judge_needs_a_model():
    with pytest.raises(ValueError, match="model"):
        score("llm_judge", "x")


USER_MODULE = """
def always_half(inp):
    return 0.5

class Scorers:
    @staticmethod
    def length(inp):
        return float(len(inp.answer))
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An importable module of user reward functions, with an installed distribution that names one of
    them as an `rlgate.rewards` entry point, and one module whose own import fails."""
    (tmp_path / "rlgate_user_rewards.py").write_text(USER_MODULE)
    (tmp_path / "rlgate_broken_rewards.py").write_text("import rlgate_missing_dependency\n")
    dist = tmp_path / "rlgate_user_rewards-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: rlgate-user-rewards\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[rlgate.rewards]\nhalf = rlgate_user_rewards:always_half\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "rlgate_user_rewards"
    for name in ("rlgate_user_rewards", "rlgate_broken_rewards"):
        sys.modules.pop(name, None)


def test_builtins_by_name():
    assert set(BUILTINS) == {
        "exact_match",
        "f1",
        "format_and_f1",
        "math_answer",
        "sql_execution_match",
        "llm_judge",
    }
    assert get_reward_fn("f1") is f1
    assert all(get_reward_fn(name) is fn for name, fn in BUILTINS.items())


@pytest.mark.parametrize(
    "name, answer, expected",
    [
        ("rlgate_user_rewards:always_half", "x", 0.5),
        ("rlgate_user_rewards.always_half", "x", 0.5),
        ("rlgate_user_rewards:Scorers.length", "four", 4.0),
        ("half", "x", 0.5),  # the entry point
        ("reward_hooks.rewards.text:exact_match", "x", 1.0),
    ],
)
def test_user_functions_by_dotted_path_and_entry_point(user_module, name, answer, expected):
    assert get_reward_fn(name)(RewardInput(answer=answer, ground_truth="x")) == expected


def test_register(monkeypatch):
    monkeypatch.setattr(registry, "_registered", {})
    register("always_one", lambda inp: 1.0)
    assert score("always_one", "anything") == 1.0
    register("always_one", lambda inp: 0.0)  # a later registration replaces it
    assert score("always_one", "anything") == 0.0
    with pytest.raises(ValueError, match="builtin"):
        register("f1", lambda inp: 1.0)
    with pytest.raises(TypeError):
        register("not_a_function", 1.0)  # type: ignore[arg-type]  # the wrong type is the test
    assert get_reward_fn("exact_match") is exact_match


@pytest.mark.parametrize(
    "name, message",
    [
        ("no_such_reward", "unknown reward function 'no_such_reward'"),
        ("rlgate_no_such_module:fn", "no module named 'rlgate_no_such_module'"),
        ("rlgate_no_such_package.sub.fn", "no module named 'rlgate_no_such_package.sub'"),
        ("rlgate_user_rewards:missing", "has no 'missing'"),
        ("reward_hooks.rewards.text:DEFAULT_ANSWER_TAGS", "not callable"),
        (":fn", "needs a module and an attribute"),
    ],
)
def test_unknown_names(user_module, name, message):
    with pytest.raises(UnknownRewardFn, match=message) as caught:
        get_reward_fn(name)
    assert isinstance(caught.value, LookupError)


def test_a_user_module_with_a_missing_dependency_is_not_unknown(user_module):
    with pytest.raises(ModuleNotFoundError, match="rlgate_missing_dependency"):
        get_reward_fn("rlgate_broken_rewards:fn")


def test_reward_input_is_strict():
    with pytest.raises(pydantic.ValidationError):
        RewardInput(answer="x", rollout_id="r1")
    assert RewardInput(answer="x").params == {}


# --------------------------------------------------------------------------------------------------------
# Answers are written by the policy under training: parsing must stay linear, SQL must stay bounded.


def test_extract_tagged_finds_what_the_regex_finds():
    """The linear scan against the regex it replaces, on random texts of tags, fragments and text."""
    import random
    import re

    from reward_hooks.rewards.text import extract_tagged

    rng = random.Random(0)
    for tags in (("<answer>", "</answer>"), ("<a>", "</a>"), ("|", "|"), ("ab", "ba"), ("[[", "]]")):
        pieces = [*tags, tags[0][:-1], tags[1][1:], "x", "\n", "a", "b", "]"]
        pattern = re.escape(tags[0]) + r"(.*?)" + re.escape(tags[1])
        for _ in range(2000):
            text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
            found = re.findall(pattern, text, flags=re.DOTALL)
            assert extract_tagged(text, tags) == (found[-1] if found else None), (tags, text)


def test_the_linear_regexes_match_what_the_quadratic_ones_matched():
    """The SQL fence and the judge's score line, against the patterns they replace, on random texts."""
    import random
    import re

    from reward_hooks.rewards.judge import _SCORE
    from reward_hooks.rewards.sql import _FENCED_SQL

    old_fence = re.compile(r"```[ \t]*(?:sql|sqlite)?[ \t]*\n(.*?)```", re.IGNORECASE | re.DOTALL)
    old_score = re.compile(r"SCORE:\s*\**\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)", re.IGNORECASE)
    rng = random.Random(0)
    for new, old, pieces in (
        (_FENCED_SQL, old_fence, ["```", " ", "\t", "\n", "sql", "SQLite", "x", "`"]),
        (_SCORE, old_score, ["SCORE:", " ", "\n", "*", "1", ".", "5", "e", "-", "x"]),
    ):
        for _ in range(5000):
            text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
            assert new.findall(text) == old.findall(text), text


PATHOLOGICAL = {  # 320 KB each; the first three were quadratic (118 s for the tags in format_and_f1)
    "unclosed tags": "<answer>" * 40_960,
    "fence and spaces": "```" + " " * 327_680,
    "digits": "1" * 327_680,
    "thousands": "1," * 163_840,
    "fractions": "\\frac{" * 54_613,
    "boxes": "\\boxed{" * 46_811,
    "fences": "```sql\n" * 46_811,
    "articles": "the a an " * 36_408,
}


@pytest.mark.parametrize("name", PATHOLOGICAL)
def test_pathological_answers_are_scored_in_linear_time(name):
    answer = PATHOLOGICAL[name]
    started = time.monotonic()
    scores = [
        score("exact_match", answer, "x"),
        score("f1", answer, "x"),
        score("format_and_f1", answer, "x"),
        score("math_answer", answer, 3),
    ]
    assert scores == [0.0, 0.0, 0.0, 0.0]
    assert time.monotonic() - started < 30  # generous (a loaded machine): quadratic, the tags took 118 s


def test_a_final_number_too_long_to_read_scores_zero():
    assert score("math_answer", "1" * 5000, 3) == 0.0  # int() refuses more than 4300 digits
    assert score("math_answer", "1" * 1000, int("1" * 1000)) == 1.0


def test_parse_score_of_a_reply_full_of_spaces():
    started = time.monotonic()
    with pytest.raises(ValueError):
        parse_score("SCORE:" + " " * 327_680 + "x")  # 17.8 s at 40 KB before: quadratic
    assert parse_score("SCORE:" + " " * 100_000 + "** 0.5") == 0.5
    assert time.monotonic() - started < 30  # generous (a loaded machine): quadratic, this took minutes


SQL_BOMBS = {  # one statement each; before the limits they took 3-45 s and up to 2.8 GB (timeout_s 5)
    "printf repeat": "SELECT printf('%.*c', 2147483647, 'x') IS NULL",
    "printf text precision": "SELECT printf('%.*c', '2147483647', 'x') IS NULL",  # SQLite converts it: 6.6 s
    "printf real precision": "SELECT printf('%.*c', 2147483647.0, 'x') IS NULL",
    "quadratic replace": "SELECT length(replace(printf('%.*c', 1000000, 'a'), printf('%.*c', 500000, 'a') || 'b', ''))",
    "quadratic instr": "SELECT instr(printf('%.*c', 1000000, 'a'), printf('%.*c', 500000, 'a') || 'b')",
    "quadratic ltrim": LTRIM_BOMB,  # 0.45 s per VM instruction: 44.8 s under timeout_s=0.2
    "zeroblob": "SELECT length(replace(hex(zeroblob(200000000)), '0', 'ab'))",
    "randomblob": "SELECT length(hex(randomblob(300000000)))",
    "doubling": "WITH RECURSIVE r(s) AS (SELECT 'x' UNION ALL SELECT s || s FROM r WHERE length(s) < 500000000) "
    "SELECT max(length(s)) FROM r",
    "wide rows": "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r WHERE i < 100000) "
    "SELECT printf('%.*c', 20000, 'x') FROM r",
    "long pattern": "SELECT printf('%.*c', 60000, 'a') LIKE '%' || printf('%.*c', 5000, 'a') || 'b'",
    # 1,000 rows of 20 x 64 KiB: fetched 1,000 rows at a time before they were counted, 1.28 GB at once
    "wide batch": "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r WHERE i < 1000) SELECT "
    + ", ".join(["zeroblob(65536)"] * 20)
    + " FROM r",
}


@pytest.mark.parametrize("name", SQL_BOMBS)
def test_sql_bombs_are_stopped_by_the_limits_not_the_clock(singer_db, name):
    """A bomb scores 0.0; as a gold query (whose error says why it failed) it fails on a limit, long before
    a generous deadline: no wall-clock bound, which a loaded machine could pass."""
    db = str(singer_db)
    assert score("sql_execution_match", SQL_BOMBS[name], US_NAMES, db_path=db) == 0.0
    with pytest.raises(RewardInputError) as failed:
        score("sql_execution_match", US_NAMES, SQL_BOMBS[name], db_path=db, timeout_s=60)
    assert "time limit" not in str(failed.value)


@pytest.mark.parametrize("precision", ["'70000'", "70000.0", "' +70000 apples'", "x'3730303030'", "7e4"])
def test_printf_reads_a_star_argument_as_sqlite_does(singer_db, precision):
    """SQLite converts a `*` argument to an integer (a real truncated, a text or blob by its numeric prefix):
    the guard refuses what SQLite would repeat 70,000 times, whatever its type."""
    with pytest.raises(RewardInputError, match="printf width or precision argument over 65536"):
        score(
            "sql_execution_match",
            US_NAMES,
            f"SELECT printf('%.*c', {precision}, 'x')",
            db_path=str(singer_db),
        )
    assert (
        score(
            "sql_execution_match",
            "SELECT printf('%.*c', '3', 'x'), printf('%*d', 4.0, 7)",
            "SELECT 'xxx', '   7'",
            db_path=str(singer_db),
        )
        == 1.0
    )


def test_sql_deadline_holds_when_each_instruction_is_slow(singer_db):
    """The progress handler runs between VM instructions only; the watchdog interrupts at the deadline. Each
    ltrim of the bomb took 0.45 s (now refused: its character set is too long), each LIKE here takes about
    0.05 s (a 990-character pattern, within the pattern limit): with a check every 1,000 instructions they
    ran 49 s and 1.0 s past a 0.2 s deadline; now 0.0 s and 0.22 s."""
    like = (
        "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r WHERE i < 300) SELECT count(*) FROM r, "
        "(SELECT printf('%.*c', 60000, 'a') x, '%' || printf('%.*c', 990, 'a') || 'b' p) WHERE substr(x, i) LIKE p"
    )
    for query in (LTRIM_BOMB, like):
        started = time.monotonic()
        assert score("sql_execution_match", query, US_NAMES, db_path=str(singer_db), timeout_s=0.2) == 0.0
        assert time.monotonic() - started < 5  # generous (a loaded machine): the deadline is 0.2 s
    with pytest.raises(RewardInputError, match="time limit"):  # the same query, stopped by the clock
        score("sql_execution_match", US_NAMES, like, db_path=str(singer_db), timeout_s=0.2)


@pytest.mark.parametrize(
    "query",
    [
        RUNAWAY,  # the signal lands in the progress handler
        "WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r) SELECT count(printf('%d', x)) FROM r",  # or printf
    ],
)
def test_rq_job_timeout_inside_sqlite_is_raised_not_scored(singer_db, query):
    """rq's job timeout is SIGALRM raising JobTimeoutException in whatever Python code runs: inside SQLite,
    one of its callbacks. sqlite3 clears what a callback raises, which made the timeout a failed query (0.0)."""
    started = time.monotonic()
    with pytest.raises(JobTimeoutException), UnixSignalDeathPenalty(1, JobTimeoutException, job_id="sql"):
        score("sql_execution_match", query, "SELECT 1", db_path=str(singer_db), timeout_s=30)
    assert time.monotonic() - started < 25  # the job's 1 s, not the query's 30 s
    assert (
        score("sql_execution_match", "SELECT 1", "SELECT 1", db_path=str(singer_db)) == 1.0
    )  # nothing left over


def test_trim_character_sets_are_bounded(singer_db):
    db = str(singer_db)
    assert (
        score(
            "sql_execution_match",
            "SELECT ltrim('xxabc', 'x'), rtrim('abcyy', 'y'), trim('  a '), trim('zaz', 'z')",
            "SELECT 'abc', 'abc', 'a', 'a'",
            db_path=db,
        )
        == 1.0
    )
    with pytest.raises(RewardInputError, match="ltrim's character set is longer than 100"):
        score("sql_execution_match", US_NAMES, "SELECT ltrim('abc', printf('%.*c', 101, 'x'))", db_path=db)


def test_sql_result_columns_are_bounded_but_wide_tables_stay_readable(tmp_path):
    path = tmp_path / "wide.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE wide (" + ", ".join(f"c{i} INTEGER" for i in range(100)) + ")")
        db.execute("INSERT INTO wide VALUES (" + ", ".join(str(i) for i in range(100)) + ")")
    db.close()
    assert score("sql_execution_match", "SELECT c99, c0 FROM wide", "SELECT 99, 0", db_path=str(path)) == 1.0
    assert score("sql_execution_match", "SELECT * FROM wide", "SELECT * FROM wide", db_path=str(path)) == 1.0
    many = "SELECT " + ", ".join(["1"] * 65)
    assert score("sql_execution_match", many, "SELECT 1", db_path=str(path)) == 0.0  # 64 columns at most
    assert (
        score("sql_execution_match", many, many, db_path=str(path)) == 1.0
    )  # unless the gold query has more


def test_a_gold_query_over_the_limits_fails_clearly(tmp_path):
    """SQLite's length limit also bounds the records an ORDER BY sorts: a gold query sorting rows longer than
    max_value_bytes fails, as a `RewardInputError` (not retried) saying so."""
    path = tmp_path / "long.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE t (a TEXT, b TEXT)")
        db.execute("INSERT INTO t VALUES (?, ?)", ("a" * 40_000, "b" * 40_000))
    db.close()
    with pytest.raises(RewardInputError, match="max_value_bytes=65536"):
        score("sql_execution_match", "SELECT 1", "SELECT a, b FROM t ORDER BY a", db_path=str(path))


def test_sql_limits_leave_ordinary_queries_alone(singer_db):
    db = str(singer_db)
    assert (
        score(
            "sql_execution_match",
            "SELECT printf('%s is %d', name, age) FROM singer",
            "SELECT name || ' is ' || age FROM singer",
            db_path=db,
        )
        == 1.0
    )
    assert score("sql_execution_match", "SELECT printf('%.*c', 3, 'x')", "SELECT 'xxx'", db_path=db) == 1.0
    assert score("sql_execution_match", "SELECT format('%5.1f', 2.25)", "SELECT '  2.3'", db_path=db) == 1.0
    long_value = "SELECT length(printf('%.*c', 100000, 'x'))"
    assert score("sql_execution_match", long_value, "SELECT 100000", db_path=db) == 0.0  # over 64 KiB
    assert (
        score("sql_execution_match", long_value, "SELECT 100000", db_path=db, max_value_bytes=200_000) == 1.0
    )
    wide = "SELECT printf('%.*c', 1000, name) FROM singer"
    assert score("sql_execution_match", wide, wide, db_path=db) == 1.0
    assert score("sql_execution_match", wide, "SELECT 1", db_path=db, max_result_bytes=3000) == 0.0


def test_sql_bombs_stay_within_memory(singer_db):
    """Peak memory of a fresh process that scores every bomb, against 2.8 GB before. (VmHWM, the peak of this
    process's own memory: ru_maxrss would carry over the parent's peak through exec.)"""
    code = (
        "import re, sys, json\n"
        "from reward_hooks.rewards import get_reward_fn, RewardInput\n"
        "bombs, db = json.loads(sys.argv[1]), sys.argv[2]\n"
        "fn = get_reward_fn('sql_execution_match')\n"
        "scores = [fn(RewardInput(answer=q, ground_truth='SELECT 1', params={'db_path': db})) for q in bombs]\n"
        "peak_kb = int(re.search(r'VmHWM:\\s*(\\d+)', open('/proc/self/status').read()).group(1))\n"
        "print(json.dumps([scores, peak_kb // 1024]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(list(SQL_BOMBS.values())), str(singer_db)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=Path(__file__).parent.parent,
    )
    scores, peak_mb = json.loads(out.stdout)
    assert scores == [0.0] * len(SQL_BOMBS)
    assert peak_mb < 400, peak_mb


@pytest.mark.parametrize(
    "value, expected",
    [
        (True, 1.0),
        (numpy.bool_(False), 0.0),
        (Decimal("0.5"), 0.5),
        (Fraction(1, 4), 0.25),
        (numpy.array(0.75), 0.75),
        (numpy.float32(1.5), 1.5),
        (numpy.int64(-3), -3.0),
        (torch.tensor(0.25), 0.25),
        (torch.tensor([2.0]), 2.0),
        (7, 7.0),
    ],
)
def test_rewards_convert_as_float_does(value, expected):
    """What `float()` took before the bound check was added still scores: bools, Decimals, numpy scalars and
    0-d arrays, one-element tensors."""
    reward = check_reward(value, 10.0)
    assert reward == expected and type(reward) is float


@pytest.mark.parametrize(
    "value, message",
    [
        (None, "must be a number, got NoneType"),
        ("1", "must be a number, got str"),
        (b"1", "must be a number"),
        (numpy.array([1.0, 2.0]), "must be a number, got ndarray"),
        (torch.tensor([1.0, 2.0]), "must be a number"),
        (Decimal("sNaN"), "must be a number"),
        (1 + 0j, "must be a number, got complex"),
        (float("nan"), "must be a finite number"),
        (numpy.float64("inf"), "must lie in [-10, 10]"),
        (Decimal("11"), "must lie in [-10, 10]"),
        (10**400, "must lie in [-10, 10]"),
        (torch.tensor(-10.5), "got -10.5"),
    ],
)
def test_rewards_that_are_not_one_finite_number_in_range_are_refused(value, message):
    with pytest.raises(RewardOutOfRange) as refused:
        check_reward(value, 10.0)
    assert message in str(refused.value)
