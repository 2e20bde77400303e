"""The whole tree is ruff-clean (rules in pyproject.toml: E, F, W, I, B, UP for Python 3.10+)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    if os.environ.get("MEMSPEC_TEST_STRICT") != "1":
        pytest.importorskip("ruff", reason="ruff is not installed (pip install -r requirements-dev.txt)")
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", str(ROOT)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"ruff check failed:\n{proc.stdout}{proc.stderr}"
