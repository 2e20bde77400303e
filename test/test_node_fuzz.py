# ruff: noqa: E402 - the ROS imports follow require_ros()
"""The goal and parameter surfaces of memspec_node fuzzed with hypothesis, over DDS.

Goals: any text (control characters, whitespace, megabyte prompts), messages with any roles, raw, any
max_new_tokens, stop lists, NaN/infinite/huge sampling values and seeds. Every goal is answered by the goal
callback (its latency is memspec-bench soak's verdict); a goal breaking a documented rule is rejected, with a
reason from the known list, and one breaking none only for a limit judged on its tokens; an accepted one ends
SUCCEEDED with at most the tokens it asked for. Parameters: any set of declared (and a few undeclared) names
with values of every type, set atomically: applied as a whole (the values read back, memspec.* in the
runtime's configuration) or refused with a reason and nothing changed. Afterwards the node still serves a
goal.

Bounded for CI: a fixed number of examples, derandomized (the same inputs on every run), no example
database; about half a minute on a shared 2-core machine."""

from __future__ import annotations

import math

import pytest

hypothesis = pytest.importorskip("hypothesis")  # requirements-dev.txt

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from node_helpers import active_harness, tiny_zoo
from ros_helpers import require_ros

require_ros()

from action_msgs.msg import GoalStatus

from memspec_interfaces.action import Generate
from memspec_interfaces.msg import ChatMessage
from memspec_ros.ros import params as P
from memspec_ros.ros.goal_runner import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_TEMPERATURE

TINY_SPECIALS = ("<pad>", "<s>", "</s>")  # the tiny zoo tokenizer's special tokens (testing/tiny_models.py)
DEFAULT_NEW = 4  # generation.max_new_tokens while fuzzing: a goal with max_new_tokens 0 gets this many
FUZZ = settings(max_examples=200, derandomize=True, database=None, deadline=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large, HealthCheck.large_base_example])
# Every reason the goal callback gives (its checks and runtime/chat.py's); an unexpected exception would
# show up as "could not be tokenized" or a reason outside this list.
REASONS = ("the prompt is empty", "the prompt is only whitespace", "raw is set but messages are given",
           "both prompt and messages are set", "the model has no chat template", "has unknown role",
           "has empty content", "has only whitespace", "the last message is from the", "temperature ",
           "top_p ", "stop strings, more than the limit", "a stop string has", "characters, more than the limit",
           "tokens, more than the limit", "exceeds the target's context", "contains the special token")
# the only reasons a goal within every rule broken_rules judges may still get: limits judged on its tokens
TOKEN_LIMITS = ("tokens can hold", "tokens, more than the limit", "exceeds the target's context")


@pytest.fixture(scope="module")
def h():
    with active_harness() as harness:
        assert harness.set_params(**{"generation.max_new_tokens": DEFAULT_NEW})[0].successful
        yield harness


# -- goals ----------------------------------------------------------------------------------------

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=60)  # no surrogates: they cannot be sent
SPECIAL = st.sampled_from(["", " ", "\n\t ", "\x00after a NUL", "\x1b[2J\x07\u202e", "word " * 2000,
                           "x" * 300_000, "def f(x):\n    return x\n"])
FLOATS = st.floats(width=32, allow_nan=True, allow_infinity=True)
VALID = st.fixed_dictionaries({  # goals within every documented rule: the accepted path
    "prompt": TEXT.filter(lambda t: t.split("\x00")[0].strip()),
    "messages": st.just([]),
    "raw": st.booleans(),
    "max_new_tokens": st.integers(0, 8),
    "stop": st.lists(TEXT, max_size=3),
    "temperature": st.one_of(st.just(0.0), st.floats(-2.0, MAX_TEMPERATURE, width=32)),
    "top_p": st.floats(-1.0, 1.0, width=32),
    "seed": st.integers(-(2**63), 2**63 - 1),
})
ANY = st.fixed_dictionaries({  # anything a client can send
    "prompt": st.one_of(TEXT, SPECIAL),
    "messages": st.lists(st.tuples(st.sampled_from(["system", "user", "assistant", "robot", "", "User"]),
                                   st.one_of(TEXT, SPECIAL)), max_size=3),
    "raw": st.booleans(),
    "max_new_tokens": st.one_of(st.integers(0, 8), st.integers(4096, 2**32 - 1)),  # the tiny target's context
    "stop": st.one_of(st.lists(TEXT, max_size=4),
                      st.sampled_from([["s"] * (MAX_STOP_STRINGS + 1), ["y" * (MAX_STOP_CHARS + 1)]])),
    "temperature": st.one_of(FLOATS, st.sampled_from([-1.0, 0.0, 1e-30, 0.7, 100.0])),
    "top_p": st.one_of(FLOATS, st.sampled_from([0.0, 1e-30, 0.9, 1.0])),
    "seed": st.integers(-(2**63), 2**63 - 1),
})


def _above(bound: float):
    return st.floats(bound, exclude_min=True, allow_nan=False, allow_infinity=False, width=32)


# one documented rule broken in an otherwise valid goal, and the reason its rejection must give
BAD = {
    "prompt": (st.sampled_from(["", " \t\n", "\x00after a NUL"]), "the prompt is"),
    "messages": (st.just([("user", "hi")]), "no chat template"),  # the tiny zoo has none
    "max_new_tokens": (st.integers(4096, 2**32 - 1), "exceeds the target's context"),
    "stop": (st.sampled_from([["s"] * (MAX_STOP_STRINGS + 1), ["ok", "y" * (MAX_STOP_CHARS + 1)], ["<s>x"],
                              ["ok", "before</s>after"]]), "stop string"),
    "temperature": (st.one_of(st.sampled_from([math.nan, math.inf, -math.inf]), _above(MAX_TEMPERATURE)),
                    "temperature"),
    "top_p": (st.one_of(st.sampled_from([math.nan, math.inf]), _above(1.0)), "top_p"),
}
ONE_BAD = st.tuples(VALID, st.sampled_from(sorted(BAD))).flatmap(
    lambda vf: BAD[vf[1]][0].map(lambda bad: {**vf[0], **({"prompt": "", "raw": False} if vf[1] == "messages" else {}),
                                              vf[1]: bad, "_broken": vf[1]}))
GOALS = st.one_of(VALID, ONE_BAD, ANY)


def broken_rules(g: dict) -> list[str]:
    """The documented rules (Generate.action) this goal breaks, as far as they can be judged without the
    tokenizer; the tiny zoo's tokenizer has no chat template."""
    prompt, messages = g["prompt"].split("\x00")[0], g["messages"]  # a NUL ends a ROS string
    broken = []
    if messages:  # no chat template: messages are never accepted here
        broken.append("messages")
    if not messages and (not prompt or prompt.isspace()):
        broken.append("empty prompt")
    t, p = g["temperature"], g["top_p"]
    if not math.isfinite(t) or t > MAX_TEMPERATURE:
        broken.append("temperature")
    if math.isnan(p) or p > 1.0:  # any negative, -inf too, is the node default
        broken.append("top_p")
    if len(g["stop"]) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in g["stop"]):
        broken.append("stop")
    # never in the decoded output text, unless it is the whole stop string (the goal then ends at that token)
    elif any(token in s and s != token for s in g["stop"] for token in TINY_SPECIALS):
        broken.append("stop")
    if g["max_new_tokens"] >= 4096:  # the tiny target's context
        broken.append("max_new_tokens")
    return broken


@FUZZ
@given(g=GOALS)
def test_fuzzed_goals_are_answered_and_end_as_documented(h, g):
    request = Generate.Goal(prompt=g["prompt"], raw=g["raw"], max_new_tokens=g["max_new_tokens"], stop=g["stop"],
                            temperature=g["temperature"], top_p=g["top_p"], seed=g["seed"],
                            messages=[ChatMessage(role=r, content=c) for r, c in g["messages"]])
    rejected_before = h.node.goals_rejected
    handle, _ = h.send(request)
    broken = broken_rules(g)
    event("accepted" if handle.accepted else "rejected")
    if "_broken" in g:  # exactly this rule is broken: rejected for it
        assert not handle.accepted, g
        assert BAD[g["_broken"]][1] in h.node.last_rejection, (g["_broken"], h.node.last_rejection)
    if not handle.accepted:
        assert h.node.goals_rejected == rejected_before + 1
        reason = h.node.last_rejection
        assert any(known in reason for known in REASONS), reason
        assert broken or any(limit in reason for limit in TOKEN_LIMITS), (g, reason)
        return
    assert not broken, (broken, g)
    response = h.result(handle, 60.0)
    assert response.status == GoalStatus.STATUS_SUCCEEDED, response.result.error_message
    assert 0 < response.result.completion_tokens <= (g["max_new_tokens"] or DEFAULT_NEW)
    assert response.result.finish_reason in ("length", "eos", "stop")


# -- parameters -----------------------------------------------------------------------------------

def _near(p: P.Param):
    """Values around a parameter's rules: its default, its range's edges and beyond, its choices, odd strings."""
    if p.int_range:
        lo, hi = p.int_range
        edges = [lo, hi, max(lo - 1, -(2**63)), min(hi + 1, 2**63 - 1), p.default]  # int64 on the wire
        return st.one_of(st.sampled_from(edges), st.integers(lo, min(hi, lo + 64)))
    if p.float_range:
        lo, hi = p.float_range
        return st.one_of(st.sampled_from([lo, hi, hi * 1.5 + 1, lo - 1, math.nan, math.inf, p.default]),
                         st.floats(lo, hi))
    if p.choices:
        return st.one_of(st.sampled_from(p.choices), TEXT)
    if isinstance(p.default, list):
        zoo = tiny_zoo()
        paths = [str(zoo / "drafts" / n) for n in ("general", "code", "math")] + ["/nonexistent", "", "../.."]
        return st.one_of(st.lists(st.sampled_from(["general", "code", "math", ""]), max_size=3),
                         st.lists(st.sampled_from(paths), max_size=3), st.lists(TEXT, max_size=2))
    if isinstance(p.default, bool):
        return st.booleans()
    return TEXT


ANY_VALUE = st.one_of(st.booleans(), st.integers(-(2**63), 2**63 - 1), FLOATS, TEXT, st.lists(TEXT, max_size=2))
NAMES = [p.name for p in P.PARAMS]
NEAR = st.sampled_from(NAMES).flatmap(lambda n: st.tuples(st.just(n), _near(P.BY_NAME[n])))
CHANGE = st.one_of(NEAR, st.tuples(st.sampled_from(NAMES), ANY_VALUE),
                   st.tuples(st.sampled_from(["memspec.nonexistent", "model.path", ""]), ANY_VALUE))
CHANGES = st.one_of(st.lists(NEAR, min_size=1, max_size=3, unique_by=lambda c: c[0]),  # mostly valid: applied
                    st.lists(CHANGE, min_size=1, max_size=3, unique_by=lambda c: c[0]))


def state(h) -> tuple:
    lo = h.node.loaded
    return P.values(h.node), lo.controller.config, sorted(lo.registry.names())


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


@FUZZ
@given(changes=CHANGES)
def test_fuzzed_parameter_changes_apply_whole_or_change_nothing(h, changes):
    before = state(h)
    result = h.set_params_atomically(**dict(changes))
    after = state(h)
    event("applied" if result.successful else "refused")
    if not result.successful:
        assert result.reason, changes
        assert after == before, changes
        return
    values, config, _ = after
    for name, value in changes:
        assert same(values[name], value if not isinstance(value, int) or isinstance(value, bool)
                    or not isinstance(P.BY_NAME[name].default, float) else float(value)), (name, value)
        if name in P.RUNTIME_FIELDS:
            assert same(getattr(config, P.RUNTIME_FIELDS[name]), values[name]), (name, value)


def test_the_node_still_serves_after_the_fuzzing(h):
    """Runs after both fuzz tests (file order): every parameter back to its start, then one plain goal."""
    defaults = {p.name: p.default for p in P.PARAMS if not p.read_only and p.when != P.AT_CONFIGURE}
    defaults.update({"drafts.registry_file": str(tiny_zoo() / "registry.yaml"), "generation.max_new_tokens": 8})
    result = h.set_params_atomically(**defaults)
    assert result.successful, result.reason
    handle, _ = h.send(Generate.Goal(prompt="def add(a, b):", temperature=0.0))
    assert handle.accepted, h.node.last_rejection
    response = h.result(handle)
    assert response.status == GoalStatus.STATUS_SUCCEEDED and response.result.completion_tokens == 8
