"""The target's KV cache reused across generations (runtime/prompt_cache.py): same logits, same outputs, less
prefill; the target-hidden predictor keeps the reused positions' hidden rows; a draft still resident catches up
only on the new tokens."""

from __future__ import annotations

import pytest
import torch

from memspec_ros.runtime.controller import RuntimeConfig, RuntimeController
from memspec_ros.runtime.draft_forward import lean_forward_for
from memspec_ros.runtime.models import LoadedModel, ModelSpec, load_model, parameter_bytes
from memspec_ros.runtime.predictor import FixedRanker, TargetHiddenEncoder
from memspec_ros.runtime.prompt_cache import PromptCache, common_prefix, reuse_refused
from memspec_ros.runtime.registry import DraftEntry, DraftRegistry
from memspec_ros.runtime.speculative import KVState, SpeculativeSession, forward_once, generate
from memspec_ros.testing.tiny_models import noisy_copy, save_model_dir, tiny_llama, tiny_tokenizer

PATHS = ("none", "int8", "int4")


# hidden 256: shapes the engine's C decoder takes (head_dim 64), so every forward path runs it
@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    tokenizer = tiny_tokenizer()
    return save_model_dir(tiny_llama(vocab_size=len(tokenizer), hidden=256, seed=0), tokenizer,
                          tmp_path_factory.mktemp("prompt_cache") / "target")


@pytest.fixture(scope="module")
def c_target():
    return tiny_llama(hidden=256, seed=0)



def _needs_reuse(refused: str) -> None:
    """Skip the rest of a test that checks what the prompt cache keeps, where it keeps nothing (no C decoder:
    ``refused`` says why). Strict mode (make test) fails such a skip, as it fails test_cpu_kernels' own."""
    if refused:
        pytest.skip(f"no prompt cache without the C decoder: {refused}")

def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 60, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([7], [8]) == 0


def _filled(model, ids: list[int]) -> KVState:
    kv = KVState()
    forward_once(model, ids, kv, 1, "cpu", lean_forward_for(model))
    return kv


def test_take_crops_to_the_shared_prefix_leaves_a_token_to_feed_and_empties_the_cache(target):
    cache = PromptCache()
    assert cache.take([1, 2, 3]).target is None  # empty
    tokens = _ids(20, 1)
    cache.keep(tokens, _filled(target, tokens))
    assert cache.tokens == 20
    kv = cache.take(tokens[:12] + [99, 98]).target
    assert kv is not None and kv.length == 12 and cache.tokens == 0  # the generation owns it now
    assert cache.take(tokens).target is None
    cache.keep(tokens, _filled(target, tokens))
    assert cache.take(tokens).target.length == 19  # the same prompt again: its last token is fed for the logits
    cache.keep(tokens, _filled(target, tokens))
    assert cache.take([99] + tokens).target is None and cache.tokens == 0  # nothing shared: dropped
    # a generation that ended inside an accepted run fed tokens it dropped: their positions go
    kv = _filled(target, tokens)
    cache.keep(tokens[:5], kv)
    assert cache.tokens == 5 and kv.length == 5 and kv.cache.get_seq_length() == 5


def test_a_goal_that_shares_nothing_hands_the_dropped_caches_pages_back(target, monkeypatch):
    """With no budget for older goals, a goal sharing nothing with the kept conversation dropped its caches without
    handing their pages back (as every other drop does)."""
    import weakref

    from memspec_ros.runtime import prompt_cache

    tokens = _ids(20, 1)
    kv = _filled(target, tokens)
    alive = weakref.ref(kv.cache)
    released = []  # whether the dropped cache was already gone when the pages were handed back
    monkeypatch.setattr(prompt_cache, "release_freed_memory", lambda: released.append(alive() is None))
    cache = PromptCache()
    cache.keep(tokens, kv)
    del kv
    released.clear()
    assert cache.take([99, 98]).target is None and cache.tokens == 0
    assert released == [True]


def test_a_session_refuses_a_prefix_that_leaves_nothing_to_feed(target):
    prompt = _ids(8, 2)
    with pytest.raises(ValueError, match="1 to 7"):
        SpeculativeSession(target, prompt, prefix=_filled(target, prompt))


@pytest.mark.parametrize("path", PATHS)
def test_a_reused_prefix_gives_the_logits_and_output_of_a_fresh_prefill(target_dir, path):
    """Every split of the prompt: the prefill after the reused KV gives the fresh prefill's logits and KV bit for bit
    (the C decoder computes each row on its own), and the generation (alone and with a draft) the fresh one's
    tokens."""
    model = load_model(ModelSpec(str(target_dir), quantization=path)).model
    refused = reuse_refused(model)
    if refused:  # no C decoder here (no compiler): reuse is off, and the controller says why
        assert "C decoder" in refused
        _needs_reuse(refused)
    draft = noisy_copy(model, 0.05, seed=3) if path == "none" else None
    prompt = _ids(40, 4)
    fresh = KVState()
    want = forward_once(model, prompt, fresh, 1, "cpu", lean_forward_for(model))
    alone = generate(model, prompt, None, max_new_tokens=24).generated_ids
    for split in (1, 5, 17, 39):
        kv = _filled(model, prompt[:split])
        got = forward_once(model, prompt[split:], kv, 1, "cpu", lean_forward_for(model))
        same = torch.equal
        assert same(got, want), (path, split)
        for layer_a, layer_b in zip(fresh.cache.layers, kv.cache.layers, strict=True):
            assert same(layer_a.keys, layer_b.keys) and same(layer_a.values, layer_b.values)
        session = SpeculativeSession(model, prompt, max_new_tokens=24, prefix=_filled(model, prompt[:split]))
        while not session.finished:
            session.step()
        assert session.generated_ids == alone and session.stats.reused_prompt_tokens == split
        if draft is not None:
            session = SpeculativeSession(model, prompt, max_new_tokens=24, prefix=_filled(model, prompt[:split]))
            while not session.finished:
                session.step("d", draft)
            assert session.generated_ids == alone


class _Loader:
    def __init__(self, drafts):
        self.drafts = drafts

    def __call__(self, name):
        model = self.drafts[name]
        return LoadedModel(model, ModelSpec(name), parameter_bytes(model), 64, 512)


def _controller(target, drafts, **cfg):
    registry = DraftRegistry([DraftEntry(n, f"/virtual/{n}", n, 1000) for n in drafts], validate=False)
    return RuntimeController(RuntimeConfig(policy="memspec", **cfg), target, None, registry,
                             FixedRanker(lambda c: list(drafts)), loader=_Loader(drafts))


def _conversation(controller, turns: list[list[int]], new: int = 16):
    """Each goal's prompt is the one before, its answer and the next turn's tokens (a chat history)."""
    history, results = [], []
    for turn in turns:
        history = history + turn
        result = controller.generate(history, max_new_tokens=new)
        results.append(result)
        history = history + result.token_ids
    return results


def _first_catchup(result) -> int:
    """Tokens the first draft fed at its first proposal of a generation."""
    return next(it.catchup_tokens for it in result.stats.iterations if it.catchup_tokens)


def test_draft_kv_caches_are_kept_for_the_model_that_computed_them(target):
    """``take`` crops each draft's KV cache to the shared prefix; a draft whose model is gone is not handed back;
    a session adopts a draft's prefix only for the same model object."""
    draft, other = noisy_copy(target, 0.05, seed=21), noisy_copy(target, 0.05, seed=22)
    tokens = _ids(20, 23)
    cache = PromptCache()
    cache.keep(tokens, _filled(target, tokens), {"a": (draft, _filled(draft, tokens[:15])),
                                                 "b": (other, _filled(other, tokens))})
    assert cache.drafts == {"a": 15, "b": 20}
    reuse = cache.take(tokens[:10] + [99])
    assert reuse.target.length == 10 and cache.drafts == {}
    assert {n: (m is {"a": draft, "b": other}[n], kv.length) for n, (m, kv) in reuse.drafts.items()} == {
        "a": (True, 10), "b": (True, 10)}
    # a draft KV longer than what the target kept (a goal that ended inside an accepted run) is cropped to it
    cache.keep(tokens[:8], _filled(target, tokens), {"a": (draft, _filled(draft, tokens))})
    assert cache.take(tokens).drafts["a"][1].length == 8

    # the model was freed (evicted, replaced): its KV cache is not handed back
    gone = noisy_copy(target, 0.05, seed=24)
    cache.keep(tokens, _filled(target, tokens), {"gone": (gone, _filled(gone, tokens))})
    del gone
    import gc

    gc.collect()
    assert cache.take(tokens).drafts == {}

    # a session: the same model takes its prefix and feeds only the rest; another object under that name does not
    prompt = tokens + _ids(6, 25)
    for model, fed in ((draft, len(prompt) + 1 - 15), (other, len(prompt) + 1)):
        session = SpeculativeSession(target, prompt, max_new_tokens=6,
                                     draft_prefixes={"a": (draft, _filled(draft, tokens[:15]))})
        session.step("a", model)
        assert session.stats.iterations[0].catchup_tokens == fed
    with pytest.raises(ValueError, match="draft 'a'"):
        SpeculativeSession(target, tokens, draft_prefixes={"a": (draft, _filled(draft, tokens))})


def test_an_evicted_drafts_cache_is_neither_counted_nor_held(target):
    """A kept goal held its evicted drafts' KV caches and counted them in the budget: older conversations, still of
    use, were dropped for memory nothing could take any more."""
    import gc

    tokens = _ids(20, 26)
    gone, stays = noisy_copy(target, 0.05, seed=27), noisy_copy(target, 0.05, seed=28)
    cache = PromptCache(budget_bytes=1 << 30)
    cache.keep(tokens, _filled(target, tokens), {"gone": (gone, _filled(gone, tokens)),
                                                 "stays": (stays, _filled(stays, tokens))})
    held = cache.bytes
    del gone
    gc.collect()
    assert cache.drafts == {"stays": 20} and cache.bytes < held  # no longer counted
    other = _ids(12, 29)
    cache.keep(other, _filled(target, other))  # the next keep lets the evicted draft's cache go
    assert list(cache._entries[0].drafts) == ["stays"]


def test_an_evicted_drafts_cache_goes_as_the_next_goal_takes_from_the_cache(target, monkeypatch):
    """The caches of drafts evicted since the last goal were dropped only at the next keep or trim: held through the
    whole next goal, uncounted by ``bytes`` and ~/diagnostics."""
    import gc
    import weakref

    from memspec_ros.runtime import prompt_cache

    tokens = _ids(20, 30)
    gone = noisy_copy(target, 0.05, seed=31)
    gone_kv = _filled(gone, tokens)
    alive = weakref.ref(gone_kv.cache)
    cache = PromptCache(budget_bytes=1 << 30)
    cache.keep(tokens, _filled(target, tokens), {"gone": (gone, gone_kv)})
    del gone, gone_kv
    gc.collect()
    released = []
    monkeypatch.setattr(prompt_cache, "release_freed_memory", lambda: released.append(alive() is None))
    reuse = cache.take(tokens[:10] + [99])  # a copy of a part: the conversation stays in the cache
    assert reuse.target is not None and reuse.drafts == {}
    assert cache._entries[0].drafts == {} and alive() is None and released == [True]


def test_hidden_rows_kept_past_the_kv_are_a_copy_not_a_view_of_the_longer_tensor(target):
    """keep() sliced the hidden rows of a goal that ended inside an accepted run: the view kept the longer tensor
    alive while ``bytes`` counted the slice."""
    tokens = _ids(20, 32)
    kv = _filled(target, tokens)
    rows = torch.zeros(24, 8)  # four rows past the KV (proposals fed, then dropped)
    cache = PromptCache(budget_bytes=1 << 30)
    cache.keep(tokens, kv, hidden_rows=rows)
    kept = cache._entries[0].hidden_rows
    assert kept.shape[0] == 20 and kept.untyped_storage().nbytes() == kept.nbytes


def test_a_reused_draft_kv_changes_no_output(target):
    """Whatever the draft's KV holds, the target verifies every token: outputs equal the target's own."""
    draft = noisy_copy(target, 0.05, seed=26)
    prompt = _ids(30, 27)
    alone = generate(target, prompt, None, max_new_tokens=20).generated_ids
    for split in (1, 12, 29):
        session = SpeculativeSession(target, prompt, max_new_tokens=20,
                                     draft_prefixes={"d": (draft, _filled(draft, prompt[:split]))})
        while not session.finished:
            session.step("d", draft)
        assert session.generated_ids == alone
        assert session.stats.iterations[0].catchup_tokens == len(prompt) + 1 - split


def test_a_forward_whose_rows_depend_on_the_rows_beside_them_is_not_reused(target):
    """The lean Python forward (shapes the C decoder does not take) rounds by the rows fed: refused, with why."""
    assert "C decoder" in reuse_refused(target)
    controller = _controller(target, {"general": noisy_copy(target, 0.05, seed=5)})
    assert controller.prompt_cache_refused
    prompt = _ids(10, 14)
    first = controller.generate(prompt, max_new_tokens=4)
    second = controller.generate(prompt + first.token_ids + [5], max_new_tokens=4)
    assert second.stats.reused_prompt_tokens == 0 and controller.prompt_cache.tokens == 0


def test_a_conversation_reuses_each_goals_kv_and_answers_as_without_it(c_target):
    target = c_target
    drafts = {"general": noisy_copy(target, 0.05, seed=5), "code": noisy_copy(target, 0.02, seed=6)}
    turns = [_ids(12, 7), _ids(6, 8), _ids(9, 9)]
    on = _controller(target, drafts)
    off = _controller(target, drafts, prompt_cache=False)
    if on.prompt_cache_refused:  # no C decoder on this machine: nothing is reused, outputs as always
        assert [r.token_ids for r in _conversation(on, turns)] == [r.token_ids for r in _conversation(off, turns)]
        _needs_reuse(on.prompt_cache_refused)
    with_cache, without = _conversation(on, turns), _conversation(off, turns)
    assert [r.token_ids for r in with_cache] == [r.token_ids for r in without]
    assert [r.stats.reused_prompt_tokens for r in without] == [0, 0, 0]
    reused = [r.stats.reused_prompt_tokens for r in with_cache]
    # goal 2 starts with goal 1's prompt and answer: all of it but the newest token was fed to the target
    assert reused[0] == 0
    assert reused[1] == len(turns[0]) + len(with_cache[0].token_ids) - 1
    assert reused[2] == reused[1] + 1 + len(turns[1]) + len(with_cache[1].token_ids) - 1
    assert on.prompt_cache.tokens > 0 and off.prompt_cache.tokens == 0
    # the drafts kept their KV caches too: a draft's first proposal in the next goal feeds only what its KV cache
    # does not hold (the new prompt tokens and the prefill's token), where without the cache it feeds all of it
    on.prompt_cache.clear()  # the conversation again, from an empty cache
    history = []
    for k, turn in enumerate(turns):
        history = history + turn
        held = on.prompt_cache.drafts
        assert (k == 0) == (not held)
        result = on.generate(history, max_new_tokens=16)
        assert result.token_ids == without[k].token_ids
        first = next(it for it in result.stats.iterations if it.catchup_tokens)
        assert first.catchup_tokens == len(history) + 1 - held.get(first.draft, 0), k
        assert (k == 0) or held.get(first.draft, 0) > len(history) // 2
        assert _first_catchup(without[k]) == len(history) + 1
        history = history + result.token_ids
    # switched off at run time, while idle: freed at once; the next goal encodes everything
    assert on.prompt_cache.conversations > 0
    on.reconfigure(prompt_cache=False)
    assert on.prompt_cache.conversations == 0 and on.prompt_cache.bytes == 0
    result = on.generate(turns[0] + with_cache[0].token_ids + turns[1], max_new_tokens=4)
    assert result.stats.reused_prompt_tokens == 0 and on.prompt_cache.tokens == 0
    # switched off during a goal (at its first scheduling point): the goal keeps nothing when it ends
    on.reconfigure(prompt_cache=True)
    on.generate(turns[0], max_new_tokens=4)
    assert on.prompt_cache.conversations == 1
    inner = on._scheduling_point

    def switch_off_then_schedule(*args):
        on.reconfigure(prompt_cache=False)  # a goal runs: pending until this scheduling point applies it
        return inner(*args)

    on._scheduling_point = switch_off_then_schedule
    result = on.generate(turns[0] + [5, 6], max_new_tokens=16)
    assert result.stats.reused_prompt_tokens > 0  # it started with the cache on
    assert on.prompt_cache.conversations == 0


def test_a_failed_generation_keeps_no_kv(c_target):
    target = c_target
    drafts = {"general": noisy_copy(target, 0.05, seed=5)}
    controller = _controller(target, drafts)
    prompt = _ids(10, 10)
    controller.generate(prompt, max_new_tokens=4)
    _needs_reuse(controller.prompt_cache_refused)
    held = controller.prompt_cache.tokens
    assert held > 0

    def broken(*_):
        raise RuntimeError("simulated failure inside the decode loop")

    controller._step = broken
    with pytest.raises(RuntimeError, match="simulated failure"):
        controller.generate(prompt[:-2] + [5, 6], max_new_tokens=4)  # shares a part of the prompt: a copy
    # nothing of the failed goal is kept; the first goal's caches, which it only copied from, stay
    assert controller.prompt_cache.conversations == 1 and controller.prompt_cache.tokens == held
    with pytest.raises(RuntimeError, match="simulated failure"):
        controller.generate(prompt + controller.prompt_cache.tokens * [5], max_new_tokens=4)  # continues nothing
    # it holds the first goal's whole prompt and parts inside its answer: a copy, so the conversation stays whole
    assert controller.prompt_cache.conversations == 1 and controller.prompt_cache.tokens == held
    with pytest.raises(RuntimeError, match="simulated failure"):
        controller.generate(prompt, max_new_tokens=4)
    controller.reconfigure(prompt_cache_bytes=0)  # one conversation: the goal takes the caches, and fails
    before, new = list(controller.prompt_cache._entries[-1].tokens), prompt + [5, 6]
    with pytest.raises(RuntimeError, match="simulated failure"):
        controller.generate(new, max_new_tokens=4)
    # the part it took is handed back (it lost the conversation, and the next turn prefilled it all anew): the
    # positions it took were never written again, and the next goal's output is still the target's own
    taken = min(common_prefix(before, new), len(new) - 1)
    assert taken > 0 and controller.prompt_cache.tokens == taken
    del controller._step  # the class's again
    again = controller.generate(new, max_new_tokens=4)
    assert again.stats.reused_prompt_tokens == taken
    assert again.token_ids == generate(target, new, None, max_new_tokens=4, eos_token_ids=[]).generated_ids


def test_a_goal_cancelled_before_its_prefill_hands_its_conversation_back(c_target):
    """A goal cancelled while it is prepared ends before its prefill; with one conversation kept it had moved that
    conversation's caches out of the prompt cache, and the next turn would encode the whole conversation again."""
    controller = _controller(c_target, {"general": noisy_copy(c_target, 0.05, seed=5)}, prompt_cache_bytes=0)
    try:
        prompt = _ids(10, 10)
        first = controller.generate(prompt, max_new_tokens=4)
        _needs_reuse(controller.prompt_cache_refused)
        held, drafts = controller.prompt_cache.tokens, controller.prompt_cache.drafts
        assert drafts  # the draft's KV cache of the conversation, kept beside the target's
        new = prompt + first.token_ids + [5, 6]
        cancelled = controller.generate(new, max_new_tokens=4, should_cancel=lambda: True)
        assert cancelled.finish_reason == "cancelled" and cancelled.token_ids == []
        assert controller.prompt_cache.conversations == 1 and controller.prompt_cache.tokens == held
        assert controller.prompt_cache.drafts == drafts  # handed back too: no catch-up over the conversation
        again = controller.generate(new, max_new_tokens=4)
        assert again.stats.reused_prompt_tokens == held
        assert again.token_ids == generate(c_target, new, None, max_new_tokens=4, eos_token_ids=[]).generated_ids
    finally:
        controller.close()


def test_a_refused_request_takes_nothing_from_the_prompt_cache(c_target):
    """A request the session would refuse (no tokens to generate, past the context) is refused before the goal takes
    its conversation's caches: with one conversation kept, taking them moves them out, and the next turn would
    encode the whole conversation again."""
    from memspec_ros.runtime.speculative import ContextLengthError

    controller = _controller(c_target, {"general": noisy_copy(c_target, 0.05, seed=5)}, prompt_cache_bytes=0)
    prompt = _ids(10, 10)
    first = controller.generate(prompt, max_new_tokens=4)
    _needs_reuse(controller.prompt_cache_refused)
    held = controller.prompt_cache.tokens
    assert held > 0
    follow = prompt + first.token_ids + [5, 6]
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        controller.generate(follow, max_new_tokens=0)
    with pytest.raises(ContextLengthError):
        controller.generate(follow, max_new_tokens=controller.max_positions)
    vocab = c_target.get_input_embeddings().num_embeddings
    for bad in (-1, vocab):  # a token id the target has no row for: refused before the prefill took the caches
        with pytest.raises(ValueError, match=r"token ids must lie in \[0, "):
            controller.generate(follow[:-1] + [bad], max_new_tokens=4)
    assert controller.prompt_cache.tokens == held
    assert controller.generate(follow, max_new_tokens=4).stats.reused_prompt_tokens == held


@pytest.mark.parametrize("prompt_cache", [True, False])
def test_the_target_hidden_encoder_holds_no_rows_between_goals(c_target, prompt_cache):
    """With the prompt cache off (or refused, or the goal failed), the encoder kept every hidden row the goal fed
    until the next goal began: memory no budget counted, held while the robot sat idle."""
    drafts = {"general": noisy_copy(c_target, 0.05, seed=5)}
    encoder = TargetHiddenEncoder(c_target, recent_tokens=8)
    registry = DraftRegistry([DraftEntry(n, f"/virtual/{n}", n, 1000) for n in drafts], validate=False)
    controller = RuntimeController(RuntimeConfig(policy="general-static", prompt_cache=prompt_cache), c_target, None,
                                   registry, encoder, loader=_Loader(drafts))
    try:
        controller.generate(_ids(20, 3), max_new_tokens=12)
        assert encoder._history == [] and encoder._fed == []
    finally:
        controller.close()
        encoder.close()


@pytest.mark.parametrize("rows_kept", [True, False])
@pytest.mark.parametrize("prompt_tokens", [0, 4, 20])
def test_the_target_hidden_encoder_keeps_the_reused_positions_rows(c_target, prompt_tokens, rows_kept):
    """With the prefix reused, the prompt features equal those of a fresh prefill, without a pass of its own,
    whichever prompt positions they pool (W 4: only fed ones, 20: reused and fed ones, 0: all). With the reused
    positions' rows not kept, still without a pass when the window lies in what the prefill fed (W 4); else one
    pass gives the same features, and the prefill's rows stay recorded for the recent window."""
    target = c_target
    lean = lean_forward_for(target)
    draft = noisy_copy(target, 0.05, seed=12)  # before the encoder's hook: a deep copy cannot copy its lock
    encoder = TargetHiddenEncoder(target, recent_tokens=8, prompt_tokens=prompt_tokens)
    try:
        first = _ids(30, 11)
        encoder.begin(first)
        session = SpeculativeSession(target, first, max_new_tokens=20)
        while not session.finished:
            session.step("d", draft)
        tokens, kv = session.tokens, session.target_kv
        # the controller's order: the rows the first generation's forwards recorded, kept; begin; the prefill
        kept = encoder.prefix_rows(kv.length)
        follow = tokens + _ids(7, 13)
        fresh = KVState()
        encoder.begin(follow)
        forward_once(target, follow, fresh, 1, "cpu", lean)
        want = encoder.prompt_features(follow)

        calls = []
        reused = kv.length
        encoder.reuse_rows(kept if rows_kept else None, reused)
        encoder.begin(follow)
        handle = target.register_forward_pre_hook(lambda *a: calls.append(1))
        try:
            forward_once(target, follow[reused:], kv, 1, "cpu", lean)
            got = encoder.prompt_features(follow)
        finally:
            handle.remove()
        passes = 0 if rows_kept or 0 < prompt_tokens <= len(follow) - reused else 1
        assert torch.allclose(got, want, atol=1e-5) and len(calls) == passes  # a pass over the prompt only if needed
        last = encoder.recent_rows(follow[-1:], 1)  # the prompt's last position: what the first token's window pools
        # (the prefill's rows are still recorded after a pass)
        assert len(last) == 1 and torch.allclose(last[0][0], hidden_last(target, follow), atol=1e-4)
        if prompt_tokens:
            with torch.inference_mode():
                hidden = target.model(input_ids=torch.tensor([follow])).last_hidden_state[0]
            assert torch.allclose(got, hidden[-prompt_tokens:].mean(0), atol=1e-4)
    finally:
        encoder.close()


def hidden_last(target, ids) -> torch.Tensor:
    """The target's final hidden state at the last position of ``ids`` (one plain pass)."""
    with torch.inference_mode():
        return target.model(input_ids=torch.tensor([list(ids)])).last_hidden_state[0, -1]


def test_a_goal_that_ends_inside_an_accepted_run_hands_back_only_what_it_kept(c_target):
    """An end token among accepted draft tokens: the rest were fed to the target but dropped. The next goal
    reuses only the kept tokens' positions and answers as a controller without the cache does."""
    import copy

    target = c_target
    prompt = _ids(12, 15)
    alone = generate(target, prompt, None, max_new_tokens=12).generated_ids
    end = alone[6]  # the 7th token ends the first goal, inside a run the exact draft proposed whole
    drafts = {"general": copy.deepcopy(target)}
    registry = DraftRegistry([DraftEntry("general", "/virtual/general", "general", 1000)], validate=False)

    def make(cache_on: bool):
        return RuntimeController(RuntimeConfig(policy="general-static", gamma=4, prompt_cache=cache_on), target,
                                 None, registry, None, loader=_Loader(drafts), eos_token_ids=[end])

    on, off = make(True), make(False)
    first = on.generate(prompt, max_new_tokens=12)
    assert first.finish_reason == "eos" and first.token_ids == off.generate(prompt, max_new_tokens=12).token_ids
    assert sum(it.accepted for it in first.stats.iterations) > 0
    _needs_reuse(on.prompt_cache_refused)
    held = on.prompt_cache.tokens  # the end token too when it was an accepted proposal (fed), never past it
    assert len(prompt) < held <= len(prompt) + len(first.token_ids)
    follow = prompt + first.token_ids + _ids(5, 16)
    second = on.generate(follow, max_new_tokens=12)
    assert second.stats.reused_prompt_tokens == held
    assert second.token_ids == off.generate(follow, max_new_tokens=12).token_ids


def test_the_cache_keeps_several_goals_within_its_budget_and_a_goal_takes_the_one_it_continues(target):
    tokens_a, tokens_b = _ids(20, 31), [61, 62] + _ids(18, 32)
    cache = PromptCache(budget_bytes=1 << 40)
    cache.keep(tokens_a, _filled(target, tokens_a), hidden_rows=torch.full((20, 3), 1.0))
    cache.keep(tokens_b, _filled(target, tokens_b), hidden_rows=torch.full((20, 3), 2.0))
    assert cache.conversations == 2 and cache.tokens == 20 and cache.bytes > 0
    reuse = cache.take(tokens_a[:15] + [99])  # shares 15 of A's tokens, then parts from it: copies, A stays
    assert reuse.target.length == 15 and cache.conversations == 2
    assert reuse.hidden_rows.shape == (15, 3) and bool((reuse.hidden_rows == 1.0).all())
    reuse.target.crop_to(3)  # the copy is the goal's own: A is untouched
    reuse = cache.take(tokens_a + [5])  # continues A (the goal before the last): takes A's caches
    assert reuse.target.length == 20 and cache.conversations == 1 and cache.tokens == 20
    assert bool((reuse.hidden_rows == 1.0).all())
    want = forward_once(target, [5], _filled(target, tokens_a), 1, "cpu", lean_forward_for(target))
    assert torch.equal(forward_once(target, [5], reuse.target, 1, "cpu", lean_forward_for(target)), want)
    assert cache.take([99, 98]).target is None and cache.conversations == 1  # shares nothing: B stays
    # the budget: older goals go, oldest first, until it holds; the last goal's is always kept
    cache.keep(tokens_a, _filled(target, tokens_a))
    one = PromptCache(budget_bytes=1 << 40)
    one.keep(tokens_a, _filled(target, tokens_a))
    size = one.bytes
    cache.set_budget(size + 1)  # room for one of them
    assert cache.conversations == 1 and cache.take(tokens_a + [5]).target.length == 20  # the newest stayed
    cache.keep(tokens_b, _filled(target, tokens_b))
    cache.keep(tokens_a, _filled(target, tokens_a))
    assert cache.conversations == 1  # over budget: only the last goal's
    cache.set_budget(0)  # one conversation: a prompt sharing nothing empties it
    assert cache.take([99, 98]).target is None and cache.conversations == 0
    with pytest.raises(ValueError, match=">= 0"):
        cache.set_budget(-1)


def test_a_repeated_prompt_keeps_one_conversation_not_a_copy_per_goal(c_target):
    """A behaviour-tree skill that sends the same prompt goal after goal gets copies of the kept conversation (it
    shares all but the last prompt token); its own caches then hold everything the older goal's held, so the older
    goal's are dropped instead of kept beside them, pushing other conversations out of the budget."""
    controller = _controller(c_target, {"general": noisy_copy(c_target, 0.05, seed=5)}, prompt_cache_bytes=1 << 40)
    other, prompt = _ids(12, 40), _ids(10, 41)
    held = other + controller.generate(other, max_new_tokens=4).token_ids
    _needs_reuse(controller.prompt_cache_refused)
    answers = [controller.generate(prompt, max_new_tokens=6).token_ids for _ in range(5)]
    assert all(a == answers[0] for a in answers)  # greedy: the same answer each time, from reused caches too
    assert controller.prompt_cache.conversations == 2  # the other conversation and one of these
    reuse = controller.prompt_cache.take(held + [5])
    assert reuse.target is not None and reuse.target.length == len(held) - 1  # the other one stayed whole


class _RowsRanker(FixedRanker):
    """Rankings as FixedRanker; hidden rows that say which goal's prompt they belong to (its first token)."""

    def __init__(self, fn) -> None:
        super().__init__(fn)
        self.prompt: list[int] = []
        self.reused: list[torch.Tensor | None] = []

    def begin(self, prompt_ids) -> None:
        self.prompt = list(prompt_ids)

    def prefix_rows(self, positions: int) -> torch.Tensor:
        return torch.full((positions, 1), float(self.prompt[0]))

    def reuse_rows(self, rows, positions=None) -> None:
        self.reused.append(rows)


def test_goals_alternating_between_two_conversations_each_continue_their_own(c_target):
    """A behaviour tree's two skills, each with its own system prompt, called in turn: with a budget each goal
    reuses its own skill's system prompt from the last goal of that skill (a copy: that goal's caches stay), and
    the predictor the rows of those positions; with none (one conversation) only what the goal shares with the
    goal before. Outputs as without a cache."""
    target = c_target
    drafts = {"general": noisy_copy(target, 0.05, seed=5)}
    systems = {"plan": [7] + _ids(30, 33), "chat": [8] + _ids(30, 34)}
    requests = [("plan", _ids(5, 35)), ("chat", _ids(6, 36)), ("plan", _ids(4, 37)), ("chat", _ids(5, 38)),
                ("plan", _ids(6, 39))]

    def run(**cfg):
        registry = DraftRegistry([DraftEntry("general", "/virtual/general", "general", 1000)], validate=False)
        ranker = _RowsRanker(lambda c: ["general"])
        controller = RuntimeController(RuntimeConfig(policy="memspec", **cfg), target, None, registry, ranker,
                                       loader=_Loader(drafts))
        results = []
        for skill, request in requests:
            prompt = systems[skill] + request
            results.append(controller.generate(prompt, max_new_tokens=8))
        return controller, ranker, results

    budget, ranker, with_budget = run()
    _, _, single = run(prompt_cache_bytes=0)
    _, _, off = run(prompt_cache=False)
    assert [r.token_ids for r in with_budget] == [r.token_ids for r in off] == [r.token_ids for r in single]
    _needs_reuse(budget.prompt_cache_refused)
    reused = [r.stats.reused_prompt_tokens for r in with_budget]
    assert reused[:2] == [0, 0] and all(n == 31 for n in reused[2:]), reused  # each its own system prompt
    assert [r.stats.reused_prompt_tokens for r in single] == [0] * 5  # the goal before is the other skill's
    assert budget.prompt_cache.conversations == 5  # no goal continued another: each copied, all fit the budget
    # the predictor got the rows of the conversation each goal continued (its first token tags them), and None for
    # a goal that reused nothing (so no goal's rows are left for a later one)
    assert [None if rows is None else (rows.shape[0], float(rows[0, 0])) for rows in ranker.reused] == [
        None, None, (31, 7.0), (31, 8.0), (31, 7.0)]


def test_two_interleaved_conversations_each_continue_their_own_caches(c_target):
    """Two people talking to the robot in turn: with a budget, each goal takes its own conversation's caches
    (everything but the newest token); keeping only the last goal's, each goal reuses nothing."""
    target = c_target
    drafts = {"general": noisy_copy(target, 0.05, seed=5)}
    firsts = {"a": [7] + _ids(9, 41), "b": [8] + _ids(9, 42)}
    turns = [("a", _ids(4, 43)), ("b", _ids(5, 44)), ("a", _ids(3, 45)), ("b", _ids(4, 46)), ("a", _ids(2, 47))]

    def run(**cfg):
        controller = _controller(target, drafts, **cfg)
        history = {name: list(tokens) for name, tokens in firsts.items()}
        results = []
        for who, turn in turns:
            history[who] += turn
            result = controller.generate(history[who], max_new_tokens=6)
            results.append((who, len(history[who]), result))
            history[who] += result.token_ids
        return controller, results

    budget, with_budget = run()
    _, single = run(prompt_cache_bytes=0)
    _, off = run(prompt_cache=False)
    assert [r.token_ids for *_, r in with_budget] == [r.token_ids for *_, r in single] == [r.token_ids for *_, r in off]
    _needs_reuse(budget.prompt_cache_refused)
    assert [r.stats.reused_prompt_tokens for *_, r in single] == [0] * 5
    # each goal continues its conversation's last goal: all of that goal's prompt and answer but the newest token
    last: dict[str, tuple[int, int]] = {}
    for who, prompt_len, result in with_budget:
        want = last[who][0] + last[who][1] - 1 if who in last else 0
        assert result.stats.reused_prompt_tokens == want, (who, prompt_len)
        last[who] = (prompt_len, len(result.token_ids))
    assert budget.prompt_cache.conversations == 2  # each goal took its conversation's caches and gave them back


def test_a_request_refused_for_its_arguments_takes_nothing_from_the_cache(c_target):
    """sampling=None raised an AttributeError in the session after the conversation's entry had been taken (and
    max_new_tokens nan passed the request's checks): the conversation was lost to a request that never ran."""
    controller = _controller(c_target, {"general": noisy_copy(c_target, 0.05, seed=5)})
    try:
        prompt = _ids(10, 10)
        first = controller.generate(prompt, max_new_tokens=4)
        _needs_reuse(controller.prompt_cache_refused)
        held = (controller.prompt_cache.conversations, controller.prompt_cache.tokens)
        assert held[1] > 0
        follow_up = prompt + first.token_ids + [3, 4]
        for changes in ({"max_new_tokens": float("nan")}, {"max_new_tokens": 2.5}, {"sampling": None}):
            with pytest.raises((ValueError, TypeError)):
                controller.generate(follow_up, **({"max_new_tokens": 4} | changes))
            assert (controller.prompt_cache.conversations, controller.prompt_cache.tokens) == held, changes
        assert controller.generate(follow_up, max_new_tokens=4).stats.reused_prompt_tokens == held[1]
    finally:
        controller.close()


def test_draft_caches_are_not_kept_where_every_goal_reloads_its_drafts(c_target):
    """With reset_cache_per_generation every goal loads its drafts anew, as other objects: the drafts' KV caches
    kept for the next goal could serve none, and took the budget's bytes from the target's caches."""
    drafts = {"general": noisy_copy(c_target, 0.05, seed=5)}
    for reset in (False, True):
        controller = _controller(c_target, drafts, reset_cache_per_generation=reset)
        try:
            controller.generate(_ids(10, 10), max_new_tokens=8)
            _needs_reuse(controller.prompt_cache_refused)
            assert controller.prompt_cache.tokens > 0
            assert bool(controller.prompt_cache.drafts) == (not reset), reset
        finally:
            controller.close()


def test_a_draft_cache_the_goal_took_but_did_not_run_is_kept_for_the_next(c_target):
    """Goal 1 ran draft a, goal 2 (the same conversation) only draft b: a's cache, taken with the conversation and
    still valid, was dropped, and a goal 3 running a again caught up on the whole conversation."""
    drafts = {"a": noisy_copy(c_target, 0.05, seed=5), "b": noisy_copy(c_target, 0.05, seed=6)}
    registry = DraftRegistry([DraftEntry(n, f"/virtual/{n}", n, 1000) for n in drafts], validate=False)
    controller = RuntimeController(RuntimeConfig(policy="general-static", general_draft="a", capacity=2), c_target,
                                   None, registry, None, loader=_Loader(drafts))
    try:
        first = controller.generate(_ids(10, 10), max_new_tokens=8)
        _needs_reuse(controller.prompt_cache_refused)
        held_a = controller.prompt_cache.drafts["a"]
        controller.reconfigure(general_draft="b")
        controller.generate(_ids(10, 10) + first.token_ids + [5, 6], max_new_tokens=8)
        assert controller.prompt_cache.drafts.get("a") == held_a and "b" in controller.prompt_cache.drafts
    finally:
        controller.close()


def test_a_turn_that_parts_inside_the_last_answer_continues_its_conversation(c_target):
    """The next turn re-sends the last answer otherwise (it ended on a stop string, the template re-rendered it):
    the cache copied the shared part and kept the stale conversation beside the new one, every turn, until the
    budget pushed other conversations out. It takes and crops the conversation instead."""
    drafts = {"general": noisy_copy(c_target, 0.05, seed=5)}
    controller = _controller(c_target, drafts)
    try:
        prompt = _ids(10, 10)
        first = controller.generate(prompt, max_new_tokens=8)
        _needs_reuse(controller.prompt_cache_refused)
        changed = [(first.token_ids[0] + 1) % 50 + 3, *first.token_ids[1:]]  # the answer, re-sent otherwise
        new = prompt + changed + [5, 6]
        second = controller.generate(new, max_new_tokens=8)
        assert second.stats.reused_prompt_tokens == len(prompt)
        assert controller.prompt_cache.conversations == 1  # was 2: the stale one kept beside it
        assert second.token_ids == generate(c_target, new, None, max_new_tokens=8, eos_token_ids=[]).generated_ids
    finally:
        controller.close()


def test_a_budget_change_that_evicts_drafts_drops_their_kept_caches_at_once(c_target):
    """The caches of drafts a K or budget change evicted stayed held (their memory, uncounted) until the next goal."""
    import copy
    import gc

    base = noisy_copy(c_target, 0.05, seed=5)

    def fresh(name):  # each load a model of its own, as a real loader's: evicted, nothing else holds it
        model = copy.deepcopy(base)
        return LoadedModel(model, ModelSpec(name), parameter_bytes(model), 64, 512)

    registry = DraftRegistry([DraftEntry("a", "/virtual/a", "a", 1000)], validate=False)
    controller = RuntimeController(RuntimeConfig(policy="general-static", general_draft="a", capacity=2), c_target,
                                   None, registry, None, loader=fresh)
    try:
        controller.generate(_ids(10, 10), max_new_tokens=8)
        _needs_reuse(controller.prompt_cache_refused)
        assert "a" in controller.prompt_cache._entries[-1].drafts
        controller.reconfigure(budget_bytes=1)  # no draft fits: evicted now (idle)
        gc.collect()
        assert controller.cache.resident() == []
        assert "a" not in controller.prompt_cache._entries[-1].drafts  # its KV cache went with it
    finally:
        controller.close()


def _two_drafts(target) -> tuple[dict, RuntimeController]:
    """Drafts 'a' and 'b' and a controller of them with room for both (the caller runs its goal and closes it)."""
    drafts = {"a": noisy_copy(target, 0.05, seed=5), "b": noisy_copy(target, 0.05, seed=6)}
    return drafts, _controller(target, drafts, capacity=2)


def _kept_after_a_goal(controller: RuntimeController) -> set[str]:
    """The drafts whose KV caches the prompt cache keeps after one goal."""
    controller.generate(_ids(10, 10), max_new_tokens=12)
    _needs_reuse(controller.prompt_cache_refused)
    return {n for entry in controller.prompt_cache._entries for n in entry.drafts}


def test_forgetting_a_draft_drops_its_kept_kv_caches_though_its_model_lives_on(c_target):
    """A draft removed from the registry while idle: its kept KV caches went only once its model was collected
    and a goal came (a weak reference dies only when nothing else holds the model)."""
    drafts, controller = _two_drafts(c_target)
    try:
        kept = _kept_after_a_goal(controller)
        assert kept and kept <= {"a", "b"}
        before = controller.prompt_cache.bytes
        controller.prompt_cache.forget_drafts(["a", "b"])
        assert all(not entry.drafts for entry in controller.prompt_cache._entries)
        assert controller.prompt_cache.bytes < before and drafts["a"] is not None  # the models live on
    finally:
        controller.close()


def test_drafts_a_swap_removes_while_idle_leave_both_caches_at_once(c_target):
    """Idle, replace_registry swapped the drafts but left the removed ones resident and their KV caches in the
    prompt cache: the node's parameter callback removed them, deciding by its goal runner's flag, which is set from
    a goal's acceptance to its end, so a swap just before generate() or just after it returned kept them (a K slot,
    a candidate for "any resident draft", bytes) until the next goal."""
    _, controller = _two_drafts(c_target)
    try:
        kept = _kept_after_a_goal(controller)
        assert "a" in controller.cache.resident() and "a" in kept, (controller.cache.resident(), kept)
        removed = controller.replace_registry(DraftRegistry([DraftEntry("b", "/virtual/b", "b", 1000)],
                                                            validate=False))
        assert [entry.name for entry in removed] == ["a"]
        assert "a" not in controller.cache.resident() and "a" not in controller.cache.loading()
        assert not any("a" in entry.drafts for entry in controller.prompt_cache._entries)
    finally:
        controller.close()


def test_a_reused_draft_evicted_mid_goal_is_freed_before_the_goal_ends(c_target):
    """The goal's own record of what it took from the prompt cache (``Reuse.drafts``) held each reused draft's
    model and KV cache until generate() returned: a draft evicted mid-goal stayed in memory, beside the cache's
    accounting that had released its bytes, for the rest of the goal."""
    import copy
    import gc
    import weakref

    base = noisy_copy(c_target, 0.05, seed=5)
    loaded: list[weakref.ref] = []

    def fresh(name):  # each load a model of its own, as a real loader's: evicted, nothing else holds it
        model = copy.deepcopy(base)
        loaded.append(weakref.ref(model))
        return LoadedModel(model, ModelSpec(name), parameter_bytes(model), 64, 512)

    registry = DraftRegistry([DraftEntry("a", "/virtual/a", "a", 1000)], validate=False)
    controller = RuntimeController(RuntimeConfig(policy="general-static", general_draft="a", capacity=2), c_target,
                                   None, registry, None, loader=fresh)
    try:
        prompt = _ids(10, 10)
        first = controller.generate(prompt, max_new_tokens=8)
        _needs_reuse(controller.prompt_cache_refused)
        assert "a" in controller.prompt_cache.drafts
        alive_after_eviction: list[bool] = []

        def evict_once() -> bool:  # polled per iteration: the first poll evicts the reused draft
            if not alive_after_eviction:
                controller.cache.remove("a")
                gc.collect()
                alive_after_eviction.append(loaded[0]() is not None)
            return False

        second = controller.generate(prompt + first.token_ids + [5, 6], max_new_tokens=8, should_cancel=evict_once)
        assert second.stats.reused_prompt_tokens > 0
        assert alive_after_eviction == [False]
    finally:
        controller.close()


def test_the_rows_handed_to_the_prompt_cache_leave_the_encoder():
    """The target-hidden encoder kept every row of a generation until the next goal began, beside the copy
    prefix_rows made for the prompt cache (counted in its budget): held twice between goals, once uncounted. And a
    reused slice of a longer conversation's rows kept the whole of them alive."""
    target = tiny_llama(hidden=64, seed=0)
    encoder = TargetHiddenEncoder(target, recent_tokens=4)
    try:
        encoder.begin(list(range(3, 13)))
        encoder._record_rows(torch.randn(10, 64), 0, 10)
        encoder._record_rows(torch.randn(3, 64), 10, 13)
        kept = encoder.prefix_rows(12)
        assert kept is not None and kept.shape == (12, 64)
        assert encoder._fed == [] and encoder._history == []  # handed over, not kept beside
        longer = torch.randn(40, 64)
        encoder.reuse_rows(longer[:12])
        assert encoder._reused_rows.untyped_storage().nbytes() == 12 * 64 * 4  # its own rows, not the 40's
    finally:
        encoder.close()


def test_the_target_hidden_encoder_refuses_to_rank_another_prompt_than_the_one_it_began():
    """prompt_features(prompt) gave the begun generation's features whatever prompt it was asked for (and the
    recent window counted from the begun prompt's length): a direct caller ranked prompt B on prompt A."""
    from memspec_ros.runtime.predictor import PredictorError

    target = tiny_llama(hidden=64, seed=0)
    encoder = TargetHiddenEncoder(target, recent_tokens=4)
    try:
        a, b = list(range(3, 13)), list(range(13, 23))
        encoder.begin(a)
        assert encoder.prompt_features(a).shape == (64,)
        with pytest.raises(PredictorError, match="another prompt than the generation it began"):
            encoder.prompt_features(b)
        encoder.begin(b)
        assert encoder.prompt_features(b).shape == (64,)
    finally:
        encoder.close()
