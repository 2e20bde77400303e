"""Reduced-vocabulary drafts: target-width logits, q = 0 outside the subset, lossless greedy and sampled."""

from __future__ import annotations

import pytest
import torch
from row_checks import assert_transformers_agrees_up_to_a_tie, target_alone
from sampling_checks import check_given_first

from memspec_ros.runtime.draft_forward import lean_forward_for
from memspec_ros.runtime.draft_vocab import DraftVocab, DraftVocabError, ReducedVocabDraft, write_vocab_map
from memspec_ros.runtime.models import ModelSpec, load_model
from memspec_ros.runtime.speculative import SamplingConfig, SpeculativeSession, generate, warp_probs
from memspec_ros.testing.tiny_models import save_model_dir, tiny_llama, tiny_tokenizer

VOCAB = 64
PROMPT = [1, 5, 7, 9, 11, 13]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=VOCAB, seed=0)


def reduced(rows: list[int], seed: int = 1, target_vocab: int = VOCAB, hidden: int = 32) -> ReducedVocabDraft:
    return ReducedVocabDraft(tiny_llama(vocab_size=len(rows) + 1, hidden=hidden, layers=1, seed=seed),
                             DraftVocab(rows, target_vocab)).eval()


def reference(target, new: int = 40) -> list[int]:
    return target_alone(target, PROMPT, new)  # the target's own greedy output, as the engine decodes it alone


def test_logits_are_the_drafts_own_on_its_rows_and_minus_inf_elsewhere():
    rows = [3, 17, 5, 60, 0]
    draft = reduced(rows)
    ids = torch.tensor([[17, 4, 60, 63]])  # 4 and 63 are outside: they share the extra row
    inner = draft.inner(input_ids=torch.tensor([[1, 5, 3, 5]])).logits  # rows of 17, other, 60, other
    out = draft(ids).logits
    assert out.shape == (1, 4, VOCAB)
    assert torch.equal(out[..., rows], inner[..., :len(rows)])
    outside = [i for i in range(VOCAB) if i not in rows]
    assert torch.isinf(out[..., outside]).all() and (out[..., outside] < 0).all()
    q = warp_probs(out[0], SamplingConfig(temperature=1.0))
    assert torch.all(q[:, outside] == 0) and torch.allclose(q.sum(-1), torch.ones(4))


def test_lean_forward_maps_ids_and_logits_like_the_module():
    from memspec_ros.runtime.speculative import KVState, forward_once

    draft = reduced(list(range(0, VOCAB, 2)), hidden=64)
    lean = lean_forward_for(draft)
    assert lean is not None and lean.vocab is draft.vocab
    a, b = KVState(), KVState()
    ids = [1, 2, 3, 63, 8]
    plain = forward_once(draft, ids, a, len(ids), torch.device("cpu"))
    fast = forward_once(draft, ids, b, len(ids), torch.device("cpu"), lean)
    finite = torch.isfinite(plain)
    assert torch.equal(finite, torch.isfinite(fast))
    assert torch.allclose(plain[finite], fast[finite], atol=1e-5)


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_identical_to_target_even_when_its_argmax_is_outside_the_subset(target, gamma):
    expected = reference(target)
    # rows hold half of the target's greedy tokens: the draft cannot propose the others at all
    missing = set(expected[::2])
    rows = [i for i in range(VOCAB) if i not in missing]
    for lean in (True, False):
        session = generate(target, PROMPT, reduced(rows), gamma=gamma, max_new_tokens=len(expected), lean_drafts=lean)
        assert session.generated_ids == expected
    assert any(it.accepted < it.proposed for it in session.stats.iterations)


def test_sampled_generation_with_a_reduced_draft_matches_the_target_distribution():
    """Joint distribution of tokens 2-4 equals the target's exact one, with q = 0 on two of five ids."""
    vocab = 5
    target = tiny_llama(vocab_size=vocab, hidden=32, seed=7, init_range=0.3)
    draft = reduced([0, 2, 4], seed=8, target_vocab=vocab)
    sampling = dict(temperature=0.8, top_p=0.9)
    prompt = [1, 3]
    runs = check_given_first(
        target, prompt, SamplingConfig(**sampling),
        lambda seed: generate(target, prompt, draft, gamma=2, max_new_tokens=4,
                              sampling=SamplingConfig(seed=seed, **sampling)), draws=1500)
    accepted = residual_outside = 0
    for ids, stats in runs:
        at = 1  # the prefill committed ids[0]
        for it in stats.iterations:
            accepted += it.accepted
            # a rejection's last committed token is drawn from the residual max(p - q, 0)
            if it.accepted < it.proposed and it.committed == it.accepted + 1:
                residual_outside += ids[at + it.accepted] in (1, 3)
            at += it.committed
    assert accepted > 0  # the draft's proposals took part
    assert residual_outside > 0  # ids the draft can never propose still come out, from the residual


def test_a_reduced_draft_directory_loads_as_a_target_width_draft(tmp_path, target):
    tok = tiny_tokenizer()
    rows = list(range(0, VOCAB, 3))
    path = save_model_dir(tiny_llama(vocab_size=len(rows) + 1, hidden=32, layers=1, seed=4), tok, tmp_path / "d")
    write_vocab_map(path, rows, VOCAB)
    loaded = load_model(ModelSpec(str(path)))
    assert isinstance(loaded.model, ReducedVocabDraft) and loaded.vocab_size == VOCAB
    session = generate(target, PROMPT, loaded.model, gamma=4, max_new_tokens=24)
    assert session.generated_ids == reference(target, 24)


@pytest.mark.parametrize("content, match", [
    ('{"target_vocab_size": 64, "target_ids": [1, 2]}', "maps 2 ids but the model has"),
    ('{"target_vocab_size": 64, "target_ids": [1, 1, 2, 3, 4, 5, 6]}', "distinct"),
    ('{"target_vocab_size": 4, "target_ids": [0, 1, 2, 3, 4, 5, 6]}', "distinct and in"),
    ('not json', "not a valid draft vocabulary"),
    # a string of seven digits was iterated into seven ids and accepted
    ('{"target_vocab_size": 64, "target_ids": "1234567"}', "non-empty list of integers"),
    ('{"target_vocab_size": 64, "target_ids": [1, 2, 3, 4, 5, 6, 7.5]}', "non-empty list of integers"),
    # a width allocated before the target's is compared: 10^12 ids asked for 8 TB
    ('{"target_vocab_size": 1000000000000, "target_ids": [0, 1, 2, 3, 4, 5, 6]}', "more than any tokenizer's"),
])
def test_a_bad_vocabulary_file_is_refused_with_the_reason(tmp_path, content, match):
    tok = tiny_tokenizer()
    path = save_model_dir(tiny_llama(vocab_size=8, hidden=32, layers=1), tok, tmp_path / "d")
    (path / "draft_vocab.json").write_text(content)
    with pytest.raises(DraftVocabError, match=match):
        load_model(ModelSpec(str(path)))


def test_a_session_runs_reduced_and_full_drafts_side_by_side(target):
    expected = reference(target)
    full = tiny_llama(vocab_size=VOCAB, hidden=32, layers=1, seed=3)
    small = reduced(list(range(VOCAB // 2)))
    session = SpeculativeSession(target, PROMPT, max_new_tokens=len(expected), gamma=3)
    session.prefill()
    for k in range(100):
        if session.finished:
            break
        session.step(*(("full", full) if k % 3 else ("small", small)))
    assert session.generated_ids == expected


def test_transformers_assisted_generation_runs_a_reduced_draft_as_the_same_layers(target):
    """The engine bench's baseline: transformers' own assisted generation with the very draft the engine runs."""
    from transformers import PreTrainedModel

    from memspec_ros.bench.engine_bench import configure_assistant
    from memspec_ros.runtime.draft_vocab import as_transformers_assistant

    expected = reference(target)
    rows = [i for i in range(VOCAB) if i not in set(expected[1::3])]  # some of the target's tokens unproposable
    draft = reduced(rows)
    assistant = as_transformers_assistant(draft)
    assert isinstance(assistant, PreTrainedModel) and assistant.config.vocab_size == VOCAB
    # the same weights, not copies: quantizing or loading the draft changes both
    assert assistant.lm_head.head.weight is draft.inner.lm_head.weight
    ids = torch.tensor([PROMPT + expected[:7]])
    assert torch.equal(assistant(ids).logits, draft(ids).logits)  # -inf outside the subset included
    configure_assistant(assistant, 4)
    with torch.inference_mode():
        out = target.generate(torch.tensor([PROMPT]), assistant_model=assistant, do_sample=False,
                              max_new_tokens=len(expected), eos_token_id=None, pad_token_id=0)
    # transformers' own arithmetic on both sides: its greedy decoding of the target is the reference (the engine's
    # output, `expected`, may part from it at a near-tie on another CPU's kernels: row_checks)
    assert_transformers_agrees_up_to_a_tie(out[0, len(PROMPT):].tolist(), target, PROMPT)
