"""make lint, run by the suite: ruff's lint and format check over the code, and mypy over the packages typed
throughout (pyproject.toml's [tool.ruff] and [tool.mypy]). A failure shows the tool's own report; ``make lint FIX=1``
fixes what ruff can."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

MAKEFILE_LINTED = re.search(r"^LINTED := (.+)$", (ROOT / "Makefile").read_text(), re.M)
LINTED = MAKEFILE_LINTED.group(1).split() if MAKEFILE_LINTED else []


def tool(*args: str) -> subprocess.CompletedProcess:
    """One of the venv's tools (its scripts sit beside this Python), from the project root."""
    command = [str(Path(sys.executable).with_name(args[0])), *args[1:]]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_finds_nothing_to_fix_and_nothing_to_format():
    assert LINTED == ["src", "tests", "benchmarks", "hydra_plugins"]  # make lint's folders: every Python file
    check = tool("ruff", "check", "--no-cache", *LINTED)
    assert check.returncode == 0, f"ruff check (make lint FIX=1 fixes some):\n{check.stdout[-6000:]}{check.stderr}"
    form = tool("ruff", "format", "--check", "--no-cache", *LINTED)
    assert form.returncode == 0, f"ruff format --check (make lint FIX=1 formats):\n{form.stdout[-6000:]}{form.stderr}"


def test_mypy_finds_no_type_error_in_the_typed_packages():
    result = tool("mypy", "--no-incremental")
    assert result.returncode == 0, f"mypy:\n{result.stdout[-6000:]}{result.stderr}"
    assert re.search(r"no issues found in \d+ source files", result.stdout), result.stdout
