"""`rlgate demo --quick`, the README's main loop, as CI runs it: real processes, the tiny model learns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REDIS_URL, ROOT

pytest.importorskip("openrlhf")
pytest.importorskip("matplotlib")


@pytest.mark.timeout(400)
def test_quick_demo_shows_the_success_rate_rising(tmp_path: Path, redis_client):
    out = tmp_path / "summary.json"
    result = subprocess.run([sys.executable, "-m", "rlgate", "demo", "--quick", "--json", str(out), "--workdir",
                             str(tmp_path / "demo"), "--redis-url", REDIS_URL],
                            cwd=ROOT, capture_output=True, text=True, timeout=380)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert set(summary) >= {"initial_success_rate", "final_success_rate", "episodes", "wall_seconds",
                            "policy_version", "curve"}
    assert summary["initial_success_rate"] <= 0.3
    assert summary["final_success_rate"] >= summary["initial_success_rate"] + 0.4, summary["curve"]
    assert summary["policy_version"] == len(summary["curve"]) >= 5
    episodes = [point["episodes"] for point in summary["curve"]]
    assert episodes == sorted(episodes) and episodes[-1] == summary["episodes"]
    assert (tmp_path / "demo" / "reward_curve.png").stat().st_size > 10_000
    assert "reward curve:" in result.stdout and "success rate" in result.stdout
