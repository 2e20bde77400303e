"""A reduced-vocabulary draft exported as a full-vocabulary llama GGUF (zoo/draft_gguf.py); no llama.cpp needed."""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest
import torch

from memspec_ros.bench.llamacpp_bench import LlamaCppBenchConfig, draft_dir_of, llamacpp_drafts
from memspec_ros.runtime.draft_vocab import DraftVocab, write_vocab_map
from memspec_ros.runtime.models import ModelSpec, load_model
from memspec_ros.testing.tiny_models import CHAT_TEMPLATE, save_model_dir, tiny_llama, tiny_tokenizer
from memspec_ros.zoo.draft_gguf import (
    DraftGGUFError,
    cached_draft_gguf,
    export_draft_gguf,
    outside_wins,
    rope_rows_to_gguf,
)

gguf = pytest.importorskip("gguf")

VOCAB = 96
ROWS = [5, 17, 3, 60, 0, 95, 42, 7, 33, 80, 11, 2]  # target ids the draft keeps, in its row order


def target_gguf(path, vocab: int = VOCAB, eos: int = 2):
    """A stand-in target GGUF: tokenizer metadata only (what the exporter copies)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list([f"tok{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_token_merges(["t o", "to k"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def reduced_draft(tmp_path, tied: bool):
    from safetensors.torch import load_file, save_file

    model = tiny_llama(vocab_size=len(ROWS) + 1, hidden=64, layers=2, seed=3)  # 4 heads, 2 KV heads
    path = save_model_dir(model, tiny_tokenizer(), tmp_path / ("tied" if tied else "untied"))
    write_vocab_map(path, ROWS, VOCAB)
    if tied:  # the bundled drafts' layout: no lm_head, the embedding is the head
        weights = load_file(str(path / "model.safetensors"))
        weights.pop("lm_head.weight")
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    return path


def tensors(reader) -> dict[str, np.ndarray]:
    return {t.name: np.asarray(t.data) for t in reader.tensors}


def field(reader, key):
    return reader.fields[key].contents()


@pytest.mark.parametrize("tied", [False, True])
def test_export_maps_inputs_and_head_rows_like_the_engine(tmp_path, tied):
    draft_dir = reduced_draft(tmp_path, tied)
    target = target_gguf(tmp_path / "target.gguf")
    out = export_draft_gguf(draft_dir, target, tmp_path / "draft.gguf")
    reader = gguf.GGUFReader(str(out))
    t = tensors(reader)
    loaded = load_model(ModelSpec(str(draft_dir))).model  # the engine's draft, speaking target ids
    embed = loaded.inner.model.embed_tokens.weight.numpy()
    head = embed if tied else loaded.inner.lm_head.weight.numpy()
    hidden = embed.shape[1]

    assert t["token_embd.weight"].shape == (VOCAB, hidden)
    assert t["output.weight"].shape == (VOCAB, hidden)
    assert t["output_norm.weight"].shape == (hidden,) and t["output_norm.weight"].dtype == np.float32
    assert len([n for n in t if n.startswith("blk.")]) == 2 * 9
    assert t["blk.0.attn_q.weight"].shape == (64, hidden) and t["blk.0.attn_k.weight"].shape == (32, hidden)

    # inputs: every target id gets the row DraftVocab.inputs maps it to (the shared row outside the subset)
    rows = DraftVocab(ROWS, VOCAB).inputs(torch.arange(VOCAB)).numpy()
    assert np.array_equal(t["token_embd.weight"], embed[rows].astype(np.float16))
    outside = np.setdiff1d(np.arange(VOCAB), ROWS)
    assert (rows[outside] == len(ROWS)).all()
    # head: in-subset ids carry the draft's own rows; every other id a zero row
    assert np.array_equal(t["output.weight"][ROWS], head[: len(ROWS)].astype(np.float16))
    assert not t["output.weight"][outside].any()

    # metadata: the target's tokenizer verbatim, the draft's architecture
    assert field(reader, "general.architecture") == "llama"
    assert field(reader, "tokenizer.ggml.tokens") == [f"tok{i}" for i in range(VOCAB)]
    assert field(reader, "tokenizer.ggml.merges") == ["t o", "to k"]
    assert field(reader, "tokenizer.chat_template") == CHAT_TEMPLATE
    assert field(reader, "tokenizer.ggml.bos_token_id") == 1 and field(reader, "tokenizer.ggml.add_bos_token") is False
    config = loaded.inner.config
    assert field(reader, "llama.vocab_size") == VOCAB
    assert field(reader, "llama.block_count") == 2
    assert field(reader, "llama.attention.head_count") == 4 and field(reader, "llama.attention.head_count_kv") == 2
    assert field(reader, "llama.rope.dimension_count") == hidden // 4
    assert field(reader, "llama.context_length") == config.max_position_embeddings
    assert np.isclose(field(reader, "llama.attention.layer_norm_rms_epsilon"), config.rms_norm_eps)


def _rope_hf(q: np.ndarray, pos: int, theta: float) -> np.ndarray:
    """Hugging Face Llama RoPE of one head: row j turns with row j + d/2."""
    d = q.shape[-1]
    freq = pos * theta ** (-np.arange(0, d, 2) / d)
    cos, sin = np.concatenate([np.cos(freq)] * 2), np.concatenate([np.sin(freq)] * 2)
    rotated = np.concatenate([-q[d // 2:], q[: d // 2]])
    return q * cos + rotated * sin


def _rope_llamacpp(q: np.ndarray, pos: int, theta: float) -> np.ndarray:
    """llama.cpp's llama RoPE of one head: rows 2j and 2j + 1 turn together."""
    d = q.shape[-1]
    freq = pos * theta ** (-np.arange(0, d, 2) / d)
    a, b = q[0::2], q[1::2]
    out = np.empty_like(q)
    out[0::2], out[1::2] = a * np.cos(freq) - b * np.sin(freq), a * np.sin(freq) + b * np.cos(freq)
    return out


def test_the_export_reads_the_weight_files_the_engine_loads(tmp_path):
    """Every *.safetensors in the folder went into the GGUF, a later file's tensors over an earlier's: a stray
    older shard beside model.safetensors (which alone the engine loads) put other weights into llama.cpp's draft."""
    from safetensors.numpy import load_file, save_file

    from memspec_ros.zoo.draft_gguf import _read_draft

    draft_dir = reduced_draft(tmp_path, tied=False)
    loaded = load_file(str(draft_dir / "model.safetensors"))
    save_file({k: np.zeros_like(v) for k, v in loaded.items()}, str(draft_dir / "zz-old.safetensors"))
    _, read = _read_draft(draft_dir)
    assert read.keys() == loaded.keys() and all(np.array_equal(read[k], loaded[k]) for k in loaded)


def test_permuted_q_k_rows_give_the_same_attention_scores_under_llamacpp_rope():
    rng = np.random.default_rng(0)
    heads, kv_heads, d, hidden = 4, 2, 16, 64
    wq, wk = rng.standard_normal((heads * d, hidden)), rng.standard_normal((kv_heads * d, hidden))
    x, y = rng.standard_normal(hidden), rng.standard_normal(hidden)
    gq, gk = rope_rows_to_gguf(wq, heads), rope_rows_to_gguf(wk, kv_heads)
    for h in range(heads):
        kv = h // (heads // kv_heads)
        q, k = slice(h * d, (h + 1) * d), slice(kv * d, (kv + 1) * d)
        hf = _rope_hf((wq @ x)[q], 7, 1e4) @ _rope_hf((wk @ y)[k], 3, 1e4)
        cpp = _rope_llamacpp((gq @ x)[q], 7, 1e4) @ _rope_llamacpp((gk @ y)[k], 3, 1e4)
        assert np.isclose(hf, cpp)
    with pytest.raises(DraftGGUFError, match="even width"):
        rope_rows_to_gguf(np.zeros((6, 4)), 4)


def test_a_target_of_another_vocabulary_is_refused(tmp_path):
    draft_dir = reduced_draft(tmp_path, tied=False)
    with pytest.raises(DraftGGUFError, match="96-token target"):
        export_draft_gguf(draft_dir, target_gguf(tmp_path / "small.gguf", vocab=80), tmp_path / "draft.gguf")


def test_draft_gguf_without_the_gguf_package_says_what_to_install(tmp_path, monkeypatch, capsys):
    """A missing gguf ended `memspec-zoo draft-gguf` in a ModuleNotFoundError traceback from deep in the export."""
    import sys

    from memspec_ros.zoo.cli import main

    draft_dir = reduced_draft(tmp_path, tied=True)
    target = target_gguf(tmp_path / "target.gguf")
    for name in [m for m in sys.modules if m == "gguf" or m.startswith("gguf.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "gguf", None)  # as uninstalled: find_spec and import both fail
    with pytest.raises(SystemExit, match=r"memspec-zoo draft-gguf: a GGUF file needs the 'gguf' package .*"
                                         r"pip install -r requirements.txt"):
        main(["draft-gguf", "--draft", str(draft_dir), "--target", str(target), "--out", str(tmp_path / "d.gguf")])
    assert not (tmp_path / "d.gguf").exists()


def test_an_output_that_is_one_of_the_inputs_is_refused_and_nothing_changes(tmp_path):
    """`memspec-zoo draft-gguf --out` naming the --target file replaced the 98 MB target with the draft, exit 0."""
    draft_dir = reduced_draft(tmp_path, tied=True)
    target = target_gguf(tmp_path / "target.gguf")
    before = target.read_bytes()
    draft_files = sorted(p.name for p in draft_dir.iterdir())
    for out, said in ((target, "is the target GGUF itself"), (draft_dir / "draft.gguf", "inside the draft's folder"),
                      (tmp_path, "is a folder")):
        with pytest.raises(DraftGGUFError, match=said):
            export_draft_gguf(draft_dir, target, out)
    assert target.read_bytes() == before and sorted(p.name for p in draft_dir.iterdir()) == draft_files


def test_the_bench_exports_each_domain_draft_once_and_reuses_it(tmp_path):
    draft_dir = reduced_draft(tmp_path, tied=True)
    target = target_gguf(tmp_path / "target.gguf")
    draft = load_model(ModelSpec(str(draft_dir))).model
    assert draft_dir_of(draft) == draft_dir
    cfg = LlamaCppBenchConfig(draft_gguf_cache=tmp_path / "cache")
    found, missing = llamacpp_drafts(target, {"general": draft}, ["general", "code"], cfg)
    assert list(found) == ["general"] and found["general"].is_file() and "code" in missing
    stamp = found["general"].stat().st_mtime_ns
    again, _ = llamacpp_drafts(target, {"general": draft}, ["general"], cfg)
    assert again["general"] == found["general"] and found["general"].stat().st_mtime_ns == stamp
    assert cached_draft_gguf(draft_dir, target, tmp_path / "cache") == found["general"]
    given = LlamaCppBenchConfig(llamacpp_draft=tmp_path / "mine.gguf")
    assert llamacpp_drafts(target, {}, ["law"], given) == ({"law": tmp_path / "mine.gguf"}, {})


def test_a_re_released_target_of_the_same_name_and_size_gets_its_own_export(tmp_path):
    """The export copies the target's tokenizer metadata; its cache key named the target by file name and size,
    so a corrected release (another eos id: the same name, the same size) reused the old export, which llama.cpp
    then refused beside the new target (special tokens differ)."""
    draft_dir = reduced_draft(tmp_path, tied=True)
    (tmp_path / "v1").mkdir()
    (tmp_path / "v2").mkdir()
    old = target_gguf(tmp_path / "v1" / "target.gguf", eos=2)
    new = target_gguf(tmp_path / "v2" / "target.gguf", eos=3)
    assert old.stat().st_size == new.stat().st_size
    first = cached_draft_gguf(draft_dir, old, tmp_path / "cache")
    second = cached_draft_gguf(draft_dir, new, tmp_path / "cache")
    assert second != first
    assert int(field(gguf.GGUFReader(str(second)), "tokenizer.ggml.eos_token_id")) == 3


def test_a_failed_export_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A write that fails (a full disk) left the cut .tmp<pid> file in the cache folder for good."""
    draft_dir = reduced_draft(tmp_path, tied=True)
    target = target_gguf(tmp_path / "target.gguf")

    def full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", full)
    with pytest.raises(OSError, match="No space"):
        export_draft_gguf(draft_dir, target, tmp_path / "out" / "draft.gguf")
    assert list((tmp_path / "out").iterdir()) == []


def test_outside_wins_counts_positions_where_a_zero_row_would_win():
    class Fixed(torch.nn.Module):
        def forward(self, ids):
            logits = torch.full((1, ids.shape[1], 4), float("-inf"))
            logits[0, :, 1] = torch.tensor([2.0, -1.0, 0.5])[: ids.shape[1]]
            return type("Out", (), {"logits": logits})()

    assert outside_wins(Fixed(), [[1, 2, 3]]) == (1, 3, -1.0)


def test_the_llamacpp_bench_reports_its_median_and_worst_speculative_configurations_beside_the_best():
    """The best of several medians is picked by the runs it reports; the median and the worst configurations are
    quoted beside it, each named, each with its own paired ratio (not the best's rate over llama.cpp's median)."""
    from memspec_ros.bench.llamacpp_bench import speculative_choice

    choice = speculative_choice({"fixed gamma": 150.0, "adaptive gamma": 300.0, "lookup": 240.0, "both": 200.0},
                                {"fixed gamma": 1.4, "adaptive gamma": 2.9, "lookup": 2.5, "both": 2.1})
    assert choice == {"speculative_tps": 300.0, "speculative_method": "adaptive gamma", "speculative_vs_llamacpp": 2.9,
                      "speculative_median_method": "both", "speculative_median_vs_llamacpp": 2.1,
                      "speculative_worst_method": "fixed gamma", "speculative_worst_vs_llamacpp": 1.4}


def test_the_llamacpp_bench_compares_texts_without_end_markers_and_drops_a_halted_method(monkeypatch, tmp_path):
    """The engine's text kept its end-of-turn token and llama.cpp's its ' [end of text]' marker, so the one check
    that both answered alike was 0 in every run; a llama.cpp method that failed halfway still reported its
    partial median as a ratio to the plain decode over all prompts."""
    from memspec_ros.bench import llamacpp_bench as lb
    from memspec_ros.runtime.speculative import generate
    from memspec_ros.testing.tiny_models import noisy_copy, tiny_llama, tiny_tokenizer

    tok = tiny_tokenizer()
    target = tiny_llama(vocab_size=len(tok), seed=0)
    prompts = [("code", tok(f"def f{i}(x):")["input_ids"], f"def f{i}(x):") for i in range(3)]
    eos = [int(tok.eos_token_id)]
    answers = {text: tok.decode(generate(target, ids, None, max_new_tokens=6, eos_token_ids=eos).generated_ids,
                                skip_special_tokens=True) for _, ids, text in prompts}

    rates = {prompts[0][2]: 10.0, prompts[1][2]: 20.0, prompts[2][2]: 1000.0}

    def completion(bin_dir, gguf, prompt, new_tokens, threads):  # the last prompt encoded one token longer
        length = len(tok(prompt)["input_ids"]) + (prompt == prompts[-1][2])
        return lb.LlamaCppRun(text=lb.llamacpp_answer(answers[prompt] + " [end of text]\n\n"),
                              decode_tps=rates[prompt], prompt_tokens=length)

    calls = []

    def lookup(bin_dir, gguf, draft, prompt, new_tokens, threads, gamma):
        calls.append(prompt)
        if len(calls) == 2:
            raise RuntimeError("llama-speculative-simple failed (exit 1): out of memory")
        return lb.LlamaCppSpecRun(decode_tps=12.0, drafted=8, accepted=4)

    monkeypatch.setattr(lb, "run_llamacpp", completion)
    monkeypatch.setattr(lb, "run_llamacpp_speculative", lookup)
    cfg = lb.LlamaCppBenchConfig(paths=("fp32",), threads=(1,), max_new_tokens=6, llamacpp_bin=tmp_path)
    draft = {"code": noisy_copy(target, 0.05, seed=1)}
    result = lb.run_llamacpp_bench(tmp_path / "t.gguf", {"fp32": target}, draft, prompts, cfg, eos, tok.decode)
    row = result["threads"]["1"]
    assert row["paths"]["fp32"]["same_text_as_llamacpp"] == 1.0
    length = len(prompts[-1][1])
    assert row["prompt_tokens_mismatched"] == [{"prompt": 2, "engine": length, "llamacpp": length + 1}]
    assert row["llamacpp_tps"] == 15.0  # the other prompt's rate is in no figure (with it: 20)
    assert "llamacpp_lookup_tps" not in row and "llamacpp_lookup_vs_llamacpp" not in row
    assert "out of memory" in result["llamacpp_lookup_failed"]
    assert row["paths"]["fp32"]["speculative_worst_method"] in {"fixed gamma", "adaptive gamma",
                                                                "adaptive gamma + context lookup",
                                                                "context lookup, no draft"}


def test_the_llamacpp_bench_says_so_when_llamacpp_was_given_no_prompt_the_engine_was(monkeypatch, tmp_path):
    """Every prompt encoded to another length by llama.cpp (a BOS added): its rates are in no figure, and the bench
    said "every answer was one token"."""
    from memspec_ros.bench import llamacpp_bench as lb
    from memspec_ros.testing.tiny_models import noisy_copy, tiny_llama, tiny_tokenizer

    tok = tiny_tokenizer()
    target = tiny_llama(vocab_size=len(tok), seed=0)
    prompts = [("code", tok(f"def f{i}(x):")["input_ids"], f"def f{i}(x):") for i in range(2)]
    monkeypatch.setattr(lb, "run_llamacpp", lambda bin_dir, gguf, prompt, *a: lb.LlamaCppRun(
        text="", decode_tps=10.0, prompt_tokens=len(tok(prompt)["input_ids"]) + 1))
    monkeypatch.setattr(lb, "run_llamacpp_speculative", lambda *a: lb.LlamaCppSpecRun(10.0, 4, 2))
    cfg = lb.LlamaCppBenchConfig(paths=("fp32",), threads=(1,), max_new_tokens=6, llamacpp_bin=tmp_path)
    with pytest.raises(lb.BenchNoRate, match="encoded every prompt to another length"):
        lb.run_llamacpp_bench(tmp_path / "t.gguf", {"fp32": target}, {"code": noisy_copy(target, 0.05, seed=1)},
                              prompts, cfg, [int(tok.eos_token_id)], tok.decode)


def test_the_llamacpp_bench_says_there_is_nothing_to_measure_when_every_answer_is_one_token(monkeypatch, tmp_path):
    """A kind without one decode rate (every answer ended at its first token) raised statistics' StatisticsError
    after every run; the bench says why, and the command line turns it into its message."""
    import pytest

    from memspec_ros.bench import llamacpp_bench as lb
    from memspec_ros.runtime.speculative import generate
    from memspec_ros.testing.tiny_models import noisy_copy, tiny_llama, tiny_tokenizer

    tok = tiny_tokenizer()
    target = tiny_llama(vocab_size=len(tok), seed=0)
    prompts = [("code", tok(f"def f{i}(x):")["input_ids"], f"def f{i}(x):") for i in range(2)]
    first = {generate(target, ids, None, max_new_tokens=1).generated_ids[0] for _, ids, _ in prompts}
    monkeypatch.setattr(lb, "run_llamacpp", lambda *a: lb.LlamaCppRun(text="", decode_tps=10.0, prompt_tokens=None))
    monkeypatch.setattr(lb, "run_llamacpp_speculative", lambda *a: lb.LlamaCppSpecRun(10.0, 4, 2))
    cfg = lb.LlamaCppBenchConfig(paths=("fp32",), threads=(1,), max_new_tokens=6, llamacpp_bin=tmp_path)
    with pytest.raises(lb.BenchNoRate, match="every answer was one token"):
        lb.run_llamacpp_bench(tmp_path / "t.gguf", {"fp32": target}, {"code": noisy_copy(target, 0.05, seed=1)},
                              prompts, cfg, sorted(first), tok.decode)


def test_the_llamacpp_bench_pairs_its_ratios_and_drops_a_method_halted_at_a_later_thread_count(monkeypatch, tmp_path):
    """The engine has no rate for a prompt answered in one token, yet its ratios to llama.cpp divided by llama.cpp's
    median over every prompt; then they divided two medians, which pairs one prompt's rate with another's (now the
    median of per-prompt ratios); and a llama.cpp method that failed at the second thread count still reported its
    figures at the first, while the result said it did not run."""
    from memspec_ros.bench import llamacpp_bench as lb
    from memspec_ros.runtime import speculative
    from memspec_ros.runtime.speculative import generate
    from memspec_ros.testing.tiny_models import noisy_copy, tiny_llama, tiny_tokenizer

    tok = tiny_tokenizer()
    target = tiny_llama(vocab_size=len(tok), seed=0)
    prompts = [("code", tok(f"def f{i}(x):")["input_ids"], f"def f{i}(x):") for i in range(5)]
    firsts = [generate(target, ids, None, max_new_tokens=1).generated_ids[0] for _, ids, _ in prompts]
    lone = next(i for i, f in enumerate(firsts) if firsts.count(f) == 1)
    eos = [firsts[lone]]  # that prompt's answer is its end token alone: no decode rate in the engine
    rates = {text: float(10 * i + 1) for i, (_, _, text) in enumerate(prompts)}  # 1, 11, 21, 31, 41
    others = sorted(r for i, r in enumerate(rates.values()) if i != lone)
    engine_rate = 100.0  # every engine method's rate, set below, so that the expected ratios are known
    over_medians = engine_rate / ((others[1] + others[2]) / 2)  # over llama.cpp's median on the four prompts
    paired = statistics.median(engine_rate / r for r in others)  # the median of the four prompts' own ratios
    assert paired != pytest.approx(over_medians) and paired != pytest.approx(engine_rate / 21.0)

    def timed(*args, **kwargs):  # the real generation, its decode time set so that its rate is engine_rate
        session = generate(*args, **kwargs)
        session.stats.decode_seconds = session.stats.decode_tokens / engine_rate
        return session

    def completion(bin_dir, gguf, prompt, new_tokens, threads):
        return lb.LlamaCppRun(text="", decode_tps=rates[prompt])

    calls = []

    def lookup(bin_dir, gguf, draft, prompt, new_tokens, threads, gamma):
        calls.append(threads)
        if threads == 2:
            raise RuntimeError("llama-lookup failed (exit 1): out of memory")
        return lb.LlamaCppSpecRun(decode_tps=12.0, drafted=8, accepted=4)

    monkeypatch.setattr(lb, "run_llamacpp", completion)
    monkeypatch.setattr(lb, "run_llamacpp_speculative", lookup)
    monkeypatch.setattr(speculative, "generate", timed)
    cfg = lb.LlamaCppBenchConfig(paths=("fp32",), threads=(1, 2), max_new_tokens=4, llamacpp_bin=tmp_path)
    draft = {"code": noisy_copy(target, 0.05, seed=1)}
    result = lb.run_llamacpp_bench(tmp_path / "t.gguf", {"fp32": target}, draft, prompts, cfg, eos, tok.decode)
    for row in result["threads"].values():
        path = row["paths"]["fp32"]
        assert path["target_alone_vs_llamacpp"] == pytest.approx(paired)
        assert path["speculative_vs_llamacpp"] == pytest.approx(paired)
        assert path["speculative_median_vs_llamacpp"] == pytest.approx(paired)
        assert path["speculative_vs_target_alone"] == pytest.approx(1.0)
        assert not any(k.startswith("llamacpp_lookup_") for k in row), row
    assert 1 in calls and "out of memory" in result["llamacpp_lookup_failed"]


def test_the_llamacpp_bench_refuses_prompts_whose_domain_has_no_draft(tmp_path):
    """A prompt whose domain had no draft ran its speculative kinds on the target alone, timed as the engine's
    speculative rate, and 'outputs identical' passed."""
    from memspec_ros.bench import llamacpp_bench as lb
    from memspec_ros.testing.tiny_models import noisy_copy, tiny_llama, tiny_tokenizer

    tok = tiny_tokenizer()
    target = tiny_llama(vocab_size=len(tok), seed=0)
    prompts = [("code", tok("def f(x):")["input_ids"], "def f(x):"), ("mixed", tok("and law")["input_ids"], "and law")]
    cfg = lb.LlamaCppBenchConfig(paths=("fp32",), threads=(1,), max_new_tokens=4, llamacpp_bin=tmp_path)
    with pytest.raises(ValueError, match="no draft for the prompts' domain.s. mixed"):
        lb.run_llamacpp_bench(tmp_path / "t.gguf", {"fp32": target}, {"code": noisy_copy(target, 0.05, seed=1)},
                              prompts, cfg, [int(tok.eos_token_id)], tok.decode)


def test_llamacpps_draft_runs_gamma_tokens_where_its_build_has_the_options(tmp_path):
    """llama.cpp's draft stops short of gamma below its own draft probability cut-off (p-min) and drops a draft
    shorter than n-min, which the bench left at their defaults while calling it "the same gamma": both are set to 0
    where this build's --help lists them, and recorded."""
    from memspec_ros.bench import llamacpp_bench as lb

    program = tmp_path / "llama-speculative-simple"
    program.write_text("#!/bin/sh\necho '  --spec-draft-n-max N   ...'\necho '  --spec-draft-p-min P   ...'\n")
    program.chmod(0o755)
    assert lb.spec_draft_options(tmp_path) == ["--spec-draft-p-min", "0"]  # n-min not in this build: not passed
    # and said: memspec-bench llamacpp warns that llama.cpp's own n-min then applied
    assert lb.missing_draft_options(lb.spec_draft_options(tmp_path)) == ["--spec-draft-n-min"]


def test_llama_completion_runs_with_its_warm_up_and_reports_its_prompt_length(tmp_path):
    """It ran with --no-warmup, so its first decode paid the cold start the engine's warm-up keeps out of the
    engine's timing; and the prompt length it encoded was never compared with the engine's."""
    from memspec_ros.bench import llamacpp_bench as lb

    args = tmp_path / "args"
    program = tmp_path / "llama-completion"
    program.write_text(f"""#!/bin/sh
echo "$@" > {args}
echo "an answer [end of text]"
echo "common_perf_print: prompt eval time =      50.00 ms /    21 tokens (    2.38 ms per token)" >&2
echo "common_perf_print:        eval time =    1000.00 ms /    99 runs   (   10.10 ms per token)" >&2
echo "common_perf_print:    sampling time =      10.00 ms /   100 runs   (    0.10 ms per token)" >&2
""")
    program.chmod(0o755)
    run = lb.run_llamacpp(tmp_path, tmp_path / "t.gguf", "a prompt", 100, 1)
    assert "--no-warmup" not in args.read_text().split()
    assert run.prompt_tokens == 21 and run.text == "an answer" and run.sampling_timed
    assert run.decode_tps == pytest.approx(99 / 1.010)
    # the first token ended the answer: "0 runs", and sampling time alone gave a rate of 0 tokens/s, in llama.cpp's
    # median only (an engine answer of one token has no decode rate)
    program.write_text("""#!/bin/sh
echo " [end of text]"
echo "common_perf_print:        eval time =       0.00 ms /     0 runs   (    0.00 ms per token)" >&2
echo "common_perf_print:    sampling time =       0.20 ms /     1 runs   (    0.20 ms per token)" >&2
""")
    assert lb.run_llamacpp(tmp_path, tmp_path / "t.gguf", "a prompt", 100, 1).decode_tps is None
