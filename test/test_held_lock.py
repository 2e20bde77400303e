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
    thread.join()
    assert waited == [True] and order == ["first done", "second in"]
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
