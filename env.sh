# Source this file (bash) to work with memspec_ros on a machine set up by `make setup`:
#     source env.sh
# It activates .venv (Python libraries and ROS 2 Jazzy from PyPI wheels), puts the venv on the
# ament/CMake prefix paths (it is the ROS underlay here), sources install/setup.bash (our two
# packages) and sets isolation defaults that you may override beforehand:
#     ROS_DOMAIN_ID=0, ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST (DDS traffic stays on this host)
# On a robot with apt ROS 2, source /opt/ros/$ROS_DISTRO/setup.bash and your workspace's
# install/setup.bash instead (README.md).

_memspec_root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
if [ ! -f "$_memspec_root/.venv/bin/activate" ] || [ ! -f "$_memspec_root/install/setup.bash" ]; then
  echo "env.sh: run 'make setup' in $_memspec_root first (no .venv or install/ yet)" >&2
  unset _memspec_root
  return 1 2>/dev/null || exit 1
fi
# a venv made for another path (a moved or copied checkout) would run that path's tree and tools. The path it was
# made for: the marker make setup writes, else its bin/activate's VIRTUAL_ENV line, read as make setup reads it
# (virtualenv and uv quote or indent it otherwise than python -m venv; an exact match refused their venvs, and make
# setup, which adopts them, left them as they were)
_memspec_made_for="$(cat "$_memspec_root/.venv/.memspec-venv" 2>/dev/null \
  || sed -nE "s/^[[:space:]]*(export[[:space:]]+)?VIRTUAL_ENV=[\"']?([^\"']*)[\"']?.*/\2/p" \
       "$_memspec_root/.venv/bin/activate" | head -1)"
if [ "$_memspec_made_for" != "$_memspec_root/.venv" ]; then
  echo "env.sh: $_memspec_root/.venv was made for another checkout path (${_memspec_made_for:-unknown}); run" \
       "'make setup' here (it makes it again)" >&2
  unset _memspec_root _memspec_made_for
  return 1 2>/dev/null || exit 1
fi
unset _memspec_made_for

# shellcheck disable=SC1091
. "$_memspec_root/.venv/bin/activate"
case ":${AMENT_PREFIX_PATH:-}:" in
  *":$VIRTUAL_ENV:"*) ;;
  *) export AMENT_PREFIX_PATH="$VIRTUAL_ENV${AMENT_PREFIX_PATH:+:$AMENT_PREFIX_PATH}" ;;
esac
case ":${CMAKE_PREFIX_PATH:-}:" in
  *":$VIRTUAL_ENV:"*) ;;
  *) export CMAKE_PREFIX_PATH="$VIRTUAL_ENV${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}" ;;
esac
# A system ROS 2 sourced in this shell before (/opt/ros/$ROS_DISTRO/setup.bash) put its Python packages on
# PYTHONPATH, which Python reads before .venv's: `import rclpy` then found that distribution's rclpy, built for
# another Python, and failed far from the cause. Every PYTHONPATH entry under that install (Humble splits it over
# lib/python3.X/site-packages and local/lib/python3.X/dist-packages) is dropped here, with a note, and the install
# leaves AMENT_PREFIX_PATH and CMAKE_PREFIX_PATH too (its packages would be found where the venv has none).
_memspec_roots=()
IFS=':' read -r -a _memspec_entries <<< "${PYTHONPATH:-}"
for _memspec_entry in "${_memspec_entries[@]}"; do
  if [ -n "$_memspec_entry" ] && [ -d "$_memspec_entry/rclpy" ] \
      && [ "${_memspec_entry#"$VIRTUAL_ENV"/}" = "$_memspec_entry" ] \
      && [[ "$_memspec_entry" =~ ^(.*)/(local/)?lib/python[0-9.]+/(site|dist)-packages/?$ ]]; then
    _memspec_entry="${BASH_REMATCH[1]}"
    _memspec_roots+=("${_memspec_entry%/local}")  # the install root (the regex's group keeps a local/ part)
  fi
done
_memspec_strip() {  # $1: a colon-separated list; prints it without the entries under the roots found above
  local kept="" entry root under
  IFS=':' read -r -a _memspec_list <<< "$1"
  for entry in "${_memspec_list[@]}"; do
    under=""
    for root in "${_memspec_roots[@]}"; do
      case "$entry/" in "$root"/*) under=1 ;; esac
    done
    [ -n "$entry" ] && [ -z "$under" ] && kept="${kept:+$kept:}$entry"
  done
  printf '%s' "$kept"
}
if [ "${#_memspec_roots[@]}" -gt 0 ]; then
  echo "env.sh: left out of PYTHONPATH, AMENT_PREFIX_PATH and CMAKE_PREFIX_PATH (another ROS 2; .venv has ROS 2" \
       "Jazzy's): ${_memspec_roots[*]}" >&2
  for _memspec_var in PYTHONPATH AMENT_PREFIX_PATH CMAKE_PREFIX_PATH; do
    _memspec_value="$(_memspec_strip "${!_memspec_var:-}")"
    if [ -n "$_memspec_value" ]; then export "$_memspec_var=$_memspec_value"; else unset "$_memspec_var"; fi
  done
fi
unset -f _memspec_strip
unset _memspec_roots _memspec_entries _memspec_entry _memspec_list _memspec_var _memspec_value

# shellcheck disable=SC1091
. "$_memspec_root/install/setup.bash"

export ROS_DOMAIN_ID="${ROS_DOMAIN_ID:-0}"
export ROS_AUTOMATIC_DISCOVERY_RANGE="${ROS_AUTOMATIC_DISCOVERY_RANGE:-LOCALHOST}"
unset _memspec_root
