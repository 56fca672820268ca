"""Execution match for text-to-SQL, Spider style: do the predicted and the gold query return the same rows?

Both queries run on the SQLite file `params["db_path"]`, opened read-only (URI `mode=ro`) with an
authorizer that allows reading only, so no answer can change the database or attach another file.

An answer is SQL the agent wrote, so what it may cost is bounded inside SQLite:

- time: a watchdog thread calls `interrupt()` at the deadline, which SQLite honours at its next jump,
  and a progress handler checks the clock every `_PROGRESS_STEPS` VM instructions. Neither can stop one
  instruction, and a few SQL functions are quadratic in their arguments' length (`replace` and `instr` on
  1 MiB strings take about 11 s; `ltrim(x, y)` compares each character of x with each of y), so
- value size: no string or blob may pass `max_value_bytes` (SQLITE_LIMIT_LENGTH, default 64 KiB: the
  same functions then take about 0.05 s), LIKE/GLOB patterns are at most `_MAX_PATTERN_CHARS`, the
  character set of a two-argument trim at most `_MAX_TRIM_CHARS`, and `printf`/`format` are wrapped to
  refuse a width or precision over that limit (SQLite's `%.*c` repeats a character `precision` times even
  when the result is too long: 7 s for 2^31 - 1, given as an integer, a real or a numeric text);
- SQLite's memory: `PRAGMA hard_heap_limit` (`HEAP_LIMIT_BYTES`, 256 MiB) with temporary tables and sorts
  kept in memory (`temp_store = MEMORY`), so a huge DISTINCT or ORDER BY fails instead of growing the
  process or filling the disk. The heap limit is SQLite's, for the whole process, and can only be lowered:
  in `rlgate worker` reward jobs are its only SQLite user (in a test run it also caps the rest of the
  suite's SQLite use at that limit);
- Python's memory: rows are fetched and counted one at a time, at most `max_rows` rows and
  `max_result_bytes` (approximate: string and blob lengths, 8 per other value, 64 per row), and the
  predicted query may return at most `_MAX_COLUMNS` columns (SQLITE_LIMIT_COLUMN, set once the schema is
  loaded, so tables of any width stay readable, and raised to the gold query's width), so one row holds
  at most 64 values of 64 KiB.

The limits apply to the gold query as well, so a gold query that passes one (for instance an ORDER BY over
rows longer than `max_value_bytes`: SQLite's length limit also bounds the records a sort holds) raises
`RewardInputError` and is not retried.
"""

from __future__ import annotations

import re
import sqlite3
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reward_hooks.rewards.errors import RewardInputError

if TYPE_CHECKING:
    from reward_hooks.rewards.registry import RewardInput

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MAX_ROWS = 100_000
DEFAULT_MAX_RESULT_BYTES = 64 << 20
DEFAULT_MAX_VALUE_BYTES = 64 << 10
HEAP_LIMIT_BYTES = 256 << 20

# `[ \t]*(?:(?:sql|sqlite)[ \t]*)?\n`, not `[ \t]*(?:sql|sqlite)?[ \t]*\n`: two adjacent `[ \t]*` split a run of
# spaces every possible way, quadratic in its length when no newline follows.
_FENCED_SQL = re.compile(r"```[ \t]*(?:(?:sql|sqlite)[ \t]*)?\n(.*?)```", re.IGNORECASE | re.DOTALL)
_ORDER_BY = re.compile(r"\border\s+by\b", re.IGNORECASE)
_READ_ACTIONS = frozenset(
    {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
)
# SQLite VM instructions between two calls of the progress handler (which checks the clock and lets
# Python's signal handlers, such as rq's job timeout, run): 100 costs about 5% on a plain counting query,
# 50 about 25%
_PROGRESS_STEPS = 100
_MAX_PATTERN_CHARS = 1_000  # SQLITE_LIMIT_LIKE_PATTERN_LENGTH (SQLite's default: 50,000)
_MAX_TRIM_CHARS = 100  # the longest character set of trim/ltrim/rtrim(X, Y)
_MAX_COLUMNS = 64  # SQLITE_LIMIT_COLUMN of the predicted query (or the gold query's width, if more)


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

    Params: `db_path` (required), `timeout_s` (default 5, per query, enforced by a watchdog thread and
    SQLite's progress handler), `max_rows` (default 100,000, per query), `max_result_bytes` (default 64 MiB,
    per query) and `max_value_bytes` (default 64 KiB, the longest string or blob; see the module docstring
    for what they bound). A predicted query that fails, runs out of time, rows, result size or SQLite's
    memory, builds a value that is too long, is more than one statement, or is no statement at all (an
    empty answer) scores 0.0. A gold query that does, a missing `db_path`, or a file that is not there raises `RewardInputError`
    (a ValueError a retry cannot fix). rq's job timeout, raised inside SQLite, is raised as it is.
    """
    params = inp.params
    db_path = params.get("db_path")
    if not isinstance(db_path, str) or not Path(db_path).is_file():
        raise RewardInputError(f"params.db_path must name an existing SQLite file, got {db_path!r}")
    limits = _Limits(
        timeout_s=_positive(params, "timeout_s", DEFAULT_TIMEOUT_S),
        max_rows=int(_positive(params, "max_rows", DEFAULT_MAX_ROWS)),
        max_result_bytes=int(_positive(params, "max_result_bytes", DEFAULT_MAX_RESULT_BYTES)),
    )
    max_value_bytes = int(_positive(params, "max_value_bytes", DEFAULT_MAX_VALUE_BYTES))
    gold = inp.ground_truth
    if not isinstance(gold, str) or not gold.strip():
        raise RewardInputError(f"ground_truth must be the gold SQL query, got {gold!r}")

    trap = _Trap()
    builtins = _GuardedBuiltins(max_value_bytes, trap)
    try:
        connection = sqlite3.connect(Path(db_path).resolve().as_uri() + "?mode=ro", uri=True)
        try:
            connection.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, max_value_bytes)
            connection.setlimit(sqlite3.SQLITE_LIMIT_LIKE_PATTERN_LENGTH, _MAX_PATTERN_CHARS)
            connection.execute(f"PRAGMA hard_heap_limit = {HEAP_LIMIT_BYTES}")
            connection.execute("PRAGMA temp_store = MEMORY")
            try:  # loads the schema now, under SQLite's own column limit: tables of any width stay readable
                connection.execute("SELECT 1 FROM sqlite_schema LIMIT 0")
            except sqlite3.Error as exc:
                raise RewardInputError(f"params.db_path is not a readable SQLite database: {exc}") from exc
            builtins.install(connection)
            connection.set_authorizer(trap.own(_read_only))
            try:
                gold_rows, gold_columns = _run(connection, gold, limits, trap)
            except _QueryFailed as exc:
                hint = (
                    (
                        f" (max_value_bytes={max_value_bytes} also bounds each row a sort, DISTINCT or "
                        "GROUP BY holds)"
                    )
                    if "too big" in str(exc)
                    else ""
                )
                raise RewardInputError(f"the gold SQL failed: {exc}{hint}") from exc
            connection.setlimit(sqlite3.SQLITE_LIMIT_COLUMN, max(_MAX_COLUMNS, gold_columns))
            try:
                predicted_rows, _ = _run(connection, extract_sql(inp.answer), limits, trap)
            except _QueryFailed:
                return 0.0
        finally:
            connection.close()
    finally:
        builtins.close()
    if _ORDER_BY.search(gold):
        return float(predicted_rows == gold_rows)
    return float(Counter(predicted_rows) == Counter(gold_rows))


@dataclass(frozen=True, slots=True)
class _Limits:
    timeout_s: float
    max_rows: int
    max_result_bytes: int


class _Trap:
    """Keeps what a Python callback (progress handler, authorizer, guarded function) raised inside SQLite.

    sqlite3 does not pass such an exception on: it reports an SQLite error instead ("interrupted", "user-
    defined function raised exception") and hands the exception to `sys.unraisablehook` when callback
    tracebacks are enabled, else drops it. rq's job timeout is SIGALRM raising JobTimeoutException in
    whatever Python code runs, which during a query is one of these callbacks, often at its first
    instruction (so no `try` inside the callback can catch it): dropped, it became a failed query scored
    0.0. While `armed`, the hook keeps the first such exception of our callbacks for `_run` to raise, and
    the message of a guarded function's refusal (a ValueError) for the query's error; anything else goes
    to the previous hook. Both are process-wide: the hook is put back after each query; callback tracebacks
    are left off afterwards, whatever they were before (sqlite3 has no getter for them)."""

    _REFUSALS = (ValueError, ArithmeticError, sqlite3.Error, MemoryError)

    def __init__(self) -> None:
        self.caught: BaseException | None = None
        self.refusal: str | None = None
        self._callbacks: list[Any] = []

    def own(self, callback: Any) -> Any:
        """`callback`, registered as ours (sqlite3 names the very object it was given)."""
        self._callbacks.append(callback)
        return callback

    @contextmanager
    def armed(self) -> Iterator[None]:
        previous = sys.unraisablehook

        def hook(unraisable: Any) -> None:
            if not any(unraisable.object is callback for callback in self._callbacks):
                previous(unraisable)
            elif isinstance(unraisable.exc_value, self._REFUSALS):
                self.refusal = f"{unraisable.exc_type.__name__}: {unraisable.exc_value}"
            elif self.caught is None:
                self.caught = unraisable.exc_value

        sys.unraisablehook = hook
        sqlite3.enable_callback_tracebacks(True)
        try:
            yield
        finally:
            sqlite3.enable_callback_tracebacks(False)  # sqlite3's default
            sys.unraisablehook = previous

    def reraise(self) -> None:
        if self.caught is not None:
            exc, self.caught = self.caught, None
            raise exc


class _Watchdog:
    """Interrupts `connection` at `deadline` from a timer thread: the progress handler runs only between
    VM instructions, and one instruction may take a while (SQLite checks the interrupt at every jump, so
    a query stops within one instruction of the deadline). `stop()` makes sure no late interrupt can hit
    the next query."""

    def __init__(self, connection: sqlite3.Connection, timeout_s: float) -> None:
        self.connection = connection
        self.fired = False
        self._lock = threading.Lock()
        self._stopped = False
        self._timer = threading.Timer(timeout_s, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if not self._stopped:
                self.fired = True
                self.connection.interrupt()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
        self._timer.cancel()


def _run(
    connection: sqlite3.Connection, query: str, limits: _Limits, trap: _Trap
) -> tuple[list[tuple[Any, ...]], int]:
    """All rows of `query` and its number of columns, or `_QueryFailed` when SQLite refuses it (a syntax
    error, a denied write, more than one statement, a value over the length limit, too many columns, the
    heap limit), it is no query at all, it passes `timeout_s` seconds (a watchdog thread interrupts it, and
    the progress handler checks the clock every `_PROGRESS_STEPS` instructions), or its rows pass
    `max_rows` or `max_result_bytes` (counted row by row, so at most one row more is ever held). An
    exception raised inside one of SQLite's callbacks (rq's job timeout) is raised as it is."""
    trap.refusal = None
    deadline = time.monotonic() + limits.timeout_s
    connection.set_progress_handler(trap.own(lambda: time.monotonic() > deadline), _PROGRESS_STEPS)
    watchdog = _Watchdog(connection, limits.timeout_s)
    try:
        with trap.armed():
            return _fetch(connection, query, limits, trap)
    except MemoryError as exc:  # SQLite's hard heap limit (SQLITE_NOMEM)
        trap.reraise()
        raise _QueryFailed(f"SQLite's heap limit of {HEAP_LIMIT_BYTES} bytes reached") from exc
    except (sqlite3.Error, UnicodeEncodeError) as exc:  # UnicodeEncodeError: lone surrogates in the text
        trap.reraise()
        if watchdog.fired or time.monotonic() > deadline:
            raise _QueryFailed(f"time limit of {limits.timeout_s} s reached") from exc
        refusal = f" ({trap.refusal})" if trap.refusal else ""
        raise _QueryFailed(f"{type(exc).__name__}: {exc}{refusal}") from exc
    finally:
        watchdog.stop()
        connection.set_progress_handler(None, 0)


def _fetch(
    connection: sqlite3.Connection, query: str, limits: _Limits, trap: _Trap
) -> tuple[list[tuple[Any, ...]], int]:
    """`_run` without its deadline and its translation of errors."""
    cursor = connection.execute(query)
    if cursor.description is None:  # no statement at all (empty, only comments): no rows to compare
        raise _QueryFailed("not a query that returns rows")
    rows: list[tuple[Any, ...]] = []
    size = 0
    for row in cursor:
        size += _row_bytes(row)
        if len(rows) == limits.max_rows:
            raise _QueryFailed(f"more than {limits.max_rows} rows")
        if size > limits.max_result_bytes:
            raise _QueryFailed(f"rows of more than {limits.max_result_bytes} bytes")
        rows.append(row)
    trap.reraise()  # a callback's exception that did not stop the query
    return rows, len(cursor.description)


def _row_bytes(row: tuple[Any, ...]) -> int:
    """What a row costs to hold, roughly: 64, plus each string's or blob's length, plus 8 per other value."""
    return 64 + sum(len(v) if isinstance(v, str | bytes) else 8 for v in row)


class _GuardedBuiltins:
    """SQLite's own `printf`/`format` and two-argument `trim`/`ltrim`/`rtrim`, run on a private in-memory
    connection once their arguments passed a check:

    - printf refuses a width or precision over `limit` (SQLite would loop that many times for `%.*c`
      before it finds the result too long). A `*` takes its value from an argument, which SQLite converts
      to an integer: a real is truncated, a text or blob read as its numeric prefix ('2147483647' and
      2147483647.0 are 2147483647). Which argument a `*` takes is not worked out: with a `*` in the
      format, every argument is converted so and none may pass `limit`.
    - trim's character set may hold at most `_MAX_TRIM_CHARS` characters: SQLite compares each character
      trimmed with each of the set (64 KiB against 64 KiB: about 9 s in one VM instruction).

    A refusal is a ValueError, which SQLite reports as the query's error (`_Trap` keeps its message)."""

    _SIZES = re.compile(r"%[-+ 0#,!]*(\*|[0-9]*)(?:\.(\*|[0-9]*))?")
    _NUMERIC_PREFIX = re.compile(r"\s*([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)")

    def __init__(self, limit: int, trap: _Trap) -> None:
        self.limit = limit
        self.trap = trap
        self.builtin = sqlite3.connect(":memory:")
        self.builtin.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, limit)

    def install(self, connection: sqlite3.Connection) -> None:
        for name in ("printf", "format"):
            connection.create_function(name, -1, self.trap.own(self.printf), deterministic=True)
        for name in ("trim", "ltrim", "rtrim"):
            connection.create_function(name, 2, self.trap.own(partial(self.trim, name)), deterministic=True)

    def printf(self, *args: Any) -> Any:
        if not args or args[0] is None:
            return None
        starred = False
        for size in (size for pair in self._SIZES.findall(str(args[0])) for size in pair):
            starred = starred or size == "*"
            if size.isdigit() and (len(size) > 10 or int(size) > self.limit):
                raise ValueError(f"printf width or precision {size} is over {self.limit}")
        if starred and any(not abs(self._as_sqlite_integer(a)) <= self.limit for a in args[1:]):
            raise ValueError(f"printf width or precision argument over {self.limit}")
        placeholders = ", ".join("?" * len(args))
        return self.builtin.execute(f"SELECT printf({placeholders})", args).fetchone()[0]

    def trim(self, name: str, value: Any, characters: Any) -> Any:
        if isinstance(characters, str | bytes) and len(characters) > _MAX_TRIM_CHARS:
            raise ValueError(f"{name}'s character set is longer than {_MAX_TRIM_CHARS} characters")
        return self.builtin.execute(f"SELECT {name}(?, ?)", (value, characters)).fetchone()[0]

    @classmethod
    def _as_sqlite_integer(cls, value: Any) -> float:
        """About what SQLite's integer conversion makes of `value` (before it truncates to 64 bits): an
        integer as it is, a real as it is, a text or blob its numeric prefix (0 without one). A NaN is 0."""
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        if isinstance(value, str):
            found = cls._NUMERIC_PREFIX.match(value)
            value = float(found.group(1)) if found else 0
        if isinstance(value, float) and value != value:
            return 0
        return value if isinstance(value, int | float) else 0

    def close(self) -> None:
        self.builtin.close()


def _read_only(action: int, *_: Any) -> int:
    """SQLite authorizer: reads, function calls and recursive CTEs pass; anything else is denied."""
    return sqlite3.SQLITE_OK if action in _READ_ACTIONS else sqlite3.SQLITE_DENY


def _positive(params: dict[str, Any], key: str, default: float) -> float:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
        raise RewardInputError(f"params.{key} must be a positive number, got {value!r}")
    return value
