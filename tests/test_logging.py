"""Log output: JSON lines off a terminal, and no secrets even in crash reports."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import structlog
from rlgate._logging import configure_logging
configure_logging("info", "{fmt}")
def handle(headers):
    api_key = "sk-SECRET-123"
    raise ValueError("upstream answered nonsense")
try:
    handle([(b"authorization", b"Bearer sk-SECRET-123")])
except ValueError:
    structlog.get_logger("t").exception("call_crashed", rollout_id="r1")
"""


def run(fmt: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(fmt=fmt)], capture_output=True, text=True, check=True
    )
    return result.stderr


def test_json_lines_with_tracebacks_but_no_locals():
    out = run("json")
    [line] = out.strip().splitlines()
    record = json.loads(line)
    assert record["event"] == "call_crashed" and record["rollout_id"] == "r1" and record["level"] == "error"
    assert "upstream answered nonsense" in line
    assert "sk-SECRET" not in out


def test_console_tracebacks_have_no_locals_either():
    out = run("console")
    assert "upstream answered nonsense" in out and "sk-SECRET" not in out
