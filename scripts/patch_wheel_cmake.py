"""Point the ROS 2 wheels' CMake export files at this venv's Python.

The ros-jazzy-* wheels are built in a manylinux container and their CMake exports hard-code
that container's Python (``/opt/python/cp311-cp311/include/python3.11`` and its NumPy include
dir). colcon-building an interface package against them then fails to find Python.h. This
rewrites those paths, in ``<prefix>/share/**/cmake/*.cmake``, to the running interpreter's
include dir and site-packages. Idempotent: patched files no longer match.

Usage: python scripts/patch_wheel_cmake.py [PREFIX]   (PREFIX defaults to sys.prefix)
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
from pathlib import Path

# /opt/python/cp311-cp311/include/python3.11 and /opt/python/cp311-cp311/lib/python3.11/site-packages
_BUILD_PREFIX = r"/opt/python/cp3\d+-cp3\d+"
_INCLUDE = re.compile(_BUILD_PREFIX + r"/include/python3\.\d+")
_SITE = re.compile(_BUILD_PREFIX + r"/lib/python3\.\d+/site-packages")


def patch(prefix: Path) -> tuple[int, int]:
    """Rewrite the build container's paths; return (files patched, files left with one)."""
    include = sysconfig.get_paths()["include"]
    site = sysconfig.get_paths()["purelib"]
    patched = leftover = 0
    for path in sorted((prefix / "share").rglob("*.cmake")):
        text = path.read_text(encoding="utf-8")
        if "/opt/python/" not in text:
            continue
        new = _SITE.sub(site, _INCLUDE.sub(include, text))
        if new != text:
            # written beside and renamed over: an interrupted run must not leave a cut file, which no later
            # run would repair (it no longer names the prefix, and pip keeps the installed wheel)
            partial = path.with_name(path.name + ".partial")
            partial.write_text(new, encoding="utf-8")
            os.replace(partial, path)
            patched += 1
        if re.search(_BUILD_PREFIX, new):
            leftover += 1
            print(f"warning: {path} still names the wheel build prefix", file=sys.stderr)
    return patched, leftover


def main() -> int:
    prefix = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(sys.prefix)
    patched, leftover = patch(prefix)
    print(f"patched the Python paths in {patched} CMake file(s) under {prefix}/share")
    return 1 if leftover else 0


if __name__ == "__main__":
    sys.exit(main())
