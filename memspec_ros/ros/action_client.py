"""An ActionClient whose goal, cancel and result requests always get their answer.

rclpy's ActionClient (7.1.6, Jazzy's wheel here; found in 7.1.5) sends a request and only then records its sequence
number; an executor spinning on another thread can take the server's answer in between, drop it as
"unexpected" and leave the future pending forever (ros2/rclpy#1123, fixed upstream by #1308 and its
backports). Clients that spin in another thread (a behaviour tree's node, the test harness, the soak
benchmark) hit it once the server answers in about a millisecond, as memspec_node's goal callback does:
test_node_fuzz.py met it. The same fix here: sending a request and recording it hold one lock, and the
executor takes answers under it.
"""

from __future__ import annotations

import threading

from rclpy.action import ActionClient


class SafeActionClient(ActionClient):
    """rclpy's ActionClient with ros2/rclpy#1123 closed: drop-in, same arguments."""

    def __init__(self, *args, **kwargs) -> None:
        self._request_lock = threading.RLock()
        super().__init__(*args, **kwargs)

    def send_goal_async(self, *args, **kwargs):
        with self._request_lock:
            return super().send_goal_async(*args, **kwargs)

    def _cancel_goal_async(self, *args, **kwargs):
        with self._request_lock:
            return super()._cancel_goal_async(*args, **kwargs)

    def _get_result_async(self, *args, **kwargs):
        with self._request_lock:
            return super()._get_result_async(*args, **kwargs)

    def take_data(self):
        with self._request_lock:
            return super().take_data()
