"""Helpers for tests that talk ROS 2 (rclpy) for real, over DDS on this host only.

Isolation: every pytest session claims a ROS_DOMAIN_ID of its own (conftest.py does it at import,
before any rclpy.init) and keeps discovery on localhost, so parallel sessions on one machine, a
node someone runs by hand (domain 0) and the network never see each other's traffic.

Importing this module never imports rclpy, so tests without ROS can share conftest.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import IO, Any

import pytest

from memspec_ros.ros.ros_env import isolate_ros_environment, lock_domain_id  # noqa: F401 - conftest's, re-exported

# 0 is the ROS default that people's own nodes use; 1..101 are valid on every platform.
TEST_DOMAIN_IDS = range(1, 102)
STRICT_ENV = "MEMSPEC_TEST_STRICT"  # "1" (make test, CI): a missing ROS environment fails, not skips

_held_domain_locks: list[IO[str]] = []


def claim_ros_domain_id() -> int:
    """Return a ROS_DOMAIN_ID no other test session on this host holds, and hold it.

    Starts at a pid-derived id and takes an exclusive lock file per id; the lock is held for
    the life of the process. MEMSPEC_TEST_ROS_DOMAIN_ID forces a value.
    """
    forced = os.environ.get("MEMSPEC_TEST_ROS_DOMAIN_ID")
    if forced:
        return int(forced)
    # (never the shell's own ROS_DOMAIN_ID, which env.sh keeps when set beforehand: the diagnostics tests would read
    # the /diagnostics of a robot or simulator running there)
    ids = list(TEST_DOMAIN_IDS)
    start = os.getpid() % len(ids)
    claimed = lock_domain_id(ids[start:] + ids[:start])
    if claimed is not None:
        domain, handle = claimed
        _held_domain_locks.append(handle)  # kept open: it holds the lock until the process exits
        return domain
    raise RuntimeError(
        f"every ROS_DOMAIN_ID in {ids[0]}..{ids[-1]} is held by another test session on this host;"
        " wait for them to finish or set MEMSPEC_TEST_ROS_DOMAIN_ID"
    )


def require_ros() -> None:
    """Skip (or, under make test / CI, fail) unless rclpy and memspec_interfaces import.

    Call it at module level before importing ROS modules. memspec_interfaces comes from the
    colcon build, so it imports only in a shell that sourced env.sh (or install/setup.bash).
    """
    try:
        import rclpy  # noqa: F401

        # the generated module, not the source folder of the same name (a namespace package
        # when the repo root is on sys.path, as with `python -m pytest`)
        from memspec_interfaces.action import Generate  # noqa: F401
    except ImportError as exc:
        message = f"ROS 2 environment not available ({exc}): run `make test`, or `source env.sh` first"
        if os.environ.get(STRICT_ENV) == "1":
            pytest.fail(message, pytrace=False)
        pytest.skip(message, allow_module_level=True)


def spin_until_complete(spinner: Any, future: Any, timeout_sec: float = 10.0, what: str = "the future") -> Any:
    """Spin an executor (or a node) until ``future`` is done; return its result.

    Unlike rclpy's spin_until_future_complete, a timeout fails the test with a message that says
    what was awaited, instead of returning silently.
    """
    if hasattr(spinner, "spin_until_future_complete"):  # an Executor
        spinner.spin_until_future_complete(future, timeout_sec=timeout_sec)
    else:  # a Node
        import rclpy

        rclpy.spin_until_future_complete(spinner, future, timeout_sec=timeout_sec)
    if not future.done():
        raise AssertionError(f"timed out after {timeout_sec:g} s waiting for {what}")
    return future.result()


def spin_until(executor: Any, condition: Callable[[], bool], timeout_sec: float = 10.0,
               what: str = "the condition") -> None:
    """Spin ``executor`` in short slices until ``condition()`` is true, or fail after the timeout."""
    deadline = time.monotonic() + timeout_sec
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_sec:g} s waiting for {what}")
        executor.spin_once(timeout_sec=0.05)


def wait_until(condition: Callable[[], bool], timeout_sec: float = 10.0, what: str = "the condition") -> None:
    """Poll ``condition()`` without spinning (for code that already runs inside a callback)."""
    deadline = time.monotonic() + timeout_sec
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_sec:g} s waiting for {what}")
        time.sleep(0.01)
