"""The node's lifecycle internals of rclpy, because rclpy (Humble to Jazzy) has no public API for them (two other
places read rclpy internals: params.declare_all its parameter overrides, action_client.py ActionClient's request
methods).

* The current lifecycle state: ``LifecycleNode`` keeps it in ``_state_machine`` and offers no getter (only the
  ~/get_state service, which a node cannot call on itself from inside a callback).
* The ~/change_state service's callback: rclpy raises out of it for a transition the current state does not
  have, which ends the node; rclcpp answers success=False instead. Wrapping the callback is the only hook.

If a future rclpy renames these, the node still runs: the state reads "unknown" and transitions go unguarded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def lifecycle_state_label(node) -> str:
    """The label of ``node``'s current lifecycle state ("unconfigured", "inactive", "active", ...)."""
    machine = getattr(node, "_state_machine", None)
    return machine.current_state[1] if machine is not None else "unknown"


def guard_change_state(node, on_error: Callable[[Any, Exception], None]) -> bool:
    """Wrap ``node``'s ChangeState service callback so that an exception becomes success=False after
    ``on_error(request, exc)``; False if this rclpy has no such service attribute."""
    service = getattr(node, "_service_change_state", None)
    if service is None:
        return False
    handler = service.callback

    def guarded(request, response):
        try:
            return handler(request, response)
        except Exception as exc:
            on_error(request, exc)
            response.success = False
            return response

    service.callback = guarded
    return True
