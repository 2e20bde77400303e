"""The node's lifecycle internals of rclpy, because rclpy (Humble to Jazzy) has no public API for them (two other
places read rclpy internals: params.declare_all its parameter overrides, action_client.py ActionClient's request
methods), and the executor's count of callbacks in flight (:func:`wait_for_callbacks`).

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


def guard_change_state(node, on_error: Callable[[Any, Exception], None], lock) -> bool:
    """Wrap ``node``'s ChangeState service callback so that an exception becomes success=False after
    ``on_error(request, exc)``; False if this rclpy has no such service attribute. ``lock`` (a reentrant one) is held
    for the whole callback: rclpy steps its state machine before and after the transition's own callback, and a
    lock held by the callback alone let another thread (the node's destruction) run between those steps."""
    service = getattr(node, "_service_change_state", None)
    if service is None:
        return False
    handler = service.callback

    def guarded(request, response):
        try:
            with lock:
                return handler(request, response)
        except Exception as exc:
            on_error(request, exc)
            response.success = False
            return response

    service.callback = guarded
    return True


READ_ONLY_LIFECYCLE_SERVICES = ("_service_get_state", "_service_get_available_states",
                                "_service_get_available_transitions", "_service_get_transition_graph")


def answer_lifecycle_queries_apart(node, group) -> int:
    """Move ``node``'s read-only lifecycle services (get_state and the lists of states and transitions) into
    ``group``: rclpy puts them in change_state's group, so a configure that loads the models left `ros2 lifecycle
    get` and a lifecycle manager's get_state unanswered until it ended. Returns how many were moved (0 if this
    rclpy names them otherwise: they then keep waiting behind a transition, as before)."""
    import weakref

    moved = 0
    for name in READ_ONLY_LIFECYCLE_SERVICES:
        service = getattr(node, name, None)
        if service is None or not hasattr(service, "callback_group"):
            continue
        service.callback_group.entities.discard(weakref.ref(service))
        service.callback_group = group
        group.add_entity(service)
        moved += 1
    return moved


def wait_for_callbacks(executor, timeout: float) -> bool:
    """Wait up to ``timeout`` s until none of ``executor``'s callbacks is running; True if none is (or this rclpy
    keeps no count). ``Executor.shutdown(timeout_sec)`` is meant to do this, but rclpy (7.1, Jazzy) sets its
    shutdown flag before testing it, so it never waits: a diagnostics update still running went on reading the
    models the node's destruction was freeing. Call it once the executor has stopped spinning. It counts the
    service, timer and subscription callbacks; an action goal's execute, which rclpy runs as a task, is not one."""
    tracker = getattr(executor, "_work_tracker", None)
    return tracker.wait(timeout) if tracker is not None else True
