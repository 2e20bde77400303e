"""The benchmark commands run end to end on generated models and report lossless outputs.

Speed is NOT asserted here (timed unit tests are noise on a shared machine); the
benchmarks print ratios measured side by side, quoted in the issue notes.
"""

from __future__ import annotations

import json

from memspec_ros.bench.cli import main
from memspec_ros.bench.tiny_zoo import build_tiny_zoo


def test_engine_bench_reports_every_figure(tmp_path):
    out = tmp_path / "engine.json"
    assert main(["engine", "--zoo", str(tmp_path / "no-zoo"), "--prompts", "2", "--runs", "1",
                 "--max-new-tokens", "12", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in ("autoregressive_tps", "hf_assisted_tps", "engine_tps", "ratio_vs_hf", "ratio_vs_autoregressive",
                "mean_accepted", "bound_tps", "bound_fraction"):
        assert result[key] >= 0, key
    assert result["outputs_identical"] is True


def test_policy_bench_runs_every_policy_losslessly(tmp_path):
    zoo = build_tiny_zoo(tmp_path / "zoo", hidden=64, layers=2)
    (zoo / "workloads").mkdir()
    for workload, prompt in (("code", "def add(a, b):"), ("math", "Solve 3x + 5 = 20.")):
        (zoo / "workloads" / f"{workload}.jsonl").write_text(json.dumps({"domain": workload, "prompt": prompt}) + "\n")
    out = tmp_path / "policies.json"
    assert main(["policies", "--zoo", str(zoo), "--predictor", str(zoo / "predictor"), "--workloads", "code,math",
                 "--prompts", "1", "--max-new-tokens", "16", "--load-ms-per-mb", "5", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["config"]["policies"]) == {"general-static", "oracle-static", "mab-sync", "mab-async",
                                                 "prediction-only", "oracle-dynamic", "memspec"}
    assert result["lossless"] is True
    assert all(v > 0 for v in result["gmean_tokens_per_second"].values())
    assert out.with_suffix(".png").stat().st_size > 0
