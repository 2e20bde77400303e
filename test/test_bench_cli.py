"""The benchmark commands run end to end on generated models and report lossless outputs.

Speed is NOT asserted here (timed unit tests are noise on a shared machine); the
benchmarks print ratios measured side by side, quoted in the issue notes.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from memspec_ros.bench.cli import main
from memspec_ros.testing.tiny_zoo import build_tiny_zoo


def test_engine_bench_reports_every_figure(tmp_path):
    out = tmp_path / "engine.json"
    assert main(["engine", "--zoo", "tiny", "--prompts", "2", "--runs", "1",
                 "--max-new-tokens", "12", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in ("autoregressive_tps", "hf_assisted_tps", "engine_tps", "engine_decode_tps", "target_alone_decode_tps",
                "bound_tps"):
        assert result[key] > 0, key
    # against its target alone, whole calls and decoding alone (the paper's metric, as llama.cpp's bench reports it)
    assert result["ratio_vs_target_alone"] == pytest.approx(result["engine_tps"] / result["target_alone_tps"])
    assert result["decode_ratio_vs_target_alone"] == pytest.approx(
        result["engine_decode_tps"] / result["target_alone_decode_tps"])
    # the ratios are of the figures beside them (--runs 1: each figure is its one run's)
    assert result["ratio_vs_hf"] == pytest.approx(result["engine_tps"] / result["hf_assisted_tps"])
    assert result["ratio_vs_autoregressive"] == pytest.approx(result["engine_tps"] / result["autoregressive_tps"])
    assert result["bound_fraction"] == pytest.approx(result["engine_decode_tps"] / result["bound_tps"])
    assert 0 <= result["mean_accepted"] <= result["gamma"]
    assert result["outputs_identical"] is True
    # transformers' own losslessness is reported, not asserted (its assisted generation is not ours to fix)
    same = result["hf_assisted_same_as_generate"]
    assert isinstance(same, float) and 0 <= same <= 1
    # the engine's own records, per draft token, per verify and per iteration besides: positive times whose sum
    # over the iterations (at least max_new_tokens / (gamma + 1) of them) fits in the decode time they were
    # taken from (tokens / decode tok/s)
    loop = [result[k] for k in ("loop_draft_ms", "loop_verify_ms", "loop_other_ms")]
    assert all(v > 0 for v in loop), loop
    iterations = result["max_new_tokens"] / (result["gamma"] + 1)
    assert iterations * (result["loop_verify_ms"] + result["loop_other_ms"]) <= \
        1000 * result["max_new_tokens"] / result["engine_decode_tps"]


def test_policy_bench_runs_every_policy_losslessly(tmp_path):
    zoo = build_tiny_zoo(tmp_path / "zoo", hidden=64, layers=2)
    (zoo / "workloads").mkdir()
    for workload, prompt in (("code", "def add(a, b):"), ("math", "Solve 3x + 5 = 20."), ("mixed", "Hello.")):
        (zoo / "workloads" / f"{workload}.jsonl").write_text(json.dumps({"domain": workload, "prompt": prompt}) + "\n")
    out = tmp_path / "policies.json"
    assert main(["policies", "--zoo", str(zoo), "--predictor", str(zoo / "predictor"), "--workloads",
                 "code,math,mixed", "--prompts", "1", "--max-new-tokens", "16", "--storage", "sd", "--json",
                 str(out)]) == 0
    result = json.loads(out.read_text())
    # the breakdown pools what the GMEAN does (it took `mixed` in too, unlike figure 7)
    assert result["gmean_workloads"] == ["code", "math"]
    assert all(pooled["over"] == ["code", "math"] for pooled in result["time_breakdown"].values())
    assert set(result["config"]["policies"]) == {"general-static", "oracle-static", "mab-sync", "mab-async",
                                                 "prediction-only", "oracle-dynamic", "memspec"}
    assert result["lossless"] is True
    assert all(v > 0 for v in result["gmean_tokens_per_second"].values())
    assert out.with_suffix(".png").stat().st_size > 0


def _chat_and_prompt_workloads(folder):
    """A workload folder as any user may bring one: a prompt-row file, a chat-row file, training data to skip."""
    folder.mkdir()
    (folder / "robotics.jsonl").write_text("".join(json.dumps({"domain": "robotics", "prompt": p}) + "\n"
                                                   for p in ("Plan a path around the box.", "Grip the cup.")))
    (folder / "chat.jsonl").write_text("".join(json.dumps({"domain": "chat", "messages": [
        {"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": again}]}) + "\n" for again in ("Again, louder.", "Once more.")))
    (folder / "train_requests.jsonl").write_text(json.dumps({"domain": "x", "prompt": "not a workload"}) + "\n")
    return folder


def test_policy_bench_reads_any_workload_folder_through_a_storage_tier(tmp_path, monkeypatch):
    from memspec_ros.runtime import draft_forward
    from memspec_ros.runtime.stats import BREAKDOWN
    from memspec_ros.runtime.storage import MEDIA

    # the loader builds each loaded draft's lean forward after the read: Oracle-Dynamic's load costs left it out
    build = draft_forward.LeanLlamaForward.__init__

    def slow_build(self, *args, **kwargs):
        time.sleep(0.03)
        build(self, *args, **kwargs)

    monkeypatch.setattr(draft_forward.LeanLlamaForward, "__init__", slow_build)
    # the bench's loaders check each draft against the target's width, as the controller's own loader does (the
    # bench made its loaders without it)
    from memspec_ros.bench import policy_bench

    made, real_loader = [], policy_bench.registry_loader

    def loader(registry, *args, **kwargs):
        made.append(kwargs)
        return real_loader(registry, *args, **kwargs)

    monkeypatch.setattr(policy_bench, "registry_loader", loader)

    zoo = build_tiny_zoo(tmp_path / "zoo", hidden=64, layers=2, chat=True)
    folder = _chat_and_prompt_workloads(tmp_path / "mine")
    out = tmp_path / "policies.json"
    assert main(["policies", "--zoo", str(zoo), "--predictor", str(zoo / "predictor"), "--workloads-dir", str(folder),
                 "--policies", "general-static,oracle-static,oracle-dynamic,memspec", "--prompts", "2",
                 "--max-new-tokens", "12", "--storage", "sd", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    from memspec_ros.runtime.models import read_config

    # every loader, the timed runs' and the ones timing loads: the models' draft dtype and device, the target's width
    assert made and all((m.get("dtype"), m.get("device"), m.get("target_vocab_size"))
                        == ("fp32", "cpu", read_config(zoo / "target")["vocab_size"]) for m in made), made
    assert result["config"]["workloads"] == ["chat", "robotics"]  # every <name>.jsonl, training files skipped
    assert result["config"]["workloads_dir"] == str(folder)
    # the schema the figures read is unchanged
    for key in ("gmean_tokens_per_second", "gmean_end_to_end_tokens_per_second", "ratios", "lossless"):
        assert key in result
    assert result["lossless"] is True
    # the medium, each draft's measured cold load, and its ratio to one speculative iteration
    storage = result["storage"]
    assert storage["medium"] == "sd" and storage["emulated"] is True
    assert storage["drafts"] and storage["iteration_seconds"] > 0
    for draft in storage["drafts"].values():
        assert draft["read_seconds"] >= MEDIA["sd"].min_read_seconds(draft["bytes"])  # paced: never faster
        assert draft["load_to_iteration"] == draft["load_seconds"] / storage["iteration_seconds"]
    costs = result["oracle_costs"]
    assert costs["capacity"] == 2 and costs["iteration_seconds"] > 0 and set(costs["load_seconds"]) == {
        "general", "code", "math"}
    assert min(costs["load_seconds"].values()) >= 0.03  # the whole load, as the cache's loader does it
    # the storage figures name both measurements apart: the costs' whole loads timed alone (what the plan, the
    # simulator and the storage item charge), beside the timed runs' own records (the page quoted one for the other)
    assert storage["modelled_load_seconds"] == pytest.approx(statistics.fmean(costs["load_seconds"].values()))
    assert storage["modelled_load_to_iteration"] == pytest.approx(
        storage["modelled_load_seconds"] / storage["iteration_seconds"])
    # the breakdown accounts for all decode time, in the named parts
    for rows in result["workloads"].values():
        for row in rows.values():
            parts = row["time_breakdown_seconds"]
            assert list(parts) == list(BREAKDOWN)
            assert sum(parts.values()) == pytest.approx(row["decode_seconds"], rel=1e-6, abs=1e-9)
            assert row["load_wait_seconds"] == parts["load_wait"]
    assert set(result["time_breakdown"]) == set(result["config"]["policies"])
    # pooled over the GMEAN's workloads, as the paper's figure 7 pools them (it took `mixed` in too), and says so
    for policy, pooled in result["time_breakdown"].items():
        assert pooled["over"] == result["gmean_workloads"]
        for part, seconds in pooled["seconds"].items():
            assert seconds == pytest.approx(sum(result["workloads"][w][policy]["time_breakdown_seconds"][part]
                                                for w in pooled["over"]), rel=1e-9, abs=1e-12)


def test_policy_bench_names_a_missing_workload(tmp_path):
    zoo = build_tiny_zoo(tmp_path / "zoo", hidden=64, layers=2, predictor=False)
    folder = _chat_and_prompt_workloads(tmp_path / "mine")
    with pytest.raises(SystemExit, match="law.jsonl.*chat, robotics"):
        main(["policies", "--zoo", str(zoo), "--workloads-dir", str(folder), "--workloads", "law",
              "--policies", "general-static", "--prompts", "1", "--max-new-tokens", "8"])


def test_policy_bench_refuses_a_predictor_it_cannot_find_and_a_run_with_no_policy_left(tmp_path):
    """A --predictor with no head silently dropped memspec, prediction-only and the cost-aware variant (and with
    only those asked for, raised IndexError after the oracles' traces were computed). The default looked in
    <zoo>/predictor/target-hidden only; it is <zoo>/predictor now, target-hidden first, then minilm."""
    zoo = build_tiny_zoo(tmp_path / "zoo", hidden=64, layers=2, predictor=False)
    folder = _chat_and_prompt_workloads(tmp_path / "mine")
    args = ["policies", "--zoo", str(zoo), "--workloads-dir", str(folder), "--prompts", "1", "--max-new-tokens", "8"]
    with pytest.raises(SystemExit, match="--predictor .*nowhere: no trained ranking head"):
        main([*args, "--policies", "general-static,memspec", "--predictor", str(tmp_path / "nowhere")])
    # named policies that rank, and no head in the zoo's predictor folder: refused before any load (they were
    # dropped with exit status 0 and a line at the end of the output when others were named beside them)
    with pytest.raises(SystemExit, match=r"zoo/predictor: no trained ranking head there .* which memspec ranking"):
        main([*args, "--policies", "general-static,memspec"])
    # the default list too: MemSpec's ratios were simply absent from a run that exited 0
    with pytest.raises(SystemExit, match=r"no trained ranking head .* prediction-only, memspec.*--policies without"):
        main(args)


def test_engine_bench_takes_a_workload_folder_and_reports_the_draft_load(tmp_path):
    zoo = build_tiny_zoo(tmp_path / "zoo", hidden=64, layers=2, predictor=False, chat=True)
    folder = _chat_and_prompt_workloads(tmp_path / "mine")
    out = tmp_path / "engine.json"
    assert main(["engine", "--zoo", str(zoo), "--workloads-dir", str(folder), "--prompts", "3", "--runs", "1",
                 "--max-new-tokens", "8", "--storage", "nvme", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["prompts"] == 3 and result["outputs_identical"] is True
    assert result["storage"]["medium"] == "nvme" and result["storage"]["drafts"]["general"]["loads"] == 1
    assert result["context_lookup"] is False and result["bound_fraction"] > 0
    # with copies from the context beside the draft: still the target's own output, and no draft-cost bound
    assert main(["engine", "--zoo", str(zoo), "--workloads-dir", str(folder), "--prompts", "3", "--runs", "1",
                 "--max-new-tokens", "24", "--context-lookup", "--adaptive-gamma", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["context_lookup"] is True and result["outputs_identical"] is True
    assert result["bound_tps"] is None and result["bound_fraction"] is None


def test_time_breakdown_and_totals_follow_their_definitions():
    """stats.py: the breakdown's parts by hand, and a workload's rate is its sums' (not a mean of rates)."""
    from memspec_ros.runtime.stats import GenerationStats, GenerationTotals, IterationStats

    def it(draft, fallback=False, **kw):
        return IterationStats(draft=draft, proposed=4, accepted=2, committed=3, preferred="a", fallback=fallback, **kw)

    s = GenerationStats(completion_tokens=10, prefill_seconds=0.5, setup_seconds=0.25, decode_seconds=2.0, iterations=[
        it("a", draft_seconds=0.1, verify_seconds=0.3, catchup_seconds=0.05, catchup_tokens=9),
        it("b", fallback=True, draft_seconds=0.2, verify_seconds=0.3, prediction_seconds=0.1),
        it("a", draft_seconds=0.1, verify_seconds=0.3, load_wait_seconds=0.4),
    ])
    parts = s.time_breakdown()
    assert parts == pytest.approx({"desired_draft": 0.2, "fallback_draft": 0.2, "prediction": 0.1, "load_wait": 0.4,
                                   "catchup": 0.05, "verify": 0.9, "other": 0.15})
    assert s.tokens_per_second == 9 / 2.0 and s.end_to_end_tokens_per_second == 10 / 2.75
    fast = GenerationStats(completion_tokens=4, decode_seconds=0.1, iterations=[it("a", draft_seconds=0.01,
                                                                                   verify_seconds=0.02)])
    totals = GenerationTotals()
    totals.add(s)
    totals.add(fast)
    assert totals.tokens_per_second == (9 + 3) / (2.0 + 0.1)
    assert totals.mean_iteration_seconds == pytest.approx((0.4 + 0.5 + 0.4 + 0.03) / 4)
    assert sum(totals.breakdown.values()) == pytest.approx(2.1)


def test_a_policy_rows_shares_are_pooled_over_its_prompts_as_the_figures_pool_them():
    """One generation with a single drafted iteration that fell back, one with thirty preferred iterations of
    three accepted tokens: pooled, 1 fallback in 31 and E[A] 90/31 (a mean of per-generation shares said 0.5 and
    1.5, beside the figures' pooled 0.032 and 2.90 for the same runs)."""
    from memspec_ros.bench.figures import policy_summary
    from memspec_ros.bench.policy_bench import PolicyRow
    from memspec_ros.runtime.stats import GenerationStats, IterationStats

    def it(fallback, accepted):
        return IterationStats(draft="b" if fallback else "a", proposed=4, accepted=accepted, committed=accepted + 1,
                              draft_seconds=0.001, verify_seconds=0.01, preferred="a", fallback=fallback,
                              prediction_seconds=0.002 if fallback else 0.0)

    short = GenerationStats(completion_tokens=2, decode_seconds=0.02, iterations=[it(True, 0)])
    long = GenerationStats(completion_tokens=121, decode_seconds=0.4, iterations=[it(False, 3) for _ in range(30)])
    row = PolicyRow()
    for stats in (short, long):
        row.totals.add(stats)
    summary = row.summary()
    assert summary["fallback_fraction"] == pytest.approx(1 / 31)
    assert summary["mean_accepted"] == pytest.approx(90 / 31)
    assert summary["prediction_overhead"] == pytest.approx(0.002 / 0.42)
    pooled = policy_summary([("p", "w", (), short), ("p", "w", (), long)], "p", ["w"])
    assert pooled["fallback_fraction_of_iterations"] == summary["fallback_fraction"]
    assert pooled["mean_accepted"] == summary["mean_accepted"]
    # nothing drafted or decoded (every load failed, the target alone ran): no share, in the JSON as in the goals
    alone = PolicyRow()
    alone.totals.add(GenerationStats(completion_tokens=1, decode_seconds=0.0, iterations=[]))
    assert alone.summary()["fallback_fraction"] is None and alone.summary()["prediction_overhead"] is None
    empty = policy_summary([("p", "w", (), GenerationStats(completion_tokens=1))], "p", ["w"])
    assert empty["fallback_fraction_of_iterations"] is None and empty["prediction_share_of_decode"] is None


def test_zoo_acceptance_workload_rows_come_from_any_folder(tmp_path):
    from memspec_ros.zoo.chat_acceptance import answers_cache_dir, workload_rows

    rows = workload_rows(_chat_and_prompt_workloads(tmp_path / "mine"), per_workload=1)
    assert list(rows) == ["chat", "robotics"]  # one workload per file, training files skipped
    assert rows["robotics"] == [{"domain": "robotics", "prompt": "Plan a path around the box.",
                                 "messages": [{"role": "user", "content": "Plan a path around the box."}]}]
    assert rows["chat"][0]["domain"] == "chat" and rows["chat"][0]["messages"][-1]["content"] == "Again, louder."
    # answers are kept per content, budget and target: another folder or budget never reuses them
    assert answers_cache_dir(rows, 16, "t") == answers_cache_dir(rows, 16, "t")
    assert len({answers_cache_dir(rows, 16, "t"), answers_cache_dir(rows, 32, "t"), answers_cache_dir(rows, 16, "u"),
                answers_cache_dir({"chat": rows["chat"]}, 16, "t")}) == 4


BUNDLED = Path(__file__).resolve().parents[1] / "models"


@pytest.mark.skipif(not (BUNDLED / "registry.yaml").is_file(), reason="the bundled zoo is not built")
def test_zoo_acceptance_measures_the_bundled_drafts_on_a_workload_folder(tmp_path):
    from memspec_ros.zoo.cli import main as zoo_main

    folder = _chat_and_prompt_workloads(tmp_path / "mine")
    (folder / "mixed.jsonl").write_text(json.dumps({"domain": "mixed", "prompt": "Add 2 and 3 in Python."}) + "\n")
    out = tmp_path / "acceptance.json"
    assert zoo_main(["acceptance", "--json", str(out), "--plot", str(tmp_path / "m.png"), "--models", str(BUNDLED),
                     "--workloads-dir", str(folder), "--answers", str(tmp_path / "answers"),
                     "--prompts-per-workload", "1", "--max-new-tokens", "12", "--threads", "1"]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["workloads"] == ["chat", "mixed", "robotics"]
    assert set(result["matrix"]["general"]) == {"chat", "mixed", "robotics"}
    assert set(result["oracle_static_gain_by_workload"]) == {"chat", "robotics"}  # every workload but mixed
    assert result["oracle_dynamic_mixed"] is not None
    assert (tmp_path / "m.png").stat().st_size > 0


def test_the_engine_bound_counts_each_generations_own_forwards():
    """The analytic bound's time for a generation: a verify per full iteration, a one-token forward per shorter
    one (the end of the answer, a plain step), a draft forward per proposal, at that prompt's forward times."""
    from memspec_ros.bench.engine_bench import _bound_seconds
    from memspec_ros.runtime.stats import GenerationStats, IterationStats

    stats = GenerationStats()
    for proposed in (4, 4, 2, 0):
        stats.iterations.append(IterationStats(draft="d" if proposed else "", proposed=proposed, accepted=0,
                                               committed=1, draft_seconds=0.0, verify_seconds=0.0))
    assert _bound_seconds(stats, 4, draft_ms=0.5, verify_ms=10.0, one_ms=6.0) == pytest.approx(
        (2 * 10.0 + 2 * 6.0 + 10 * 0.5) / 1000)


@pytest.mark.parametrize("argv", [["engine", "--runs", "0"], ["policies", "--prompts", "-1"],
                                  ["llamacpp", "--max-new-tokens", "0"], ["soak", "--goals", "0"],
                                  ["paper", "--threads", "0"]])
def test_counts_below_one_are_refused_before_anything_runs(argv, capsys):
    """Zero runs or prompts ran nothing and then failed on an empty median: argparse refuses them with the reason."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "is not a positive integer" in capsys.readouterr().err


def test_round_robin_prompts_skip_a_file_that_repeats_anothers_rows(tmp_path):
    from memspec_ros.bench.cli import _round_robin_rows, _unique_prompt_ids

    class Chars:  # a tokenizer of characters, no chat template: the prompt's text is its ids
        chat_template = None

        def __call__(self, text, **_):
            return {"input_ids": [ord(c) for c in text]}

    rows = {"a": ["a0", "a1", "a2"], "b": ["b0", "b1"]}
    for name, prompts in rows.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"domain": name, "prompt": p}) + "\n"
                                                        for p in prompts))
    (tmp_path / "all.jsonl").write_text((tmp_path / "a.jsonl").read_text() + (tmp_path / "b.jsonl").read_text())
    got = ["".join(map(chr, ids)) for ids in _unique_prompt_ids(Chars(), _round_robin_rows(tmp_path, 5), 5)]
    assert got == ["a0", "b0", "a1", "b1", "a2"]


def test_the_papers_evaluation_reads_a_workload_folder(tmp_path, monkeypatch):
    """memspec-bench paper --workloads-dir: the real runs take that folder's workloads (every <name>.jsonl), as
    policies does; a folder that is not there is refused before anything runs."""
    from memspec_ros.bench import figures

    zoo = build_tiny_zoo(tmp_path / "zoo", hidden=64, layers=2, chat=True)
    folder = _chat_and_prompt_workloads(tmp_path / "mine")
    with pytest.raises(SystemExit, match="is not a directory"):
        main(["paper", "--zoo", str(zoo), "--workloads-dir", str(tmp_path / "none")])
    seen = {}

    def fake_run_paper(zoo_dir, out, **kwargs):
        seen.update(kwargs)
        raise ValueError("stopped here")

    monkeypatch.setattr(figures, "run_paper", fake_run_paper)
    with pytest.raises(SystemExit, match="stopped here"):
        main(["paper", "--zoo", str(zoo), "--workloads-dir", str(folder), "--out", str(tmp_path / "out")])
    assert seen["workloads_dir"] == folder and seen["workloads"] == ["chat", "robotics"]


def test_the_action_and_soak_benches_send_held_out_requests_only():
    """action_bench.domain_prompts skipped only a file named train_prompts, so the bundled zoo's
    train_requests.jsonl sent training requests (2 of the first 12 prompts) as if held out."""
    from memspec_ros.bench.action_bench import domain_prompts

    folder = Path(__file__).resolve().parents[1] / "models" / "workloads"
    held_out = {json.loads(line)["prompt"] for name in ("code", "math", "law", "medical", "general")
                for line in (folder / f"{name}.jsonl").read_text().splitlines()}
    prompts = domain_prompts(folder, 30)
    assert len(prompts) == 30 and set(prompts) <= held_out


def test_the_engine_bench_pools_e_a_over_every_iteration(tmp_path, monkeypatch):
    """E[A] is accepted tokens over all speculative iterations of the bench's generations (stats.py's
    GenerationTotals), as the policies bench and the figures count it, not a mean of per-prompt means: a short
    generation weighed as much as a long one."""
    from memspec_ros.bench import engine_bench
    from memspec_ros.runtime.stats import GenerationTotals

    seen, lengths = [], []
    real = engine_bench.generate

    def recording(target, ids, draft=None, **kw):
        session = real(target, ids, draft, **kw)
        if draft is not None and kw.get("max_new_tokens") != 8:  # the bench's runs, not its warm-up
            seen.append(session.stats)
            lengths.append(len(session.generated_ids))
        return session

    monkeypatch.setattr(engine_bench, "generate", recording)
    out = tmp_path / "engine.json"
    assert main(["engine", "--zoo", "tiny", "--prompts", "3", "--runs", "1",
                 "--max-new-tokens", "24", "--json", str(out)]) == 0
    pooled = GenerationTotals()
    for stats in seen:
        pooled.add(stats)
    per_prompt = sum(s.mean_accepted for s in seen) / len(seen)
    assert len(seen) == 3 and pooled.mean_accepted != pytest.approx(per_prompt)  # the case tells them apart
    data = json.loads(out.read_text())
    assert data["mean_accepted"] == pytest.approx(pooled.mean_accepted)
    # each method's token count is recorded beside its rate (lossless: the engine's equals the target alone's)
    assert data["generated_tokens"]["engine"] == sum(lengths) == data["generated_tokens"]["target_alone"]
    assert set(data["generated_tokens"]) == set(data["per_run"])


def test_every_engine_bench_method_is_warmed_up_before_its_timed_calls(monkeypatch, tmp_path):
    """Only the engine and transformers' assisted generation were warmed up: the target alone (the 1.6x goal's
    denominator) and transformers' generate paid their first call's allocations inside the timed loop."""
    from memspec_ros.bench import engine_bench

    calls = []
    real_generate, real_hf = engine_bench.generate, engine_bench._hf_generate

    def generate(target, ids, draft=None, **kw):
        calls.append(("engine" if draft is not None else "target_alone", kw.get("max_new_tokens")))
        return real_generate(target, ids, draft, **kw)

    def hf(target, assistant, ids, max_new_tokens, *a):
        calls.append(("hf_assisted" if assistant is not None else "autoregressive", max_new_tokens))
        return real_hf(target, assistant, ids, max_new_tokens, *a)

    monkeypatch.setattr(engine_bench, "generate", generate)
    monkeypatch.setattr(engine_bench, "_hf_generate", hf)
    assert main(["engine", "--zoo", "tiny", "--prompts", "2", "--runs", "1", "--max-new-tokens", "12",
                 "--json", str(tmp_path / "engine.json")]) == 0
    timed = [i for i, (_, n) in enumerate(calls) if n == 12]
    warmed = {method for method, n in calls[: timed[0]] if n == 8}
    assert warmed == {method for method, _ in calls}, calls[: timed[0]]


def test_table2_reads_the_report_of_the_predictor_the_runs_used(tmp_path):
    """`memspec-bench paper --predictor DIR`: Table 2 read <zoo>/predictor/report.json whatever DIR was."""
    import shutil

    from memspec_ros.bench.figures import predictor_report, table2

    mine = tmp_path / "mine"
    shutil.copytree(Path(__file__).resolve().parents[1] / "models" / "predictor", mine)
    report = json.loads((mine / "report.json").read_text())
    report["majority_top1"] = 0.123
    (mine / "report.json").write_text(json.dumps(report))
    for given in (mine, mine / "target-hidden"):
        assert predictor_report(given) == mine / "report.json"
        assert table2(predictor_report(given))["majority_top1"] == 0.123


def test_table2_shows_the_score_after_an_earlier_turn_where_the_report_has_it(tmp_path):
    from memspec_ros.bench.figures import _summary_line, table2

    report = {"encoders": {"minilm": {"prompt": {"top1": 0.5, "top2": 0.75, "contexts": 8}}},
              "label_horizon_intervals": 0, "prompt_tokens": 16,
              "conversations": {"trained_on": True, "encoders": {"minilm": {"prompt": {"top1": 0.25, "top2": 0.5,
                                                                                      "contexts": 8}}}}}
    (tmp_path / "report.json").write_text(json.dumps(report))
    lines = _summary_line("table2", table2(tmp_path / "report.json"))
    assert "| minilm | prompt | 50.0% | 75.0% | 25.0% | 50.0% |" in lines
    assert "the prompt's last 16 positions" in lines[0] and "trained on such conversations too" in lines[0]
    del report["conversations"], report["prompt_tokens"]  # a report from before either
    (tmp_path / "report.json").write_text(json.dumps(report))
    lines = _summary_line("table2", table2(tmp_path / "report.json"))
    assert "| minilm | prompt | 50.0% | 75.0% | n/a | n/a |" in lines and "the whole prompt" in lines[0]


def test_the_engine_bench_refuses_a_datastore_of_another_tokenizer_or_without_lookup(tmp_path):
    """`memspec-bench engine --datastore`: read with no tokenizer check (the llamacpp bench had one), and taken
    then ignored without --context-lookup."""
    from memspec_ros.runtime.datastore import Datastore

    zoo = build_tiny_zoo(tmp_path / "zoo", hidden=64, layers=2, predictor=False, chat=True)
    store = tmp_path / "other.safetensors"
    Datastore([[5, 6, 7, 8]], fingerprint="another tokenizer").save(store)
    common = ["engine", "--zoo", str(zoo), "--prompts", "1", "--runs", "1", "--max-new-tokens", "4",
              "--datastore", str(store)]
    with pytest.raises(SystemExit, match="add --context-lookup"):
        main(common)
    assert main(common[:-1] + ["none", "--json", str(tmp_path / "e.json")]) == 0  # 'none' asks for no datastore
    with pytest.raises(SystemExit, match="another tokenizer"):
        main(common + ["--context-lookup"])


@pytest.mark.parametrize("argv", [["--prompts", "0"], ["--prompts", "-3"], ["--interval", "0"],
                                  ["--capacity", "100"], ["--interval", "100000"],
                                  ["--predictor", "/nonexistent/predictor"], ["--threads", "-5"],
                                  ["--registry", "/nonexistent/registry.yaml", "--untrained"],
                                  ["--workload", "/nonexistent/w.jsonl", "--untrained"],
                                  ["--prompt-tokens", "8"],  # trained heads pool what they were trained with
                                  ["--json", f"{__file__}/o.json", "--untrained"]])  # under a file: never made
def test_the_prediction_overhead_bench_refuses_bad_counts_and_a_missing_predictor(argv, capsys):
    """--prompts 0 ran every row (read_prompts' 0 is 'all'), -3 all but three; a mistyped --predictor fell back
    to random heads and reported their E[A] and fallback as the trained predictor's."""
    from memspec_ros.bench.prediction_overhead import main as overhead

    with pytest.raises(SystemExit) as exc:
        overhead(argv)
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_the_soak_is_not_ok_when_a_burst_takes_more_or_fewer_goals_than_the_queue_holds():
    """The burst phase's point is the queue's bound: _figures judged the run without it (only the CI-size test
    asserted it, so a --long run passed with a broken bound)."""
    from collections import Counter

    from memspec_ros.bench.soak_bench import InvariantMonitor, _figures

    def figures(bursts, terminal=None):
        done = {"sent": 10, "accepted": 10, "rejected": 0, "terminal": terminal or {"succeeded": 10}, "lost": 0,
                "unanswered": 0, "bursts_accepted": bursts, "accept_latencies": [0.001], "phase_latencies": {},
                "seconds": 1.0}
        return _figures(done, InvariantMonitor(2, 100), 100, [0.001], 100, 100, [100], Counter(a=1), Counter(a=1), 4)

    assert figures([4, 4])["ok"] is True
    assert figures([4, 5])["ok"] is False and figures([3, 4])["ok"] is False
    # a goal ABORTED (a draft that failed under the budget, an error) is not lost, but the run did not pass
    assert figures([4, 4], {"succeeded": 9, "aborted": 1})["ok"] is False


def test_every_timed_policy_run_starts_with_no_load_in_flight(tmp_path, monkeypatch):
    """The paper's protocol resets the cache per generation. Left to generate(), that reset waited for the run
    before's prefetch still in flight, inside the next policy's end-to-end time (the controller counts from its
    entry): the bench resets outside the timing, so each run starts with no load in flight."""
    import threading

    from memspec_ros.runtime.controller import RuntimeController
    from memspec_ros.runtime.storage import DraftStorage

    zoo = build_tiny_zoo(tmp_path / "zoo", hidden=64, layers=2)
    (zoo / "workloads").mkdir()
    (zoo / "workloads" / "code.jsonl").write_text(json.dumps({"domain": "code", "prompt": "def add(a, b):"}) + "\n")
    in_flight = []
    real = RuntimeController.generate
    load = DraftStorage.load
    run_over = threading.Event()  # set once a run's end was recorded (and before any run)
    run_over.set()
    first_load = threading.Event()  # set at a run's start: its first load is the cold cache's blocking one

    def slow_load(self, *args, **kwargs):
        # a slow medium: every prefetch lasts until its run has ended (whatever this machine's speed), so
        # MemSpec's last prefetches outlive its run; the blocking first load of a run does not wait for that
        if first_load.is_set():
            first_load.clear()
        else:
            run_over.wait(30)
        return load(self, *args, **kwargs)

    monkeypatch.setattr(DraftStorage, "load", slow_load)

    after = []

    def generate(self, *args, **kwargs):
        in_flight.append(self.cache.loading())
        run_over.clear()
        first_load.set()
        try:
            return real(self, *args, **kwargs)
        finally:
            after.append(self.cache.loading())
            run_over.set()

    monkeypatch.setattr(RuntimeController, "generate", generate)
    assert main(["policies", "--zoo", str(zoo), "--predictor", str(zoo / "predictor"), "--workloads", "code",
                 "--policies", "memspec,general-static", "--prompts", "1", "--runs", "2", "--max-new-tokens", "16",
                 "--storage", "sd", "--no-simulator", "--json", str(tmp_path / "p.json")]) == 0
    assert len(in_flight) >= 4 and not any(in_flight)
    assert any(after)  # a load outlived its run: the bench's reset is what cleared it


def test_the_committed_results_page_rerenders(tmp_path):
    """`memspec-bench paper --render-only` on results from before the held-out gate (no 'gate' key) raised
    KeyError: such a run's validation is shown as what it was judged on, speed-matched."""
    import shutil

    from memspec_ros.bench.figures import rerender

    out = tmp_path / "results"
    shutil.copytree(Path(__file__).resolve().parents[1] / "docs" / "results", out)
    validation = json.loads((out / "policies.json").read_text())["simulator_validation"]
    validation.pop("gate", None)
    data = json.loads((out / "policies.json").read_text())
    data["simulator_validation"] = validation
    (out / "policies.json").write_text(json.dumps(data))
    rerender(out)
    assert "Gate (speed-matched (a run from before the held-out gate))" in (out / "README.md").read_text()


def test_the_gmean_is_over_every_workload_but_mixed():
    """Picking the paper's five names out of a folder judged `code, kitchen, navigation` on code alone, and a
    folder without those names put `mixed` into the GMEAN."""
    from memspec_ros.bench.policy_bench import domain_workloads

    assert domain_workloads(["code", "kitchen", "navigation"]) == ["code", "kitchen", "navigation"]
    assert domain_workloads(["kitchen", "navigation", "mixed"]) == ["kitchen", "navigation"]
    assert domain_workloads(["code", "math", "law", "medical", "general", "mixed"]) == [
        "code", "math", "law", "medical", "general"]
    assert domain_workloads(["mixed"]) == ["mixed"]


def test_a_step_without_a_proposal_is_target_only_time_even_when_flagged_fallback():
    """Nothing resident (or a failed draft) gives a target-only step with the fallback flag: figures 7 and 9 drew
    its verify as fallback execution while the fallback share beside them left it out."""
    from memspec_ros.runtime.stats import GenerationStats, IterationStats

    stats = GenerationStats(decode_seconds=1.0)
    stats.iterations = [
        IterationStats(draft="a", proposed=4, accepted=2, committed=3, draft_seconds=0.1, verify_seconds=0.2,
                       preferred="a"),
        IterationStats(draft="", proposed=0, accepted=0, committed=1, draft_seconds=0.0, verify_seconds=0.3,
                       preferred="b", fallback=True),
    ]
    parts = stats.execution_parts()
    assert parts["fallback"] == 0.0 and parts["target_only"] == pytest.approx(0.3)
    assert parts["desired"] == pytest.approx(0.3) and stats.fallback_fraction == 0.0


def test_a_ratio_over_a_zero_rate_passes_no_goal_and_a_gmean_covers_every_workload():
    """A zero MAB-Async rate on one workload made the worst-workload ratio inf ("met"), a zero GMEAN raised after
    every run, and `normalized` averaged a policy over the workloads where the base was not zero."""
    from memspec_ros.bench.figures import normalized
    from memspec_ros.runtime.stats import ratio

    assert ratio(1.0, 0.0) is None and ratio(3.0, 2.0) == 1.5
    table = {"code": {"general-static": {"tps": 0.0}, "memspec": {"tps": 5.0}},
             "math": {"general-static": {"tps": 10.0}, "memspec": {"tps": 5.0}}}
    out = normalized(table, ["general-static", "memspec"], ["code", "math"], "tps")
    assert out["math"]["memspec"] == 0.5 and out["GMEAN"]["memspec"] == 0.0  # was 0.5, over math alone


def test_every_bench_divides_by_a_zero_rate_the_same_way():
    """The benches divided in three ways: the action bench wrote NaN (invalid JSON for other tools), the engine
    bench and the llama.cpp bench raised ZeroDivisionError after every run, the figures gave None. All use
    stats.ratio now: a rate of 0 as the base gives null, and a run without one is left out of a per-run median."""
    from memspec_ros.bench.llamacpp_bench import _Tally
    from memspec_ros.runtime.stats import paired_ratio, rounded

    assert paired_ratio([10.0, 20.0, 30.0], [0.0, 10.0, 10.0]) == pytest.approx(2.5)  # the first run has no ratio
    assert paired_ratio([1.0], [0.0]) is None and rounded(None) is None and rounded(2 / 3, 2) == 0.67
    engine, llama = _Tally(rates={(0, 0): 10.0, (0, 1): 12.0}), _Tally(rates={(0, 0): 0.0, (0, 1): 0.0})
    assert engine.vs(llama) is None
    json.dumps(engine.vs(llama), allow_nan=False)  # null, never NaN


def test_goals_after_a_workload_where_every_policy_committed_nothing():
    """A workload whose prompts all ended at their first token leaves every rate 0 there, so every GMEAN 0: the
    cost-aware, headroom and replay ratios divided by it and raised ZeroDivisionError after every real run, and no
    figure file was written. They are n/a, as the goal rows already were."""

    from memspec_ros.bench.figures import CA, GS, MAB, MS, OD, OS, _x, goals

    policies = [GS, OS, OD, MAB, MS, CA]
    rates = {"code": 0.0, "math": 7.0}
    table = {w: {p: {"tokens_per_second": r, "end_to_end_tokens_per_second": r} for p in policies}
             for w, r in rates.items()}
    sim = {p: {"workloads": {w: {"simulated_tokens_per_second": r, "simulated_end_to_end": r}
                             for w, r in rates.items()}} for p in policies}
    bench = SimpleNamespace(result={"workloads": table, "config": {"policies": policies}, "storage": {},
                                    "simulator_validation": {"pooled": {"policies": sim}}}, runs=[])
    out = goals(bench, {"gmean_over": list(rates)})
    assert out["headroom"]["oracle_dynamic_vs_general_static"] is None
    assert set(out["cost_aware"].values()) == {None}  # the ratios n/a, and the shares of no time
    # "at most" goals on nothing drafted or decoded: their 0.0 was "met"
    shares = {row["goal"]: row for row in out["rows"] if "fallback" in row["goal"] or "overhead" in row["goal"]}
    assert len(shares) == 2 and all(row["measured"] is None and not row["met"] for row in shares.values()), shares
    assert set(out["noise_free_replay"].values()) == {None}
    assert not any(row["met"] for row in out["rows"] if row["measured"] is None)
    assert _x(None) == "n/a (a zero baseline)" and _x(1.25) == "1.250"


def test_the_worst_workload_goal_is_above_mab_async_and_the_page_says_so():
    """"Above MAB-Async on every workload" was checked against 1 + 1e-9 and printed as ">= 1.000": a tie is not met,
    and the row says ">"."""
    from memspec_ros.bench.figures import CA, GS, MAB, MS, OD, OS, goals

    policies = [GS, OS, OD, MAB, MS, CA]
    table = {w: {p: {"tokens_per_second": 7.0, "end_to_end_tokens_per_second": 7.0} for p in policies}
             for w in ("code", "math")}
    sim = {p: {"workloads": {w: {"simulated_tokens_per_second": 7.0, "simulated_end_to_end": 7.0}
                             for w in table}} for p in policies}
    bench = SimpleNamespace(result={"workloads": table, "config": {"policies": policies}, "storage": {},
                                    "simulator_validation": {"pooled": {"policies": sim}}}, runs=[])
    [worst] = [r for r in goals(bench, {"gmean_over": ["code", "math"]})["rows"] if "worst" in r["goal"]]
    assert worst["measured"] == 1.0 and worst["target"] == 1.0 and worst["compare"] == ">" and not worst["met"]
    table["math"][MS]["tokens_per_second"] = 7.7
    table["code"][MS]["tokens_per_second"] = 7.0 * (1 + 1e-12)  # above by a hair: met, as "above" says
    [worst] = [r for r in goals(bench, {"gmean_over": ["code", "math"]})["rows"] if "worst" in r["goal"]]
    assert worst["met"]


@pytest.mark.parametrize("option, value, says", [("--workloads", "code,code,math", "names code more than once"),
                                                 ("--workloads", "code,,math", "an empty name"),
                                                 ("--policies", "memspec,memspec", "names memspec more than once")])
def test_a_name_given_twice_is_refused_before_anything_runs(tmp_path, option, value, says):
    """`--workloads code,code,math` ran every code prompt twice per round and weighed code double in every GMEAN;
    `--policies memspec,memspec` ran MemSpec twice per prompt."""
    (tmp_path / "registry.yaml").write_text("")
    with pytest.raises(SystemExit, match=says):
        main(["policies", "--zoo", str(tmp_path), option, value])


def test_render_only_refuses_the_options_it_would_ignore(tmp_path):
    """`paper --render-only --prompts 8 --storage sd` re-rendered the old page and exited 0, as if it had run."""
    from memspec_ros.bench.cli import main

    with pytest.raises(SystemExit, match=r"--render-only: --prompts, --storage have no effect"):
        main(["paper", "--render-only", "--out", str(tmp_path), "--prompts", "8", "--storage", "sd"])
    assert list(tmp_path.iterdir()) == []


def test_render_only_without_a_run_there_says_what_to_do(tmp_path):
    with pytest.raises(SystemExit, match="no paper.json or policies.json.*run it first"):
        main(["paper", "--render-only", "--out", str(tmp_path)])


def test_the_paper_run_publishes_all_of_its_results_or_none(tmp_path, monkeypatch):
    """policies.json was written as soon as the real runs ended and the items only at the very end: a failure or
    Ctrl-C in between left the new real runs beside the old figures, and --render-only showed the two on one page.
    The run writes into a folder beside the results, moved in once everything is made; stopped, the results are
    unchanged and what was made is kept where the log says."""
    import shutil

    from memspec_ros.bench import figures

    committed = Path(__file__).resolve().parents[1] / "docs" / "results"
    zoo = tmp_path / "zoo"
    (zoo / "predictor" / "target-hidden").mkdir(parents=True)
    shutil.copy(committed.parent.parent / "models" / "predictor" / "target-hidden" / "predictor.json",
                zoo / "predictor" / "target-hidden")
    out = tmp_path / "results"
    shutil.copytree(committed, out)
    before = {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()}
    logged = []

    def stopped(zoo_dir, stage, t0, **kwargs):
        (stage / "policies.json").write_text("{}")  # the real runs' result, then a failure
        raise KeyboardInterrupt

    monkeypatch.setattr(figures, "_evaluate", stopped)
    with pytest.raises(KeyboardInterrupt):
        figures.run_paper(zoo, out, log=logged.append)
    assert {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()} == before
    [stage] = [f for f in out.iterdir() if f.name.startswith(".paper-run-")]
    assert (stage / "policies.json").read_text() == "{}"
    assert f"{out} is unchanged" in logged[-1] and str(stage) in logged[-1]
    shutil.rmtree(stage)

    def finished(zoo_dir, stage, t0, **kwargs):  # every file a run makes (the committed ones, here)
        index = json.loads((committed / "paper.json").read_text())
        for name in ["paper", "policies", *index["items"]]:
            shutil.copy(committed / f"{name}.json", stage)
        index["wall_seconds"] = 12345.0
        (stage / "paper.json").write_text(json.dumps(index))
        items = {name: json.loads((committed / f"{name}.json").read_text()) for name in index["items"]}
        return index, items, json.loads((committed / "policies.json").read_text())

    monkeypatch.setattr(figures, "_evaluate", finished)
    assert figures.run_paper(zoo, out, log=logged.append)["wall_seconds"] == 12345.0
    assert json.loads((out / "paper.json").read_text())["wall_seconds"] == 12345.0
    assert not [f for f in out.iterdir() if f.name.startswith(".paper-run-")]
    assert "Generated by `memspec-bench paper` in 205.8 min" in (out / "README.md").read_text()


@pytest.mark.parametrize("within, lossless, code", [(True, True, 0), (False, True, 1), (True, False, 1)])
def test_the_paper_run_fails_when_the_simulator_is_outside_its_tolerance(tmp_path, monkeypatch, capsys, within,
                                                                          lossless, code):
    """The sweeps and storage figures come from the simulator alone, published "as far as validation holds": a
    run whose held-out validation failed still exited 0, its only sign a word in the README."""
    from memspec_ros.bench import figures

    zoo = build_tiny_zoo(tmp_path / "zoo", hidden=64, layers=2, chat=True)
    folder = _chat_and_prompt_workloads(tmp_path / "mine")
    index = {"items": ["fig6"], "wall_seconds": 60.0, "lossless": lossless,
             "validation": {"within_tolerance": within, "kind": "held out", "max_abs_error_end_to_end": 0.2}}
    monkeypatch.setattr(figures, "run_paper", lambda *args, **kwargs: index)
    assert main(["paper", "--zoo", str(zoo), "--workloads-dir", str(folder), "--out", str(tmp_path / "o")]) == code
    assert ("simulator is outside its tolerance" in capsys.readouterr().err) == (not within)


def test_the_engine_benchs_bound_fraction_and_loop_verify_are_like_for_like():
    """bound_fraction divided the median decode rate by the median bound, of different runs; the loop's verify time
    was averaged over every iteration (one-row target steps, short adaptive verifies) beside the isolated time of a
    gamma + 1 row verify."""
    from memspec_ros.bench.engine_bench import _LoopTimes, bound_fraction
    from memspec_ros.runtime.stats import GenerationStats, IterationStats, paired_ratio

    # runs (decode, bound): (100, 110), (90, 120), (95, 100): per run 0.91, 0.75, 0.95; the medians' ratio 0.86
    assert bound_fraction([100.0, 90.0, 95.0], [110.0, 120.0, 100.0]) == pytest.approx(100 / 110)
    # the engine's ratios to its baselines likewise (they divided the medians): per run 2, 2.5, 0.75; medians' 2.5
    assert paired_ratio([10.0, 20.0, 30.0], [5.0, 8.0, 40.0]) == pytest.approx(2.0)
    its = [IterationStats("d", 4, 2, 3, 0.001, 0.010), IterationStats("d", 4, 4, 5, 0.001, 0.010),
           IterationStats("", 0, 0, 1, 0.0, 0.002), IterationStats("d", 1, 1, 2, 0.001, 0.004)]
    loop = _LoopTimes(4)
    loop.add(GenerationStats(completion_tokens=11, decode_seconds=0.05, iterations=its))
    assert loop.verify_ms == pytest.approx(10.0) and loop.iterations == 4


def test_measured_latency_per_generation_is_averaged_as_the_simulated_one():
    """The measured end-to-end seconds per generation beside the simulated ones pooled every run, where the
    simulated figures average per-workload means: with workloads of unequal prompt counts the two disagreed."""

    from memspec_ros.bench.figures import measured_seconds_per_generation

    def run(workload, seconds):
        return ("memspec", workload, (1,), SimpleNamespace(end_to_end_seconds=seconds))

    runs = [run("code", 1.0), run("code", 1.0), run("code", 1.0), run("math", 4.0), run("law", 9.0)]
    # the GMEAN of the workloads' means (1 and 4), as the simulated rows and the item's gmean_over say: not the pooled
    # mean (1.75), nor the arithmetic mean of the means (2.5) the item once labelled a GMEAN
    assert measured_seconds_per_generation(runs, ["code", "math"], ["memspec"]) == {"memspec": pytest.approx(2.0)}


def test_the_unseen_comparison_survives_a_zero_rate_and_takes_any_workload_folder():
    """scripts/compare_unseen.py: its own GMEAN raised on a zero rate (math.log(0)), and it judged only the five
    domains' names, so a run on other workloads compared nothing."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "compare_unseen.py"
    spec = importlib.util.spec_from_file_location("compare_unseen", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    policies = ["general-static", "mab-async", "oracle-dynamic", "memspec"]
    rates = {"kitchen": 10.0, "navigation": 0.0, "mixed": 5.0}
    table = {w: {p: {"tokens_per_second": r, "end_to_end_tokens_per_second": r, "fallback_fraction": 0.1}
                 for p in policies} for w, r in rates.items()}
    out = module.summary({"workloads": table, "config": {"policies": policies, "prompts": 2}})
    assert out["domains"] == ["kitchen", "navigation"] and out["tps"]["memspec"] == 0.0
    assert out["ratios"]["MemSpec / General-Static (paper's metric)"] is None
    assert out["ratios"]["MemSpec / MAB-Async on the worst workload"] is None


def test_a_sweep_leaves_out_the_settings_the_controller_refuses_with_its_predictor(monkeypatch):
    """Figure 10 replayed MemSpec at N = 2, 8 and 16 with a head whose labels span intervals of N = 4 (label
    horizon 1), which the controller refuses at any other N: figures of a configuration no node can run."""

    from memspec_ros.bench.figures import sweep
    from memspec_ros.bench.policy_bench import BenchRun, PolicyBenchConfig
    from memspec_ros.runtime.oracle import ScheduleCosts
    from memspec_ros.runtime.simulator import CostModel
    from memspec_ros.runtime.stats import GenerationStats, GenerationTotals, IterationStats

    head = SimpleNamespace(recent_tokens=0, label_horizon=1, interval=4)
    workloads = ["code", "math", "law", "medical", "general"]
    traces = [SimpleNamespace(workload=w) for w in workloads]
    bench = BenchRun(result={}, cfg=PolicyBenchConfig(interval=4), traces=traces, costs=CostModel(),
                     schedule_costs=ScheduleCosts(), predictor=head, domains={}, registry=None, runs=[])
    assert bench.refusal(["general-static", "memspec"], interval=4) == ""
    assert "memspec: interval (N) 8 is not the predictor's N, 4" in bench.refusal(["memspec"], interval=8)
    assert bench.refusal(["general-static"], interval=8) == ""  # it ranks with no predictor
    with pytest.raises(ValueError, match="the controller refuses memspec"):
        bench.simulate(["memspec"], interval=8)
    simulated = []

    def replayed(policies, costs=None, **changes):
        simulated.append(changes["interval"])
        totals = GenerationTotals()
        totals.add(GenerationStats(completion_tokens=5, decode_seconds=1.0,
                                   iterations=[IterationStats("general", 4, 3, 4, 0.1, 0.2)]))
        return {p: dict.fromkeys(workloads, totals) for p in policies}

    monkeypatch.setattr(bench, "simulate", replayed)
    item = sweep(bench, "fig10", (2, 4, 8), "interval", ["general-static", "memspec"], "emmc", "N")
    assert simulated == [4] and item["values"] == [4] and set(item["rows"]) == {"4"}
    assert set(item["refused"]) == {"2", "8"} and "interval 2, 8 left out" in item["title"]


def test_the_breakdown_figures_over_a_baseline_that_decoded_nothing_are_n_a_not_a_crash(tmp_path):
    """Figures 7 and 9 divided each part by MAB-Async's (General-Static's) pooled decode time: where every
    generation of it ended at the prefill that is 0, and ZeroDivisionError came after every real run. The parts
    are n/a there (as :func:`ratio` has it), the plot says so, and a base that decoded keeps its ratios."""

    from memspec_ros.bench.figures import GS, MAB, MS, figure7, figure8_9, plot
    from memspec_ros.runtime.stats import GenerationStats

    policies = [GS, MAB, MS]
    table = {"code": {p: {"tokens_per_second": 1.0, "end_to_end_tokens_per_second": 1.0} for p in policies}}
    decoded = GenerationStats(completion_tokens=5, decode_seconds=0.5)
    bench = SimpleNamespace(result={"workloads": table, "config": {"policies": policies}},
                            runs=[(GS, "code", (1,), GenerationStats()), (MAB, "code", (1,), GenerationStats()),
                                  (MS, "code", (1,), decoded)])
    for item, key in ((figure7(bench, "local"), "normalized_to_mab_async"),
                      (figure8_9(bench, "local"), "breakdown_normalized_to_general_static")):
        assert {v for parts in item[key].values() for v in parts.values()} == {None}
        plot(item, tmp_path / f"{item['item']}.png", "test")
        assert (tmp_path / f"{item['item']}.png").stat().st_size > 0
    bench.runs[1] = (MAB, "code", (1,), decoded)  # MAB-Async decoded: MemSpec's parts over it, 1 in all
    parts = figure7(bench, "local")["normalized_to_mab_async"][MS]
    assert sum(parts.values()) == pytest.approx(1.0)


def test_bad_bench_and_zoo_options_are_refused_before_any_model_loads(tmp_path, capsys, monkeypatch):
    """Each of these was found late: --threads 1,1 ran the llama.cpp bench twice (the second row over the first),
    a missing --datastore or --draft-path was named after the target had loaded and its paths were timed, --out
    naming a file raised from mkdir, a missing --llamacpp-draft failed every speculative run into a reason string,
    acceptance's --sampling-temperature nan wrote NaN into acceptance.json and its --json was not checked at all."""
    from memspec_ros.bench import cli as bench_cli
    from memspec_ros.zoo.cli import main as zoo_main

    def no_load(args):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(bench_cli, "_engine_models", no_load)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(SystemExit) as exc:
        main(["llamacpp", "--threads", "1,1"])
    assert exc.value.code == 2 and "more than once" in capsys.readouterr().err
    for argv, said in ((["engine", "--context-lookup", "--datastore", str(tmp_path / "typo.safetensors")],
                        "--datastore"),
                       (["engine", "--target", str(tmp_path / "t"), "--draft-path", str(tmp_path / "d")], "--target"),
                       (["paper", "--out", str(blocker)], "is a file"),
                       (["llamacpp", "--llamacpp-draft", str(tmp_path / "d.gguf")], "--llamacpp-draft")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert said in str(exc.value), exc.value
    for argv in (["--sampling-temperature", "nan"], ["--json", str(blocker / "acc.json")],
                 ["--plot", str(blocker / "m.png")]):
        with pytest.raises(SystemExit) as exc:
            zoo_main(["acceptance", "--json", str(tmp_path / "a.json"), *argv])
        assert exc.value.code == 2 and f"argument {argv[0]}:" in capsys.readouterr().err, argv
    assert not list(tmp_path.glob("*.json"))


def test_bench_json_is_strict_json_and_an_interrupt_is_said(monkeypatch, capsys):
    """A NaN (a latency percentile of a run with no goal) was written as bare NaN, which jq and browsers refuse;
    Ctrl-C in a bench gave a traceback."""
    from memspec_ros.bench import cli as bench_cli

    text = bench_cli._write_json({"p50": float("nan"), "rows": [{"max": float("inf")}, 1.5]}, None)
    assert json.loads(text) == {"p50": None, "rows": [{"max": None}, 1.5]}

    class Interrupt(KeyboardInterrupt):
        pass

    def interrupted(args):
        raise Interrupt

    parsed = SimpleNamespace(command="soak", func=interrupted)
    monkeypatch.setattr(bench_cli, "build_parser", lambda: SimpleNamespace(parse_args=lambda argv: parsed))
    try:
        assert bench_cli.main(["soak"]) == 130
    except Interrupt:  # not pytest's to take: it would end the whole session
        pytest.fail("Ctrl-C went out of main() as a traceback")
    assert "memspec-bench soak: interrupted" in capsys.readouterr().err


def test_the_action_benchs_medians_leave_a_one_token_pair_out_on_both_sides(tmp_path, monkeypatch):
    """The medians dropped a goal with no decode rate (one token) on each side apart: a pair whose action goal had
    one token and whose direct call had more stayed in the direct median, so the ratio of the two medians
    compared different goals."""
    from memspec_ros.bench import action_bench

    def row(i, action_tps, direct_tps):
        side = lambda tps: {"tps": tps, "e2e": tps / 2, "text": "t", "tokens": 8}  # noqa: E731
        return {"run": 0, "prompt": i, "action": side(action_tps), "direct": side(direct_tps)}

    rows = [row(0, 0.0, 1000.0), row(1, 10.0, 20.0), row(2, 30.0, 40.0)]
    monkeypatch.setattr(action_bench, "_pairs", lambda *a, **k: (rows, {"policy": "memspec", "predictor_note": "",
                                                                        "storage": {"medium": "local"}}))
    (tmp_path / "registry.yaml").write_text("drafts: []\n")
    result = action_bench.run_action_bench(tmp_path, prompts=1, runs=1)
    assert result["action_tokens_per_second_median"] == 20.0 and result["direct_tokens_per_second_median"] == 30.0
    assert result["ratio_steady_state"] == pytest.approx(20.0 / 30.0)


def test_engine_bench_stops_every_method_at_the_chat_templates_end_of_turn(monkeypatch):
    """The engine bench asked for the end tokens without the tokenizer, so a model whose generation config names
    only the end of a document (a ChatML template over a base model's eos) decoded past <|im_end|> in every method,
    measuring text the node never produces. With the target's tokenizer, every method gets the template's end of
    turn, as the node does."""
    from memspec_ros.bench import engine_bench
    from memspec_ros.bench.engine_bench import EngineBenchConfig, run_engine_bench
    from memspec_ros.runtime.chat import template_end_of_turn
    from memspec_ros.testing.tiny_models import noisy_copy, tiny_llama, tiny_tokenizer

    tok = tiny_tokenizer(chat=True)
    end_of_turn = template_end_of_turn(tok)
    target = tiny_llama(vocab_size=len(tok), hidden=64, layers=2, seed=0)
    target.generation_config.eos_token_id = tok.eos_token_id  # the end of a document only
    calls = []  # (method, tokens asked for, end ids): the timed calls ask for cfg.max_new_tokens, the warm-ups 8
    real_generate, real_hf = engine_bench.generate, engine_bench._hf_generate

    def generate(target, ids, draft, **kwargs):
        calls.append(("engine" if draft is not None else "target alone", kwargs["max_new_tokens"],
                      list(kwargs.get("eos_token_ids", ()))))
        return real_generate(target, ids, draft, **kwargs)

    def hf_generate(target, assistant, ids, new, gamma, eos):
        calls.append(("hf assisted" if assistant is not None else "hf generate", new, list(eos)))
        return real_hf(target, assistant, ids, new, gamma, eos)

    monkeypatch.setattr(engine_bench, "generate", generate)
    monkeypatch.setattr(engine_bench, "_hf_generate", hf_generate)
    cfg = EngineBenchConfig(max_new_tokens=6, runs=1, prompts=1)
    run_engine_bench(target, noisy_copy(target, 0.01), [[5, 9, 14]], cfg, tokenizer=tok)
    timed = [(method, eos) for method, new, eos in calls if new == cfg.max_new_tokens]
    assert end_of_turn is not None
    assert sorted(m for m, _ in timed) == ["engine", "hf assisted", "hf generate", "target alone"]
    assert all(end_of_turn in eos for _, eos in timed), timed


def test_the_action_bench_reads_the_drafts_through_the_storage_it_is_given(tmp_path):
    """--storage was on the engine, policies and paper benches only: the action bench's node always read its drafts
    from the local disk, and its JSON named no medium. It sets the node's cache.storage and records the medium,
    the timed pairs' draft loads and their time over one iteration."""
    out = tmp_path / "action.json"
    main(["action", "--zoo", "tiny", "--prompts", "1", "--runs", "1", "--max-new-tokens", "8", "--storage", "sd",
          "--policy", "general-static", "--json", str(out)])  # its exit status is the goal's (a speed ratio)
    storage = json.loads(out.read_text())["storage"]
    assert storage["medium"] == "sd" and storage["emulated"] is True
    assert storage["loads"] >= 1 and storage["mean_load_seconds"] > 0  # a load per goal: the cache reset per goal
    # over one speculative iteration (draft + verify); none where the tiny drafts proposed nothing (adaptive gamma)
    if storage["iteration_seconds"] > 0:
        expected = storage["mean_load_seconds"] / storage["iteration_seconds"]
        assert storage["load_to_iteration"] == pytest.approx(expected)
    else:
        assert storage["load_to_iteration"] is None


@pytest.mark.parametrize("argv", [["engine", "--zoo", "{bundled}", "--json", "{bundled}/registry.yaml"],
                                  ["policies", "--zoo", "{bundled}", "--json", "{bundled}/drafts/p.json"],
                                  ["paper", "--zoo", "{bundled}", "--out", "{bundled}"],
                                  ["engine", "--zoo", "{tmp}", "--json", "{tmp}/e.json"]])
def test_a_result_named_inside_the_zoo_is_refused_before_the_run(tmp_path, capsys, argv):
    """`--json models/registry.yaml` ran the whole bench and then wrote its JSON over the zoo's registry (a plot
    beside it too; `paper --out models` its items): refused by the parser, the zoo untouched."""
    def files():
        return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in BUNDLED.rglob("*") if p.is_file()}

    before = files()
    argv = [a.format(bundled=BUNDLED, tmp=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and "is inside the zoo" in capsys.readouterr().err
    assert files() == before
    assert not list(tmp_path.iterdir())


def test_a_bench_result_that_cannot_be_written_whole_leaves_the_earlier_one(tmp_path, monkeypatch, capsys):
    """The JSON was written in place: a full disk part-way left neither the earlier result nor this one."""
    import errno

    from memspec_ros.bench import cli as bench_cli

    out = tmp_path / "engine.json"
    out.write_text('{"earlier": 1}\n')
    real_write = Path.write_text

    def half_then_full(self, text, *args, **kwargs):
        real_write(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_full)
    with pytest.raises(SystemExit, match="could not write the result"):
        bench_cli._write_json({"new": 2}, str(out))
    monkeypatch.undo()
    assert out.read_text() == '{"earlier": 1}\n' and [p.name for p in tmp_path.iterdir()] == ["engine.json"]
    assert json.loads(capsys.readouterr().out) == {"new": 2}  # the result itself is printed, not lost
