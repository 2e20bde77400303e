"""runtime/atomic_write.held_lock: one process at a time works in a folder (the teacher's answers, GPT-QModel's
quantized target), the second waiting, said so, and never opening a file through a link planted at the lock's name."""

from __future__ import annotations

import os
import threading
import time

import pytest

from memspec_ros.runtime.atomic_write import held_lock


def test_a_second_holder_waits_for_the_first_and_says_so(tmp_path):
    lock = tmp_path / ".train.lock"
    order: list[str] = []
    held, asked = threading.Event(), threading.Event()

    def first():
        with held_lock(lock):
            held.set()
            asked.wait(30.0)  # held until the second holder has found it taken (no fixed sleep to race)
            time.sleep(0.05)
            order.append("first done")

    thread = threading.Thread(target=first)
    thread.start()
    assert held.wait(10.0)
    waited: list[bool] = []
    with held_lock(lock, lambda: waited.append(True) or asked.set()):  # flock: another open file description
        order.append("second in")
    thread.join(30.0)
    assert not thread.is_alive() and waited == [True] and order == ["first done", "second in"]
    with held_lock(lock, lambda: waited.append(True)):  # free now: no wait
        pass
    assert waited == [True]


def test_a_link_at_the_locks_name_is_not_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("someone's file")
    os.symlink(elsewhere, tmp_path / ".train.lock")
    with pytest.raises(OSError), held_lock(tmp_path / ".train.lock"):
        pass
    assert elsewhere.read_text() == "someone's file"


def test_a_bounded_wait_gives_up_on_a_holder_that_never_lets_go(tmp_path):
    """A process stopped while it held the lock held every other process's wait for good (the CPU kernels' compile
    lock is taken as a node configures): with a timeout the wait ends in TimeoutError (an OSError)."""
    lock = tmp_path / ".k.lock"
    with held_lock(lock):
        with pytest.raises(TimeoutError, match="for more than 0.3 s"), held_lock(lock, timeout=0.3):
            pass
    with held_lock(lock, timeout=0.3):  # free again
        pass
