"""The project's lint: ruff, as pyproject.toml configures it (``[tool.ruff]``: pyflakes, pycodestyle, 120 columns),
finds nothing in the package, the tests and the benchmarks, so CI fails on a lint error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_finds_nothing():
    pytest.importorskip("ruff", reason="ruff comes with the dev extra: pip install -e '.[dev]'")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, f"ruff check found lint errors (fix them, or `ruff check --fix`):\n{out.stdout}"


def test_the_lint_covers_the_code_and_fails_on_an_error(tmp_path):
    """The configuration is the one that runs (not an empty selection), and an error in a file fails the check."""
    pytest.importorskip("ruff")
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nx = 1\n" + "y = '" + "a" * 130 + "'\n")
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                          "--config", str(ROOT / "pyproject.toml"), str(bad)], capture_output=True, text=True)
    assert out.returncode == 1 and "F401" in out.stdout and "E501" in out.stdout, out.stdout
