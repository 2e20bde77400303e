"""scripts/setup.sh's venv handling, run against a fake interpreter (no pip, no network, a second each).

The fake stands in for ``python3.11``: ``-m venv DIR`` makes a venv whose ``bin/python`` is the fake
again, ``-m pip install`` records its arguments, and the handful of ``-c`` probes the script makes answer
as a Python 3.11 with torch would. What is checked is setup.sh's own logic: which venvs it keeps, which
it makes again, that every pip call is held to the constraints, and that pip's failure is the script's.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("bash") is None,
                                reason="setup.sh refuses any machine but x86-64 (the ROS wheels' binaries)")

FAKE_PYTHON = r"""#!/usr/bin/env bash
# a stand-in for python3.11 (test/test_setup_script.py)
here="$(cd "$(dirname "$0")/.." && pwd -P)"
case "$1" in
  --version) echo "Python 3.11.9"; exit 0 ;;
  -m)
    case "$2" in
      venv)
        [ -z "${FAKE_VENV_WITHOUT_PIP:-}" ] || { mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; touch "$3/nopip"; exit 0; }
        mkdir -p "$3/bin"; cp "$0" "$3/bin/python"
        printf 'VIRTUAL_ENV="%s"\n' "$3" >"$3/bin/activate"
        echo "venv $3" >>"$FAKE_LOG"; exit 0 ;;
      pip)
        [ ! -e "$here/nopip" ] || { echo "No module named pip" >&2; exit 1; }
        [ "$3" = install ] || exit 0
        echo "pip $*" >>"$FAKE_LOG"
        echo "WARNING: Location 'file:///nowhere' is ignored: it is neither a file nor a directory." >&2
        if [ -n "${FAKE_PIP_FAILS:-}" ]; then echo "ERROR: no matching distribution" >&2; exit 1; fi
        exit 0 ;;
    esac ;;
  -c)
    case "$2" in
      *sys.version_info*) echo "3.11" ;;
      *'torch.__version__'*) echo "torch==2.13.0+cpu" ;;
    esac
    exit 0 ;;
esac
exit 0  # scripts/patch_wheel_cmake.py
"""


@pytest.fixture()
def checkout(tmp_path):
    """A checkout holding setup.sh and the files it hashes, and a PATH whose python3.11 is the fake."""
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup.sh", root / "scripts" / "setup.sh")
    for name in ("requirements.txt", "requirements-dev.txt", "requirements-ros.txt", "requirements-model.txt",
                 "constraints.txt", "constraints-gptq.txt", "requirements-gptq.txt"):
        (root / name).write_text("# test\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3.11"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    return root.resolve(), fake


def run_setup(root: Path, fake: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    log = root / "fake.log"
    environ = {**os.environ, "MEMSPEC_PYTHON": str(fake), "FAKE_LOG": str(log), **env}
    return subprocess.run(["bash", str(root / "scripts" / "setup.sh"), *args], cwd=root, env=environ,
                          capture_output=True, text=True, timeout=60)


def log_lines(root: Path) -> list[str]:
    path = root / "fake.log"
    return path.read_text().splitlines() if path.exists() else []


def make_venv(root: Path, fake: Path, *, path_in_activate: str | None, pip: bool = True) -> Path:
    venv = root / ".venv"
    (venv / "bin").mkdir(parents=True)
    shutil.copy(fake, venv / "bin" / "python")
    if path_in_activate is not None:
        (venv / "bin" / "activate").write_text(f'VIRTUAL_ENV="{path_in_activate}"\n')
    if not pip:
        (venv / "nopip").touch()
    (venv / "keepsake").touch()  # tells a kept venv from one made again
    return venv


def test_a_fresh_checkout_gets_a_venv_and_every_pip_call_is_held_to_the_constraints(checkout):
    root, fake = checkout
    done = run_setup(root, fake, "deps")
    assert done.returncode == 0, done.stderr
    venv = root / ".venv"
    assert (venv / ".memspec-venv").read_text().strip() == str(venv)
    pips = [line for line in log_lines(root) if line.startswith("pip ")]
    assert pips, "no pip install ran"
    assert all("-c constraints.txt" in line for line in pips), pips
    # the torch that imports is held while the requirements install (a requirement cannot upgrade it)
    requirements = next(line for line in pips if "-r requirements.txt" in line)
    assert f"-c {venv}/.memspec-stamps/torch-pin.txt" in requirements
    assert (venv / ".memspec-stamps" / "torch-pin.txt").read_text().strip() == "torch==2.13.0+cpu"
    # the machine's harmless index warning is filtered out, the script's progress says how long it has run
    assert "is ignored" not in done.stderr
    assert re.search(r"^\[setup +\d+s\] installing the pinned requirements", done.stdout, re.M), done.stdout


def test_a_venv_made_by_an_earlier_setup_here_is_kept(checkout):
    root, fake = checkout
    venv = make_venv(root, fake, path_in_activate=str(root / ".venv"))
    done = run_setup(root, fake, "deps")
    assert done.returncode == 0, done.stderr
    assert (venv / "keepsake").exists()
    assert not any(line.startswith("venv ") for line in log_lines(root))
    assert (venv / ".memspec-venv").read_text().strip() == str(venv)


def test_a_venv_of_a_moved_checkout_is_made_again(checkout):
    root, fake = checkout
    venv = make_venv(root, fake, path_in_activate="/somewhere/else/.venv")
    done = run_setup(root, fake, "deps")
    assert done.returncode == 0, done.stderr
    assert "made for another path or never finished" in done.stdout
    assert not (venv / "keepsake").exists()
    assert f"venv {venv}" in log_lines(root)
    # a marker naming another path counts the same as activate does
    (venv / ".memspec-venv").write_text("/somewhere/else/.venv\n")
    (venv / "keepsake").touch()
    assert run_setup(root, fake, "deps").returncode == 0
    assert not (venv / "keepsake").exists()


def test_a_venv_left_without_pip_is_made_again(checkout):
    root, fake = checkout
    venv = make_venv(root, fake, path_in_activate=str(root / ".venv"), pip=False)
    done = run_setup(root, fake, "deps")
    assert done.returncode == 0, done.stderr
    assert not (venv / "keepsake").exists() and not (venv / "nopip").exists()
    assert any(line.startswith("pip ") for line in log_lines(root))


def test_an_interpreter_that_cannot_make_a_venv_with_pip_is_named_and_leaves_nothing(checkout):
    root, fake = checkout
    done = run_setup(root, fake, "deps", FAKE_VENV_WITHOUT_PIP="1")
    assert done.returncode != 0
    assert "did not make a venv with pip" in done.stderr and "python3.11-venv" in done.stderr
    assert not (root / ".venv").exists()  # the next run starts over instead of using a venv without pip


def test_pips_failure_is_the_scripts_and_its_error_is_printed_before_the_script_stops(checkout):
    root, fake = checkout
    done = run_setup(root, fake, "deps", FAKE_PIP_FAILS="1")
    assert done.returncode != 0
    assert "ERROR: no matching distribution" in done.stderr  # not lost with the filter's process
    assert not (root / ".venv" / ".memspec-stamps" / "deps").exists()


def test_gptq_venv_is_held_to_its_own_constraints_and_made_again_when_moved(checkout):
    root, fake = checkout
    gvenv = root / ".venv-gptq"
    (gvenv / "bin").mkdir(parents=True)
    shutil.copy(fake, gvenv / "bin" / "python")
    (gvenv / "bin" / "activate").write_text('VIRTUAL_ENV="/old/place/.venv-gptq"\n')
    done = run_setup(root, fake, "gptq")
    assert done.returncode == 0, done.stderr
    assert f"venv {gvenv}" in log_lines(root)
    pips = [line for line in log_lines(root) if line.startswith("pip ")]
    assert pips and all("-c constraints-gptq.txt" in line for line in pips), pips
    # up to date now: a second run makes nothing
    again = run_setup(root, fake, "gptq")
    assert again.returncode == 0 and "up to date" in again.stdout
    assert len([line for line in log_lines(root) if line.startswith("pip ")]) == len(pips)


def test_no_python_for_the_gptq_venv_is_named(checkout):
    root, _ = checkout
    done = run_setup(root, Path("/nonexistent/python3.11"), "gptq")
    assert done.returncode != 0 and "set MEMSPEC_PYTHON" in done.stderr


def test_a_missing_build_tool_is_named_before_any_pip_install(checkout):
    """The compiler, CMake and Python headers were checked after the pip installs, minutes into a clean setup."""
    root, fake = checkout
    done = run_setup(root, fake, "build", CC="/nonexistent/cc")
    assert done.returncode != 0 and "needs /nonexistent/cc on PATH" in done.stderr, done.stderr
    assert not [line for line in log_lines(root) if line.startswith(("pip ", "venv "))]


def test_a_python_of_another_version_is_named_before_the_build_tools_and_any_venv(checkout, tmp_path):
    """With a Python 3.12 and no compiler, the build tools' check ran first and named the compiler (or 3.12's
    missing headers), not the interpreter that no install could use."""
    root, _ = checkout
    other = tmp_path / "bin" / "python3.12"
    other.write_text(FAKE_PYTHON.replace('echo "3.11"', 'echo "3.12"'))
    other.chmod(0o755)
    for target in ("build", "deps"):
        done = run_setup(root, other, target, CC="/nonexistent/cc")
        assert done.returncode != 0 and f"'{other}' is Python 3.12" in done.stderr, done.stderr
        assert "/nonexistent/cc" not in done.stderr and not log_lines(root) and not (root / ".venv").exists()


def test_a_venv_made_here_by_another_tool_is_adopted_not_deleted(checkout):
    """virtualenv and uv write the activate line quoted or indented otherwise: only a line naming another path is
    evidence of a moved checkout; a venv made here by hand (a CUDA torch installed into it) is kept."""
    root, fake = checkout
    venv = make_venv(root, fake, path_in_activate=None)
    (venv / "bin" / "activate").write_text(f"if true; then\n    VIRTUAL_ENV='{venv}'\nfi\n")
    done = run_setup(root, fake, "deps")
    assert done.returncode == 0, done.stderr
    assert (venv / "keepsake").exists() and not any(line.startswith("venv ") for line in log_lines(root))


def test_env_sh_leaves_another_ros_distributions_python_packages_out(tmp_path):
    """A system ROS 2 sourced before env.sh put its rclpy on PYTHONPATH, which Python reads before .venv's: `import
    rclpy` found the other distribution's, built for another Python. env.sh drops every entry of that install (Humble
    splits it over lib/python3.10/site-packages and local/lib/python3.10/dist-packages, rclpy in the second) and the
    install's prefix from the ament and CMake paths, and says so."""
    if not (REPO / ".venv" / "bin" / "activate").is_file() or not (REPO / "install" / "setup.bash").is_file():
        pytest.skip("env.sh needs `make setup` first")  # strict mode (make test) turns this into a failure
    humble = tmp_path / "opt_ros_humble"
    pure = humble / "lib" / "python3.10" / "site-packages"
    (pure / "launch").mkdir(parents=True)
    native = humble / "local" / "lib" / "python3.10" / "dist-packages"
    (native / "rclpy").mkdir(parents=True)
    mine = tmp_path / "mine"
    mine.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV",)}
    env |= {"PYTHONPATH": f"{pure}:{native}:{mine}", "AMENT_PREFIX_PATH": str(humble),
            "CMAKE_PREFIX_PATH": str(humble)}
    done = subprocess.run(["bash", "-c", f'source "{REPO}/env.sh" && echo "PYTHONPATH=$PYTHONPATH"'
                                         ' && echo "AMENT_PREFIX_PATH=$AMENT_PREFIX_PATH"'
                                         ' && echo "CMAKE_PREFIX_PATH=$CMAKE_PREFIX_PATH"'
                                         ' && python -c "import rclpy; print(rclpy.__file__)"'],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    values = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    assert str(mine) in values["PYTHONPATH"].split(":")
    for name in ("PYTHONPATH", "AMENT_PREFIX_PATH", "CMAKE_PREFIX_PATH"):
        assert not [e for e in values[name].split(":") if e.startswith(str(humble))], (name, values[name])
    assert f"(another ROS 2; .venv has ROS 2 Jazzy's): {humble}" in done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith(str(REPO / ".venv"))


def test_env_sh_takes_a_venv_that_make_setup_adopted(tmp_path):
    """make setup adopts a .venv made by virtualenv or uv (their bin/activate quotes or indents the VIRTUAL_ENV line
    otherwise than python -m venv); env.sh matched that line exactly and refused it as "made for another checkout
    path; run 'make setup' here", which kept it again: make test and make demo could never start. env.sh reads the
    path as make setup does (its marker, else the line however quoted), and still refuses another path's venv."""
    root = tmp_path / "checkout"
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / "install").mkdir()
    (root / "install" / "setup.bash").write_text("")
    shutil.copy(REPO / "env.sh", root / "env.sh")
    activate = root / ".venv" / "bin" / "activate"

    def sourced() -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", f'source "{root}/env.sh" && echo "venv=$VIRTUAL_ENV"'],
                              capture_output=True, text=True, timeout=60)

    venv = str(root.resolve() / ".venv")
    for line in (f"    VIRTUAL_ENV='{venv}'", f"export VIRTUAL_ENV={venv}", f'VIRTUAL_ENV="{venv}"'):
        activate.write_text(f"{line}\nexport VIRTUAL_ENV\n")
        done = sourced()
        assert done.returncode == 0 and f"venv={venv}" in done.stdout, (line, done.stderr)
    activate.write_text("VIRTUAL_ENV='/elsewhere/.venv'\nexport VIRTUAL_ENV\n")
    done = sourced()
    assert done.returncode == 1 and "was made for another checkout path (/elsewhere/.venv)" in done.stderr
    (root / ".venv" / ".memspec-venv").write_text(venv + "\n")  # make setup's marker decides where it exists
    activate.write_text(f"VIRTUAL_ENV='{venv}'\nexport VIRTUAL_ENV\n")
    assert sourced().returncode == 0
    (root / ".venv" / ".memspec-venv").write_text("/copied/from/.venv\n")
    assert sourced().returncode == 1


def test_make_bench_render_only_leaves_out_the_run_options():
    """make bench always passed BENCH_PATHS (--quantization int4 ...), which --render-only refuses as options of a
    run: `make bench BENCH_ARGS=--render-only` could only fail."""
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")

    def paper_line(*assignments: str) -> str:
        done = subprocess.run(["make", "-n", "-C", str(REPO), "bench", *assignments], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        text = done.stdout.replace("\\\n", " ")
        return next(line for line in text.splitlines() if "bench.cli paper" in line)

    assert "--quantization int4" in paper_line()
    rendered = paper_line("BENCH_ARGS=--render-only")
    assert "--render-only" in rendered and "--quantization" not in rendered
