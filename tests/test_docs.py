"""The documentation that is generated from the code stays current."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT


def test_the_configuration_reference_is_current():
    """docs/configuration.md is what scripts/config_reference.py prints from the settings classes; after
    changing a setting, run `.venv/bin/python scripts/config_reference.py > docs/configuration.md`."""
    generated = subprocess.run([sys.executable, str(ROOT / "scripts" / "config_reference.py")], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout
    assert "## `rlgate gateway`" in generated and "`RLGATE_REDIS_URL`" in generated
    assert (ROOT / "docs" / "configuration.md").read_text() == generated, (
        "docs/configuration.md is out of date: .venv/bin/python scripts/config_reference.py > docs/configuration.md")
