# ruff: noqa: E402 - the ROS imports follow require_ros()
"""SafeActionClient (ros/action_client.py): a goal answered while the sending thread is between sending the
request and recording it still completes its future (rclpy's ActionClient drops that answer: ros2/rclpy#1123).
The window is widened on purpose, so that both outcomes are certain, not a matter of timing."""

from __future__ import annotations

import threading
import time

import pytest
from ros_helpers import require_ros, wait_until

require_ros()

import rclpy
from rclpy.action import ActionClient, ActionServer, GoalResponse
from rclpy.executors import MultiThreadedExecutor

from memspec_interfaces.action import Generate
from memspec_ros.ros.action_client import SafeActionClient

PATIENCE = 5.0  # seconds a request may wait to be recorded: the server's answer arrives well within it


class _SlowSend:
    """The client's rcl handle, where a goal request is recorded only once its answer has been taken (the race,
    made certain on any machine: a fixed pause let a slow server answer after it)."""

    def __init__(self, handle) -> None:
        self._handle = handle
        self._answered = threading.Event()

    def send_goal_request(self, request):
        sequence = self._handle.send_goal_request(request)
        # rclpy's client takes the answer meanwhile (at once: the race is certain); SafeActionClient takes nothing
        # while it records a request, so this waits out the patience, the answer waiting for it
        self._answered.wait(PATIENCE)
        return sequence

    def take_goal_response(self, *args):
        taken = self._handle.take_goal_response(*args)
        if all(taken):
            self._answered.set()
        return taken

    def __getattr__(self, name):
        return getattr(self._handle, name)


@pytest.mark.parametrize("client_class, answered", [(ActionClient, False), (SafeActionClient, True)])
def test_a_goal_answered_before_it_is_recorded_still_completes(rclpy_context, client_class, answered):
    server_node = rclpy.create_node("race_server", context=rclpy_context)
    client_node = rclpy.create_node("race_client", context=rclpy_context)
    server = ActionServer(server_node, Generate, "race", execute_callback=lambda handle: Generate.Result(),
                          goal_callback=lambda goal: GoalResponse.REJECT)  # answered at once
    client = client_class(client_node, Generate, "race")
    executor = MultiThreadedExecutor(num_threads=2, context=rclpy_context)
    executor.add_node(server_node)
    executor.add_node(client_node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    try:
        wait_until(client.server_is_ready, 30.0, "the action server")
        client._client_handle = _SlowSend(client._client_handle)
        future = client.send_goal_async(Generate.Goal(prompt="x"))
        deadline = time.monotonic() + 5.0
        while not future.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert future.done() == answered
        if answered:
            assert not future.result().accepted
    finally:
        executor.shutdown(timeout_sec=2.0)
        client.destroy()
        server.destroy()
        client_node.destroy_node()
        server_node.destroy_node()
