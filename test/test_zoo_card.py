"""The model card's goal lines are computed from the acceptance JSON, never written by hand."""

from __future__ import annotations

import json

import torch

from memspec_ros.zoo.card import build_phases, render
from memspec_ros.zoo.corpora import DOMAINS, WORKLOADS


def _measurements(phases: dict) -> dict:
    def model() -> dict:  # a fresh one per name, so a test can change one model's figures
        latency = {"1": 1.0, "5": 1.5, "lean1": 0.8, "lean5": 1.2}
        return {
            "params": 1e6,
            "shape": "8x1",
            "fp16_bytes": 2e6,
            "latency_ms": {"1": dict(latency), "2": dict(latency)},
            "perplexity": {d: 10.0 for d in DOMAINS},
        }
    return {
        "threads": 2,
        "latency_threads": [1, 2],
        "vocab_size": 2048,
        "models": {n: model() for n in ("target", *DOMAINS)},
        "data": {},
        "phases": phases,
        "rollouts": None,
        "domain_rollouts": None,
    }


def _acceptance(own: float, off: float, static: float, dynamic: float) -> dict:
    matrix = {d: {w: 2.0 for w in WORKLOADS} for d in DOMAINS}
    gains = {d: {w: (own if w == d else off) for w in DOMAINS} for d in DOMAINS[1:]}
    return {
        "matrix": matrix,
        "config": {"gamma": 4, "max_new_tokens": 128, "prompts_per_workload": 100},
        "domain_gain_over_general": gains,
        "oracle_static_gain": static,
        "oracle_static_gain_by_workload": {w: static for w in DOMAINS},
        "oracle_dynamic_gain_mixed": dynamic,
        "oracle_dynamic_mixed": 2.2,
        "best_fixed_per_prompt": {"mixed": 2.0},
        "mean_generated_tokens": {w: 128 for w in WORKLOADS},
        "gain_ceiling_over_general": {w: 0.1 for w in WORKLOADS},
        "repeated_4gram_fraction": {w: 0.5 for w in WORKLOADS},
        "sampling_temperature": 0.7,
        "sampling_overlap": {d: {w: 0.875 for w in WORKLOADS} for d in DOMAINS},
    }


def test_goal_lines_follow_the_measurements():
    met = render(_measurements({}), _acceptance(own=0.3, off=-0.2, static=0.25, dynamic=0.12))
    assert "by >= 25%: code +30%" in met and "-> met" in met and "loses to it on the other domains: met" in met
    assert (
        "oracle_static_gain >= 0.20: **0.250** (met" in met
        and "oracle_dynamic_gain_mixed >= 0.10: **0.120** (met" in met
    )
    missed = render(_measurements({}), _acceptance(own=0.1, off=0.05, static=0.02, dynamic=0.07))
    assert (
        "NOT met for code, math, law, medical" in missed
        and "NOT everywhere: also beats `general` code on general (+5%)" in missed
    )
    assert "**0.020** (NOT met" in missed and "**0.070** (NOT met" in missed
    # general accepting nothing on a workload: its gains there are n/a (acceptance_summary), and meet no goal
    none = _acceptance(own=0.3, off=-0.2, static=0.25, dynamic=0.12)
    none["domain_gain_over_general"]["code"]["code"] = None
    none["oracle_static_gain"] = none["oracle_static_gain_by_workload"]["law"] = None
    text = render(_measurements({}), none)
    assert "by >= 25%: code n/a" in text and "NOT met for code" in text
    assert "oracle_static_gain >= 0.20: **n/a** (NOT met; per workload" in text and "math +0.25, law n/a" in text
    assert "| math | 0.88 | 0.88 | 0.88 | 0.88 | 0.88 | 0.88 |" in missed
    assert (
        "no draft can beat `general` by more than code +10%" in missed
        and "continuation (loops, which any draft predicts): code 50%" in missed
    )


def test_build_runs_are_listed_with_their_objective(tmp_path):
    runs = {"target": {"step": 10}, "general-base": {"step": 20}, "general": {"step": 30, "start": "general-base"},
            "code": {"step": 5, "start": "general"}}
    for name, meta in runs.items():
        config = {"max_minutes": 1, "batch_size": 16, "seq_len": 256, "lr": 1e-3, "compile": name == "target"}
        (tmp_path / "hf" / name).mkdir(parents=True)
        (tmp_path / "hf" / name / "train_meta.json").write_text(
            json.dumps({**meta, "elapsed_s": 60.0, "final_loss": 0.5, "config": config})
        )
    phases = build_phases(tmp_path)
    assert list(phases) == ["target", "general-base", "general", "code"]
    card = render(_measurements(phases), None)
    # the toy zoo is built by build-toy (`memspec-zoo build` is the chat zoo's, and exports over models/)
    assert "memspec-zoo build-toy --out artifacts/toy-zoo" in card and "memspec-zoo build " not in card
    assert (
        "| target | 1 | 10 | 6.00 | 16 x 256 | 0.001 | 0.500 |"
        " next-token CE on the corpus mixture, torch.compile'd step |"
        in card
    )
    assert (
        "| general-base | 1 | 20 | 3.00 | 16 x 256 | 0.001 | 0.500 |"
        " from scratch: KL(target || draft) on the corpus mixture |"
        in card
    )
    assert (
        "| code | 1 | 5 | 12.00 | 16 x 256 | 0.001 | 0.500 |"
        " from `general`: KL(target || draft) over the target's top-k on its own continuations (on-policy) |"
        in card
    )


def test_rollout_data_lines_count_the_domain_drafts_extra_continuations():
    shared = {
        "config": {
            "sequences_per_source": 1024,
            "min_prompt_tokens": 32,
            "max_prompt_tokens": 96,
            "new_tokens": 128,
            "top_k": 32,
        },
        "sources": {n: {} for n in (*DOMAINS, "mixed")},
        "seconds": 1200,
    }
    m = {**_measurements({}), "rollouts": shared}
    assert "1024 prompts per\nsource (general, code, math, law, medical, mixed)" in render(m, None)
    assert "domain_rollouts" not in render(m, None)
    extra = {"config": {**shared["config"], "sequences_per_source": 3072}, "sources": {d: {} for d in DOMAINS[1:]},
             "seconds": 2400}
    card = render({**m, "domain_rollouts": extra}, None)
    assert "3072 more prompts per domain\n(code, math, law, medical)" in card and "(40 minutes)" in card
    assert "distilled on 4096 continuations of its domain, where the general\ndraft saw 1024 of each" in card
    # the paper recipe's general draft is general-base unchanged: it saw none of the continuations
    paper = {**m, "domain_rollouts": extra, "phases": {"general": {
        "steps": 20, "seconds": 3, "config": {}, "final_loss": None, "objective": "-", "copy_of": "general-base"}}}
    assert "where the general\ndraft saw none (paper recipe" in render(paper, None)


def test_cached_measurements_are_reused_only_for_the_same_weight_files(tmp_path, monkeypatch):
    """``memspec-zoo card`` re-measures when any weight file changed, even if the registry did not
    (drafts copied into models/ after an export), and reuses the cache otherwise."""
    import os

    from memspec_ros.zoo import card

    models, work = tmp_path / "models", tmp_path / "work"
    (models / "drafts" / "code").mkdir(parents=True)
    work.mkdir()
    (models / "registry.yaml").write_text("drafts: []\n")
    weights = models / "drafts" / "code" / "model.safetensors"
    weights.write_bytes(b"first")
    calls = []
    monkeypatch.setattr(card, "measure", lambda *a: calls.append(1) or {"n": len(calls)})
    monkeypatch.setattr(card, "render", lambda m, acc, notes: f"measured {m['n']}")
    card.write_card(models, work, None)
    card.write_card(models, work, None)
    assert len(calls) == 1 and (models / "MODEL_CARD.md").read_text() == "measured 1"
    weights.write_bytes(b"other weights")  # new draft weights, registry untouched and older
    os.utime(models / "registry.yaml", ns=(1, 1))
    card.write_card(models, work, None)
    assert len(calls) == 2 and (models / "MODEL_CARD.md").read_text() == "measured 2"


def test_forward_cost_ratio_is_printed_per_thread_count_and_forward_path():
    """The card gives the target / draft cost through transformers and through the lean forward the
    engine runs drafts with (same code for both), at each measured thread count, from the medians."""
    m = _measurements({})
    m["models"]["target"]["latency_ms"] = {"1": {"1": 9.0, "5": 12.0, "lean1": 7.5, "lean5": 9.0},
                                           "2": {"1": 18.0, "5": 20.0, "lean1": 16.0, "lean5": 17.0}}
    m["models"]["general"]["latency_ms"] = {"1": {"1": 1.2, "5": 1.3, "lean1": 0.75, "lean5": 0.8},
                                            "2": {"1": 2.5, "5": 2.6, "lean1": 2.0, "lean5": 2.1}}
    card = render(m, None)
    assert "| 1 | transformers | 9.00 | 12.00 | 1.20 | **7.5x** | 10.0x |" in card
    assert "| 1 | lean | 7.50 | 9.00 | 0.75 | **10.0x** | 12.0x |" in card
    assert "| 2 | transformers | 18.00 | 20.00 | 2.50 | **7.2x** | 8.0x |" in card
    assert "| 2 | lean | 16.00 | 17.00 | 2.00 | **8.0x** | 8.5x |" in card
    assert "| target | 8x1 | 1.00 M | 2.0 MB | 9.00 | 18.00 |" in card


def test_latencies_are_measured_at_each_thread_count(monkeypatch, tmp_path):
    """measure() sets torch's threads before each interleaved latency run and goes back to the
    perplexity threads after, so the 1- and 2-thread columns are what they say."""
    from memspec_ros.testing.tiny_models import tiny_llama
    from memspec_ros.zoo import card

    seen = []
    monkeypatch.setattr(card, "load_zoo", lambda d: (list(range(64)), tiny_llama(), {"general": tiny_llama()}, None))
    monkeypatch.setattr(card, "interleaved_latencies", lambda models: seen.append(torch.get_num_threads()) or {
        n: {"1": float(seen[-1]), "5": 1.0, "lean1": 1.0, "lean5": 1.0} for n in models})
    monkeypatch.setattr(card, "read_docs", lambda p: [])
    monkeypatch.setattr(card, "encode_documents", lambda tok, docs: [])
    monkeypatch.setattr(card, "perplexity", lambda *a, **k: seen.append(("ppl", torch.get_num_threads())) or 1.0)
    monkeypatch.setattr(card, "dir_bytes", lambda p: 0)
    before = torch.get_num_threads()
    try:
        m = card.measure(tmp_path, tmp_path, threads=2, latency_threads=(1, 2))
    finally:
        torch.set_num_threads(before)
    assert seen[:2] == [1, 2] and set(seen[2:]) == {("ppl", 2)}
    assert m["latency_threads"] == [1, 2]
    assert m["models"]["target"]["latency_ms"]["1"]["1"] == 1.0 and m["models"]["target"]["latency_ms"]["2"]["1"] == 2.0


def test_lean_latency_is_measured_on_the_lean_path(monkeypatch):
    from memspec_ros.runtime import draft_forward
    from memspec_ros.testing.tiny_models import tiny_llama
    from memspec_ros.zoo.card import forward_latency_ms

    calls = []
    real = draft_forward.LeanLlamaForward.__call__
    monkeypatch.setattr(
        draft_forward.LeanLlamaForward,
        "__call__",
        lambda self, ids, cache, start, keep: (
            calls.append((len(ids), start, keep)) or real(self, ids, cache, start, keep)
        ),
    )
    model = tiny_llama()
    assert forward_latency_ms(model, n_prefix=8, repeats=3, new_tokens=5, lean=True) > 0
    assert calls == [(8, 0, 1), (5, 8, 5)] * 5  # prefix, then the timed 5-token forward after it
    calls.clear()
    forward_latency_ms(model, n_prefix=8, repeats=3, new_tokens=1)
    assert calls == []  # the transformers path does not touch it
