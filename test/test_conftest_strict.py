"""Strict mode (MEMSPEC_TEST_STRICT=1, `make test`, CI) fails a skip instead of passing quietly, a
pytest.importorskip included, in a test or at module level; only skips for a fact about the machine
(no CUDA device, ...) stay skips. Checked on a scratch suite that uses this conftest."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

SCRATCH_TESTS = '''
import pytest

def test_a_missing_package():
    pytest.importorskip("memspec_no_such_package")

def test_a_machine_without_cuda():
    pytest.skip("the pinned-memory side-stream path needs CUDA")

@pytest.mark.skipif(True, reason="the bundled zoo is not built")
def test_a_setup_fault():
    pass

@pytest.mark.xfail(reason="a known failure stays an xfail")
def test_expected_to_fail():
    assert False

def test_that_runs():
    pass
'''

SCRATCH_MODULE_SKIP = '''
import pytest

pytest.importorskip("memspec_no_such_package")

def test_never_collected():
    pass
'''


def run_scratch(tmp_path: Path, strict: bool) -> tuple[int, str]:
    for helper in ("conftest.py", "ros_helpers.py"):
        shutil.copy(HERE / helper, tmp_path / helper)
    (tmp_path / "test_scratch.py").write_text(SCRATCH_TESTS)
    (tmp_path / "test_scratch_module.py").write_text(SCRATCH_MODULE_SKIP)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["MEMSPEC_TEST_STRICT"] = "1" if strict else "0"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                           "--continue-on-collection-errors", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def test_without_strict_mode_skips_stay_skips(tmp_path):
    rc, out = run_scratch(tmp_path, strict=False)
    assert rc == 0, out
    assert "1 passed, 4 skipped, 1 xfailed" in out, out


@pytest.mark.timeout(180)
def test_strict_mode_fails_every_skip_but_a_machine_fact(tmp_path):
    rc, out = run_scratch(tmp_path, strict=True)
    assert rc != 0, out
    assert "FAILED test_scratch.py::test_a_missing_package" in out, out
    assert "ERROR test_scratch.py::test_a_setup_fault" in out, out  # a skipif fails at setup
    assert "memspec_no_such_package" in out and "the bundled zoo is not built" in out
    assert "ERROR test_scratch_module.py" in out, out  # the module-level importorskip
    assert "SKIPPED [1] test_scratch.py" in out and "needs CUDA" in out  # a machine without CUDA
    assert "XFAIL test_scratch.py::test_expected_to_fail" in out, out
    assert "PASSED test_scratch.py::test_that_runs" in out, out
