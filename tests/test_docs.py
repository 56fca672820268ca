"""The documentation that is generated from the code stays current."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import ROOT


def test_the_configuration_reference_is_current():
    """docs/configuration.md is what scripts/config_reference.py prints from the settings classes; after
    changing a setting, run `.venv/bin/python scripts/config_reference.py > docs/configuration.md`."""
    generated = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "config_reference.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "## `rlgate gateway`" in generated and "`RLGATE_REDIS_URL`" in generated
    assert (ROOT / "docs" / "configuration.md").read_text() == generated, (
        "docs/configuration.md is out of date: .venv/bin/python scripts/config_reference.py > docs/configuration.md"
    )


def test_links_resolve():
    """Every relative link (and image) in README.md and docs/*.md points to a file or folder that exists."""
    link = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)  # code blocks hold no links
        for target in link.findall(text):
            if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path = target.split("#", 1)[0]
            if path and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "broken relative links:\n" + "\n".join(broken)


def test_the_layout_names_every_module_script_and_compose_file():
    """docs/layout.md names every module of the packages (as `module`, or its subpackage as `sub/`), every
    file of scripts/, and every compose file: a module added without a line there fails here."""
    named = set(re.findall(r"`([^`]+)`", (ROOT / "docs" / "layout.md").read_text()))
    missing = []
    for package in (
        "rlgate/episodes",
        "gateway",
        "reward_hooks",
        "rlgate/inference",
        "learner",
        "rlgate/demo",
        "rlgate",
    ):
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT / package)
            if package == "rlgate" and relative.parts[0] in ("episodes", "inference", "demo"):
                continue  # named as packages of their own above
            if path.stem in ("__init__", "__main__"):
                continue
            names = {path.stem} if len(relative.parts) == 1 else {f"{relative.parts[0]}/"}
            if not names & named:
                missing.append(str(path.relative_to(ROOT)))
    for path in sorted((ROOT / "scripts").iterdir()):
        if path.name != "__pycache__" and path.name not in named:
            missing.append(str(path.relative_to(ROOT)))
    for path in [*sorted(ROOT.glob("docker-compose*.yml")), ROOT / "Dockerfile"]:
        if path.name not in named:
            missing.append(path.name)
    assert not missing, missing
