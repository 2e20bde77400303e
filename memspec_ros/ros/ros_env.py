"""The ROS environment a self-contained run sets up for itself (the demo, the test sessions): no rclpy import.

The demo and the tests start their own node and its clients on a ROS_DOMAIN_ID of their own. A shell's own
middleware settings are not theirs: another RMW (only rmw_fastrtps comes with the venv's ROS: rclpy.init failed), a
discovery server that is not running (every node a client of it: spin timeouts), DDS profiles, an SROS2 enclave, or
a discovery range beyond this host (two machines' demos on one LAN claimed the same domain and answered each other).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterable
from typing import IO

from ..runtime.atomic_write import open_lock

# where the domain locks are (default: the system's temporary folder): one folder for every session on the host, also
# where a test session moves its own temporary files (a noexec /tmp) and child processes inherit that TMPDIR
LOCK_DIR_ENV = "MEMSPEC_DOMAIN_LOCK_DIR"

CLEARED = ("RMW_IMPLEMENTATION", "ROS_DISCOVERY_SERVER", "ROS_SUPER_CLIENT", "FASTDDS_DEFAULT_PROFILES_FILE",
           "FASTRTPS_DEFAULT_PROFILES_FILE", "ROS_SECURITY_ENABLE", "ROS_SECURITY_KEYSTORE",
           "ROS_SECURITY_ENCLAVE_OVERRIDE", "ROS_SECURITY_STRATEGY", "ROS_STATIC_PEERS")


def lock_domain_id(ids: Iterable[int]) -> tuple[int, IO[str]] | None:
    """The first of ``ids`` that no other demo or test session on this host holds, and the open file whose lock holds
    it (until it is closed or the process exits); None if every one is held. Never the shell's own ROS_DOMAIN_ID: a
    robot or simulator on this host may run there, and would meet the nodes started on it."""
    own = os.environ.get("ROS_DOMAIN_ID", "").strip()
    for domain in ids:
        if str(domain) == own:
            continue
        try:  # another user's lock file (a shared host): not ours to open, so not ours to take; nor a link planted
            # at its name in the shared /tmp (it would create a file where it points)
            folder = os.environ.get(LOCK_DIR_ENV) or tempfile.gettempdir()
            handle = open_lock(os.path.join(folder, f"memspec_ros_test_domain_{domain}.lock"))
        except OSError:
            continue
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            continue
        return domain, handle
    return None


def isolate_ros_environment(domain_id: int) -> None:
    """Set the environment rclpy reads at init (and child processes inherit): ``domain_id``, discovery on this host
    only, and none of the shell's middleware settings."""
    os.environ["ROS_DOMAIN_ID"] = str(domain_id)
    os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"  # Jazzy and later
    for name in CLEARED:
        os.environ.pop(name, None)
    if os.environ.get("ROS_DISTRO") == "humble":
        os.environ["ROS_LOCALHOST_ONLY"] = "1"  # Humble's spelling of the same
    else:
        os.environ.pop("ROS_LOCALHOST_ONLY", None)  # deprecated from Jazzy on, and it warns
