"""Execution match for text-to-SQL, Spider style: do the predicted and the gold query return the same rows?

Both queries run on the SQLite file `params["db_path"]`, opened read-only (URI `mode=ro`) with an
authorizer that allows reading only, so no answer can change the database or attach another file.
"""

from __future__ import annotations

import re
import sqlite3
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reward_hooks.rewards.registry import RewardInput

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MAX_ROWS = 100_000

_FENCED_SQL = re.compile(r"```[ \t]*(?:sql|sqlite)?[ \t]*\n(.*?)```", re.IGNORECASE | re.DOTALL)
_ORDER_BY = re.compile(r"\border\s+by\b", re.IGNORECASE)
_READ_ACTIONS = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
                           sqlite3.SQLITE_RECURSIVE})
_PROGRESS_STEPS = 1_000  # SQLite VM instructions between two deadline checks


class _QueryFailed(Exception):
    """A query did not produce its rows: an SQLite error, the time limit, or the row limit."""


def extract_sql(answer: str) -> str:
    """The SQL of an answer: the last fenced code block tagged `sql`, `sqlite` or untagged, else the whole
    answer; stripped."""
    blocks = _FENCED_SQL.findall(answer)
    return (blocks[-1] if blocks else answer).strip()


def sql_execution_match(inp: RewardInput) -> float:
    """1.0 if the predicted query returns the gold query's rows, else 0.0.

    The predicted query is `extract_sql(answer)`; the gold query is `ground_truth` (a string). Rows are
    compared as multisets (`Counter` of row tuples: duplicates count, row order does not), or as ordered
    lists when the gold query contains `ORDER BY` anywhere (as Spider's evaluation does). Columns are
    compared in order, and values with Python equality (so 1 == 1.0).

    Params: `db_path` (required), `timeout_s` (default 5, per query, enforced with SQLite's progress
    handler), `max_rows` (default 100,000, per query, so a runaway cross join cannot exhaust memory).
    A predicted query that fails, runs out of time or rows, is more than one statement, or is no statement
    at all (an empty answer) scores 0.0. A gold query that does, a missing `db_path`, or a file that is
    not there raises ValueError.
    """
    params = inp.params
    db_path = params.get("db_path")
    if not isinstance(db_path, str) or not Path(db_path).is_file():
        raise ValueError(f"params.db_path must name an existing SQLite file, got {db_path!r}")
    timeout_s = _positive(params, "timeout_s", DEFAULT_TIMEOUT_S)
    max_rows = int(_positive(params, "max_rows", DEFAULT_MAX_ROWS))
    gold = inp.ground_truth
    if not isinstance(gold, str) or not gold.strip():
        raise ValueError(f"ground_truth must be the gold SQL query, got {gold!r}")

    connection = sqlite3.connect(Path(db_path).resolve().as_uri() + "?mode=ro", uri=True)
    try:
        connection.set_authorizer(_read_only)
        try:
            gold_rows = _run(connection, gold, timeout_s, max_rows)
        except _QueryFailed as exc:
            raise ValueError(f"the gold SQL failed: {exc}") from exc
        try:
            predicted_rows = _run(connection, extract_sql(inp.answer), timeout_s, max_rows)
        except _QueryFailed:
            return 0.0
    finally:
        connection.close()
    if _ORDER_BY.search(gold):
        return float(predicted_rows == gold_rows)
    return float(Counter(predicted_rows) == Counter(gold_rows))


def _run(connection: sqlite3.Connection, query: str, timeout_s: float, max_rows: int) -> list[tuple]:
    """All rows of `query`, or `_QueryFailed` when SQLite refuses it (a syntax error, a denied write, more
    than one statement), it is no query at all, it passes `timeout_s` seconds (the progress handler
    interrupts it), or it returns more than `max_rows` rows."""
    deadline = time.monotonic() + timeout_s
    connection.set_progress_handler(lambda: time.monotonic() > deadline, _PROGRESS_STEPS)
    try:
        cursor = connection.execute(query)
        if cursor.description is None:  # no statement at all (empty, only comments): no rows to compare
            raise _QueryFailed("not a query that returns rows")
        rows = cursor.fetchmany(max_rows + 1)
    except (sqlite3.Error, UnicodeEncodeError) as exc:  # UnicodeEncodeError: lone surrogates in the text
        if time.monotonic() > deadline:
            raise _QueryFailed(f"time limit of {timeout_s} s reached") from exc
        raise _QueryFailed(f"{type(exc).__name__}: {exc}") from exc
    finally:
        connection.set_progress_handler(None, 0)
    if len(rows) > max_rows:
        raise _QueryFailed(f"more than {max_rows} rows")
    return rows


def _read_only(action: int, *_: Any) -> int:
    """SQLite authorizer: reads, function calls and recursive CTEs pass; anything else is denied."""
    return sqlite3.SQLITE_OK if action in _READ_ACTIONS else sqlite3.SQLITE_DENY


def _positive(params: dict[str, Any], key: str, default: float) -> float:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
        raise ValueError(f"params.{key} must be a positive number, got {value!r}")
    return value
