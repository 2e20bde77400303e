# ruff: noqa: E402 - the ROS imports follow require_ros()
"""The node's forward-path and gamma parameters reach what it loads and runs."""

from __future__ import annotations

from contextlib import contextmanager

from conftest import fix_adaptive_costs
from node_helpers import Harness, goal, node_overrides, tiny_zoo
from ros_helpers import require_ros
from test_prompt_cache import _needs_reuse

require_ros()

from action_msgs.msg import GoalStatus


@contextmanager
def harness_with(defaults: bool = False, **params):
    """The node on the tiny zoo with the tests' baseline (node_helpers.TEST_BASELINE), or with its own declared
    defaults for everything but the zoo and the thread count."""
    import rclpy
    from rclpy.context import Context

    context = Context()
    rclpy.init(context=context)
    h = Harness(context, overrides=node_overrides(tiny_zoo(), baseline=not defaults, **params))
    h.activate()
    try:
        yield h
    finally:
        h.close()
        rclpy.try_shutdown(context=context)


def test_target_and_draft_paths_and_adaptive_gamma_are_configured_and_the_goal_is_lossless(monkeypatch):
    from memspec_ros.runtime.speculative import generate

    # a verify row adds nothing and a draft token costs next to nothing: adaptive gamma drafts whatever the tiny
    # random draft's acceptance, on any machine, so the int4 draft's proposals really go through the int8 verify
    fix_adaptive_costs(monkeypatch, lambda model, k, vocab: 10.0, 0.01)
    with harness_with(**{"model.quantization": "int8", "drafts.quantization": "int4",
                         "memspec.adaptive_gamma": True}) as h:
        loaded = h.node._loaded
        assert loaded.target.forward_path == "int8"
        handle, _ = h.send(goal(max_new_tokens=24))
        result = h.result(handle)
        assert result.status == GoalStatus.STATUS_SUCCEEDED
        assert sum(it.proposed for it in h.node._window.view().combined.iterations) > 0
        drafts = [loaded.controller.cache.get(name) for name in loaded.controller.cache.resident()]
        assert drafts and all(d.forward_path == "int4" for d in drafts)
        # the node's answer is the int8 target's own greedy continuation of the same prompt ids
        from memspec_ros.runtime.chat import prompt_ids

        ids = prompt_ids(loaded.tokenizer, "def add(a, b):")
        alone = generate(loaded.target.model, ids, None, max_new_tokens=24,
                         eos_token_ids=loaded.controller.eos_token_ids).generated_ids
        assert result.result.text == loaded.tokenizer.decode(alone, skip_special_tokens=True)


def test_the_declared_defaults_run_int4_drafts_adaptive_gamma_and_lookup_and_answer_as_the_target(fixed_costs):
    """A plain launch gets the settings that change only speed (drafts int4, adaptive gamma, context lookup),
    and its answer is still the target's own greedy answer. (Forward costs fixed: whether adaptive gamma takes a
    copy over the draft would otherwise depend on this machine's timings.)"""
    from memspec_ros.runtime.chat import prompt_ids
    from memspec_ros.runtime.speculative import generate

    with harness_with(defaults=True) as h:
        loaded = h.node._loaded
        config = loaded.controller.config
        assert config.adaptive_gamma is True and config.confidence_stop is True and config.context_lookup is True
        assert loaded.target.forward_path == "fp32"  # model.quantization none: the target computes as loaded
        handle, _ = h.send(goal(max_new_tokens=48))
        result = h.result(handle)
        assert result.status == GoalStatus.STATUS_SUCCEEDED
        drafts = [loaded.controller.cache.get(name) for name in loaded.controller.cache.resident()]
        assert drafts and all(d.forward_path == "int4" for d in drafts)
        assert result.result.copied_iterations > 0  # the tiny target repeats itself: lookup copies
        ids = prompt_ids(loaded.tokenizer, "def add(a, b):")
        alone = generate(loaded.target.model, ids, None, max_new_tokens=48,
                         eos_token_ids=loaded.controller.eos_token_ids).generated_ids
        assert result.result.text == loaded.tokenizer.decode(alone, skip_special_tokens=True).replace("\x00", "")


def test_context_lookup_reaches_the_session_and_the_result_counts_its_copies():
    from memspec_ros.runtime.chat import prompt_ids
    from memspec_ros.runtime.speculative import generate

    with harness_with(**{"memspec.context_lookup": True}) as h:
        loaded = h.node._loaded
        assert loaded.controller.config.context_lookup is True
        handle, _ = h.send(goal(max_new_tokens=48))
        result = h.result(handle)
        assert result.status == GoalStatus.STATUS_SUCCEEDED
        # the tiny zoo's target soon repeats itself, so copies happen; the answer stays the target's own
        assert result.result.copied_iterations > 0
        assert "lookup" not in result.result.drafts_used
        ids = prompt_ids(loaded.tokenizer, "def add(a, b):")
        alone = generate(loaded.target.model, ids, None, max_new_tokens=48,
                         eos_token_ids=loaded.controller.eos_token_ids).generated_ids
        # (a ROS string cannot hold NUL: the goal runner drops it, and the tiny tokenizer's noise has some)
        assert result.result.text == loaded.tokenizer.decode(alone, skip_special_tokens=True).replace("\x00", "")


def _tiny_datastore(path, answers, fingerprint: str | None = None):
    from memspec_ros.runtime.datastore import Datastore
    from memspec_ros.runtime.models import load_tokenizer, tokenizer_fingerprint

    if fingerprint is None:
        fingerprint = tokenizer_fingerprint(load_tokenizer(tiny_zoo() / "target"))
    Datastore(answers, fingerprint=fingerprint).save(path)
    return str(path)


def test_the_datastore_parameter_loads_past_answers_that_lookup_copies_from(tmp_path):
    """datastore.path names past answers; with memspec.context_lookup the node copies from them, and the
    answer stays the target's own."""
    from memspec_ros.runtime.chat import prompt_ids
    from memspec_ros.runtime.models import ModelSpec, load_model, load_tokenizer
    from memspec_ros.runtime.speculative import generate

    tokenizer = load_tokenizer(tiny_zoo() / "target")
    target = load_model(ModelSpec(str(tiny_zoo() / "target"))).model
    ids = prompt_ids(tokenizer, "def add(a, b):")
    alone = generate(target, ids, None, max_new_tokens=48, eos_token_ids=[]).generated_ids
    store = _tiny_datastore(tmp_path / "past.safetensors", [alone[:40]])
    with harness_with(**{"memspec.context_lookup": True, "datastore.path": store, "memspec.remember_answers": 3}) as h:
        loaded = h.node._loaded
        assert loaded.controller.datastore is not None and loaded.controller.datastore.answers == 1
        status = {s.name: s for s in h.node._diagnostics.collect()}["memspec: target model"]
        assert dict((v.key, v.value) for v in status.values)["datastore"].startswith(f"{store}: 1 answers")
        handle, _ = h.send(goal(max_new_tokens=48))
        result = h.result(handle)
        assert result.status == GoalStatus.STATUS_SUCCEEDED
        expected = generate(loaded.target.model, ids, None, max_new_tokens=48,
                            eos_token_ids=loaded.controller.eos_token_ids).generated_ids
        assert result.result.text == loaded.tokenizer.decode(expected, skip_special_tokens=True).replace("\x00", "")
        assert result.result.copied_iterations > 0  # (test_datastore shows the copies come from it)
        # memspec.remember_answers: the answer is kept for the next goals (test_datastore: copied from)
        assert loaded.controller.remembered_answers == 1
        status = {s.name: s for s in h.node._diagnostics.collect()}["memspec: target model"]
        assert dict((v.key, v.value) for v in status.values)["remembered answers"] == "1"
        # memspec.prompt_cache (on by default): this target (hidden 64) is not the C decoder's, so nothing is kept
        # and diagnostics say why (what is kept and shown where it runs: the hidden-256 test below)
        shown = dict((v.key, v.value) for v in status.values)["prompt cache"]
        assert loaded.controller.prompt_cache_refused
        assert shown == f"off: {loaded.controller.prompt_cache_refused}"
        assert result.result.reused_prompt_tokens == 0


def test_a_datastore_for_another_tokenizer_fails_configure_with_the_reason(tmp_path):
    import rclpy
    from lifecycle_msgs.msg import Transition
    from rclpy.context import Context

    store = _tiny_datastore(tmp_path / "other.safetensors", [[1, 2, 3]], fingerprint="another-tokenizer")
    context = Context()
    rclpy.init(context=context)
    h = Harness(context, overrides=node_overrides(tiny_zoo(), **{"datastore.path": store}))
    try:
        assert not h.transition(Transition.TRANSITION_CONFIGURE)
        assert h.state() == "unconfigured"
        status = {s.name: s for s in h.node._diagnostics.collect()}["memspec: target model"]
        assert "another tokenizer" in status.message and "--stages datastore" in status.message, status.message
        # 'none' turns it off; configure then succeeds
        assert h.set_params(**{"datastore.path": "none"})[0].successful
        assert h.transition(Transition.TRANSITION_CONFIGURE)
        assert h.node._loaded.controller.datastore is None
    finally:
        h.close()
        rclpy.try_shutdown(context=context)


def test_a_goal_that_repeats_the_last_goals_tokens_reuses_their_encoding_and_answers_the_same(tmp_path):
    """memspec.prompt_cache on a zoo whose target runs the C decoder (hidden 256): the second goal reuses its
    prompt's KV from the first, reports it in the result, and answers identically."""
    import tempfile
    from pathlib import Path

    import rclpy
    from rclpy.context import Context

    from memspec_ros.runtime.chat import prompt_ids
    from memspec_ros.testing.tiny_zoo import build_tiny_zoo

    zoo = build_tiny_zoo(Path(tempfile.mkdtemp(dir=tmp_path)), hidden=256, layers=2, draft_layers=1)
    context = Context()
    rclpy.init(context=context)
    h = Harness(context, overrides=node_overrides(zoo, baseline=True))
    h.activate()
    try:
        controller = h.node._loaded.controller
        ids = prompt_ids(h.node._loaded.tokenizer, "def add(a, b):")
        results = []
        for _ in range(2):
            handle, _ = h.send(goal(max_new_tokens=16))
            results.append(h.result(handle))
        assert all(r.status == GoalStatus.STATUS_SUCCEEDED for r in results)
        assert results[0].result.text == results[1].result.text
        _needs_reuse(controller.prompt_cache_refused)  # refused only without a C compiler: strict mode fails it
        assert len(ids) > 1 and [r.result.reused_prompt_tokens for r in results] == [0, len(ids) - 1]
        # the goal's KV is kept, the drafts' that ran too, and diagnostics show it
        cache = controller.prompt_cache
        assert cache.tokens > len(ids) and cache.conversations == 1 and cache.bytes > 0
        drafts = cache.drafts
        assert drafts and all(0 < n <= cache.tokens for n in drafts.values())
        status = {s.name: s for s in h.node._diagnostics.collect()}["memspec: target model"]
        assert dict((v.key, v.value) for v in status.values)["prompt cache"] == (
            f"{cache.tokens} tokens of the last goal; drafts' tokens: "
            + ", ".join(f"{name} {n}" for name, n in sorted(drafts.items()))
            + f"; goals held: 1, {cache.bytes / 1e6:.1f} MB (memspec.prompt_cache_bytes {128 * 2**20})")
    finally:
        h.close()
        rclpy.try_shutdown(context=context)


def test_the_auto_paths_timings_name_the_gamma_they_were_measured_at():
    """model.quantization auto times 1 and gamma+1 tokens at configure; memspec.gamma may change at run time and the
    path stays. /diagnostics said "1 / gamma+1 tokens", which after memspec.gamma 8 read as 9-row verifies timed:
    it names the row count and the configure's gamma."""
    with harness_with(**{"model.quantization": "auto", "memspec.gamma": 3}) as h:
        assert h.set_params(**{"memspec.gamma": 6})[0].successful
        status = {s.name: s for s in h.node._diagnostics.collect()}["memspec: target model"]
        keys = [kv.key for kv in status.values if kv.key.startswith("auto ")]
        assert keys and all(k.endswith("ms (1 / 4 tokens, gamma 3 at configure)") for k in keys), keys
