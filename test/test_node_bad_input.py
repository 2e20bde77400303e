# ruff: noqa: E402 - the ROS imports follow require_ros()
"""Bad input over DDS, the cases of issue 18 that test_node_action.py, test_node_chat.py and
test_node_params_diagnostics.py do not already cover. Each goal gets a rejection answered by the goal
callback with a specific reason (its latency is memspec-bench soak's verdict, not a unit test's), or is
accepted with the outcome Generate.action documents (a clamp, or the node default); each bad parameter is
refused with its reason and changes nothing."""

from __future__ import annotations

import math

import pytest
from node_helpers import Harness, active_harness, goal, node_overrides, tiny_zoo
from ros_helpers import require_ros

require_ros()

from action_msgs.msg import GoalStatus
from rclpy.serialization import deserialize_message, serialize_message

from memspec_interfaces.action import Generate
from memspec_ros.ros import params as P
from memspec_ros.ros.goal_runner import MAX_STOP_CHARS, MAX_STOP_STRINGS

NEW = 12


@pytest.fixture(scope="module")
def h():
    with active_harness() as harness:
        yield harness


def goal_with(request=None, **values):
    """``goal()`` with any fields set (its temperature too)."""
    request = request or goal()
    for key, value in values.items():
        setattr(request, key, value)
    return request


def rejected(h, request, reason: str) -> None:
    before = h.node.goals_rejected
    handle, _ = h.send(request)
    assert not handle.accepted, reason
    assert reason in h.node.last_rejection, (reason, h.node.last_rejection)
    assert h.node.goals_rejected == before + 1  # counted once, for /diagnostics


def succeeded(h, request) -> Generate.Result:
    handle, _ = h.send(request)
    assert handle.accepted, h.node.last_rejection
    response = h.result(handle)
    assert response.status == GoalStatus.STATUS_SUCCEEDED, response.result.error_message
    return response.result


# -- goals ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt, raw", [(" ", False), ("\n\t  \r\n", False), ("\u3000\u2003", True)])
def test_a_whitespace_only_prompt_is_rejected(h, prompt, raw):
    rejected(h, goal(prompt=prompt, raw=raw), "the prompt is only whitespace")


def test_control_characters_are_text_and_a_nul_ends_the_ros_string(h):
    """Control characters, escape sequences and bidi overrides are ordinary text to the tokenizer: the goal
    succeeds. A NUL cannot cross ROS (a C string ends there), so a prompt that starts with one arrives empty."""
    result = succeeded(h, goal(prompt="\x01\x07\x1b[31mred\x1b[0m\x7f\u202eevil\u202c\x08", max_new_tokens=NEW))
    assert result.completion_tokens == NEW and result.prompt_tokens > 0
    rejected(h, goal(prompt="\x00 hidden after a NUL"), "the prompt is empty")


def test_invalid_utf8_arrives_as_replacement_characters_and_surrogates_cannot_be_sent(h):
    """A C++ client can put any bytes in a string; rclpy decodes a taken message with errors='replace', the
    same conversion deserialize_message runs here, so the node sees U+FFFD where the bytes were invalid and
    answers the goal like any other. A Python client cannot even serialize a lone surrogate."""
    wire = serialize_message(Generate.Goal(prompt="valid XXXX then more", max_new_tokens=NEW, temperature=0.0))
    for bad in (b"\xff\xfe\x80\xc0", b"\xed\xa0\x80Z"):  # stray bytes; a UTF-8-encoded surrogate (U+D800)
        taken = deserialize_message(wire.replace(b"XXXX", bad), Generate.Goal)
        assert "\ufffd" in taken.prompt and taken.prompt.startswith("valid ")
        assert succeeded(h, taken).completion_tokens == NEW
    with pytest.raises(UnicodeEncodeError):
        serialize_message(Generate.Goal(prompt="lone \ud800 surrogate"))


def test_a_prompt_over_the_context_is_rejected_whatever_max_prompt_tokens_allows(h):
    assert h.set_params(**{"generation.max_prompt_tokens": 10_000_000})[0].successful
    try:
        context = h.node.loaded.max_positions
        rejected(h, goal(prompt="word " * context), f"more than the limit of {context - 1}")
    finally:
        assert h.set_params(**{"generation.max_prompt_tokens": 1024})[0].successful


def test_max_new_tokens_zero_is_the_node_default_and_a_huge_one_is_rejected(h):
    assert succeeded(h, goal(max_new_tokens=0)).completion_tokens == h.get_param("generation.max_new_tokens")
    rejected(h, goal(max_new_tokens=2**32 - 1), "exceeds the target's context")


@pytest.mark.parametrize("field, value, reason", [
    ("temperature", math.nan, "temperature nan out of range"),
    ("temperature", math.inf, "temperature inf out of range"),
    ("temperature", -math.inf, "temperature -inf out of range"),
    ("temperature", 100.5, "temperature 100.5 out of range"),
    ("top_p", math.nan, "top_p nan out of range"),
    ("top_p", math.inf, "top_p inf out of range"),
    ("top_p", 1.0000001, "out of range: (0, 1]"),
])
def test_out_of_range_sampling_values_are_rejected(h, field, value, reason):
    rejected(h, goal_with(**{field: value}), reason)


def test_sampling_values_that_mean_the_default_or_greedy(h):
    """Negative temperature, top_p <= 0 and any negative seed mean the node's defaults (greedy here); a
    positive temperature under 1e-5 decodes greedily (float32 softmax turns to NaN near 1e-40); a top_p so
    small that it keeps only the most likely token samples that token, so the greedy text again."""
    greedy = succeeded(h, goal(prompt="The patient", max_new_tokens=NEW)).text
    for settings in ({"temperature": -3.0}, {"temperature": 1e-30}, {"temperature": 1e-6, "seed": 3},
                     {"temperature": 0.0, "top_p": -2.0}, {"temperature": -1.0, "top_p": -math.inf},
                     {"temperature": -1.0, "seed": -42},
                     {"temperature": 1.5, "top_p": 1e-30, "seed": 5}):
        request = goal_with(goal(prompt="The patient", max_new_tokens=NEW), **settings)
        assert succeeded(h, request).text == greedy, settings


def test_stop_lists_empty_entries_and_bounds(h):
    plain = succeeded(h, goal(max_new_tokens=NEW)).text
    assert succeeded(h, goal(max_new_tokens=NEW, stop=[""] * 3)).text == plain  # an empty stop string never matches
    at_limit = [f"{i:04d}" + "\u2603" * (MAX_STOP_CHARS - 4) for i in range(MAX_STOP_STRINGS)]  # never in the output
    assert succeeded(h, goal(max_new_tokens=NEW, stop=at_limit)).text == plain
    # every entry counts against the limit, an empty one too (it never matches: Generate.action)
    rejected(h, goal(stop=at_limit + [""]), f"{MAX_STOP_STRINGS + 1} stop strings, more than the limit")
    rejected(h, goal(stop=["x"] * (MAX_STOP_STRINGS + 1)), f"{MAX_STOP_STRINGS + 1} stop strings, more than the limit")
    rejected(h, goal(stop=["ok", "y" * (MAX_STOP_CHARS + 1)]),
             f"a stop string has {MAX_STOP_CHARS + 1} characters, more than the limit of {MAX_STOP_CHARS}")
    # the output text is decoded without special tokens: a stop string holding one never matched, the goal ran on
    rejected(h, goal(stop=["ok", "then</s>"]), "stop string 'then</s>' contains the special token '</s>'")


# -- parameters -------------------------------------------------------------------------------------

def state(h) -> tuple:
    """Every parameter's value, the runtime's configuration and the live registry."""
    lo = h.node.loaded
    runtime = (lo.controller.config, lo.registry.names()) if lo is not None else None
    return P.values(h.node), runtime


def refused(h, words: str, atomically: bool = False, **values) -> None:
    before = state(h)
    if atomically:
        result = h.set_params_atomically(**values)
    else:
        [result] = h.set_params(**values)
    assert not result.successful, values
    assert words in result.reason, (values, result.reason)
    assert state(h) == before, values


@pytest.mark.parametrize("name, value", [
    ("memspec.capacity", 0),  # K = 0
    ("memspec.interval", 0),  # N = 0
    ("memspec.recent_tokens", -1),  # negative T
    ("memspec.gamma", 0),
    ("memspec.ucb_c", math.nan),
    ("generation.temperature", math.inf),
    ("generation.top_p", math.nan),
    ("generation.top_p", 0.0),  # the declared range excludes it, as the node's check does: (0, 1]
    ("action.max_queued_goals", -1),
])
def test_out_of_range_runtime_parameters_are_refused(h, name, value):
    refused(h, f"Parameter {name} out of range", **{name: value})  # rclpy's check of the declared range


@pytest.mark.parametrize("name, value", [("memspec.budget_bytes", -1), ("memspec.prompt_cache_bytes", -1),
                                         ("generation.seed", -2)])
def test_a_range_past_32_bits_is_checked_by_the_node(h, name, value):
    """Not declared (rqt_reconfigure's Qt slider takes 32-bit ints): the node's own check refuses it."""
    refused(h, f"{name} must be in [", **{name: value})


@pytest.mark.parametrize("name, value, words", [
    ("memspec.policy", "bogus", "memspec.policy must be one of"),  # unknown policy
    ("memspec.policy", "", "memspec.policy must be one of"),
    ("memspec.capacity", 2.5, "Wrong parameter type, expected 'Type.INTEGER'"),
    ("drafts.names", "general", "Wrong parameter type, expected 'Type.STRING_ARRAY'"),
])
def test_unknown_choices_and_wrong_types_are_refused(h, name, value, words):
    refused(h, words, **{name: value})


def test_registry_changes_that_cannot_work_are_refused(h, tmp_path):
    zoo = tiny_zoo()
    code, general = str(zoo / "drafts" / "code"), str(zoo / "drafts" / "general")
    refused(h, "/nonexistent/code", atomically=True, **{  # a missing draft path
        "drafts.names": ["code"], "drafts.paths": ["/nonexistent/code"], "drafts.domains": ["code"]})
    refused(h, "'general'", atomically=True, **{  # duplicate names
        "drafts.names": ["general", "general"], "drafts.paths": [general, code], "drafts.domains": ["general", "code"]})
    refused(h, "drafts.names", atomically=True, **{  # lists of different lengths
        "drafts.names": ["general", "code"], "drafts.paths": [general], "drafts.domains": [""]})
    # one list alone (`ros2 param set` sets one at a time): the refusal says how to change them together
    refused(h, "change them together in one ~/set_parameters_atomically call", **{"drafts.names": ["general", "code"]})
    # an empty entry among others: dropped, it paired code with math's path and math with code's (its domain too)
    math = str(zoo / "drafts" / "math")
    refused(h, "drafts.paths has an empty entry (position 1)", atomically=True, **{
        "drafts.names": ["code", "math"], "drafts.paths": [math, "", code], "drafts.domains": ["code", "math"]})
    refused(h, "drafts.domains has an empty entry (position 0)", atomically=True, **{
        "drafts.names": ["code", "math"], "drafts.paths": [code, math], "drafts.domains": ["", "code", "math"]})
    empty = tmp_path / "no_weights"
    empty.mkdir()
    refused(h, str(empty), atomically=True, **{  # a draft directory without weights
        "drafts.names": ["general"], "drafts.paths": [str(empty)], "drafts.domains": ["general"]})


def test_a_registry_without_the_general_draft_is_refused_while_general_static_runs_it(h):
    code = str(tiny_zoo() / "drafts" / "code")
    only_code = {"drafts.names": ["code"], "drafts.paths": [code], "drafts.domains": ["code"]}
    assert h.set_params(**{"memspec.policy": "general-static"})[0].successful
    try:
        refused(h, "memspec.general_draft 'general' is not in the draft registry (code)", atomically=True, **only_code)
        refused(h, "memspec.general_draft 'nope' is not in the draft registry", **{"memspec.general_draft": "nope"})
        assert h.set_params(**{"memspec.policy": "memspec"})[0].successful
        assert h.set_params_atomically(**only_code).successful  # memspec needs no general draft
        refused(h, "memspec.general_draft 'general' is not in the draft registry (code)",
                **{"memspec.policy": "general-static"})
    finally:
        assert h.set_params_atomically(**{"drafts.names": [""], "drafts.paths": [""], "drafts.domains": [""],
                                          "memspec.policy": "memspec"}).successful
    assert sorted(h.node.loaded.registry.names()) == ["code", "general", "math"]


@pytest.fixture
def unconfigured(rclpy_context):
    harness = Harness(rclpy_context, name="memspec_unconfigured", overrides=node_overrides(tiny_zoo()))
    yield harness
    harness.close()


@pytest.mark.parametrize("name, value, words", [
    ("model.dtype", "fp64", "model.dtype must be one of"),  # unknown dtype
    ("model.dtype", "FP32", "model.dtype must be one of"),
    ("model.device", "tpu", "model.device must be 'cpu' or 'cuda[:N]'"),  # unknown device
    ("model.device", "cuda0", "model.device must be 'cpu' or 'cuda[:N]'"),
    ("model.device", "cuda:", "model.device must be 'cpu' or 'cuda[:N]'"),  # torch refused these at configure
    ("model.device", "cuda:abc", "model.device must be 'cpu' or 'cuda[:N]'"),
    ("model.quantization", "int3", "model.quantization must be one of"),
    ("drafts.quantization", "fp8", "drafts.quantization must be one of"),
    ("cache.storage", "floppy", "cache.storage must be one of"),
    ("model.threads", -1, "Parameter model.threads out of range"),
])
def test_configure_time_parameters_are_checked_while_unconfigured(unconfigured, name, value, words):
    assert unconfigured.state() == "unconfigured"
    refused(unconfigured, words, **{name: value})


def test_a_prompt_token_past_the_targets_embedding_is_rejected_not_accepted_and_aborted(h, monkeypatch):
    """A tokenizer with more tokens than the target's embedding rows: the runtime refuses such ids, so the goal
    was accepted and then aborted, where Generate.action promises an invalid goal is rejected."""
    from memspec_ros.ros import goal_runner

    monkeypatch.setattr(goal_runner, "input_rows", lambda model: 3)  # every real prompt id lies past row 2
    rejected(h, goal(max_new_tokens=NEW), "outside the target's 3 embedding rows")
    monkeypatch.undo()
    succeeded(h, goal(max_new_tokens=NEW))
