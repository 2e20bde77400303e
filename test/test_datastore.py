"""The datastore (runtime/datastore.py): past answers that context lookup searches beside the context. Its
index finds what a full search finds, a hash collision never becomes a copy, its file refuses what it
cannot use, and proposals copied from it leave the output the target's own."""

from __future__ import annotations

import random
from itertools import product
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from sampling_checks import check_given_first
from test_lookup import PROMPT

from memspec_ros.runtime import datastore as datastore_module
from memspec_ros.runtime.datastore import DATASTORE_NGRAMS, SEPARATOR, Datastore, DatastoreError
from memspec_ros.runtime.lookup import LookupConfig, NgramIndex
from memspec_ros.runtime.speculative import SamplingConfig, generate
from memspec_ros.testing.tiny_models import tiny_llama


def _rank(flat: list[int], after: list[int], at: int) -> tuple[int, int, int]:
    """How many occurrences share the next token, the next two (0 when the answer ends after one), and the
    position: the brute-force order of which occurrence to copy."""
    shared_one = sum(flat[q] == flat[at] for q in after)
    two = flat[at + 1] != SEPARATOR
    shared_two = sum(flat[q + 1] != SEPARATOR and flat[q : q + 2] == flat[at : at + 2] for q in after) if two else 0
    return shared_one, shared_two, at


def _searched(context: list[int], answers: list[list[int]], limit: int, config: LookupConfig,
              store: LookupConfig) -> tuple[list[int], int]:
    """By brute force: the longest suffix the context had before, at its latest occurrence; only without
    one, the longest (of ``store``'s lengths) in the answers: of its occurrences followed by a token of the
    same answer, the one whose next token most share, then next two, then the latest, copied up to that
    answer's end."""
    for n in range(config.max_ngram, config.min_ngram - 1, -1):
        suffix = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if len(context) >= n and context[start : start + n] == suffix:
                return context[start + n : start + n + limit], n
    flat = [t for answer in answers for t in [*answer, SEPARATOR]] + [SEPARATOR]
    for n in range(store.max_ngram, store.min_ngram - 1, -1):
        if len(context) < n:
            continue
        suffix = context[-n:]
        after = [start + n for start in range(len(flat) - n - 1)
                 if flat[start : start + n] == suffix and flat[start + n] != SEPARATOR]
        if after:
            chosen = max(after, key=lambda at: _rank(flat, after, at))
            window = flat[chosen : chosen + limit]
            return window[: window.index(SEPARATOR)] if SEPARATOR in window else window, n
    return [], 0


@pytest.mark.parametrize("config,store_config", [(LookupConfig(), DATASTORE_NGRAMS),
                                                 (LookupConfig(1, 3), LookupConfig(2, 2)),
                                                 (LookupConfig(3, 5), LookupConfig(1, 4))])
def test_lookup_with_a_datastore_proposes_what_a_full_search_finds(config, store_config):
    rng = random.Random(1)
    answers = [[rng.randrange(5) for _ in range(rng.randrange(0, 40))] for _ in range(40)]
    store = Datastore(answers, store_config)
    from_store = checked = 0
    for _ in range(150):
        index, context = NgramIndex(config, [store]), []
        for _ in range(rng.randrange(1, 12)):
            chunk = [rng.randrange(7) for _ in range(rng.randrange(1, 4))]  # ids 5, 6: never in the answers
            index.extend(chunk)
            context += chunk
            for limit in (1, 4):
                got = index.propose(limit)
                assert got == _searched(context, answers, limit, config, store_config), (context, limit)
                checked += 1
                from_store += bool(got[0]) and not _searched(context, [], limit, config, store_config)[0]
    assert checked > 500 and from_store > 100  # many proposals came from the datastore, not the context


def test_a_copy_stops_at_the_end_of_its_answer():
    store = Datastore([[1, 2, 3, 4], [5, 6, 7, 8, 9]])  # searched from 3 tokens on
    index = NgramIndex(LookupConfig(), [store])
    index.extend([9, 1, 2])
    assert index.propose(4) == ([], 0)  # "1 2" is too short a match in past answers
    index.extend([3])
    assert index.propose(4) == ([4], 3)  # "1 2 3" is followed by 4, then that answer ends
    index.extend([4])
    assert index.propose(4) == ([], 0)  # "2 3 4" ends an answer: nothing followed it there


def test_the_context_is_searched_before_past_answers():
    store = Datastore([[1, 2, 3, 4, 5]])
    index = NgramIndex(LookupConfig(), [store])
    index.extend([7, 3, 8, 1, 2, 3])
    assert index.propose(2) == ([4, 5], 3)  # only past answers hold a match
    index = NgramIndex(LookupConfig(), [store])
    index.extend([2, 3, 8, 1, 2, 3])
    assert index.propose(2) == ([8, 1], 2)  # the context's "2 3" wins over the past answers' "1 2 3"


def test_a_lookup_key_equals_the_index_key():
    rng = random.Random(2)
    for n in (1, 3, 6):
        ngram = [rng.randrange(200_000) for _ in range(n)]
        assert datastore_module._key(ngram) == int(datastore_module._keys(np.array(ngram, dtype=np.int64), n)[0])


def test_a_hash_collision_is_a_miss_not_a_wrong_copy(monkeypatch):
    """With every n-gram given the same key, only the n-gram really stored may be found."""
    monkeypatch.setattr(datastore_module, "_keys",
                        lambda tokens, n: np.zeros(max(len(tokens) - n + 1, 0), dtype=np.uint64))
    monkeypatch.setattr(datastore_module, "_key", lambda ngram: 0)
    store = Datastore([[1, 2, 3, 4, 5, 6]], LookupConfig(2, 2))
    stored = [(a, b) for a, b in [(1, 2), (2, 3), (3, 4), (4, 5)] if store.find([a, b]) is not None]
    assert len(stored) == 1  # one entry per key survives, and only that n-gram is found
    (a, b), = stored
    at = store.find([a, b])
    assert store.tokens[at - 2 : at].tolist() == [a, b] and store.find([7, 8]) is None


def test_the_file_keeps_the_answers_and_the_tokenizer(tmp_path):
    answers = [[1, 2, 3], [], [70_000, 5]]  # an empty answer, and an id beyond uint16
    store = Datastore(answers, fingerprint="tok-a")
    store.save(tmp_path / "d.safetensors", source="test")
    loaded = Datastore.load(tmp_path / "d.safetensors", fingerprint="tok-a")
    assert np.array_equal(loaded.tokens, store.tokens) and loaded.answers == 3 and loaded.token_count == 5
    Datastore([[1, 2, 3]]).save(tmp_path / "small.safetensors")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "small.safetensors"), "np") as f:
        assert f.get_tensor("tokens").dtype == np.uint16  # a 49 k vocabulary's answers take 2 bytes a token


def test_a_datastore_too_large_to_index_in_the_free_memory_is_refused_before_it_is_read(tmp_path, monkeypatch):
    """Indexing takes about 100x the file's size: a large or crafted datastore ran the node out of memory at
    configure. Its token count comes from the header; one that fits is loaded as before, and where the free memory
    is unknown nothing is refused."""
    path = tmp_path / "d.safetensors"
    Datastore([list(range(1, 1001))], fingerprint="tok-a").save(path)
    need = 1000 * datastore_module.INDEX_PEAK_BYTES_PER_TOKEN
    read = []
    monkeypatch.setattr(datastore_module, "read_answers", lambda *a: read.append(a) or ([], {}))
    monkeypatch.setattr(datastore_module, "available_memory_bytes", lambda: need - 1)
    with pytest.raises(DatastoreError, match=r"holds 1,000 tokens: indexing them takes up to .* more than the"):
        Datastore.load(path)
    assert not read
    monkeypatch.undo()
    for free in (need, None):
        monkeypatch.setattr(datastore_module, "available_memory_bytes", lambda free=free: free)
        assert Datastore.load(path).token_count == 1000
    free = datastore_module.available_memory_bytes()
    assert free is None or free > 0  # this machine's own figure, where it has one


def test_a_save_cut_short_leaves_the_datastore_that_was_there(tmp_path, monkeypatch):
    """The build wrote straight over models/datastore.safetensors: a rebuild cut mid-write destroyed the file the
    node reads by default."""
    import safetensors.numpy

    path = tmp_path / "datastore.safetensors"
    Datastore([[1, 2, 3]], fingerprint="tok-a").save(path)
    before = path.read_bytes()

    def cut(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise OSError("No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", cut)
    with pytest.raises(OSError, match="No space"):
        Datastore([[4, 5, 6, 7]], fingerprint="tok-a").save(path)
    assert path.read_bytes() == before and Datastore.load(path, fingerprint="tok-a").answers == 1
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no hidden partial file left in the zoo


def test_a_datastore_takes_integer_token_ids_and_keeps_its_own_metadata(tmp_path):
    """Floats were truncated to ids (1.7 -> 1) and booleans taken as 0/1, where the file loader refuses both; a
    caller's metadata named like the file's own replaced it (a format the loader then refused, a wrong count)."""
    for answer in ([1.5, 2.0], [True, False]):
        with pytest.raises(DatastoreError, match="not token ids"):
            Datastore([[1, 2], answer])
    assert Datastore([np.array([1, 2], dtype=np.uint16), []]).answers == 2
    for key in ("format", "answers", "tokenizer_fingerprint"):
        with pytest.raises(ValueError, match=f"{key} is the file's own"):
            Datastore([[1, 2, 3]]).save(tmp_path / "d.safetensors", **{key: "x"})
        assert not list(tmp_path.iterdir())


def test_a_datastore_for_another_tokenizer_or_not_a_datastore_is_refused(tmp_path):
    Datastore([[1, 2, 3]], fingerprint="tok-a").save(tmp_path / "d.safetensors")
    with pytest.raises(DatastoreError, match="another tokenizer"):
        Datastore.load(tmp_path / "d.safetensors", fingerprint="tok-b")
    with pytest.raises(DatastoreError, match="no datastore file"):
        Datastore.load(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(DatastoreError, match="not a datastore"):
        Datastore.load(tmp_path / "junk.safetensors")
    save_file({"weight": np.zeros(3, dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(DatastoreError, match="not a datastore"):
        Datastore.load(tmp_path / "model.safetensors")
    save_file({"tokens": np.arange(4, dtype=np.uint16), "offsets": np.array([0, 9])},
              str(tmp_path / "bad.safetensors"), metadata={"format": datastore_module.FORMAT})
    with pytest.raises(DatastoreError, match="offsets"):
        Datastore.load(tmp_path / "bad.safetensors")
    # uint64 offsets that go backwards: np.diff wrapped round and passed them (two answers read back overlapping)
    save_file({"tokens": np.arange(10, dtype=np.int32), "offsets": np.array([0, 8, 3, 10], dtype=np.uint64)},
              str(tmp_path / "backwards.safetensors"), metadata={"format": datastore_module.FORMAT})
    with pytest.raises(DatastoreError, match="offsets"):
        Datastore.load(tmp_path / "backwards.safetensors")
    with pytest.raises(DatastoreError, match="negative"):
        Datastore([[1, -5]])
    # -1 is the separator: in an answer it split it in two when saved (one answer written, two read back)
    with pytest.raises(DatastoreError, match="negative"):
        Datastore([[5, 6, 7, -1, 8, 9]])
    save_file({"tokens": np.array([5, 6, 7, -1, 8], dtype=np.int32), "offsets": np.array([0, 5])},
              str(tmp_path / "sep.safetensors"), metadata={"format": datastore_module.FORMAT})
    with pytest.raises(DatastoreError, match="negative"):
        Datastore.load(tmp_path / "sep.safetensors")
    # malformed arrays: a clear DatastoreError, not a TypeError or numpy's ValueError from deep inside
    save_file({"tokens": np.arange(4, dtype=np.int32), "offsets": np.array([0.0, 4.0])},
              str(tmp_path / "float.safetensors"), metadata={"format": datastore_module.FORMAT})
    with pytest.raises(DatastoreError, match="offsets"):
        Datastore.load(tmp_path / "float.safetensors")
    save_file({"tokens": np.arange(4, dtype=np.int32).reshape(2, 2), "offsets": np.array([0, 4])},
              str(tmp_path / "2d.safetensors"), metadata={"format": datastore_module.FORMAT})
    with pytest.raises(DatastoreError, match="not one row of integer ids"):
        Datastore.load(tmp_path / "2d.safetensors")


def test_a_datastore_with_ids_past_the_targets_vocabulary_is_refused_before_a_goal(pair):
    """A copied id the target has no embedding row for would fail its verify and end the goal: a session and a
    controller refuse such a datastore up front."""
    from memspec_ros.runtime.controller import RuntimeConfig, RuntimeController
    from memspec_ros.runtime.registry import DraftRegistry

    target, _ = pair
    vocab = target.get_input_embeddings().num_embeddings
    store = Datastore([[4, 5, 13, vocab + 75, 7]])
    with pytest.raises(DatastoreError, match=f"token id {vocab + 75}, past the target's {vocab} tokens"):
        generate(target, PROMPT, None, max_new_tokens=8, lookup=LookupConfig(), datastores=(store,))
    with pytest.raises(DatastoreError, match="past the target's"):
        RuntimeController(RuntimeConfig(policy="general-static", context_lookup=True), target, None,
                          DraftRegistry([], validate=False), eos_token_ids=[], datastore=store)
    Datastore([[4, 5, vocab - 1]]).check_vocab(vocab)  # the last row is a token


@pytest.mark.parametrize("gamma,adaptive,with_draft", list(product([1, 4], [False, True], [False, True])))
def test_greedy_output_is_the_targets_own_with_copies_from_past_answers(pair, gamma, adaptive, with_draft,
                                                                        fixed_costs):
    """Past answers: the target's own answer to another prompt, and noise. The copies they give must not
    change a token."""
    target, draft = pair
    reference = generate(target, PROMPT, None, max_new_tokens=60).generated_ids
    other = generate(target, [2, 4, 6, 8, 10], None, max_new_tokens=60).generated_ids
    rng = random.Random(0)
    store = Datastore([other, [rng.randrange(24) for _ in range(200)], reference[5:30]])
    session = generate(target, PROMPT, draft if with_draft else None, draft_name="noisy", gamma=gamma,
                       max_new_tokens=60, adaptive_gamma=adaptive, lookup=LookupConfig(), datastores=[store])
    assert session.generated_ids == reference
    assert session.stats.copied_iterations > 0


def test_past_answers_save_iterations_when_the_question_comes_again(pair):
    target, _ = pair
    prompt = [3, 1, 4, 1, 5]
    reference = generate(target, prompt, None, max_new_tokens=60)
    alone = generate(target, prompt, None, max_new_tokens=60, lookup=LookupConfig())
    remembered = generate(target, prompt, None, max_new_tokens=60, lookup=LookupConfig(),
                          datastores=[Datastore([reference.generated_ids])])
    assert remembered.generated_ids == reference.generated_ids
    # its own earlier answer matches from the first iterations on: fewer target forwards than context alone
    assert len(remembered.stats.iterations) < len(alone.stats.iterations)


def test_sampled_output_keeps_the_targets_distribution_with_copies_from_past_answers():
    """Joint distribution of generated tokens 2-4 equals the target's exact one when proposals are copies
    (one-hot q) from a datastore: with 5 ids, past answers match nearly every context."""
    vocab = 5
    target = tiny_llama(vocab_size=vocab, hidden=32, seed=7, init_range=0.3)
    sampling = dict(temperature=0.8, top_p=0.9)
    prompt = [2, 4, 0]  # no 2-gram of it recurs: the copies come from the datastore
    rng = random.Random(3)
    store = Datastore([[rng.randrange(vocab) for _ in range(40)] for _ in range(5)])
    copied = []

    def run(seed):
        session = generate(target, prompt, None, gamma=3, max_new_tokens=4, lookup=LookupConfig(),
                           datastores=[store], sampling=SamplingConfig(seed=seed, **sampling))
        copied.append(session.stats.copied_iterations > 0)
        return session

    check_given_first(target, prompt, SamplingConfig(**sampling), run, draws=1500)
    assert sum(copied) > len(copied) // 2, sum(copied)  # most generations copied from the datastore


def test_the_controller_passes_its_datastore_only_with_context_lookup(pair):
    from memspec_ros.runtime.controller import RuntimeConfig, RuntimeController
    from memspec_ros.runtime.registry import DraftRegistry

    target, _ = pair
    reference = generate(target, PROMPT, None, max_new_tokens=40).generated_ids
    iterations = {}
    for lookup, store in ((False, Datastore([reference])), (True, None), (True, Datastore([reference]))):
        ctl = RuntimeController(RuntimeConfig(policy="general-static", context_lookup=lookup), target, None,
                                DraftRegistry([], validate=False), eos_token_ids=[], datastore=store)
        result = ctl.generate(PROMPT, 40)
        assert result.token_ids == reference
        assert (result.stats.copied_iterations > 0) == lookup
        iterations[lookup, store is not None] = len(result.stats.iterations)
        ctl.close()
    # its own answer among the past ones: copied where the context has no match, fewer target forwards
    assert iterations[True, True] < iterations[True, False] < iterations[False, True]


def test_the_controller_remembers_its_last_answers_and_copies_from_them(pair):
    from memspec_ros.runtime.controller import RuntimeConfig, RuntimeController
    from memspec_ros.runtime.registry import DraftRegistry

    target, _ = pair
    ctl = RuntimeController(RuntimeConfig(policy="general-static", context_lookup=True, remember_answers=2), target,
                            None, DraftRegistry([], validate=False), eos_token_ids=[])
    reference = generate(target, PROMPT, None, max_new_tokens=40).generated_ids
    first, again = ctl.generate(PROMPT, 40), ctl.generate(PROMPT, 40)
    assert first.token_ids == again.token_ids == reference
    assert len(again.stats.iterations) < len(first.stats.iterations)  # the first answer is copied from
    for prompt in ([2, 4, 6], [3, 5, 7]):
        ctl.generate(prompt, 10)
    assert ctl.remembered_answers == 2  # only the last two are kept
    # fewer kept: at once, not after the next goal that succeeds (it stayed in memory and on /diagnostics, and the
    # next goal still copied from every one)
    ctl.reconfigure(remember_answers=1)
    assert ctl.remembered_answers == 1 and ctl._remembered.answers == 1
    ctl.reconfigure(remember_answers=0)
    assert ctl.remembered_answers == 0 and ctl._remembered is None
    ctl.generate(PROMPT, 40)
    assert ctl.remembered_answers == 0 and ctl._datastores() == ()
    ctl.close()


def test_remembered_answers_are_bounded_by_their_tokens_too(pair, monkeypatch):
    """remember_answers bounded the answers' count only: 1,000 answers as long as the context held about 220 MB and
    took seconds to index again after every goal. The oldest go once the tokens pass REMEMBERED_TOKENS (one answer
    is always kept)."""
    from memspec_ros.runtime import controller as controller_module
    from memspec_ros.runtime.controller import RuntimeConfig, RuntimeController
    from memspec_ros.runtime.registry import DraftRegistry

    target, _ = pair
    monkeypatch.setattr(controller_module, "REMEMBERED_TOKENS", 25)
    ctl = RuntimeController(RuntimeConfig(policy="general-static", context_lookup=True, remember_answers=10), target,
                            None, DraftRegistry([], validate=False), eos_token_ids=[])
    try:
        for prompt in ([2, 4, 6], [3, 5, 7], [4, 6, 8]):
            ctl.generate(prompt, 10)  # 10 tokens each
        assert ctl.remembered_answers == 2 and ctl.remembered_tokens == 20  # the first went: 30 > 25
        ctl.generate([5, 7, 9], 40)  # one answer over the bound alone: kept, the others go
        assert ctl.remembered_answers == 1 and ctl.remembered_tokens == 40
        ctl.reconfigure(remember_answers=0)
        assert ctl.remembered_answers == 0 and ctl.remembered_tokens == 0
    finally:
        ctl.close()


def test_of_several_datastores_the_longest_match_wins_then_the_first():
    recent, shipped = Datastore([[1, 2, 3, 4, 5]]), Datastore([[9, 1, 2, 3, 4, 7], [2, 3, 4, 8]])
    index = NgramIndex(LookupConfig(), [recent, shipped])
    index.extend([6, 9, 1, 2, 3, 4])
    assert index.propose(2) == ([7], 5)  # "9 1 2 3 4" only in the second: longer than the first's "1 2 3 4"
    index = NgramIndex(LookupConfig(), [recent, shipped])
    index.extend([6, 0, 2, 3, 4])
    assert index.propose(2) == ([5], 3)  # "2 3 4" in both: the first datastore's continuation


def _domain_datastores_script():
    """scripts/domain_datastores.py, imported by path (scripts/ is not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "domain_datastores.py"
    spec = importlib.util.spec_from_file_location("domain_datastores", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_domain_datastore_probe_walks_and_combines_as_the_engine_would():
    """scripts/domain_datastores.py, by hand: the walk from the prefill's token, the hindsight walk per interval,
    the teacher-forced copies (the case test_lookup replays), and the two ways of combining copy and draft."""
    probe = _domain_datastores_script()
    # an iteration after 1 committed token accepts 2 (3 committed, next at 4), then 1 at 4: the answer is done
    assert probe.walk([0, 2, 0, 0, 1, 0]) == (5, [2, 1])
    assert probe.walk([0, 2, 0, 0, 1, 0], 1, 1) == (3, [2])
    a, b = [0, 2, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 2, 0, 0]
    assert probe.mean_walk(a) == pytest.approx(2 / 5) and probe.mean_walk(b) == pytest.approx(2 / 6)
    # with hindsight every iteration: a's 2 at 1, then b's 2 at 6: four iterations, 4 tokens accepted
    assert probe.dynamic_walk({"a": a, "b": b[:8]}, 1) == pytest.approx(1.0)
    copied, proposed = probe.copy_accepted([1, 2, 3, 4, 5], [9, 1, 2, 3, 4, 7], None, 4)
    assert copied == [0, 0, 0, 2, 1, 0] and proposed == [False, False, False, True, True, False]
    rules = probe.combine([0, 1, 1, 0], [0, 0, 2, 0], [False, True, True, False])
    assert rules == {"draft": [0, 1, 1, 0], "store": [0, 0, 2, 0], "copy_first": [0, 0, 2, 0],
                     "best_of": [0, 1, 2, 0]}


def test_the_domain_datastore_probe_gives_general_every_domain_at_the_same_budget():
    probe = _domain_datastores_script()
    by_domain = {"general": [np.array([1, 1, 1])], "code": [np.array([2, 2, 2, 2]), np.array([5, 5, 5])],
                 "math": [np.array([3, 3, 3])]}
    stores = probe.bundle_stores(by_domain, ["general", "code"], budget=100)
    assert stores["general"].token_count == 13 and stores["code"].token_count == 7
    assert set(stores["code"].tokens.tolist()) - {SEPARATOR} == {2, 5}  # a domain's bundle: its own answers only
    # whole answers until the budget is reached: the one that passes it is the last
    assert [len(a) for a in probe.sample_budget([np.zeros(4)] * 5, 9, seed=0)] == [4, 4, 4]
