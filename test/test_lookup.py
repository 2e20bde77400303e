"""Context lookup (runtime/lookup.py): the n-gram index finds what a full search finds, and proposals copied
from the context leave the output the target's own, greedy and sampled, alone or beside a draft."""

from __future__ import annotations

import random
from itertools import product

import pytest
from sampling_checks import check_given_first

from memspec_ros.runtime.lookup import LOOKUP_DRAFT, LookupConfig, NgramIndex
from memspec_ros.runtime.speculative import SamplingConfig, generate
from memspec_ros.runtime.stats import GenerationStats, IterationStats
from memspec_ros.testing.tiny_models import noisy_copy, tiny_llama


def _searched(tokens: list[int], limit: int, config: LookupConfig) -> tuple[list[int], int]:
    """The proposal by brute force: the longest suffix seen earlier, its latest earlier occurrence."""
    for n in range(config.max_ngram, config.min_ngram - 1, -1):
        if len(tokens) < n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + limit], n
    return [], 0


@pytest.mark.parametrize("config", [LookupConfig(), LookupConfig(1, 3), LookupConfig(3, 5)])
def test_the_index_proposes_what_a_full_search_finds(config):
    rng = random.Random(0)
    index = NgramIndex(config)
    tokens: list[int] = []
    found = 0
    for _ in range(400):
        chunk = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]  # 6 ids: n-grams recur often
        index.extend(chunk)
        tokens += chunk
        for limit in (1, 4):
            got = index.propose(limit)
            assert got == _searched(tokens, limit, config)
            found += bool(got[0])
    assert found > 100  # the comparison covered matches, not only misses
    assert index.propose(0) == ([], 0)


def test_a_suffix_seen_only_at_the_end_proposes_nothing():
    index = NgramIndex(LookupConfig(2, 3))
    index.extend([1, 2, 3, 4])
    assert index.propose(4) == ([], 0)
    index.extend([1, 2])  # "1 2" occurred before, followed by 3 4 1 2
    assert index.propose(4) == ([3, 4, 1, 2], 2)


@pytest.mark.parametrize("bad", [(0, 2), (3, 2), (2, 9)])
def test_bad_ngram_bounds_are_rejected(bad):
    with pytest.raises(ValueError, match="min_ngram"):
        LookupConfig(*bad)


# a prompt with repeats: the tiny model's answer soon repeats itself too, so copies are proposed
PROMPT = [1, 5, 7, 9, 1, 5, 7, 2, 3]


@pytest.mark.parametrize("gamma", [1, 3, 4, 8])
@pytest.mark.parametrize("with_draft", [False, True])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_output_is_the_targets_own_with_copies(pair, gamma, with_draft, adaptive, fixed_costs):
    target, draft = pair
    reference = generate(target, PROMPT, None, max_new_tokens=60).generated_ids
    session = generate(target, PROMPT, draft if with_draft else None, draft_name="noisy", gamma=gamma,
                       max_new_tokens=60, adaptive_gamma=adaptive, lookup=LookupConfig())
    assert session.generated_ids == reference
    copies = [it for it in session.stats.iterations if it.draft == LOOKUP_DRAFT]
    assert copies and session.stats.copied_iterations == len(copies)
    assert all(0 < it.proposed <= gamma and it.accepted <= it.proposed for it in copies)
    if not adaptive:  # fixed gamma: a match is always copied, and a copy this repetitive answer mostly keeps
        assert sum(it.accepted for it in copies) > 0


def test_sampled_output_keeps_the_targets_distribution_with_copies():
    """Joint distribution of generated tokens 2-4 equals the target's exact one when proposals are copies
    (one-hot q) from one-token matches, which a 5-token vocabulary gives in most generations."""
    vocab = 5
    target = tiny_llama(vocab_size=vocab, hidden=32, seed=7, init_range=0.3)
    sampling = dict(temperature=0.8, top_p=0.9)
    prompt = [1, 3, 1, 3]
    runs = check_given_first(
        target, prompt, SamplingConfig(**sampling),
        lambda seed: generate(target, prompt, None, gamma=2, max_new_tokens=4, lookup=LookupConfig(1, 2),
                              sampling=SamplingConfig(seed=seed, **sampling)), draws=1500)
    copied = sum(stats.copied_iterations > 0 for _, stats in runs)
    assert copied > len(runs) // 2, copied  # most generations copied at least once


def test_the_controller_copies_losslessly_under_every_policy(pair, fixed_costs):
    from memspec_ros.runtime.controller import RuntimeConfig, RuntimeController
    from memspec_ros.runtime.models import LoadedModel, ModelSpec, parameter_bytes
    from memspec_ros.runtime.oracle import GreedyOracle
    from memspec_ros.runtime.policies import POLICIES
    from memspec_ros.runtime.predictor import FixedRanker
    from memspec_ros.runtime.registry import DraftEntry, DraftRegistry

    target, _ = pair
    drafts = {"general": noisy_copy(target, 0.05, seed=1), "code": noisy_copy(target, 0.01, seed=2)}
    reference = generate(target, PROMPT, None, max_new_tokens=40).generated_ids
    oracle = GreedyOracle.compute(target, drafts, PROMPT, 40, gamma=4, interval=4)
    registry = DraftRegistry([DraftEntry(n, f"/virtual/{n}", n, 1000) for n in drafts], validate=False)
    for policy, adaptive in product(POLICIES, (False, True)):
        ctl = RuntimeController(
            RuntimeConfig(policy=policy, context_lookup=True, adaptive_gamma=adaptive), target, None, registry,
            FixedRanker(lambda context: ["code", "general"]), eos_token_ids=[], oracle_for=lambda p: oracle,
            loader=lambda name: LoadedModel(drafts[name], ModelSpec(name), parameter_bytes(drafts[name]), 64, 512))
        result = ctl.generate(PROMPT, 40)
        assert result.token_ids == reference, (policy, adaptive)
        assert result.stats.copied_iterations > 0, (policy, adaptive)
        assert result.stats.summary()["copied_iterations"] == result.stats.copied_iterations
        ctl.close()


def test_copies_are_neither_drafts_used_nor_draft_switches():
    def it(draft: str) -> IterationStats:
        return IterationStats(draft=draft, proposed=2, accepted=1, committed=2, draft_seconds=0.0,
                              verify_seconds=0.001)

    stats = GenerationStats(prompt_tokens=3)
    stats.iterations = [it("code"), it(LOOKUP_DRAFT), it("code"), it(LOOKUP_DRAFT), it("math")]
    assert stats.draft_switches == 1  # code -> math; the copies in between load and evict nothing
    assert stats.drafts_used == ["code", "math"]
    assert stats.copied_iterations == 2


def test_the_offline_replay_counts_what_the_engine_would_copy():
    """scripts/lookup_acceptance.py: replayed on an answer that repeats its prompt, by hand."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "lookup_acceptance.py"
    spec = importlib.util.spec_from_file_location("lookup_acceptance", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # prompt 1 2 3 4 5; answer 9 1 2 3 4 7. The prefill commits "9" (no iteration). After "5 9" nothing matches;
    # after "9 1", "1" alone is too short; after "1 2" (seen at the prompt's start, followed by 3 4 5 9) the copy is
    # capped at the two tokens the answer leaves before its last (the engine proposes at most the tokens left less
    # one): 3 and 4 stand, and 7 is the target's own token, so the answer is complete after three iterations
    steps = list(module.replay([1, 2, 3, 4, 5], [9, 1, 2, 3, 4, 7], 4, LookupConfig()))
    assert steps == [(0, 0, 0), (0, 0, 0), (2, 2, 2)]


def test_a_copy_is_weighed_against_the_draft_that_would_run_instead(pair, monkeypatch):
    """With adaptive gamma a copy is proposed when its expected tokens per millisecond reach the draft's, else
    only every PROBE_EVERY declined copies (so the copies' acceptance stays current): taking every copy cost
    the strong math draft most of its gain (1.67x the target alone against 2.35x)."""
    from conftest import fix_adaptive_costs

    from memspec_ros.runtime.gamma_choice import PROBE_EVERY, ForwardCosts
    from memspec_ros.runtime.speculative import SpeculativeSession

    target, draft = pair
    fix_adaptive_costs(monkeypatch, lambda model, k, vocab: 10.0 + k if model is target else 0.1, 0.1)
    session = SpeculativeSession(target, PROMPT, max_new_tokens=40, gamma=4, adaptive_gamma=True,
                                 lookup=LookupConfig())
    chooser = session._gamma_chooser
    free = ForwardCosts(verify_ms=[10.0 + k for k in range(1, 6)], draft_ms=0.0)
    for _ in range(30):
        chooser.observe("noisy", 4, 4)  # the draft: every proposal accepted
        chooser.observe(LOOKUP_DRAFT, 4, 0)  # the copies: none
    rival = session._draft_costs("noisy", draft)
    decisions = [chooser.choose_copy(free, LOOKUP_DRAFT, 4, "noisy", rival) for _ in range(3 * PROBE_EVERY)]
    assert sum(map(bool, decisions)) == 3 and decisions[PROBE_EVERY - 1]  # only the probes
    for _ in range(60):
        chooser.observe(LOOKUP_DRAFT, 4, 4)  # copies as good as the draft, and free of draft forwards
    assert chooser.choose_copy(free, LOOKUP_DRAFT, 4, "noisy", rival) == 4


def test_copies_too_poor_for_a_plain_step_are_still_probed_beside_a_draft(pair, monkeypatch):
    """The probe that keeps a declined copy's acceptance current must be made: once the copies' estimate fell
    below a plain step's worth, the gamma test granted the probe and the test against the draft declined it
    again (restarting the count), so no copy was proposed for the rest of the generation."""
    from conftest import fix_adaptive_costs

    from memspec_ros.runtime.gamma_choice import PROBE_EVERY, ForwardCosts
    from memspec_ros.runtime.speculative import SpeculativeSession

    target, draft = pair
    fix_adaptive_costs(monkeypatch, lambda model, k, vocab: 10.0 + 5 * k if model is target else 0.1, 0.1)
    session = SpeculativeSession(target, PROMPT, max_new_tokens=40, gamma=4, adaptive_gamma=True,
                                 lookup=LookupConfig())
    chooser = session._gamma_chooser
    free = ForwardCosts(verify_ms=[10.0 + 5 * k for k in range(1, 6)], draft_ms=0.0)
    for _ in range(6):
        chooser.observe(LOOKUP_DRAFT, 4, 0)  # six failed copies: not worth a plain step's extra rows
        chooser.observe("noisy", 4, 2)
    rival = session._draft_costs("noisy", draft)
    decisions = [chooser.choose_copy(free, LOOKUP_DRAFT, 4, "noisy", rival) for _ in range(4 * PROBE_EVERY)]
    assert decisions.count(1) == 4 and set(decisions) == {0, 1}  # a one-token probe every PROBE_EVERY



def test_the_offline_replay_searches_a_datastore_file_without_its_withheld_rows(tmp_path, monkeypatch, capsys):
    """scripts/lookup_acceptance.py --datastore: the bundled datastore's answers are searched (an answer
    copied from it), its withheld (empty) rows are not counted, and --corpus beside it is refused."""
    import importlib.util
    import json
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    from memspec_ros.runtime.datastore import Datastore

    path = Path(__file__).resolve().parents[1] / "scripts" / "lookup_acceptance.py"
    spec = importlib.util.spec_from_file_location("lookup_acceptance", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    prompt, answer = [1, 2, 3], [20, 21, 22, 23, 24, 25, 26, 27]
    save_file({"prompt_ids": torch.tensor(prompt), "prompt_offsets": torch.tensor([0, 3]),
               "answer_ids": torch.tensor(answer), "answer_offsets": torch.tensor([0, 8])},
              str(tmp_path / "heldout-00000.safetensors"), metadata={"meta": json.dumps({"domains": ["code"]})})
    Datastore([[], [5, 20, 21, 22, 23, 24, 25, 26, 27], []]).save(tmp_path / "datastore.safetensors")
    out = tmp_path / "replay.json"
    argv = ["lookup_acceptance.py", str(tmp_path), "--datastore", str(tmp_path / "datastore.safetensors"),
            "--json", str(out)]
    monkeypatch.setattr("sys.argv", argv)
    module.main()
    result = json.loads(out.read_text())
    assert result["corpus"]["answers"] == 1 and result["corpus"]["tokens"] == 9
    # after 20 21 22 (3 tokens, the datastore's shortest n-gram) the rest of the answer is copied
    assert result["copied_share"] > 0 and result["by_domain"]["code"]["accepted_per_copy"] == 4
    monkeypatch.setattr("sys.argv", argv + ["--corpus", "train"])
    with pytest.raises(SystemExit, match="pass one"):
        module.main()


def test_a_copied_iterations_time_is_the_lookups_alone(pair, monkeypatch, clock_jump):
    """The draft's one-off timing runs (weighing a copy against it) ran inside the lookup's stopwatch: the first
    copied iteration beside a new draft charged them as its draft time."""
    from conftest import fix_adaptive_costs

    target, _ = pair
    draft = noisy_copy(target, 0.03, seed=5)  # a model object whose timing was never measured
    slow = 60.0  # seconds a draft's timing run takes here (on the stopwatches' clock): far more than any lookup

    def timing(model, k, vocab):
        if model is draft:
            clock_jump(slow)
            return 50.0  # dear: the copies win
        return 10.0 + k

    fix_adaptive_costs(monkeypatch, timing, 50.0)
    # every bigram (9, t) recurs: whatever the prefill's token, the first iteration finds a copy
    prompt = [tok for t in range(24) for tok in (9, t, 3, 4)] + [9]
    session = generate(target, prompt, draft, draft_name="noisy", gamma=4, max_new_tokens=24, adaptive_gamma=True,
                       lookup=LookupConfig())
    copied = [it for it in session.stats.iterations if it.draft == LOOKUP_DRAFT]
    assert copied, "the test needs copied iterations"
    assert all(it.draft_seconds < slow for it in copied), [it.draft_seconds for it in copied]
