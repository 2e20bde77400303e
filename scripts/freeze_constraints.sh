#!/usr/bin/env bash
# Write constraints.txt and constraints-gptq.txt from the two venvs that `make setup` made: every
# installed distribution at its installed version, so scripts/setup.sh installs exactly these on a
# clean clone. After changing a requirements file: empty both files first (`: > constraints.txt;
# : > constraints-gptq.txt`: setup installs under them, so an old pin would hold the new requirement
# back or fail it), run a FRESH setup (make distclean && make setup), then this, and commit both files.
# Left out of constraints.txt: torch and its CUDA runtime (setup.sh keeps whatever torch imports).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
cd "$ROOT"

freeze() {  # freeze VENV EXCLUDE_REGEX HEADER...
  local venv="$1" exclude="$2"
  shift 2
  [ -x "$venv/bin/python" ] || { echo "freeze_constraints.sh: no $venv; run make setup first" >&2; exit 1; }
  printf '# %s\n' "$@"
  printf '# Written by scripts/freeze_constraints.sh from a fresh %s (%s); do not edit by hand.\n' \
    "${venv#"$ROOT"/}" "$(date -u +%Y-%m-%d)"
  "$venv/bin/python" -m pip freeze --exclude-editable 2>/dev/null | LC_ALL=C sort -f | grep -Eiv "$exclude"
}

freeze .venv '^(torch|nvidia-[a-z0-9-]+|triton)==' \
  "Every package scripts/setup.sh installs into .venv, at the version a clean clone resolved: a new release" \
  "of a dependency of a dependency (the ROS middleware behind ros-jazzy-rclpy, numpy, huggingface-hub, the" \
  "colcon plug-ins) cannot change what CI gets. torch is not here: setup.sh never replaces a torch that imports." \
  >constraints.txt.partial
freeze .venv-gptq '^$' \
  "Every package scripts/setup.sh installs into .venv-gptq (GPT-QModel and its torch), at the version a" \
  "clean clone resolved." \
  >constraints-gptq.txt.partial
mv constraints.txt.partial constraints.txt
mv constraints-gptq.txt.partial constraints-gptq.txt
echo "wrote constraints.txt ($(grep -vc '^#' constraints.txt) pins) and constraints-gptq.txt ($(grep -vc '^#' constraints-gptq.txt) pins)"
