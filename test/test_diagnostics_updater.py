# ruff: noqa: E402 - the ROS imports follow require_ros()
"""memspec_ros.ros.diagnostics against the real diagnostic_updater (ros/diagnostics, ros2-jazzy):
DiagnosticStatusWrapper.mergeSummary, the Updater's "Node starting up" and "No message was set",
diagnostic_updater.use_fqn, force_update, and config/diagnostic_analyzers.yaml as
diagnostic_aggregator's GenericAnalyzer reads it. No models are loaded here."""

from __future__ import annotations

import pytest
from ros_helpers import require_ros

require_ros()

from memspec_ros.ros.diagnostics import ERROR, NO_MESSAGE, OK, WARN, Status

FIRST, SECOND = "first text", "second text"

# (level set by summary, level merged, expected level, expected message): mergeSummary's rule is that
# two OK or two not-OK texts are joined with "; ", and when only one is not OK its text alone stays.
MERGE_CASES = [
    (OK, OK, OK, f"{FIRST}; {SECOND}"),
    (OK, WARN, WARN, SECOND),
    (OK, ERROR, ERROR, SECOND),
    (WARN, OK, WARN, FIRST),
    (WARN, WARN, WARN, f"{FIRST}; {SECOND}"),
    (WARN, ERROR, ERROR, f"{FIRST}; {SECOND}"),
    (ERROR, WARN, ERROR, f"{FIRST}; {SECOND}"),
    (ERROR, OK, ERROR, FIRST),
]


LEVEL_NAMES = {OK: "OK", WARN: "WARN", ERROR: "ERROR"}


@pytest.mark.parametrize(("first", "merged", "level", "message"), MERGE_CASES,
                         ids=[f"{LEVEL_NAMES[a]}-then-{LEVEL_NAMES[b]}" for a, b, _, _ in MERGE_CASES])
def test_merge_follows_merge_summary(first, merged, level, message):
    s = Status()
    s.summary(first, FIRST)
    s.merge(merged, SECOND)
    assert (s.level, s.message) == (level, message)


def test_merge_onto_an_empty_text_adds_no_separator():
    s = Status()
    s.summary(OK, "")
    s.merge(OK, SECOND)
    assert (s.level, s.message) == (OK, SECOND)


def test_a_status_no_task_set_is_an_error():
    s = Status()
    assert (s.level, s.message) == (ERROR, NO_MESSAGE)
    s.merge(WARN, SECOND)  # both not OK: joined, as the real wrapper does with its preset status
    assert (s.level, s.message) == (ERROR, f"{NO_MESSAGE}; {SECOND}")
