"""The speculative engine is lossless and its KV caches roll back correctly."""

from __future__ import annotations

import random
from collections import Counter
from itertools import product

import pytest
import torch
from row_checks import assert_transformers_agrees_up_to_a_tie, target_alone
from sampling_checks import check_given_first, chi2, chi2_critical

from memspec_ros.runtime.speculative import (
    ContextLengthError,
    SamplingConfig,
    SpeculativeSession,
    generate,
    speculative_accept,
    warp_probs,
)
from memspec_ros.testing.tiny_models import noisy_copy, tiny_llama, tiny_tokenizer

PROMPT = [1, 5, 7, 9, 11, 13]
NEW = 48


@pytest.fixture(scope="module")
def drafts(target):
    # an unrelated model (accepts ~nothing), two noisy copies (partial) and an exact copy (everything)
    return {
        "random": tiny_llama(layers=1, hidden=32, seed=1),
        "noisy": noisy_copy(target, 0.03, seed=2),
        "close": noisy_copy(target, 0.01, seed=3),
        "same": noisy_copy(target, 0.0),
    }


def reference(target, prompt=PROMPT, new=NEW, eos=None):
    """The target's own greedy output: the engine decoding it alone (row_checks.target_alone; transformers'
    agrees up to a near-tie, test_autoregressive_without_draft)."""
    return target_alone(target, prompt, new, eos)


@pytest.mark.parametrize("gamma", range(1, 9))
def test_greedy_identical_to_target_for_every_gamma_and_draft(target, drafts, gamma):
    expected = reference(target)
    for name, draft in drafts.items():
        session = generate(target, PROMPT, draft, draft_name=name, gamma=gamma, max_new_tokens=NEW)
        assert session.generated_ids == expected, (name, gamma)
        assert session.finish_reason == "length"


def test_drafts_cover_every_acceptance_length(target, drafts):
    """The drafts above really exercise rejection at every position and full acceptance."""
    # Several prompts and long outputs: which lengths one short run shows depends on near-ties in the
    # tiny models' logits, which differ by CPU (one run saw length 3 once); the union over these is robust.
    seen: Counter[int] = Counter()
    for prompt, (name, draft) in product([PROMPT, [2, 4, 6], [17, 3, 50, 8], [33] * 5, [40, 41, 42]], drafts.items()):
        session = generate(target, prompt, draft, draft_name=name, gamma=4, max_new_tokens=2 * NEW)
        seen.update(it.accepted for it in session.stats.iterations if it.proposed == 4)
    assert set(seen) == {0, 1, 2, 3, 4}, seen


def test_random_draft_switches_stay_lossless_and_cost_catchup(target, drafts):
    expected = reference(target)
    names = list(drafts)
    for trial in range(6):
        rng = random.Random(trial)
        session = SpeculativeSession(target, PROMPT, max_new_tokens=NEW, gamma=rng.randint(1, 6))
        session.prefill()
        while not session.finished:
            if rng.random() < 0.2:
                session.drop_draft(rng.choice(names))  # an eviction mid-generation
            name = rng.choice(names)
            session.gamma = rng.randint(1, 6)
            session.step(name, drafts[name])
            # cache invariant: the target holds every committed token but the newest one
            assert session._target_kv.length == len(session.tokens) - 1
            assert session._draft_kv.get(name) is None or session._draft_kv[name].length <= len(session.tokens)
        assert session.generated_ids == expected
        switches = [it for it in session.stats.iterations if it.catchup_tokens]
        assert session.stats.draft_switches > 0 and switches
        # an incoming draft feeds everything it has not seen, in one forward
        assert max(it.catchup_tokens for it in switches) > 2
        assert all(it.catchup_seconds > 0 for it in switches)


def test_statistics_add_up(target, drafts):
    session = generate(target, PROMPT, drafts["close"], draft_name="close", gamma=4, max_new_tokens=NEW)
    stats = session.stats
    assert stats.completion_tokens == NEW == 1 + stats.decode_tokens
    for it in stats.iterations:
        assert it.committed == it.accepted + 1 <= it.proposed + 1
    assert stats.mean_accepted == pytest.approx(
        sum(it.accepted for it in stats.iterations) / len(stats.speculative_iterations)
    )
    assert stats.tokens_per_second > 0 and stats.decode_seconds > 0 and stats.prefill_seconds > 0
    assert stats.drafts_used == ["close"] and stats.draft_switches == 0


def test_eos_ends_generation_like_the_target(target, drafts):
    free = reference(target)
    eos = free[10]  # a token the target emits: make it the EOS
    expected = reference(target, eos=eos)
    assert expected[-1] == eos and len(expected) <= 11
    session = generate(target, PROMPT, drafts["same"], gamma=4, max_new_tokens=NEW, eos_token_ids=[eos])
    assert session.generated_ids == expected
    assert session.finish_reason == "eos"


def test_max_new_tokens_is_exact_for_every_gamma(target, drafts):
    for new in (1, 2, 3, 7):
        for gamma in (1, 4, 8):
            session = generate(target, PROMPT, drafts["same"], gamma=gamma, max_new_tokens=new)
            assert len(session.generated_ids) == new


def test_autoregressive_without_draft(target):
    session = generate(target, PROMPT, None, max_new_tokens=NEW)
    assert_transformers_agrees_up_to_a_tie(session.generated_ids, target, PROMPT)
    assert session.stats.mean_accepted == 0.0 and session.stats.drafts_used == []


def test_stop_strings_and_streamed_chunks():
    tokenizer = tiny_tokenizer()
    target = tiny_llama(vocab_size=len(tokenizer), seed=5)
    draft = noisy_copy(target, 0.02, seed=6)
    prompt = tokenizer("The patient")["input_ids"]
    free = generate(target, prompt, draft, gamma=3, max_new_tokens=40, tokenizer=tokenizer)
    text = free.text
    assert len(text) > 12
    stop = text[8:11]
    chunks: list[str] = []
    session = generate(
        target, prompt, draft, gamma=3, max_new_tokens=40, tokenizer=tokenizer,
        stop_strings=[stop], on_chunk=lambda delta, ids: chunks.append(delta),
    )
    assert session.finish_reason == "stop"
    assert session.text == text[: text.find(stop)]
    assert "".join(chunks) == session.text  # the stream never shows the stop string
    chunks.clear()
    generate(target, prompt, draft, gamma=3, max_new_tokens=40, tokenizer=tokenizer,
             on_chunk=lambda delta, ids: chunks.append(delta))
    assert "".join(chunks) == text


def test_a_stop_string_inside_an_accepted_run_ends_where_the_target_alone_ends():
    """The tokens after the one that completes a stop string are the target's own too, but one-token decoding
    never commits them: with an exact copy as the draft (every proposal stands, gamma 6) the ids, the finish
    reason and the text equal the target alone's for every stop string, also where an end token or the length
    limit falls later in the same accepted run."""
    tokenizer = tiny_tokenizer()
    target = tiny_llama(vocab_size=len(tokenizer), seed=5)
    same = noisy_copy(target, 0.0)
    prompt = tokenizer("The patient")["input_ids"]
    free = generate(target, prompt, None, max_new_tokens=40, tokenizer=tokenizer)
    text, ids = free.text, free.generated_ids
    stops = {text[i : i + n] for i in range(0, len(text) - 3, 3) for n in (1, 3)} - {""}
    checked = 0
    for stop, new, eos in product(sorted(stops), (8, 40), ([], ids[6:7])):
        kwargs = dict(max_new_tokens=new, tokenizer=tokenizer, stop_strings=[stop], eos_token_ids=eos)
        alone = generate(target, prompt, None, **kwargs)
        fast = generate(target, prompt, same, gamma=6, **kwargs)
        assert (fast.generated_ids, fast.finish_reason, fast.text) == (
            alone.generated_ids, alone.finish_reason, alone.text), (stop, new, eos)
        assert all(it.accepted <= it.committed for it in fast.stats.iterations)
        checked += alone.finish_reason == "stop" and len(alone.generated_ids) % 7 != 1
    assert checked  # some stops fell inside an accepted run


def test_a_stop_string_the_last_allowed_token_completes_is_a_stop_not_a_length():
    """The length limit was checked before the text: a stop string completed by the max_new_tokens-th token cut the
    text there but reported "length"."""
    tokenizer = tiny_tokenizer()
    target = tiny_llama(vocab_size=len(tokenizer), seed=5)
    prompt = tokenizer("The patient")["input_ids"]
    free = generate(target, prompt, None, max_new_tokens=40, tokenizer=tokenizer)
    checked = 0
    for n in range(2, 20):
        before = tokenizer.decode(free.generated_ids[: n - 1], skip_special_tokens=True)
        now = tokenizer.decode(free.generated_ids[:n], skip_special_tokens=True)
        added = now[len(before):] if now.startswith(before) else ""
        if not added or added in before:  # a string only the n-th token completes
            continue
        for draft in (None, noisy_copy(target, 0.0)):
            session = generate(target, prompt, draft, gamma=4, max_new_tokens=n, tokenizer=tokenizer,
                               stop_strings=[added])
            assert (session.finish_reason, session.text, session.generated_ids) == (
                "stop", before, free.generated_ids[:n]), n
        checked += 1
    assert checked


def test_a_cancelled_generation_streams_the_text_its_result_holds():
    """The text held back as a possible stop string's start was in the cancelled result but never streamed: the
    feedback joined differed from the result's text."""
    tokenizer = tiny_tokenizer()
    target = tiny_llama(vocab_size=len(tokenizer), seed=5)
    prompt = tokenizer("The patient")["input_ids"]
    free = generate(target, prompt, None, max_new_tokens=12, tokenizer=tokenizer)
    stop = free.text[-1] + "\x01\x01"  # never completed: its first character is held back at the end
    chunks: list[str] = []
    session = SpeculativeSession(target, prompt, max_new_tokens=40, tokenizer=tokenizer, stop_strings=[stop],
                                 on_chunk=lambda delta, ids: chunks.append(delta))
    session.prefill()
    while len(session.generated_ids) < 12:
        session.step("draft", None)
    assert session.text == free.text and "".join(chunks) == free.text[:-1]  # its last character held back
    session.cancel()
    assert session.finish_reason == "cancelled"
    assert "".join(chunks) == session.text == free.text


def test_a_run_cut_by_an_end_token_counts_only_its_committed_proposals(target):
    """Proposals that stood after an end token were never committed: they are not accepted tokens."""
    same = noisy_copy(target, 0.0)
    ids = generate(target, PROMPT, None, max_new_tokens=NEW).generated_ids
    eos = ids[3]
    session = generate(target, PROMPT, same, gamma=8, max_new_tokens=NEW, eos_token_ids=[eos])
    assert session.generated_ids == ids[: ids.index(eos) + 1] and session.finish_reason == "eos"
    last = session.stats.iterations[-1]
    assert last.accepted <= last.committed and last.proposed == 8


def test_a_temperature_that_is_not_a_number_is_refused_and_a_tiny_one_samples_the_argmax(target, drafts):
    """NaN or an infinite temperature is a clear error; a tiny positive one (logits / T overflowing to inf) samples
    the greedy tokens instead of failing inside torch.multinomial on inf - inf."""
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature must be a finite number"):
            SamplingConfig(temperature=bad)
    for t in (1e-39, 1e-46):  # 1e-46 rounds to 0 in float32: 0 / 0 gave NaN probabilities and raised
        tiny = SamplingConfig(temperature=t, seed=3)
        # greedy wherever float32's 1 / T overflows: CUDA divides by a scalar as a * (1 / T), and 0 * inf is NaN
        assert tiny.greedy and torch.isinf(1 / torch.tensor(t, dtype=torch.float32))
        session = generate(target, PROMPT, drafts["noisy"], gamma=4, max_new_tokens=16, sampling=tiny)
        assert session.generated_ids == reference(target, new=16), t
    least = SamplingConfig(temperature=float(torch.finfo(torch.float32).tiny), seed=3)  # the smallest that samples
    assert not least.greedy and torch.isfinite(1 / torch.tensor(least.temperature, dtype=torch.float32))
    assert torch.isfinite(warp_probs(torch.tensor([[0.0, -1.0, 3.0]]), least)).all()


def test_the_acceptance_coin_is_fp32_whatever_the_default_dtype():
    """transformers' from_pretrained sets torch's process-wide default dtype to 16 bits while a draft loads on the
    loader thread; the coin took it, and a bf16 coin (989 distinct values in 20,000 draws, none above 0.99609375)
    accepted every ratio above that. The coin's draws do not depend on the default dtype."""
    from memspec_ros.runtime.speculative import speculative_accept

    p = torch.tensor([[0.2, 0.8], [0.5, 0.5]])
    q = torch.tensor([[0.2008, 0.7992]])  # ratio p/q 0.996 for token 0: a bf16 coin never rejects it

    def rejections(dtype) -> int:
        before = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            gen = torch.Generator().manual_seed(0)
            return sum(speculative_accept(p, q, [0], gen)[0] == 0 for _ in range(4000))
        finally:
            torch.set_default_dtype(before)

    assert rejections(torch.bfloat16) == rejections(torch.float32) > 0


def test_a_failed_acceptance_leaves_the_targets_cache_at_the_committed_text(target, drafts, monkeypatch):
    """A verify that succeeded, then an acceptance that raised (NaN logits in the sampling, out of memory in its
    sort): the draft's cache was cropped back, the target's kept the proposals, and a step after that fed only the
    new proposals behind them: the output went on from a context the target never committed."""
    session = SpeculativeSession(target, PROMPT, max_new_tokens=NEW, gamma=4)
    session.prefill()
    accept = session._accept

    def fails_once(*args):
        monkeypatch.setattr(session, "_accept", accept)
        raise RuntimeError("probability tensor contains either inf, nan or element < 0")

    monkeypatch.setattr(session, "_accept", fails_once)
    with pytest.raises(RuntimeError, match="probability tensor"):
        session.step("close", drafts["close"])
    assert session._target_kv.length == len(session.tokens) - 1
    while not session.finished:
        session.step("close", drafts["close"])
    assert session.generated_ids == reference(target, new=NEW)


def test_text_stream_is_incremental_and_joins_to_the_full_decode():
    from pathlib import Path

    from memspec_ros.runtime.models import load_tokenizer
    from memspec_ros.runtime.speculative import _TextStream

    tokenizer = load_tokenizer(Path(__file__).resolve().parent / "data" / "toy_tokenizer")  # byte-level BPE
    window = []

    class Recording:  # records how many tokens each decode call sees
        def decode(self, ids, **kwargs):
            window.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    r = random.Random(0)
    text = "Größe µ-Werte: naïve café — 温度 ✓ def f(x): return x ** 2\n" * 30
    cases = [tokenizer(text)["input_ids"]] + [[r.randrange(3, len(tokenizer)) for _ in range(300)] for _ in range(20)]
    for ids in cases:  # real multi-byte text, and random ids that split UTF-8 sequences anywhere
        stream, chunks, i = _TextStream(Recording(), []), [], 0
        while i < len(ids):
            i = min(len(ids), i + r.randint(1, 5))
            chunks.append(stream.update(ids[:i], final=i == len(ids))[0])
        full = tokenizer.decode(ids, skip_special_tokens=True)
        assert stream.text == full and "".join(chunks) == full
    # each call decodes the few tokens since the last character boundary, not the whole output
    assert max(window) <= 40 and len(cases[0]) > 500


class _ByteTokenizer:
    """Token i is the bytes ``pieces[i]``: byte-level BPE's pieces, which may end inside a UTF-8 character."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("pieces, stop_at", [([b"A", b"b\xc3", b"\xa9"], 2),
                                             ([b"Ab\xc3", b"\xc3", b"\xc3", b"\xc3", b"z"], 1)])
def test_a_stop_string_is_found_in_the_token_that_also_starts_an_unfinished_character(pieces, stop_at):
    """A token holding the stop's last character and the first byte of the next one decodes to U+FFFD at its end:
    the stream waited for that character's last byte before taking any of the token's text, so the stop "Ab" was
    found a token later (or, the character never finishing, not before max_new_tokens). The text stays exact."""
    from memspec_ros.runtime.speculative import _TextStream

    tokenizer = _ByteTokenizer(pieces)
    stream = _TextStream(tokenizer, ["Ab"])
    for n in range(1, len(pieces) + 1):
        delta, stopped = stream.update(list(range(n)), final=n == len(pieces))
        if stopped:
            break
    assert stopped and n == stop_at and stream.text == "" and delta == ""
    plain = _TextStream(tokenizer, ["no such stop"])  # without a stop, the text joins to the full decode
    chunks = [plain.update(list(range(n)), final=n == len(pieces))[0] for n in range(1, len(pieces) + 1)]
    assert "".join(chunks) == plain.text == tokenizer.decode(range(len(pieces)))


def test_the_stream_holds_back_only_text_that_can_begin_a_stop_string():
    """The hold-back was reduced stop by stop: with stops "zq" and "yw", "abxyz" held back "yz" (the second stop
    was matched against the tail the first had cut), though "yz" begins neither. It holds the longest tail that
    begins one."""
    from memspec_ros.runtime.speculative import _TextStream

    tokenizer = _ByteTokenizer([b"ab", b"xy", b"z", b"w"])
    stream = _TextStream(tokenizer, ["zq", "yw"])
    assert stream.update([0, 1], final=False) == ("abx", False)  # "y" may begin "yw"
    assert stream.update([0, 1, 2], final=False) == ("y", False)  # "z" may begin "zq"; "yz" begins neither
    stream = _TextStream(tokenizer, ["zq", "xyzw"])  # the longest tail that begins a stop is held
    assert stream.update([0, 1, 2], final=False) == ("ab", False)
    assert stream.update([0, 1, 2, 3], final=False) == ("", True) and stream.text == "ab"


def test_cancel_keeps_partial_output(target, drafts):
    session = SpeculativeSession(target, PROMPT, max_new_tokens=NEW, gamma=2)
    session.prefill()
    session.step("close", drafts["close"])
    partial = list(session.generated_ids)
    session.cancel()
    assert session.finish_reason == "cancelled" and session.generated_ids == partial
    with pytest.raises(RuntimeError, match="finished"):
        session.step("close", drafts["close"])


def test_stepping_a_session_whose_prefill_ends_it_is_a_whole_generation(target, drafts):
    """step() prefills a session not started; where that prefill already ends the generation (one token allowed,
    or the first token ends it) it raised "finished", so ``while not finished: step()`` failed on a generation that
    succeeded. It returns empty statistics instead, and a step after that still raises."""
    first = reference(target, new=1)
    for kwargs in ({"max_new_tokens": 1}, {"max_new_tokens": NEW, "eos_token_ids": first}):
        session = SpeculativeSession(target, PROMPT, gamma=2, **kwargs)
        steps = []
        while not session.finished:
            steps.append(session.step("close", drafts["close"]))
        assert session.generated_ids == first and [s.committed for s in steps] == [0]
        assert session.stats.iterations == []
        with pytest.raises(RuntimeError, match="finished"):
            session.step("close", drafts["close"])


def test_bad_arguments_are_rejected_with_reasons(target):
    with pytest.raises(ValueError, match="prompt is empty"):
        SpeculativeSession(target, [], max_new_tokens=4)
    with pytest.raises(ValueError, match="gamma"):
        SpeculativeSession(target, PROMPT, gamma=0)
    # a verify of more rows than the forward paths check for row-exactness could change the output
    with pytest.raises(ValueError, match=r"1\.\.8"):
        SpeculativeSession(target, PROMPT, gamma=9)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(temperature=1.0, top_p=0.0)
    with pytest.raises(ContextLengthError, match="context of 512"):
        SpeculativeSession(target, PROMPT, max_new_tokens=600, max_positions=512)


# -- sampling: the target's distribution is preserved ------------------------


def test_acceptance_rule_reproduces_target_distribution():
    gen = torch.Generator().manual_seed(0)
    vocab = 6
    p = torch.softmax(torch.randn(2, vocab, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(1, vocab, generator=gen) * 1.5, -1)
    n = 20000
    counts: Counter = Counter()
    for _ in range(n):
        proposal = int(torch.multinomial(q[0], 1, generator=gen))
        accepted, extra = speculative_accept(p, q, [proposal], gen)
        counts[proposal if accepted else extra] += 1
    stat, dof = chi2(counts, {i: float(p[0, i]) for i in range(vocab)}, n)
    assert stat < chi2_critical(dof), (stat, dof)


def test_a_rejection_whose_residual_rounds_to_nothing_never_draws_the_rejected_token():
    """Where p - q is nowhere positive (p = q to rounding: a q row whose sum rounds above p's), the extra token
    was drawn from p itself, which could give back the token just rejected."""
    from memspec_ros.runtime.speculative import speculative_accept

    gen = torch.Generator().manual_seed(0)
    # q's row sums above p's, as rounding can make it: p - q is 0 or negative everywhere, and 1 is rejected 11% of
    # the time
    p, q = torch.tensor([[0.2, 0.8], [0.5, 0.5]]), torch.tensor([[0.2, 0.9]])
    outcomes = [speculative_accept(p, q, [1], gen) for _ in range(2000)]
    assert any(accepted == 0 for accepted, _ in outcomes)
    assert all(extra == 0 for accepted, extra in outcomes if accepted == 0)


@pytest.mark.parametrize("q_kind", ["one-hot (a copy)", "zeros outside a subset (reduced vocabulary)", "dense"])
def test_acceptance_rule_reproduces_the_target_distribution_at_every_position(q_kind):
    """The joint tests draw 1,500 samples; this one has the power to see a wrong residual for the proposals the
    engine makes besides a dense one: a copied token (q one-hot), a reduced-vocabulary draft's q (0 outside its
    ids), and two proposals, so the second row and the bonus row are checked too. Each position's token is
    compared with p at that position given the tokens before it."""
    gen = torch.Generator().manual_seed(1)
    vocab, n = 6, 20000
    p = torch.softmax(torch.randn(3, vocab, generator=gen) * 1.5, -1)
    if q_kind.startswith("one-hot"):
        q = torch.nn.functional.one_hot(torch.tensor([2, 4]), vocab).float()
    else:
        q = torch.softmax(torch.randn(2, vocab, generator=gen) * 1.5, -1)
        if q_kind.startswith("zeros"):
            q[:, [0, 3]] = 0.0
            q = q / q.sum(-1, keepdim=True)
    first: Counter = Counter()
    second: Counter = Counter()
    second_n = 0
    for _ in range(n):
        proposals = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
        accepted, extra = speculative_accept(p, q, proposals, gen)
        tokens = proposals[:accepted] + [extra]
        first[tokens[0]] += 1
        # p's rows do not depend on the earlier token here, so the second token follows p[1] given any first one
        if accepted >= 1:
            second[tokens[1]] += 1
            second_n += 1
    stat, dof = chi2(first, {i: float(p[0, i]) for i in range(vocab)}, n)
    assert stat < chi2_critical(dof), (q_kind, "first", stat, dof)
    stat, dof = chi2(second, {i: float(p[1, i]) for i in range(vocab)}, second_n)
    assert stat < chi2_critical(dof), (q_kind, "second", stat, dof)


def test_warp_probs_is_transformers_temperature_and_top_p_where_no_logits_tie():
    """The sampled tests build their reference with warp_probs itself: here it is checked against transformers'
    own warpers (the target's sampling as `generate(do_sample=True)` warps it) on rows without ties (at a tie on
    the top-p cut the two keep different ids of equal probability: lower ids first here)."""
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(200, 50, generator=gen) * 3
    for temperature, top_p in ((0.7, 0.9), (1.3, 0.5), (1.0, 1.0), (0.2, 0.99)):
        ours = warp_probs(logits, SamplingConfig(temperature=temperature, top_p=top_p))
        warped = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_p < 1.0:
            warped = TopPLogitsWarper(top_p)(None, warped)
        theirs = torch.softmax(warped, -1)
        assert torch.equal(ours > 0, theirs > 0), (temperature, top_p)
        assert torch.allclose(ours, theirs, atol=1e-5), (temperature, top_p)


def test_sampled_generation_matches_target_distribution():
    """Joint distribution of the generated tokens 2-4 equals the target's exact one."""
    vocab = 5
    target = tiny_llama(vocab_size=vocab, hidden=32, seed=7, init_range=0.3)
    draft = tiny_llama(vocab_size=vocab, hidden=32, layers=1, seed=8, init_range=0.3)
    sampling_kwargs = dict(temperature=0.8, top_p=0.9)
    prompt = [1, 3]
    runs = check_given_first(
        target, prompt, SamplingConfig(**sampling_kwargs),
        lambda seed: generate(target, prompt, draft, gamma=2, max_new_tokens=4,
                              sampling=SamplingConfig(seed=seed, **sampling_kwargs)), draws=1500)
    # the draft's proposals took part, both ways: plain sampling alone would pass the chi-square too
    accepted = sum(it.accepted for _, stats in runs for it in stats.iterations)
    rejected = sum(it.accepted < it.proposed for _, stats in runs for it in stats.iterations)
    assert accepted > 0 and rejected > 0, (accepted, rejected)


def test_a_draft_that_fails_mid_proposal_keeps_only_committed_tokens_in_its_cache(target, drafts, monkeypatch):
    """Its forward advanced the cache over its first proposal before the second one's logits failed: a session kept
    past the failure fed that draft a context with a token never committed."""
    from memspec_ros.runtime import speculative

    draft = drafts["close"]
    session = SpeculativeSession(target, PROMPT, max_new_tokens=NEW, gamma=3)
    session.prefill()
    session.step("close", draft)
    real, calls = speculative._forward, []

    def second_fails(model, *args):
        logits = real(model, *args)
        calls.append(model is draft)
        return torch.full_like(logits, float("nan")) if calls.count(True) == 2 else logits

    monkeypatch.setattr(speculative, "_forward", second_fails)
    with pytest.raises(speculative.DraftFailure, match="not finite"):
        session.step("close", draft)
    assert session._draft_kv["close"].length == len(session.tokens) - 1  # as between iterations
    # the same draft runs again in this session (its cache held every committed token: nothing left to feed, and it
    # failed at its next step), and the output is still the target's
    monkeypatch.setattr(speculative, "_forward", real)
    while not session.finished:
        session.step("close", draft)
    assert session.generated_ids == reference(target)


def test_a_verify_that_fails_leaves_the_drafts_cache_a_prefix_of_the_text(target, drafts, monkeypatch):
    """The target's verify raising (a MemoryError, say) left the draft's cache over its uncommitted proposals: a
    caller that stepped again fed the draft nothing, and the draft was taken out of service for it."""
    draft = drafts["close"]
    session = SpeculativeSession(target, PROMPT, max_new_tokens=NEW, gamma=3)
    session.step("close", draft)
    verify = session._verify

    def fails_once(proposals):
        session._verify = verify
        raise MemoryError("out of memory in the verify")

    session._verify = fails_once
    with pytest.raises(MemoryError):
        session.step("close", draft)
    assert session._draft_kv["close"].length == len(session.tokens) - 1  # as between iterations
    while not session.finished:
        session.step("close", draft)
    assert session.generated_ids == reference(target)


def test_another_model_under_a_drafts_name_does_not_continue_the_first_ones_cache(target, drafts):
    """step("a", model2) after step("a", model1) fed model2 from model1's cache, and the session then reported that
    cache as model2's."""
    session = SpeculativeSession(target, PROMPT, max_new_tokens=NEW, gamma=3)
    session.step("a", drafts["random"])
    session.step("a", drafts["close"])
    assert session.draft_kvs["a"][0] is drafts["close"]
    assert session.stats.iterations[-1].catchup_tokens == len(session.tokens) - session.stats.iterations[-1].committed
    while not session.finished:
        session.step("a", drafts["close"])
    assert session.generated_ids == reference(target)


def test_a_draft_with_a_shorter_position_table_stops_proposing_before_its_end(target):
    """A GPT-2 draft of 32 positions beside a target of more: past them its forward raised IndexError, and the draft
    was taken out of service (for later goals too). It now proposes while its table lasts, then the steps are plain."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=target.config.vocab_size, n_positions=32, n_embd=32, n_layer=1,
                                      n_head=2)).eval()
    session = SpeculativeSession(target, PROMPT, max_new_tokens=NEW, gamma=4)
    while not session.finished:
        session.step("gpt2", gpt2)
    assert session.generated_ids == reference(target)
    ran = [len(PROMPT) + sum(it.committed for it in session.stats.iterations[:i]) + 1
           for i, it in enumerate(session.stats.iterations) if it.draft == "gpt2"]
    assert ran and max(ran) < 32  # it ran only while its positions lasted
    assert session.stats.iterations[-1].draft == ""  # past them: plain steps, no failure


def test_a_target_with_a_position_table_refuses_a_generation_past_it_before_it_starts():
    """With no max_positions given (generate(), a bench), a GPT-2 target's table was not checked: the verify that
    fed its first position past the table raised IndexError mid-generation."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from memspec_ros.runtime.speculative import ContextLengthError

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2)).eval()
    with pytest.raises(ContextLengthError, match="exceeds the target's context of 32 tokens"):
        generate(gpt2, list(range(1, 21)), max_new_tokens=20)
    with pytest.raises(ContextLengthError, match="context of 32 tokens"):  # a larger limit passed is capped too
        generate(gpt2, list(range(1, 21)), max_new_tokens=20, max_positions=1000)
    assert len(generate(gpt2, list(range(1, 21)), max_new_tokens=12).generated_ids) == 12  # up to its end


def test_a_longrope_target_is_served_only_within_its_original_length():
    """A longrope target (Phi-3 style) picks short or long frequencies from a call's longest position: a verify
    straddling original_max_position_embeddings computed its rows with the long ones where one-token decoding used
    the short ones for the positions before it, so greedy output could drift from the target's own. Its context is
    that original length: refused past it, as a context limit is."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from memspec_ros.runtime.draft_forward import context_positions
    from memspec_ros.runtime.speculative import ContextLengthError

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                          "long_factor": [4.0] * 8, "original_max_position_embeddings": 16})
    torch.manual_seed(0)
    longrope = LlamaForCausalLM(config).eval()
    assert context_positions(longrope.config) == 16
    with pytest.raises(ContextLengthError, match="context of 16 tokens"):
        generate(longrope, list(range(1, 11)), max_new_tokens=10)
    out = generate(longrope, list(range(1, 11)), longrope, max_new_tokens=6, gamma=4)
    assert out.generated_ids == generate(longrope, list(range(1, 11)), max_new_tokens=6).generated_ids


def test_the_last_token_spends_no_draft_timing(target, drafts, monkeypatch):
    """With one token left nothing can be proposed, yet adaptive gamma ran the draft's timing forwards first: a
    timing failure there took the draft out of service for nothing."""
    from memspec_ros.runtime import speculative

    def fails(*_args, **_kwargs):
        raise RuntimeError("the timing forward failed")

    monkeypatch.setattr(speculative, "measure_costs", fails)
    out = generate(target, PROMPT, drafts["close"], gamma=4, max_new_tokens=2, adaptive_gamma=True)
    assert out.generated_ids == reference(target, new=2)
    # generate() goes on with the target alone after a draft failure, so the output alone could not tell
    assert out.draft_failure == "", out.draft_failure


def test_draft_evicted_on_another_thread_mid_iteration_does_not_break_the_step(target, drafts):
    # the cache's loader thread calls drop_draft when it evicts; here it lands while the draft runs
    session = SpeculativeSession(target, PROMPT, max_new_tokens=NEW, gamma=3, lean_drafts=False)
    draft = drafts["close"]
    hook = draft.register_forward_pre_hook(lambda *_: session.drop_draft("close"))
    try:
        session.prefill()
        while not session.finished:
            session.step("close", draft)
    finally:
        hook.remove()
    assert session.generated_ids == reference(target)
    assert all(it.catchup_tokens > 0 for it in session.stats.iterations)  # every step started from scratch


def test_argmax_rows_picks_torchs_indices_ties_and_nan_included():
    from memspec_ros.runtime.speculative import argmax_rows

    rows = torch.randn(5, 49152, generator=torch.Generator().manual_seed(0))
    rows[1, [7, 900]] = 99.0  # a tie: the first
    rows[2, 3000:] = float("-inf")  # a reduced-vocabulary draft's row
    rows[3, [11, 40]] = float("nan")  # NaN counts as the largest, the first of them
    assert argmax_rows(rows) == rows.argmax(dim=-1).tolist() == [argmax_rows(r) for r in rows]
    assert argmax_rows(rows[1]) == 7 and argmax_rows(rows[3]) == 11
    half = rows[:, :64].to(torch.bfloat16)  # another dtype: torch's own argmax
    assert argmax_rows(half) == half.argmax(dim=-1).tolist()


@pytest.mark.parametrize("row", ["reduced", "nan", "+inf", "all -inf", "bf16"])
def test_the_greedy_draft_token_is_the_checked_rows_argmax_or_a_draft_failure(row, monkeypatch):
    """The greedy loop's one-pass draft choice (_greedy_draft_token) against the checked row and argmax_rows it
    stands in for: the same token, or the same DraftFailure."""
    from memspec_ros.runtime import speculative

    logits = torch.randn(2, 4096, generator=torch.Generator().manual_seed(1))
    logits[-1, 2000:] = float("-inf")  # a reduced-vocabulary draft's absent ids
    if row == "nan":
        logits[-1, [5, 70]] = float("nan")
    elif row == "+inf":
        logits[-1, 9] = float("inf")
    elif row == "all -inf":
        logits[-1] = float("-inf")
    elif row == "bf16":
        logits = logits.to(torch.bfloat16)  # not a numpy row: torch's own max and argmax
    monkeypatch.setattr(speculative, "_forward", lambda *args: logits)
    if row in ("reduced", "bf16"):
        expected = speculative.argmax_rows(speculative._checked_draft_row("d", None))
        assert speculative._greedy_draft_token("d", None) == (expected, 1.0)
        assert expected == int(logits[-1].float().argmax())
        # with its confidence: the token's softmax probability, the absent ids' -inf counting for nothing
        token, p = speculative._greedy_draft_token("d", None, confidence=True)
        assert token == expected
        assert p == pytest.approx(float(torch.softmax(logits[-1].float(), -1)[expected]), rel=1e-3)
        assert p == pytest.approx(float(torch.softmax(logits[-1, :2000].float(), -1).max()), rel=1e-3)
        return
    with pytest.raises(speculative.DraftFailure, match="not finite") as checked:
        speculative._checked_draft_row("d", None)
    with pytest.raises(speculative.DraftFailure, match="not finite") as greedy:
        speculative._greedy_draft_token("d", None)
    assert str(greedy.value) == str(checked.value)


def test_generate_goes_on_without_a_draft_that_fails_and_keeps_its_tokens(target, drafts, monkeypatch):
    """generate() let the DraftFailure out: the generation and its tokens were lost, and the message said the draft
    was taken out of service, which nothing did. Now it goes on with the target alone, as the controller does."""
    from memspec_ros.runtime import speculative

    draft, real, calls = drafts["close"], speculative._forward, []

    def draft_fails(model, *args):
        logits = real(model, *args)
        calls.append(model is draft)
        return torch.full_like(logits, float("nan")) if model is draft else logits

    monkeypatch.setattr(speculative, "_forward", draft_fails)
    session = generate(target, PROMPT, draft, max_new_tokens=NEW, gamma=3)
    assert session.generated_ids == reference(target) and "not finite" in session.draft_failure
    assert calls.count(True) == 1  # out of service after its failure: never run again


def test_a_draft_token_its_own_distribution_gives_probability_0_takes_the_draft_out(target, drafts, monkeypatch):
    """p/q is inf for such a token, so the acceptance rule took it whatever the target gives it (a sampler that drew
    a zero-weight id, as CUDA multinomial did in old torch releases): the draft fails instead."""
    session = SpeculativeSession(target, PROMPT, max_new_tokens=8, gamma=3,
                                 sampling=SamplingConfig(temperature=0.8, seed=1))
    session.prefill()
    choose = session._choose

    def zero_weight_draw(logits):  # (after the prefill, only the draft's tokens are drawn through _choose)
        token, probs = choose(logits)
        probs = probs.clone()
        probs[token] = 0.0  # the token it drew has no weight in its own distribution
        return token, probs

    monkeypatch.setattr(session, "_choose", zero_weight_draw)
    from memspec_ros.runtime import speculative

    with pytest.raises(speculative.DraftFailure, match="probability 0"):
        session.step("close", drafts["close"])


def test_generate_refuses_a_draft_that_is_no_model_or_scores_other_token_ids(target):
    """A draft wider than the target raised IndexError deep in torch; a narrower one was taken out of service at its
    first step, the run going on with the target alone, said only in the log; a string failed on a weak reference."""
    width = target.config.vocab_size
    for wrong in (tiny_llama(vocab_size=width * 2, layers=1, hidden=32), tiny_llama(vocab_size=width // 2, layers=1,
                                                                                     hidden=32)):
        with pytest.raises(ValueError, match="must share token ids"):
            generate(target, PROMPT, wrong, max_new_tokens=4)
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        generate(target, PROMPT, "draft", max_new_tokens=4)


def test_a_session_takes_a_tensor_prompt_and_names_settings_of_the_wrong_type(target):
    """As the controller takes them: a tensor prompt raised "Boolean value of Tensor ... is ambiguous", a dict of
    sampling settings failed on .seed, an end id given alone on "'int' object is not iterable"."""
    assert generate(target, torch.tensor(PROMPT), None, max_new_tokens=6).generated_ids == reference(target, new=6)
    with pytest.raises(TypeError, match="sampling must be a SamplingConfig, got dict"):
        generate(target, PROMPT, None, max_new_tokens=4, sampling={"temperature": 1.0})
    with pytest.raises(TypeError, match=r"eos_token_ids must be a list of token ids, got 2: pass \[2\]"):
        generate(target, PROMPT, None, max_new_tokens=4, eos_token_ids=2)
    with pytest.raises(TypeError, match="end token ids must be integers, got 'x'"):
        generate(target, PROMPT, None, max_new_tokens=4, eos_token_ids=["x"])
