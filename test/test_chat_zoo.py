"""The chat zoo's build: requests from this machine's sources, the target's stored answers, reduced-vocabulary
drafts distilled from them, export, and the acceptance matrix, on a tiny instruct-style target."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from row_checks import assert_greedy_up_to_a_tie, assert_top_k_up_to_a_tie, target_alone

from memspec_ros.runtime.draft_vocab import ReducedVocabDraft
from memspec_ros.runtime.models import ModelSpec, load_model
from memspec_ros.runtime.speculative import generate
from memspec_ros.testing.tiny_models import save_model_dir, tiny_llama, tiny_tokenizer
from memspec_ros.zoo import chat_workloads as cw
from memspec_ros.zoo.chat_acceptance import chat_acceptance
from memspec_ros.zoo.chat_build import ChatBuildConfig, ChatZooBuild, general_domains
from memspec_ros.zoo.chat_drafts import AnswerStreams, ChatDraftArch, new_draft, select_vocab, split_validation
from memspec_ros.zoo.corpora import DOMAINS, WORKLOADS, split_of
from memspec_ros.zoo.errors import ZooSetupError
from memspec_ros.zoo.rollouts import IGNORE
from memspec_ros.zoo.teacher import (
    Answer,
    TeacherConfig,
    answer_requests,
    answered_rows,
    chat_prompt_ids,
    datastore_answers,
    load_answers,
)
from memspec_ros.zoo.train import TrainConfig


@pytest.fixture(scope="module")
def workloads():
    return cw.build_chat_workloads(cw.ChatWorkloadConfig(heldout_per_workload=20, train_per_domain=40))


def test_requests_cover_every_workload_and_held_out_sources_never_train(workloads):
    heldout, train = workloads
    assert set(heldout) == set(WORKLOADS) and all(len(rows) == 20 for rows in heldout.values())
    assert all(len(train[d]) == 40 for d in DOMAINS) and train["mixed"]
    train_sources = {q.source for rows in train.values() for q in rows}
    for w, rows in heldout.items():
        for q in rows:
            assert q.domain == w and q.content.strip()
            parts = q.source.removeprefix("mixed:").split("+")
            assert all(split_of(p, cw.ChatWorkloadConfig().heldout_fraction) == "heldout" for p in parts), q.source
            assert q.source not in train_sources
    # a mixed request asks two things of different domains
    for q in heldout["mixed"]:
        first, second = (p.split(":", 1)[0] for p in q.source.removeprefix("mixed:").split("+"))
        assert first != second and "First:" in q.content and "Second:" in q.content
    row = heldout["code"][0].row()
    assert row["messages"] == [{"role": "user", "content": row["prompt"]}]


def test_no_training_request_asks_about_what_a_held_out_one_asks(workloads):
    """Splitting by source left the same material on both sides (a paragraph in two manuals, a problem drawn twice
    and asked in other words): 15 of the committed zoo's 600 held-out requests were verbatim training requests, and
    the drafts accepted far more on them. Requests that share their material are one request for the split."""
    heldout, train = workloads
    held = set().union(*(cw.request_material(q.content) for rows in heldout.values() for q in rows))
    assert not [q.source for rows in train.values() for q in rows if cw.request_material(q.content) & held]
    # the phrasing is not part of the material; both halves of a mixed request are
    problem = "What is 12 + 30?"
    asked = {a.format(p=problem) for a in cw._MATH_ASKS}
    assert {cw.request_material(t) for t in asked} == {frozenset([problem])}
    law = cw._LAW_ASKS[0].format(q="The licensee may copy the software.")
    both = cw._mixed(cw.ChatRequest("math", "m", cw._MATH_ASKS[1].format(p=problem)), cw.ChatRequest("law", "l", law))
    assert cw.request_material(both.content) == {problem, "The licensee may copy the software."}


def test_a_training_quota_or_mixed_pair_the_sources_cannot_fill_is_said():
    """The committed zoo's code quota came up 2,064 short and 4 of its 6 mixed pairs got no training request, without
    a word (the mixed pairs need training requests beyond each domain's quota)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a quota that fits says nothing
        cw.build_chat_workloads(cw.ChatWorkloadConfig(heldout_per_workload=20, train_per_domain=40))
    with pytest.warns(UserWarning, match=r"fewer training requests than asked.*code \d+ of 1000000.*mixed "):
        cw.build_chat_workloads(cw.ChatWorkloadConfig(heldout_per_workload=20, train_per_domain=1_000_000))


def test_a_workload_never_asks_the_same_thing_twice(workloads):
    """A random problem drawn twice under two phrasings was two rows (math held out "Solve x^2 + 9x + 8 = 0."
    twice), as was an ICD code the library lists twice: each material is kept once, the first, before the split."""
    problem = "Solve x^2 + 9x + 8 = 0."
    requests = [cw.ChatRequest("math", "math:1", cw._MATH_ASKS[0].format(p=problem)),
                cw.ChatRequest("math", "math:2", cw._MATH_ASKS[1].format(p=problem)),
                cw.ChatRequest("math", "math:3", cw._MATH_ASKS[0].format(p="Solve x + 1 = 2."))]
    assert [q.source for q in cw._first_of_each(requests)] == ["math:1", "math:3"]
    heldout, train = workloads
    for rows in [*heldout.values(), *train.values()]:
        materials = [cw.request_material(q.content) for q in rows]
        assert len(set(materials)) == len(materials)


def test_requests_are_deterministic(workloads):
    again = cw.build_chat_workloads(cw.ChatWorkloadConfig(heldout_per_workload=20, train_per_domain=40))
    assert [q.source for q in again[0]["mixed"]] == [q.source for q in workloads[0]["mixed"]]
    assert [q.content for q in again[1]["law"]] == [q.content for q in workloads[1]["law"]]


def test_held_out_requests_do_not_depend_on_the_training_quota(workloads):
    """A larger training set (a GPU build answers more requests) must leave the held-out requests, and so
    every held-out answer and figure measured on them, as they were; the math pool once grew with the quota."""
    more = cw.build_chat_workloads(cw.ChatWorkloadConfig(heldout_per_workload=20, train_per_domain=400))
    for w in WORKLOADS:
        assert [q.content for q in more[0][w]] == [q.content for q in workloads[0][w]], w
    assert len(more[1]["math"]) == 400


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    tok = tiny_tokenizer(chat=True)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    tok.eos_token = "<|im_end|>"
    model = tiny_llama(vocab_size=len(tok), hidden=64, layers=2, seed=0, init_range=0.2, max_positions=1024)
    model.generation_config.eos_token_id = end
    path = save_model_dir(model, tok, tmp_path_factory.mktemp("target") / "target")
    return path, tok, model


ROWS = [{"domain": d, "messages": [{"role": "user", "content": f"{d} question number {i}: what is it?"}]}
        for i in range(3) for d in (*DOMAINS, "mixed")]


def test_teacher_stores_greedy_answers_with_their_top_k_and_resumes(tiny_target, tmp_path):
    path, tok, model = tiny_target
    cfg = TeacherConfig(max_new_tokens=12, batch_size=4, top_k=5, chunk_requests=8)
    made = answer_requests(model, tok, ROWS, tmp_path, "t", cfg)
    assert made > 0 and len(list(tmp_path.glob("t-*.safetensors"))) == 3
    assert answer_requests(model, tok, ROWS, tmp_path, "t", cfg) == 0  # every shard done: nothing recomputed
    answers = load_answers(tmp_path, "t")
    assert [a.domain for a in answers] == [r["domain"] for r in ROWS]
    for a, row in zip(answers, ROWS, strict=True):
        assert a.prompt_ids == chat_prompt_ids(tok, row["messages"])
        assert 1 <= len(a.answer_ids) <= 12 and a.top_ids.shape == (len(a.answer_ids), 5)
        with torch.no_grad():
            logits = model(torch.tensor([a.prompt_ids + a.answer_ids])).logits[0, len(a.prompt_ids) - 1:-1]
        # the stored answer is the target's greedy answer, and the labels its top-5 log-probabilities: checked
        # against one unpadded forward, up to a near-tie the teacher's padded batch may split the other way
        assert_greedy_up_to_a_tie(a.answer_ids, logits, 1e-4 * float(logits.abs().max()))
        assert_top_k_up_to_a_tie(a.top_ids, a.top_logp, torch.log_softmax(logits, -1), 2e-2)


def test_teacher_resumes_by_rows_with_another_chunk_size_and_refuses_other_requests(tiny_target, tmp_path):
    """A build interrupted on a CPU (chunks of 8) and resumed on a GPU (chunks of 16) answers every row once, in
    order; shards made for other requests are refused, not taken for these rows' answers."""
    path, tok, model = tiny_target
    small = TeacherConfig(max_new_tokens=6, batch_size=4, chunk_requests=8)
    answer_requests(model, tok, ROWS[:8], tmp_path, "t", small)  # interrupted after one shard
    answer_requests(model, tok, ROWS, tmp_path, "t", replace(small, chunk_requests=16))
    answers = load_answers(tmp_path, "t")
    assert [a.prompt_ids for a in answers] == [chat_prompt_ids(tok, r["messages"]) for r in ROWS]
    assert answer_requests(model, tok, ROWS, tmp_path, "t", replace(small, chunk_requests=4)) == 0
    assert len(load_answers(tmp_path, "t")) == len(ROWS)
    with pytest.raises(ValueError, match="made for other requests"):
        answer_requests(model, tok, ROWS[1:], tmp_path, "t", small)


def test_a_teacher_resumed_with_another_batch_size_says_so_and_its_shards_record_both(tiny_target, tmp_path, capsys):
    """Batched, left-padded greedy decoding may split a near-tie otherwise at another batch size or device: shards
    recorded neither, so a build resumed with --teacher-batch 512 --device cuda mixed answers of both settings, and
    its build_config.json named only the second."""
    from memspec_ros.zoo.teacher import answered_settings

    path, tok, model = tiny_target
    small = TeacherConfig(max_new_tokens=6, batch_size=4, chunk_requests=8)
    answer_requests(model, tok, ROWS[:8], tmp_path, "t", small)  # interrupted after one shard
    assert "resuming" not in capsys.readouterr().out
    answer_requests(model, tok, ROWS, tmp_path, "t", replace(small, batch_size=2))
    said = capsys.readouterr().out
    assert "first 8 answers were made with {'batch_size': 4, 'device': 'cpu'}" in said, said
    assert answered_settings(tmp_path, "t") == [{"batch_size": 4, "device": "cpu"}, {"batch_size": 2, "device": "cpu"}]


def test_answers_made_by_another_target_are_refused(tiny_target, tmp_path):
    """Shards did not name their target: a build or acceptance run given another model with the same tokenizer (a
    larger SmolLM2, another quantization) took the old target's answers for the new one's."""
    from memspec_ros.runtime.model_source import model_digest

    path, tok, model = tiny_target
    small = TeacherConfig(max_new_tokens=6, batch_size=4, chunk_requests=8)
    digest = model_digest(path)
    answer_requests(model, tok, ROWS[:8], tmp_path, "t", small, target_digest=digest)
    assert answer_requests(model, tok, ROWS[:8], tmp_path, "t", small, target_digest=digest) == 0  # same: resumed
    with pytest.raises(ValueError, match="made by another target"):
        answer_requests(model, tok, ROWS, tmp_path, "t", small, target_digest="f" * 64)
    assert len(load_answers(tmp_path, "t")) == 8
    copy = tmp_path / "same-model-elsewhere"
    shutil.copytree(path, copy)
    assert model_digest(copy) == digest  # by content, not by path


def test_answers_recorded_by_a_folder_targets_weights_alone_are_refused_with_the_reason(tiny_target, tmp_path):
    """Work dirs made before answers_identity covered a folder target's answer files recorded its weights alone: their
    answers were refused as another target's, which they are not. They are refused still (where they stop cannot be
    checked), and the error says so; another target's answers keep their own message."""
    import shutil

    from memspec_ros.runtime.model_source import answers_identity, earlier_identities, model_digest

    path, tok, model = tiny_target
    small = TeacherConfig(max_new_tokens=6, batch_size=4, chunk_requests=8)
    answer_requests(model, tok, ROWS[:8], tmp_path, "t", small, target_digest=model_digest(path))  # the old record
    identity = answers_identity(path)
    assert model_digest(path) in earlier_identities(identity) and identity not in earlier_identities(identity)
    with pytest.raises(ValueError, match="made by this target's weights, recorded before all of its config"):
        answer_requests(model, tok, ROWS, tmp_path, "t", small, target_digest=identity)
    assert len(load_answers(tmp_path, "t")) == 8  # nothing appended
    with pytest.raises(ValueError, match="made by another target"):
        answer_requests(model, tok, ROWS, tmp_path, "t", small, target_digest="f" * 64)
    assert earlier_identities("f" * 64) == set()
    # recorded by the identity of session 55 (five answer files: not the chat template), for a folder that has one
    folder = shutil.copytree(path, tmp_path / "with-template")
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    newer = answers_identity(folder)
    [before] = earlier_identities(newer) - {model_digest(folder)}
    answer_requests(model, tok, ROWS[:8], tmp_path / "s55", "t", small, target_digest=before)
    with pytest.raises(ValueError, match="made by this target's weights, recorded before all of its config"):
        answer_requests(model, tok, ROWS, tmp_path / "s55", "t", small, target_digest=newer)


def test_answers_record_a_folder_targets_answer_shaping_files_and_a_gguf_by_its_digest(tiny_target, tmp_path):
    """The teacher's shards named a folder target by its weights alone: with its generation_config's eos corrected
    (answers cut elsewhere) a resumed teacher mixed answers cut at two end tokens. answers_identity names those
    files too; a GGUF's stays its file's digest (the bundled zoo's records)."""
    import json as jsonlib

    from memspec_ros.runtime.model_source import answers_identity, model_digest

    path, _, _ = tiny_target
    copy = tmp_path / "target"
    shutil.copytree(path, copy)
    before = answers_identity(copy)
    assert before == answers_identity(path) != model_digest(copy)  # by content, the files included
    config = copy / "generation_config.json"
    data = jsonlib.loads(config.read_text()) if config.is_file() else {}
    config.write_text(jsonlib.dumps({**data, "eos_token_id": [0, 1]}))
    assert answers_identity(copy) != before and model_digest(copy) == model_digest(path)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF not really")
    assert answers_identity(gguf) == model_digest(gguf)


def test_the_gptq_report_refuses_stored_answers_of_another_target_or_length(tiny_target, tmp_path):
    """Its answers were matched by prompt ids alone: another model's, or answers cut at another length, were
    measured as this target's 128-token answers."""
    from memspec_ros.runtime.model_source import model_digest
    from memspec_ros.zoo.gptq_target import check_stored_answers

    path, tok, model = tiny_target
    mine, other = tmp_path / "mine", tmp_path / "other"
    answer_requests(model, tok, ROWS[:4], mine, "heldout", TeacherConfig(max_new_tokens=6, batch_size=4),
                    target_digest=model_digest(path))
    answer_requests(model, tok, ROWS[:4], other, "heldout", TeacherConfig(batch_size=4), target_digest="f" * 64)
    with pytest.raises(SystemExit, match="made by another target"):
        check_stored_answers(other, model_digest(path))
    with pytest.raises(SystemExit, match=r"cut at max_new_tokens \[6\], not the 128"):
        check_stored_answers(mine, model_digest(path))
    check_stored_answers(tmp_path / "none", model_digest(path))  # no stored answers: made anew, nothing to check
    # a build resumed with another length is told the harmless fix first (its answers took minutes to hours)
    with pytest.raises(ValueError, match=r"max_new_tokens \[6\], not 128: run with --max-new-tokens 6"):
        answered_rows([chat_prompt_ids(tok, r["messages"]) for r in ROWS[:4]], mine, "heldout", 128,
                      target_digest=model_digest(path))


def test_answer_rows_label_answer_tokens_only_and_drop_ids_outside_the_vocabulary():
    answer = Answer([1, 3, 5], [7, 8, 9, 4], torch.tensor([[7, 2]] * 4, dtype=torch.int32),
                    torch.tensor([[-0.1, -2.5]] * 4, dtype=torch.float16))
    ids = select_vocab([answer], rows=4, always=[4])  # keeps 4 first, then the most frequent: 7, 8, 9
    assert ids[0] == 4 and set(ids) == {4, 7, 8, 9}
    target = tiny_llama(vocab_size=16, hidden=32, layers=1)
    draft = new_draft(target, ids, ChatDraftArch(rows=4, hidden_size=32, num_layers=1, intermediate_size=64,
                                                 num_heads=2, num_kv_heads=2))
    x, y, top_ids, top_logp = AnswerStreams([answer], draft.vocab, 0).batch(1, 64)
    unk = len(ids)
    assert x[0].tolist() == [unk, unk, unk, ids.index(7), ids.index(8), ids.index(9), ids.index(4)]
    # position 2 (the last request token) predicts the first answer token; request positions carry no label
    assert y[0].tolist() == [IGNORE, IGNORE, ids.index(7), ids.index(8), ids.index(9), ids.index(4)]
    assert top_ids[0, 2].tolist() == [ids.index(7), unk] and top_logp[0, 2, 1] == float("-inf")  # id 2 has no row


@pytest.fixture(scope="module")
def tiny_build(tiny_target, tmp_path_factory):
    path, tok, _ = tiny_target
    tmp_path = tmp_path_factory.mktemp("build")
    work = tmp_path / "work"
    (work / "workloads").mkdir(parents=True)
    for w in WORKLOADS:
        rows = [
            {"domain": w, "prompt": f"{w} request {i}", "messages": [{"role": "user", "content": f"{w} request {i}"}]}
            for i in range(4)
        ]
        (work / "workloads" / f"{w}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train = [
        {"domain": d, "prompt": f"{d} training {i}", "messages": [{"role": "user", "content": f"{d} training {i}"}]}
        for i in range(6)
        for d in (*DOMAINS, "mixed")
    ]
    (work / "workloads" / "train_requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    steps = TrainConfig(max_steps=6, max_minutes=5, batch_size=4, seq_len=64, warmup_steps=2, validate_every=3,
                        checkpoint_every=3)
    cfg = ChatBuildConfig(work_dir=work, out_dir=tmp_path / "out", target=str(path), threads=1,
                          teacher=TeacherConfig(max_new_tokens=10, batch_size=8, chunk_requests=16),
                          arch=ChatDraftArch(rows=120, hidden_size=32, num_layers=1, intermediate_size=64, num_heads=2,
                                             num_kv_heads=2),
                          general_train=steps, domain_train=replace(steps, max_steps=3), validation_answers=4)
    ChatZooBuild(cfg).run(["workloads", "teacher", "vocab", "general", "domains", "export", "datastore"])
    return cfg


def test_a_tiny_build_distils_exports_and_measures_a_lossless_zoo(tiny_target, tiny_build):
    path, tok, _ = tiny_target
    cfg = tiny_build
    work, out = cfg.work_dir, cfg.out_dir
    vocab = json.loads((work / "vocab.json").read_text())
    assert len(vocab["target_ids"]) == 120 and vocab["train_coverage"] > 0.5
    general_meta = json.loads((work / "ckpt" / "general" / "final" / "train_meta.json").read_text())
    assert general_meta["step"] == 6 and general_meta["answers"] > 0
    # the general draft learns from every domain's answers (the default --general-domains all)
    assert set(general_meta["domains"]) == {*DOMAINS, "mixed"}
    assert general_meta["answers"] == len(split_validation(load_answers(work / "teacher", "train"))[0])
    registry = (out / "registry.yaml").read_text()
    assert f'path: "{path}"' in registry and all(f"path: drafts/{d}" in registry for d in DOMAINS)
    assert (out / "workloads" / "mixed.jsonl").is_file()
    # what the training answers were made with, from their shards (a resumed build may have used two settings)
    assert json.loads((out / "build_config.json").read_text())["teacher_answers_made_with"] == [
        {"batch_size": 8, "device": "cpu"}]
    target = load_model(ModelSpec(str(path))).model
    prompt = chat_prompt_ids(tok, [{"role": "user", "content": "code request 0"}])
    reference = target_alone(target, prompt, 16)
    drafts = {}
    for d in DOMAINS:
        loaded = load_model(ModelSpec(str(out / "drafts" / d)))
        assert isinstance(loaded.model, ReducedVocabDraft) and loaded.vocab_size == len(tok)
        assert loaded.size_bytes < 400_000  # fp16 on disk, a 121-row head
        drafts[d] = loaded.model
        assert generate(target, prompt, loaded.model, gamma=3, max_new_tokens=16).generated_ids == reference
    # a second run finds every stage done and changes nothing
    before = (out / "drafts" / "code" / "model.safetensors").read_bytes()
    ChatZooBuild(cfg).run(["teacher", "vocab", "general", "domains", "export"])
    assert (out / "drafts" / "code" / "model.safetensors").read_bytes() == before
    result = chat_acceptance(drafts, load_answers(work / "teacher", "heldout"), gamma=4, interval=2)
    assert set(result["matrix"]) == set(DOMAINS) and set(result["matrix"]["general"]) == set(WORKLOADS)
    assert all(0.0 <= v <= 4.0 for row in result["matrix"].values() for v in row.values())
    assert result["oracle_dynamic_mixed"] >= result["matrix"]["general"]["mixed"] - 1e-9
    # the hindsight walk on every workload: mixed's gain beside what it gives where the domain never changes
    dynamic = result["oracle_dynamic_gain_by_workload"]
    assert set(dynamic) == set(WORKLOADS) and dynamic["mixed"] == result["oracle_dynamic_gain_mixed"]
    assert all(g >= -1e-9 for g in dynamic.values() if g is not None)  # never below the best fixed draft
    # a draft named outside the domains (one distilled on every domain, say) is scored and is an oracle candidate
    extra = chat_acceptance({**drafts, "all-domains": drafts["code"]}, load_answers(work / "teacher", "heldout"),
                            gamma=4, interval=2)
    assert list(extra["matrix"]) == [*DOMAINS, "all-domains"]
    assert extra["matrix"]["all-domains"] == result["matrix"]["code"]
    assert extra["domain_gain_over_general"]["all-domains"] == result["domain_gain_over_general"]["code"]


def test_the_datastore_stage_stores_the_training_answers_for_the_targets_tokenizer(tiny_target, tiny_build, tmp_path):
    from memspec_ros.runtime.datastore import Datastore, DatastoreError
    from memspec_ros.runtime.loader import DATASTORE_FILE
    from memspec_ros.runtime.models import tokenizer_fingerprint

    _, tok, _ = tiny_target
    train = load_answers(tiny_build.work_dir / "teacher", "train")
    store = Datastore.load(tiny_build.out_dir / DATASTORE_FILE, fingerprint=tokenizer_fingerprint(tok))
    assert store.answers == len(train) > 0  # the training answers, and only them (never the held-out ones)
    assert store.tokens[store.tokens >= 0].tolist() == [t for a in train for t in a.answer_ids]
    with pytest.raises(DatastoreError, match="another tokenizer"):
        Datastore.load(tiny_build.out_dir / DATASTORE_FILE, fingerprint="another")
    # read back as answers paired with the zoo's training requests: the teacher's, in its order
    paired = datastore_answers(tiny_build.out_dir / DATASTORE_FILE, tok)
    assert [(a.prompt_ids, a.answer_ids, a.domain) for a in paired] == [
        (a.prompt_ids, a.answer_ids, a.domain) for a in train]
    fewer = tmp_path / "three_requests.jsonl"
    fewer.write_text("".join((tiny_build.out_dir / "workloads" / "train_requests.jsonl").read_text()
                             .splitlines(keepends=True)[:3]))
    with pytest.raises(ValueError, match=r"holds \d+ answers but .* only 3 requests"):
        datastore_answers(tiny_build.out_dir / DATASTORE_FILE, tok, fewer)
    # as many requests, one of them another (rebuilt on another machine): each answer would pair with another request
    lines = (tiny_build.out_dir / "workloads" / "train_requests.jsonl").read_text().splitlines()
    row = json.loads(lines[0])
    row["prompt"] = row["messages"][-1]["content"] = "Something else entirely."
    other = tmp_path / "other_requests.jsonl"
    other.write_text("\n".join([json.dumps(row), *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match="made for other training requests"):
        datastore_answers(tiny_build.out_dir / DATASTORE_FILE, tok, other)
    # it records the target that made the answers: the same target pairs them, another of the same tokenizer (the
    # predictor trainer's --target) is refused instead of teaching the predictor another model's acceptance
    assert len(datastore_answers(tiny_build.out_dir / DATASTORE_FILE, tok, target=str(tiny_build.target))) == len(train)
    other_target = tmp_path / "other_target"
    shutil.copytree(tiny_build.target, other_target)
    _perturbed(other_target / "model.safetensors")
    with pytest.raises(ValueError, match="holds the answers of another target"):
        datastore_answers(tiny_build.out_dir / DATASTORE_FILE, tok, target=str(other_target))
    # the stage alone, into an output folder no export has made yet (a build that stores its answers first)
    alone = replace(tiny_build, out_dir=tmp_path / "fresh")
    ChatZooBuild(alone).run(["datastore"])
    again = Datastore.load(alone.out_dir / DATASTORE_FILE, fingerprint=tokenizer_fingerprint(tok))
    assert again.answers == store.answers and again.tokens.tolist() == store.tokens.tolist()


def _work_asking_heldout_material(build, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of ``build``'s work dir whose training request 1 asks a held-out request's material in other words
    (a work dir split before chat_workloads dropped such requests); (the copy, its train_requests.jsonl)."""
    work = tmp_path / "work"
    shutil.copytree(build.work_dir, work)
    requests = work / "workloads" / "train_requests.jsonl"
    rows = [json.loads(line) for line in requests.read_text().splitlines()]
    held = json.loads((work / "workloads" / "code.jsonl").read_text().splitlines()[0])["prompt"]
    rows[1]["prompt"] = cw._MATH_ASKS[0].format(p=held)
    requests.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return work, requests


def test_the_datastore_withholds_answers_to_requests_a_held_out_one_asks(tiny_target, tiny_build, tmp_path):
    """A work dir split before training requests that ask what a held-out one asks were dropped (the committed zoo's:
    109 of its 10,240) must not put their answers in the datastore, where context lookup copies them into held-out
    answers: such a row is kept empty, so answer i still answers request i."""
    from memspec_ros.runtime.datastore import Datastore
    from memspec_ros.runtime.loader import DATASTORE_FILE
    from memspec_ros.runtime.models import tokenizer_fingerprint

    _, tok, _ = tiny_target
    work, requests = _work_asking_heldout_material(tiny_build, tmp_path)
    cfg = replace(tiny_build, work_dir=work, out_dir=tmp_path / "out")
    ChatZooBuild(cfg).run(["datastore"])
    store = Datastore.load(cfg.out_dir / DATASTORE_FILE, fingerprint=tokenizer_fingerprint(tok))
    train = load_answers(tiny_build.work_dir / "teacher", "train")
    assert store.answers == len(train)
    kept = [a.answer_ids for i, a in enumerate(train) if i != 1]
    assert store.tokens[store.tokens >= 0].tolist() == [t for a in kept for t in a]
    paired = datastore_answers(cfg.out_dir / DATASTORE_FILE, tok, requests)
    assert [a.answer_ids for a in paired] == kept


def test_the_toy_build_never_exports_over_another_zoo(tmp_path, monkeypatch):
    """build-toy's --out defaulted to models/, the bundled real-target zoo, which its export replaced draft by draft
    (a crash midway left the chat registry naming drafts that were gone). Its default is its own folder now, and an
    --out holding another zoo is refused before any stage runs."""
    import argparse

    from memspec_ros.zoo import build, cli
    from memspec_ros.zoo.cli import main

    parser = argparse.ArgumentParser()
    cli._build_parser(parser.add_subparsers(dest="cmd"))
    assert parser.parse_args(["build-toy"]).out == "artifacts/toy-zoo" == str(build.BuildConfig().out_dir)
    monkeypatch.setattr(build.ZooBuild, "run", lambda *a, **k: pytest.fail("a stage ran"))
    zoo = tmp_path / "zoo"
    shutil.copytree(Path(__file__).resolve().parents[1] / "models", zoo, ignore=shutil.ignore_patterns("drafts"))
    before = sorted(p.relative_to(zoo) for p in zoo.rglob("*"))
    with pytest.raises(SystemExit, match=r"--out .*zoo holds another zoo .*give an empty or new folder"):
        main(["build-toy", "--work-dir", str(tmp_path / "w"), "--out", str(zoo)])
    assert sorted(p.relative_to(zoo) for p in zoo.rglob("*")) == before
    (zoo / build.TOY_MARKER).write_text("")  # an earlier toy export: replaced as before
    with pytest.raises(pytest.fail.Exception, match="a stage ran"):
        main(["build-toy", "--work-dir", str(tmp_path / "w"), "--out", str(zoo)])


@pytest.mark.parametrize("command", ["build", "build-toy"])
def test_a_device_or_stage_list_the_build_cannot_use_is_refused_before_any_work(command, tmp_path, monkeypatch,
                                                                                capsys):
    """--device cuda without CUDA, 'gpu' or a CUDA index past the last device failed in torch (a traceback) after
    the target had loaded and a stage had run; an empty --stages ran nothing and exited 0."""
    from memspec_ros.zoo.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA, wherever this runs
    cases = [(["--device", "cuda"], "torch sees no CUDA device"), (["--device", "gpu"], "use cpu or cuda"),
             (["--stages", ""], "argument --stages: no name given")]
    for argv, said in cases:
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--work-dir", str(tmp_path / "w"), *argv])
        assert exit_info.value.code == 2 and said in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # one CUDA device
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit):
        main([command, "--work-dir", str(tmp_path / "w"), "--device", "cuda:1"])
    assert "this machine has 1 CUDA device(s), 0 to 0" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def test_the_predictor_trains_on_the_stored_answers_without_decoding(tiny_build, tmp_path, monkeypatch):
    from memspec_ros.runtime import oracle
    from memspec_ros.zoo import predictor_training

    monkeypatch.setattr(oracle.ContinuationCache, "continuation", lambda *a, **k: pytest.fail("decoded the target"))
    out = tmp_path / "predictor"
    args = ["--registry", str(tiny_build.out_dir / "registry.yaml"), "--answers", str(tiny_build.work_dir / "teacher"),
            "--out", str(out), "--encoders", "target-hidden", "--epochs", "5", "--quiet"]
    assert predictor_training.main(args) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["prompts"] == len(load_answers(tiny_build.work_dir / "teacher", "train"))
    assert report["contexts"] >= report["prompts"] and set(report["label_counts"]) == set(DOMAINS)
    assert (out / "target-hidden").is_dir()
    # the head records the N and the gamma its labels were walked at (the gamma was not recorded)
    head = json.loads((out / "target-hidden" / "predictor.json").read_text())
    assert (head["interval"], head["gamma"]) == (4, 4)
    # the datastore file holds the same answers' tokens: the same traces, so the same labels
    again = tmp_path / "from-datastore"
    args[args.index("--answers") + 1] = str(tiny_build.out_dir / "datastore.safetensors")
    args[args.index("--out") + 1] = str(again)
    assert predictor_training.main(args) == 0
    from_store = json.loads((again / "report.json").read_text())
    assert (from_store["prompts"], from_store["label_counts"]) == (report["prompts"], report["label_counts"])
    # the teacher's shards keep token ids only: no conversation forms, and the report says why; the datastore's
    # requests file has the text: the held-out requests are also scored after an earlier turn (and trained on)
    assert "token ids only" in report["conversations"]["skipped"]
    scored = from_store["conversations"]
    assert scored["trained_on"] and set(scored["encoders"]["target-hidden"]) == {"prompt", "recent", "prompt+recent"}
    from memspec_ros.runtime.predictor import RankingHead

    head = RankingHead.load(again / "target-hidden")
    assert head.config.prompt_tokens == 16 and "prompt+recent/conversation_top1" in head.config.metrics


def test_a_teacher_folder_is_checked_as_the_build_checks_it_before_the_predictor_trains(tiny_target, tiny_build,
                                                                                       tmp_path, monkeypatch):
    """--answers <work dir>/teacher loaded the shards as they were: answers made by another target (another SmolLM2
    size or quantization, same tokenizer) trained a head stamped with this target's fingerprint, and the answers to
    training requests asking what a held-out request asks (which the build's drafts and datastore withhold) were
    trained on, then scored on the held-out request."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from memspec_ros.runtime import models
    from memspec_ros.zoo import predictor_training
    from memspec_ros.zoo.teacher import teacher_folder_answers

    path, tok, _ = tiny_target
    work = tmp_path / "work"
    shutil.copytree(tiny_build.work_dir / "teacher", work / "teacher")
    shutil.copytree(tiny_build.work_dir / "workloads", work / "workloads")
    every = load_answers(work / "teacher", "train")
    assert len(teacher_folder_answers(work / "teacher", tok, str(path))) == len(every)
    # a held-out request that asks what training row 0 asks: its answer is left out, as the build leaves it out
    first = json.loads((work / "workloads" / "train_requests.jsonl").read_text().splitlines()[0])
    with (work / "workloads" / "code.jsonl").open("a") as f:
        f.write(json.dumps({"domain": "code", "prompt": first["prompt"], "messages": first["messages"]}) + "\n")
    kept = teacher_folder_answers(work / "teacher", tok, str(path))
    assert len(kept) == len(every) - 1 and list(kept[0].prompt_ids) == list(every[1].prompt_ids)
    # answers another target made: refused before any model loads
    for shard in sorted((work / "teacher").glob("train-*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["meta"])
        save_file(tensors, str(shard), metadata={"meta": json.dumps({**meta, "target_digest": "0" * 64})})
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model loaded before the check"))
    with pytest.raises(SystemExit, match="made by another target"):
        predictor_training.main(["--registry", str(tiny_build.out_dir / "registry.yaml"), "--answers",
                                 str(work / "teacher"), "--out", str(tmp_path / "out"), "--quiet"])
    assert not (tmp_path / "out").exists()


def test_a_predictor_run_cut_before_its_last_encoder_leaves_the_predictor_as_it_was(tiny_build, tmp_path,
                                                                                     monkeypatch):
    """Each encoder's head was saved as soon as it was trained: a run cut during the second left one new head beside
    an old one and the old report."""
    from memspec_ros.zoo import predictor_training

    out = tmp_path / "predictor"
    args = ["--registry", str(tiny_build.out_dir / "registry.yaml"), "--answers", str(tiny_build.work_dir / "teacher"),
            "--out", str(out), "--encoders", "target-hidden", "--epochs", "2", "--quiet"]
    assert predictor_training.main(args) == 0
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def cut(*_a, **_k):
        raise KeyboardInterrupt  # the user's Ctrl-C while the second encoder loads

    monkeypatch.setattr(predictor_training, "MiniLMEncoder", cut)
    args[args.index("--encoders") + 1: args.index("--encoders") + 2] = ["target-hidden", "minilm"]
    args[args.index("--epochs") + 1] = "3"  # another head than the one kept
    with pytest.raises(KeyboardInterrupt):
        predictor_training.main(args)
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_the_model_card_reports_the_builds_files_and_says_which_goals_are_met(tiny_build, tmp_path):
    from memspec_ros.zoo.chat_card import render

    def path_latency(target_ms: float, draft_ms: float) -> dict:
        drafts = {d: {"1": draft_ms, "5": 1.5 * draft_ms} for d in DOMAINS}
        return {"target": {"1": target_ms, "5": 2 * target_ms}, **drafts}

    measured = {"threads": 1, "target_parameters": 134_500_000, "paths": ["none", "int4"],
                "latency_ms": {"none": path_latency(30.0, 0.5), "int4": path_latency(4.0, 0.2)},
                "vocab": {"rows": 8192, "train_coverage": 0.998, "heldout_coverage": 0.968},
                "drafts": {d: {"parameters": 2_500_000, "bytes_on_disk": 5_000_000} for d in DOMAINS}}
    matrix = {d: {w: (1.5 if d == w else 1.0) for w in WORKLOADS} for d in DOMAINS}
    acceptance = {
        "matrix": matrix,
        "oracle_static_gain": 0.25,
        "oracle_dynamic_gain_mixed": 0.05,
        "domain_gain_over_general": {d: {w: matrix[d][w] - 1 for w in DOMAINS} for d in DOMAINS if d != "general"},
    }
    text = render(measured, acceptance, tiny_build.work_dir)
    # per path: the draft's 1- and 5-token forwards and the target's 1-token forward over the draft's
    assert "| code | 0.50 | 0.75 | 60.0x | 0.20 | 0.30 | 20.0x |" in text
    assert "| target | 30.00 | 60.00 | 1.0x | 4.00 | 8.00 | 1.0x |" in text
    assert "vocabulary of 8192 target ids" in text and "99.8% of the training answers' tokens" in text
    assert "Drafts total 25.0 MB" in text
    assert "| oracle_static_gain >= 0.20 | 0.250 | yes |" in text
    assert "| oracle_dynamic_gain_mixed >= 0.10 | 0.050 | no |" in text
    assert "code +50%, math +50%, law +50%, medical +50% | yes |" in text
    general_meta = json.loads((tiny_build.work_dir / "ckpt" / "general" / "final" / "train_meta.json").read_text())
    assert f"| {general_meta['best_step']} of {general_meta['step']} |" in text
    # without the build's work directory, the steps come from the copies the zoo ships beside each draft
    shipped = json.loads((tiny_build.out_dir / "drafts" / "general" / "train_meta.json").read_text())
    alone = render(measured, acceptance, tmp_path / "no-build", tiny_build.out_dir)
    assert f"| {shipped['best_step']} of {shipped['step']} |" in alone
    assert "| answers of every domain (" in text
    # a general draft of the paper's recipe (--general-domains general) says what it learnt from
    paper_zoo = tmp_path / "paper"
    shutil.copytree(tiny_build.out_dir, paper_zoo)
    (paper_zoo / "drafts" / "general" / "train_meta.json").write_text(json.dumps({**shipped, "domains": ["general"]}))
    assert "| general answers only (" in render(measured, acceptance, tmp_path / "no-build", paper_zoo)
    # the shipped record wins over the work dir's, which may be of a draft trained again and not exported
    retrained = tmp_path / "retrained"
    (retrained / "ckpt" / "general" / "final").mkdir(parents=True)
    (retrained / "ckpt" / "general" / "final" / "train_meta.json").write_text(
        json.dumps({**general_meta, "best_step": 12345, "step": 23456}))
    assert f"| {shipped['best_step']} of {shipped['step']} |" in render(measured, acceptance, retrained,
                                                                        tiny_build.out_dir)
    # a draft with no training record and no measured size: n/a, not "0.00 -> 0.00" beside "? of ?"
    bare = tmp_path / "bare"
    shutil.copytree(tiny_build.out_dir, bare)
    (bare / "drafts" / "law" / "train_meta.json").unlink()
    measured["drafts"]["law"] = {}
    row = next(line for line in render(measured, acceptance, tmp_path / "no-build", bare).splitlines()
               if line.startswith("| law |"))
    assert row == "| law | n/a | n/a | law answers, from `general` (n/a) | n/a of n/a | n/a -> n/a |"


def test_the_build_refuses_stages_that_would_ship_or_cache_untrained_results(tiny_target, tiny_build, tmp_path):
    """export without trained drafts shipped random ones; vocab without answers cached a specials-only vocabulary."""
    path, _, _ = tiny_target
    work = tmp_path / "work"
    shutil.copytree(tiny_build.work_dir / "workloads", work / "workloads")
    fresh = replace(tiny_build, work_dir=work, out_dir=tmp_path / "out")
    with pytest.raises(ValueError, match="before vocab"):
        ChatZooBuild(fresh).run(["vocab"])
    assert not (work / "vocab.json").exists()
    shutil.copytree(tiny_build.work_dir / "teacher", work / "teacher")
    shutil.copy(tiny_build.work_dir / "vocab.json", work / "vocab.json")
    with pytest.raises(ValueError, match="no trained general, code, math, law, medical draft"):
        ChatZooBuild(fresh).run(["export"])
    assert not (tmp_path / "out" / "drafts").exists()
    # domains without general: each domain draft started from random weights and was cached as trained
    with pytest.raises(ValueError, match="run the general stage before domains"):
        ChatZooBuild(fresh).run(["domains"])
    assert not (work / "ckpt").exists()


def test_held_out_pool_check_counts_each_domains_mixed_pairs(monkeypatch):
    """code and medical are in three mixed pairs: a pool enough for two failed with a bare IndexError."""
    cfg = cw.ChatWorkloadConfig(heldout_per_workload=12, train_per_domain=5)
    two_pairs = cfg.heldout_per_workload + 2 * (cfg.heldout_per_workload // len(cw.MIXED_PAIRS) + 1)

    def source(domain):
        def make(c):
            held = 0
            for i in range(5000):
                q = cw.ChatRequest(domain, f"{domain}:{i}", f"{domain} request {i}")
                if split_of(q.source, c.heldout_fraction) == "heldout":
                    if held == two_pairs:
                        continue  # every domain gets what the old check asked for, no more
                    held += 1
                yield q
        return make

    monkeypatch.setattr(cw, "SOURCES", {d: source(d) for d in DOMAINS})
    with pytest.raises(ZooSetupError, match="held-out code requests"):
        cw.build_chat_workloads(cfg)


def test_a_setup_problem_in_a_stage_ends_the_build_in_one_line(tmp_path, monkeypatch):
    """Too few held-out requests on this machine, a missing source package or a checkpoint of another run raised a
    plain RuntimeError, which memspec-zoo build did not catch: a traceback for a problem its message explains."""
    from memspec_ros.zoo import chat_build
    from memspec_ros.zoo.cli import main

    def stage(self, stages):
        raise ZooSetupError("only 3 held-out code requests on this machine, 100 needed: install the sources")

    monkeypatch.setattr(chat_build.ChatZooBuild, "run", stage)
    with pytest.raises(SystemExit, match="^memspec-zoo build: only 3 held-out code requests"):
        main(["build", "--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / "o"), "--stages", "workloads"])


def test_the_model_card_says_n_a_for_gains_it_cannot_compute_and_scores_extra_drafts(tiny_build):
    from memspec_ros.zoo.chat_card import render

    lat = {"target": {"1": 30.0, "5": 60.0}, **{d: {"1": 0.5, "5": 0.75} for d in DOMAINS}}
    measured = {"threads": 1, "target_parameters": 1, "paths": ["none"], "latency_ms": {"none": lat},
                "vocab": {"rows": 10, "train_coverage": 1.0, "heldout_coverage": 1.0},
                "drafts": {d: {"parameters": 1, "bytes_on_disk": 1} for d in DOMAINS}}
    names = (*DOMAINS, "all-domains")
    acceptance = {"matrix": {d: dict.fromkeys(WORKLOADS, 0.0) for d in names}, "oracle_static_gain": None,
                  "oracle_dynamic_gain_mixed": None,
                  "domain_gain_over_general": {d: dict.fromkeys(DOMAINS) for d in names if d != "general"}}
    text = render(measured, acceptance, tiny_build.work_dir)
    assert "| oracle_static_gain >= 0.20 | n/a | no |" in text
    assert "| oracle_dynamic_gain_mixed >= 0.10 | n/a | no |" in text


def test_the_model_card_needs_the_vocabulary_figures_from_the_build_or_kept_measurements(tmp_path):
    from memspec_ros.zoo.chat_card import write_chat_card

    models = tmp_path / "models"
    models.mkdir()
    with pytest.raises(FileNotFoundError, match="--work-dir"):
        write_chat_card(models, tmp_path / "no-build", tmp_path / "acceptance.json")
    assert not (models / "MODEL_CARD.md").exists() and not (models / "card_measurements.json").exists()
    # another build's work dir (a relative path recorded in build_config.json, read from another checkout): its
    # vocabulary's coverage was reported as these drafts'
    (models / "drafts" / "general").mkdir(parents=True)
    (models / "drafts" / "general" / "draft_vocab.json").write_text(json.dumps({"target_ids": [1, 2, 3],
                                                                                "target_vocab_size": 10}))
    (tmp_path / "other-build").mkdir()
    (tmp_path / "other-build" / "vocab.json").write_text(json.dumps({"target_ids": [1, 2, 4], "rows": 3,
                                                                     "train_coverage": 0.9, "heldout_coverage": 0.8}))
    with pytest.raises(ValueError, match="another build's vocabulary than the drafts'"):
        write_chat_card(models, tmp_path / "other-build", tmp_path / "acceptance.json")
    assert not (models / "MODEL_CARD.md").exists() and not (models / "card_measurements.json").exists()


@pytest.mark.parametrize("argv", [
    ["build", "--teacher-requests", "-5"],  # sliced the last 5 requests off, silently
    ["build", "--train-per-domain", "-1"],
    ["build", "--teacher-chunk", "0"],  # failed inside the teacher with "range() arg 3 must not be zero"
    ["build", "--teacher-batch", "0"],
    ["build", "--general-minutes", "0"],  # trained nothing and exported the untrained draft
    ["build", "--domain-lr", "-1e-3"],
    ["build", "--domain-minutes", "nan"],
    ["build", "--general-domains", "codee"],  # a typo would have trained the general draft on nothing
    ["build", "--general-domains", "all,code"],
    ["build-toy", "--rollouts-per-source", "0"],  # failed in the rollouts after an hour of training the target
    ["build-toy", "--target-steps", "0"],  # saved an untrained target as done
    ["build-toy", "--target-minutes", "0"],
    ["build-toy", "--batch-size", "0"],
])
def test_the_build_refuses_bad_counts_before_any_work(argv, tmp_path, capsys):
    from memspec_ros.zoo.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--work-dir", str(tmp_path / "w"), "--stages", "workloads"])
    assert exit_info.value.code == 2 and not (tmp_path / "w").exists()
    assert "argument " + argv[1] in capsys.readouterr().err


def test_the_toy_build_refuses_one_rollout_per_source_before_any_work(tmp_path):
    """One rollout a source passed (a positive count), went to validation whole, and the domains stage failed in
    torch.randint on the empty training split, after the target's hour of training."""
    from memspec_ros.zoo.cli import main

    with pytest.raises(SystemExit, match=r"rollouts per source \(1\) must be at least 2"):
        main(["build-toy", "--rollouts-per-source", "1", "--domain-rollouts-per-source", "1", "--work-dir",
              str(tmp_path / "w"), "--out", str(tmp_path / "o"), "--stages", "workloads"])
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("argv, says", [
    # 66 over 4 heads: transformers refused it at the general stage, after the teacher and the vocabulary
    (["build", "--draft-hidden", "66"], "--draft-hidden 66 does not split into 4 attention heads of an even width"),
    # 4 heads of 25: a RuntimeError in the rotary embedding at the first draft forward
    (["build", "--draft-hidden", "100"], "--draft-hidden 100 does not split into 4 attention heads"),
    # 3 heads of 66.7 / 2 heads of 65: after the target's hour, and the work dir then refused the corrected flag
    (["build-toy", "--draft-hidden", "200"], "--draft-hidden 200 does not split into 3 attention heads"),
    (["build-toy", "--draft-hidden", "130"], "--draft-hidden 130 does not split into 2 attention heads"),
    (["build-toy", "--target-hidden", "200"], "--target-hidden 200 does not split into 3 attention heads"),
    (["build-toy", "--target-init", "/nowhere/target"], "--target-init /nowhere/target has no model.safetensors"),
])
def test_model_widths_and_a_starting_target_are_checked_before_the_work_dir_records_the_settings(argv, says,
                                                                                                  tmp_path):
    from memspec_ros.zoo.cli import main

    with pytest.raises(SystemExit, match=re.escape(says)):
        main([*argv, "--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / "o"), "--stages", "workloads"])
    assert not (tmp_path / "w").exists()


def test_a_toy_stage_run_before_the_one_whose_files_it_reads_ends_in_one_line(tmp_path):
    """build-toy caught ValueError only (build caught FileNotFoundError too): a stage before its inputs, or a
    --target-init folder emptied since, ended in a traceback."""
    from memspec_ros.zoo.cli import main

    with pytest.raises(SystemExit, match=r"^memspec-zoo build-toy: .*No such file or directory: .*corpora"):
        main(["build-toy", "--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / "o"), "--stages", "tokenizer"])


@pytest.mark.parametrize("command", ["build", "build-toy"])
def test_a_misspelt_stage_is_refused_before_the_work_dir_is_made(command, tmp_path):
    from memspec_ros.zoo.cli import main

    with pytest.raises(SystemExit, match="unknown stage"):
        main([command, "--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / "o"), "--stages", "teachr"])
    assert not (tmp_path / "w").exists()


def test_a_stage_run_before_its_inputs_says_what_to_run_and_bad_predictor_settings_are_refused(
        tiny_target, tmp_path, capsys):
    from memspec_ros.zoo import predictor_training
    from memspec_ros.zoo.cli import main

    (tmp_path / "w" / "workloads").mkdir(parents=True)
    with pytest.raises(SystemExit, match="comes from the vocab stage; run it"):  # was a FileNotFoundError traceback
        main(["build", "--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / "o"), "--stages", "general",
              "--target", str(tiny_target[0])])
    # an --out or --work-dir that cannot be written: said before any stage, not a traceback at export
    (tmp_path / "file").write_text("not a folder")
    for flag in ("--out", "--work-dir"):
        paths = {"--work-dir": str(tmp_path / "w"), "--out": str(tmp_path / "o"), flag: str(tmp_path / "file")}
        with pytest.raises(SystemExit, match=f"memspec-zoo build: {flag} .*file is a file; name a folder"):
            main(["build", *[x for kv in paths.items() for x in kv], "--stages", "export",
                  "--target", str(tiny_target[0])])
    assert (tmp_path / "file").read_text() == "not a folder"
    for bad in (["--heldout-fraction", "1"], ["--heldout-fraction", "0"], ["--max-prompts", "-1"]):
        with pytest.raises(SystemExit) as exit_info:  # every prompt held out trained a head on nothing
            predictor_training.main([*bad, "--out", str(tmp_path / "p")])
        assert exit_info.value.code == 2 and bad[0] in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_settings_the_chat_zoo_would_drop_are_refused(tiny_build, tmp_path):
    """The chat acceptance is greedy over stored answers: --sampling-temperature and --continuations were dropped
    silently; stored answers cut at another max_new_tokens were reused as if made at the one asked for."""
    from memspec_ros.zoo.cli import main
    from memspec_ros.zoo.teacher import answered_prompts, answered_rows

    for flag, value in (("--sampling-temperature", "0.9"), ("--continuations", str(tmp_path / "c.json"))):
        with pytest.raises(SystemExit, match=f"{flag} apply to the toy zoo only"):
            main(["acceptance", "--json", str(tmp_path / "a.json"), "--models",
                  str(Path(__file__).resolve().parents[1] / "models"), flag, value])
    teacher = tiny_build.work_dir / "teacher"
    prompts = answered_prompts(teacher, "train")
    assert answered_rows(prompts, teacher, "train", tiny_build.teacher.max_new_tokens) == len(prompts)
    with pytest.raises(ValueError, match="made with max_new_tokens"):
        answered_rows(prompts, teacher, "train", tiny_build.teacher.max_new_tokens + 1)
    # acceptance over a build's teacher folder: the fix is the length they were made with, not removing the folder
    # (it holds the build's training answers too)
    with pytest.raises(SystemExit, match=r"made with max_new_tokens \[10\].*--max-new-tokens 10\)"):
        main(["acceptance", "--json", str(tmp_path / "a.json"), "--models", str(tiny_build.out_dir),
              "--answers", str(teacher), "--max-new-tokens", "11"])
    assert not (tmp_path / "a.json").exists()


def test_acceptance_says_its_answers_folder_cannot_be_written_before_the_target_answers(tiny_build, tmp_path,
                                                                                        monkeypatch):
    """The target's answers to the held-out requests are stored in --answers (default <models>/answers): a folder
    that cannot be written (an installed share/ folder) failed after the target's minutes of answering."""
    import os

    from memspec_ros.runtime import models
    from memspec_ros.zoo import cli

    out = tmp_path / "out"  # writable: only the folder the answers would be made in is not
    out.mkdir()

    def read_only(path, mode, real=os.access):
        return real(path, mode) and not (mode == os.W_OK and os.path.samefile(path, tmp_path))

    monkeypatch.setattr(cli.os, "access", read_only)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the target loaded to answer"))
    with pytest.raises(SystemExit, match=r"answers are stored in .*new.*cannot be written to: give --answers"):
        cli.main(["acceptance", "--json", str(out / "a.json"), "--models", str(tiny_build.out_dir),
                  "--answers", str(tmp_path / "new")])
    assert not (tmp_path / "new").exists() and not (out / "a.json").exists()


def test_a_failed_export_leaves_the_zoo_as_it_was(tiny_build, tmp_path, monkeypatch):
    """Export replaced each draft in place and wrote the registry last: a failure on the third draft (a full disk)
    left new and old drafts mixed under a stale registry. Now nothing in the zoo changes unless all of it was
    written."""
    from memspec_ros.zoo import chat_build

    out = tmp_path / "zoo"
    shutil.copytree(tiny_build.out_dir, out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    real = chat_build.export_draft

    def failing(draft, tok, dest, *args, **kwargs):
        if dest.name == "math":
            raise OSError("No space left on device")
        return real(draft, tok, dest, *args, **kwargs)

    monkeypatch.setattr(chat_build, "export_draft", failing)
    with pytest.raises(OSError, match="No space left"):
        ChatZooBuild(replace(tiny_build, out_dir=out)).run(["export"])
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*")
             if p.is_file() and ".export-partial" not in p.parts}
    assert after == before
    monkeypatch.setattr(chat_build, "export_draft", real)
    ChatZooBuild(replace(tiny_build, out_dir=out)).run(["export"])  # and a rerun completes it
    assert not (out / ".export-partial").exists() and (out / "drafts" / "math" / "model.safetensors").is_file()


def test_an_export_that_replaces_the_drafts_sets_aside_what_the_old_ones_made(tiny_build, tmp_path, capsys):
    """Export replaced the drafts and left the predictor trained on the old ones beside them: the node loads
    <zoo>/predictor on its own, so it ranked the new drafts with a head made for others under the same names (and
    the acceptance report and card described the old drafts). Moved aside (kept), with the commands that remake
    them; an export that leaves the drafts as they were moves nothing."""
    out = tmp_path / "zoo"
    shutil.copytree(tiny_build.out_dir, out)
    (out / "predictor" / "target-hidden").mkdir(parents=True)
    (out / "predictor" / "target-hidden" / "head.safetensors").write_bytes(b"a head")
    (out / "acceptance.json").write_text("{}")
    ChatZooBuild(replace(tiny_build, out_dir=out)).run(["export"])  # the same drafts again
    assert (out / "predictor" / "target-hidden" / "head.safetensors").is_file() and (out / "acceptance.json").is_file()
    (out / "drafts" / "code" / "model.safetensors").write_bytes(b"other weights")  # drafts that export replaces
    capsys.readouterr()
    ChatZooBuild(replace(tiny_build, out_dir=out)).run(["export"])
    assert not (out / "predictor").exists() and not (out / "acceptance.json").exists()
    aside = out / "previous-drafts"
    assert (aside / "predictor" / "target-hidden" / "head.safetensors").read_bytes() == b"a head"
    assert (aside / "acceptance.json").read_text() == "{}"
    said = capsys.readouterr().out
    assert "moved to" in said and "memspec-train-predictor --registry" in said and "memspec-zoo card" in said
    # with the zoo's own JSON the heatmap goes to the zoo's acceptance_matrix.png, the card's (was --plot
    # acceptance.png, a file nothing shows)
    assert f"acceptance --models {out} --json {out / 'acceptance.json'};" in said and "--plot" not in said


def test_an_export_cut_short_after_moving_the_drafts_still_sets_aside_what_the_old_ones_made(
        tiny_build, tmp_path, monkeypatch):
    """The old drafts' predictor was set aside after the moves, by comparing the drafts before and after: an export
    cut short between the two (a full disk writing the registry) and rerun found the new drafts on both sides, and
    the predictor trained on the old ones stayed beside the new ones for good. So did the heatmap (the list named
    acceptance.png, the zoo's is acceptance_matrix.png)."""
    from memspec_ros.zoo import registry_io

    out = tmp_path / "zoo"
    shutil.copytree(tiny_build.out_dir, out)
    (out / "predictor").mkdir()
    (out / "predictor" / "head.safetensors").write_bytes(b"a head")
    (out / "acceptance_matrix.png").write_bytes(b"old heatmap")
    (out / "drafts" / "code" / "model.safetensors").write_bytes(b"other weights")
    real = registry_io.write_registry

    def failing(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(registry_io, "write_registry", failing)
    with pytest.raises(OSError, match="No space left"):
        ChatZooBuild(replace(tiny_build, out_dir=out)).run(["export"])
    monkeypatch.setattr(registry_io, "write_registry", real)
    ChatZooBuild(replace(tiny_build, out_dir=out)).run(["export"])
    assert not (out / "predictor").exists() and not (out / "acceptance_matrix.png").exists()
    assert (out / "previous-drafts" / "predictor" / "head.safetensors").read_bytes() == b"a head"
    assert (out / "previous-drafts" / "acceptance_matrix.png").read_bytes() == b"old heatmap"


def test_the_validation_split_keeps_each_answer_on_its_side_when_more_are_answered():
    """A shuffle of the whole answer list put other answers in validation when the build answered more requests:
    domain drafts rebuilt on more answers were validated on answers `general` had trained on. The side of an answer
    is now a function of its request; every domain still has validation answers."""

    def answer(i: int, domain: str) -> Answer:
        return Answer([1, i, i % 7], [5, 6], torch.zeros((2, 1), dtype=torch.int32),
                      torch.zeros((2, 1), dtype=torch.float16), domain)

    answers = [answer(i, DOMAINS[i % len(DOMAINS)]) for i in range(2000)]
    small_train, small_val = split_validation(answers[:1000])
    big_train, big_val = split_validation(answers)
    ids = {id(a) for a in big_val}
    assert {id(a) for a in small_val} <= ids and not {id(a) for a in small_train} & ids
    assert 0.02 < len(big_val) / len(answers) < 0.08  # about one in 20
    few = [answer(i, "law") for i in range(3)]  # a domain with few answers still gets one to validate on
    assert len(split_validation(few + answers[:40])[1]) >= 1
    assert any(a.domain == "law" for a in split_validation(few)[1])


def test_a_cached_draft_trained_with_other_settings_is_not_taken_for_these(tiny_build, tmp_path):
    """A rerun with more steps reported the draft "cached", and build_config.json then recorded the new steps."""
    work = tmp_path / "work"
    shutil.copytree(tiny_build.work_dir, work)
    more = replace(tiny_build, work_dir=work, out_dir=tmp_path / "out",
                   general_train=replace(tiny_build.general_train, max_steps=tiny_build.general_train.max_steps + 5))
    with pytest.raises(ValueError, match=r"cached general draft .* trained with other settings \(max_steps 6 -> 11\)"):
        ChatZooBuild(more).run(["general"])
    # the domains stage starts from the general draft: one of other settings is refused before any fine-tuning
    # (each domain draft cached here was fine-tuned from it, so they would all have been taken, and new ones trained
    # for hours from it, refused only at export)
    with pytest.raises(ValueError, match=r"cached general draft .* trained with other settings \(max_steps 6 -> 11\)"):
        ChatZooBuild(more).run(["domains"])
    # which validated step's weights are kept is the run's too: another validation period is another draft
    other_validation = replace(tiny_build, work_dir=work, out_dir=tmp_path / "out",
                               domain_train=replace(tiny_build.domain_train, validate_every=2))
    with pytest.raises(ValueError, match=r"cached code draft .* other settings \(validate_every 3 -> 2\)"):
        ChatZooBuild(other_validation).run(["domains"])
    ChatZooBuild(replace(tiny_build, work_dir=work, out_dir=tmp_path / "out")).run(["general"])  # same: cached
    ChatZooBuild(replace(tiny_build, work_dir=work, out_dir=tmp_path / "out")).run(["domains"])  # same: cached
    paper = replace(tiny_build, work_dir=work, out_dir=tmp_path / "out", general_domains=("general",))
    domains = r"\(domains code,general,law,math,medical,mixed -> general,"
    with pytest.raises(ValueError, match=r"cached general draft .* " + domains):
        ChatZooBuild(paper).run(["general"])  # the paper's recipe (general answers only) is not this draft
    shutil.rmtree(work / "ckpt" / "general")
    ChatZooBuild(paper).run(["general"])
    meta = json.loads((work / "ckpt" / "general" / "final" / "train_meta.json").read_text())
    assert meta["domains"] == ["general"]
    kept = split_validation(load_answers(work / "teacher", "train"))[0]
    assert meta["answers"] == sum(a.domain == "general" for a in kept)
    with pytest.raises(ValueError, match="unknown general-draft domain"):
        general_domains(("prose",))


def _perturbed(weights: Path) -> None:
    """``weights`` (a model's model.safetensors) changed as a retraining with other data would change it."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(weights))
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 0.01
    save_file(tensors, str(weights), metadata={"format": "pt"})


def test_drafts_built_on_a_changed_input_are_not_taken_as_cached(tiny_build, tmp_path):
    """Each draft records what it was built from: a general draft trained again under cached domain drafts, or a
    vocabulary made again under cached drafts, shipped drafts of two lineages (or old weights behind new ids)."""
    work = tmp_path / "work"
    shutil.copytree(tiny_build.work_dir, work)
    cfg = replace(tiny_build, work_dir=work, out_dir=tmp_path / "out")
    ChatZooBuild(cfg).run(["general", "domains"])  # unchanged: every draft cached
    more_steps = replace(cfg, domain_train=replace(cfg.domain_train, max_steps=cfg.domain_train.max_steps + 1))
    with pytest.raises(ValueError, match=r"cached code draft .* \(max_steps 3 -> 4\)"):
        ChatZooBuild(more_steps).run(["export"])  # build_config.json would have recorded 4 steps
    assert not cfg.out_dir.exists()
    _perturbed(work / "ckpt" / "general" / "final" / "model.safetensors")
    with pytest.raises(ValueError, match=r"cached code draft .* \(start [0-9a-f]+ -> [0-9a-f]+\)"):
        ChatZooBuild(cfg).run(["domains"])
    vocab = json.loads((work / "vocab.json").read_text())
    vocab["target_ids"][-2:] = vocab["target_ids"][-1:-3:-1]  # two ids swapped: another vocabulary, same size
    (work / "vocab.json").write_text(json.dumps(vocab))
    with pytest.raises(ValueError, match=r"cached general draft .* \(vocab [0-9a-f]+ -> [0-9a-f]+\)"):
        ChatZooBuild(cfg).run(["general"])
    more_rows = replace(cfg, arch=replace(cfg.arch, rows=cfg.arch.rows + 8))
    with pytest.raises(ValueError, match=r"vocab.json was made for other settings \(requested_rows 120 -> 128\)"):
        ChatZooBuild(more_rows).run(["vocab"])


def test_a_checkpoint_of_a_run_with_other_settings_is_not_resumed(tiny_build, tmp_path):
    """An interrupted general draft resumed with more steps kept its old horizon, stopped at the old step count and
    recorded the new one; its train_meta then matched the new settings, so nothing could tell."""
    work = tmp_path / "work"
    shutil.copytree(tiny_build.work_dir, work)
    shutil.rmtree(work / "ckpt" / "general" / "final")  # the run's checkpoint (ckpt/general/run) stays
    more = replace(tiny_build, work_dir=work, out_dir=tmp_path / "out",
                   general_train=replace(tiny_build.general_train, max_steps=tiny_build.general_train.max_steps + 5))
    with pytest.raises(ValueError, match=r"checkpoint .*run is a run with other settings \(max_steps 6 -> 11\)"):
        ChatZooBuild(more).run(["general"])
    assert not (work / "ckpt" / "general" / "final").exists()
    ChatZooBuild(replace(tiny_build, work_dir=work, out_dir=tmp_path / "out")).run(["general"])  # same: resumed
    assert json.loads((work / "ckpt" / "general" / "final" / "train_meta.json").read_text())["step"] == 6


def test_answers_made_for_other_requests_are_refused_not_paired_by_position(tiny_build, tmp_path):
    """Workloads written again after the teacher ran shifted the rows: the datastore withheld the wrong answers and
    the drafts learnt answers after other requests."""
    work = tmp_path / "work"
    shutil.copytree(tiny_build.work_dir, work)
    requests = work / "workloads" / "train_requests.jsonl"
    requests.write_text("".join(requests.read_text().splitlines(keepends=True)[1:]))  # the first request dropped
    before = (tiny_build.out_dir / "datastore.safetensors").read_bytes()
    out = tmp_path / "out"
    shutil.copytree(tiny_build.out_dir, out)
    cfg = replace(tiny_build, work_dir=work, out_dir=out)
    with pytest.raises(ValueError, match="made for other requests"):
        ChatZooBuild(cfg).run(["datastore"])
    assert (out / "datastore.safetensors").read_bytes() == before
    with pytest.raises(ValueError, match="made for other requests"):
        ChatZooBuild(cfg).run(["general"])


def test_drafts_are_not_distilled_on_a_teacher_run_that_stopped_part_way(tiny_build, tmp_path):
    """A teacher killed after some shards, then `build --stages vocab,...`: the drafts were distilled on the answers
    it had made while build_config.json recorded the full count."""
    work = tmp_path / "work"
    shutil.copytree(tiny_build.work_dir, work)
    cfg = replace(tiny_build, work_dir=work, out_dir=tmp_path / "out")
    shards = sorted(ChatZooBuild(cfg).teacher_dir.glob("train-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    (work / "vocab.json").unlink()
    with pytest.raises(ValueError, match="the teacher stage did not finish"):
        ChatZooBuild(cfg).run(["vocab"])
    assert not (work / "vocab.json").exists()


def test_cached_workloads_written_with_other_settings_are_refused(tiny_build, tmp_path):
    work = tmp_path / "work"
    shutil.copytree(tiny_build.work_dir, work)
    cfg = replace(tiny_build, work_dir=work, out_dir=tmp_path / "out")
    settings = json.loads(json.dumps(asdict(cfg.workloads), default=str))
    (work / "workloads" / "workload_config.json").write_text(json.dumps(settings))
    ChatZooBuild(cfg).run(["workloads"])  # the same settings: cached
    more = replace(cfg, workloads=replace(cfg.workloads, train_per_domain=cfg.workloads.train_per_domain + 1))
    with pytest.raises(ValueError, match=r"written with other settings \(train_per_domain .*\): run with"
                                         rf" --train-per-domain {cfg.workloads.train_per_domain} "):
        ChatZooBuild(more).run(["workloads"])
    # the workloads stage left out: the stages that read the requests refuse them too (--train-per-domain was
    # accepted, ignored, and recorded in build_config.json)
    (work / "vocab.json").unlink()
    with pytest.raises(ValueError, match=r"written with other settings \(train_per_domain"):
        ChatZooBuild(more).run(["teacher", "vocab"])


@pytest.mark.parametrize("target", ["pkg:no_such_package_here/model.gguf", "pkg:bad.name/x.gguf", "no/such/dir"])
def test_a_build_with_a_missing_target_says_so_before_any_stage_runs(target, tmp_path):
    """A mistyped --target failed with a ModelLoadError traceback after the workloads stage had written its files."""
    from memspec_ros.zoo.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["build", "--work-dir", str(tmp_path / "w"), "--target", target, "--stages", "workloads,teacher"])
    assert str(exit_info.value).startswith(f"memspec-zoo build: --target {target}:")
    assert not (tmp_path / "w" / "workloads").exists()


def test_a_build_whose_write_fails_midway_says_its_work_is_kept_and_how_to_go_on(tiny_target, tmp_path,
                                                                                 monkeypatch):
    """A full disk (OSError, or safetensors' own error type) ended hours of stages in a traceback that said neither
    that the finished work is kept nor how to go on; nor did a failed shard or checkpoint write remove its
    temporary file from the full disk (a shard's here; a checkpoint's is written by the same written_aside)."""
    from safetensors import SafetensorError

    from memspec_ros.zoo.cli import main

    path, _, _ = tiny_target
    for error in (OSError(28, "No space left on device"),
                  SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")):
        def full(self, stages, error=error):
            raise error

        monkeypatch.setattr(ChatZooBuild, "run", full)
        with pytest.raises(SystemExit) as exit_info:
            main(["build", "--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / "out"), "--target", str(path)])
        said = str(exit_info.value)
        assert said.startswith("memspec-zoo build: a write failed") and str(tmp_path / "w") in said
        assert "run the same command again" in said
    # a damaged file is no write failure: its own error, not the disk advice (rerunning would fail the same way)
    damaged = SafetensorError("Error while deserializing header: invalid header length")
    monkeypatch.setattr(ChatZooBuild, "run", lambda self, stages: (_ for _ in ()).throw(damaged))
    with pytest.raises(SafetensorError, match="invalid header length"):
        main(["build", "--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / "out"), "--target", str(path)])
    monkeypatch.undo()
    import safetensors.torch

    from memspec_ros.zoo.teacher import save_shard

    answer = Answer([1, 2], [3, 4], torch.zeros((2, 1), dtype=torch.int32), torch.zeros((2, 1), dtype=torch.float16))

    def no_space(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a shard")
        raise SafetensorError("Error while serializing: IoError(No space left on device)")

    monkeypatch.setattr(safetensors.torch, "save_file", no_space)
    (tmp_path / "shards").mkdir()
    with pytest.raises(SafetensorError):
        save_shard(tmp_path / "shards" / "train-00000.safetensors", [answer], {"split": "train"})
    assert list((tmp_path / "shards").iterdir()) == []  # no temporary file left on the full disk


def test_draft_gguf_with_a_target_that_is_no_gguf_says_so(tmp_path):
    """A target that is no GGUF file, or a mistyped pkg: target, raised a bare ValueError / ModelDirectoryError."""
    from memspec_ros.zoo.cli import main

    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"not a gguf file at all" * 10)
    draft = Path(__file__).parents[1] / "models" / "drafts" / "code"
    for target in (str(not_gguf), "pkg:no_such_package_here/model.gguf"):
        with pytest.raises(SystemExit) as exit_info:
            main(["draft-gguf", "--draft", str(draft), "--target", target, "--out", str(tmp_path / "d.gguf")])
        assert str(exit_info.value).startswith("memspec-zoo draft-gguf: "), exit_info.value
    assert not (tmp_path / "d.gguf").exists()


def test_drafts_never_learn_answers_to_requests_a_held_out_one_asks(tiny_build, tmp_path):
    """A work dir split before such requests were dropped kept their answers out of the datastore only: the
    vocabulary, the drafts' training and their early stopping still learnt them, and cached drafts that had were
    taken for this build's."""
    work, requests = _work_asking_heldout_material(tiny_build, tmp_path)
    build = ChatZooBuild(replace(tiny_build, work_dir=work, out_dir=tmp_path / "out"))
    contaminated = load_answers(work / "teacher", "train")[1]
    train_set, val = build._split()
    assert all(a.prompt_ids != contaminated.prompt_ids for a in [*train_set, *val])
    assert len(build.learning_answers()) == len(build.train_answers()) - 1
    with pytest.raises(ValueError, match=r"vocab.json was made for other settings \(answers"):
        build.run(["vocab"])
    with pytest.raises(ValueError, match=r"cached general draft .* \(answers"):
        build.run(["general"])


def test_drafts_distilled_on_answers_made_again_are_not_taken_as_cached(tiny_target, tiny_build, tmp_path):
    """The teacher's answers made again (another length, as its own error told the user to) with the same count:
    the vocabulary and every draft were reported cached and shipped as distilled on the new answers."""
    work = tmp_path / "work"
    shutil.copytree(tiny_build.work_dir, work)
    cfg = replace(tiny_build, work_dir=work, out_dir=tmp_path / "out")
    with pytest.raises(ValueError, match=r"made with max_new_tokens \[10\], not 11"):  # checked before any training
        ChatZooBuild(replace(cfg, teacher=replace(cfg.teacher, max_new_tokens=11))).run(["general"])
    shutil.rmtree(work / "teacher")
    longer = replace(cfg, teacher=replace(cfg.teacher, max_new_tokens=12))
    ChatZooBuild(longer).run(["teacher"])
    assert len(load_answers(work / "teacher", "train")) == len(load_answers(tiny_build.work_dir / "teacher", "train"))
    with pytest.raises(ValueError, match=r"vocab.json was made for other settings \(answers_digest"):
        ChatZooBuild(longer).run(["vocab"])
    with pytest.raises(ValueError, match=r"cached general draft .* \(answers_digest"):
        ChatZooBuild(longer).run(["general"])
    # a draft recorded before its answers were (an existing work dir): compared without them, not refused
    meta_path = work / "ckpt" / "general" / "final" / "train_meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["identity"]["answers_digest"]
    meta_path.write_text(json.dumps(meta))
    shutil.rmtree(work / "teacher")
    shutil.copytree(tiny_build.work_dir / "teacher", work / "teacher")
    ChatZooBuild(cfg).run(["general"])  # cached


def test_a_relative_target_is_written_where_the_registry_finds_it(tiny_target, tiny_build, tmp_path, monkeypatch):
    """The registry reads a path from its own folder: a --target relative to where the build ran named a file
    that was not there, and a '#' or ': ' in it broke the YAML."""
    from memspec_ros.runtime.loader import registry_target

    target = tmp_path / "target #1: tiny"
    shutil.copytree(tiny_target[0], target)
    monkeypatch.chdir(tmp_path)
    cfg = replace(tiny_build, target=target.name, out_dir=tmp_path / "out")
    ChatZooBuild(cfg).run(["export"])
    assert registry_target(cfg.out_dir / "registry.yaml") == str(target.resolve())


def test_a_zoo_built_from_a_hugging_face_folder_is_measured_as_a_chat_zoo(tiny_build, tmp_path):
    """Only a GGUF or package target was recognised: acceptance and card took such a zoo for the toy one (its
    reduced-vocabulary drafts loaded unwrapped, an IndexError on the first target id past their rows)."""
    from memspec_ros.testing.tiny_zoo import build_tiny_zoo
    from memspec_ros.zoo.cli import _is_chat_zoo, main

    assert _is_chat_zoo(tiny_build.out_dir)
    out = tmp_path / "acceptance.json"
    zoo_plot = tiny_build.out_dir / "acceptance_matrix.png"
    before = zoo_plot.stat().st_mtime_ns if zoo_plot.exists() else None
    assert main(["acceptance", "--json", str(out), "--models", str(tiny_build.out_dir), "--answers",
                 str(tiny_build.work_dir / "teacher"), "--max-new-tokens", str(tiny_build.teacher.max_new_tokens)]) == 0
    assert set(json.loads(out.read_text())["matrix"]) == set(DOMAINS)
    # the heatmap goes beside this JSON: the zoo's own, which its card shows, was overwritten
    assert (tmp_path / "acceptance.png").is_file()
    assert (zoo_plot.stat().st_mtime_ns if zoo_plot.exists() else None) == before
    assert not _is_chat_zoo(build_tiny_zoo(tmp_path / "toy", hidden=32, layers=1))  # full-vocabulary drafts, a folder


def test_a_zoo_moved_away_from_its_target_still_checks_the_stored_answers(tiny_build, tmp_path):
    """Export records a local target by its absolute path: on another machine the zoo has no target, and the stored
    answers were then checked by their count alone (answers cut at another length scored silently). The drafts ship
    the target's tokenizer, which checks them."""
    from memspec_ros.zoo.cli import main

    zoo = tmp_path / "zoo"
    shutil.copytree(tiny_build.out_dir, zoo)
    registry = zoo / "registry.yaml"
    registry.write_text(re.sub(r'(?m)^  path: ".*"$', '  path: "/no/such/target"', registry.read_text()))
    base = ["acceptance", "--json", str(tmp_path / "a.json"), "--models", str(zoo),
            "--answers", str(tiny_build.work_dir / "teacher")]
    with pytest.raises(SystemExit, match="--max-new-tokens 10"):  # answers cut at 10 tokens, scored as if 11
        main([*base, "--max-new-tokens", str(tiny_build.teacher.max_new_tokens + 1)])
    assert not (tmp_path / "a.json").exists()
    assert main([*base, "--max-new-tokens", str(tiny_build.teacher.max_new_tokens)]) == 0


def test_the_card_of_a_chat_zoo_reads_its_own_builds_work_dir(tiny_build, monkeypatch):
    """The card's --work-dir defaulted to the toy build's folder: a chat zoo's card then found no vocab.json and
    printed the figures kept from an earlier build, without a word."""
    from memspec_ros.zoo import chat_card
    from memspec_ros.zoo.cli import main

    seen = []
    monkeypatch.setattr(chat_card, "write_chat_card", lambda models, work, acceptance, notes: seen.append(work) or "")
    assert main(["card", "--models", str(tiny_build.out_dir)]) == 0
    assert seen == [Path(tiny_build.work_dir)]  # the work_dir its build_config.json records


def test_a_build_run_elsewhere_with_a_relative_work_dir_is_found_again(tiny_build, tmp_path, monkeypatch):
    """build_config.json recorded the work dir as given, and a relative one was read back from the source tree's
    root: a build run from another folder had its card and its gptq answers looked up in a folder it never used."""
    from memspec_ros.zoo.chat_build import ChatZooBuild, recorded_work_dir

    work = Path(tiny_build.work_dir)
    monkeypatch.chdir(work.parent)
    out = tmp_path / "elsewhere"
    ChatZooBuild(replace(tiny_build, work_dir=Path(work.name), out_dir=out)).run(["export"])
    assert recorded_work_dir(out) == work.resolve()


def test_the_predictor_can_learn_from_answers_the_drafts_never_trained_on(tiny_build, tmp_path, capsys):
    """Labels from the drafts' own training answers favour the domain drafts (fine-tuned on them) more than new
    requests do: --unseen-by-drafts keeps the build's validation bucket only, which no draft trained on."""
    from memspec_ros.zoo.predictor_training import main, unseen_by_drafts

    answers = load_answers(tiny_build.work_dir / "teacher", "train")
    train_set, val = ChatZooBuild(tiny_build)._split()
    unseen = unseen_by_drafts(answers, tiny_build.out_dir)
    assert [a.prompt_ids for a in unseen] == [a.prompt_ids for a in split_validation(answers)[1]]
    assert not {tuple(a.prompt_ids) for a in unseen} & {tuple(a.prompt_ids) for a in train_set}
    with pytest.raises(SystemExit, match="needs the zoo's build_config.json"):
        unseen_by_drafts(answers, tmp_path)
    with pytest.raises(SystemExit):
        main(["--registry", str(tiny_build.out_dir / "registry.yaml"), "--prompts", str(tmp_path / "p.jsonl"),
              "--unseen-by-drafts"])
    assert "--unseen-by-drafts selects among a zoo's stored --answers" in capsys.readouterr().err


def test_the_workload_overlap_script_groups_sources_by_file_module_and_icd_category():
    """scripts/workload_overlap.py (docs/results/workload-overlap.json): what "the same file, module or ICD
    category" means for each kind of source."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "workload_overlap.py"
    spec = importlib.util.spec_from_file_location("workload_overlap", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.source_group("code:ntpath.py:commonpath") == module.source_group("code:ntpath.py:join")
    assert module.source_group("medical:L414") == "L41" != module.source_group("medical:L501")
    assert module.source_group("law:/usr/share/doc/x/copyright#8") == "/usr/share/doc/x/copyright"
    assert module.spans("a b c d", 3) == {"a b c", "b c d"} and module.spans("a b", 3) == set()


def test_the_teacher_stage_before_the_workloads_says_which_stage_to_run(tiny_build, tmp_path):
    """In a fresh work dir it failed in a bare "[Errno 2] No such file or directory: .../code.jsonl"."""
    with pytest.raises(ValueError, match=r"code.jsonl: the requests come from the workloads stage; run it first"):
        ChatZooBuild(replace(tiny_build, work_dir=tmp_path / "fresh", out_dir=tmp_path / "out")).run(["teacher"])


def test_acceptance_of_a_few_requests_per_workload_has_the_target_answer_those_alone(tiny_build, tmp_path,
                                                                                    monkeypatch):
    """--prompts-per-workload 5 had the target answer every held-out request (600 in the bundled zoo, minutes on a
    CPU) into <models>/answers to score 5 of each workload. With no answers stored there yet, it answers the scored
    requests alone, in a cache folder of their own; the zoo's folder is left for the whole set."""
    from memspec_ros.zoo.chat_acceptance import first_per_domain, heldout_rows
    from memspec_ros.zoo.cli import main
    from memspec_ros.zoo.teacher import answered_prompts

    monkeypatch.setenv("MEMSPEC_CACHE_DIR", str(tmp_path / "cache"))
    zoo = tmp_path / "zoo"
    shutil.copytree(tiny_build.out_dir, zoo, ignore=shutil.ignore_patterns("answers"))
    rows = heldout_rows(zoo)
    scored = first_per_domain(rows, 1)
    assert len({r["domain"] for r in rows}) == len(scored) < len(rows)
    out = tmp_path / "a.json"
    assert main(["acceptance", "--json", str(out), "--models", str(zoo), "--prompts-per-workload", "1",
                 "--max-new-tokens", str(tiny_build.teacher.max_new_tokens)]) == 0
    assert not (zoo / "answers").exists()
    [folder] = {p.parent for p in (tmp_path / "cache").rglob("heldout-*.safetensors")}
    assert len(answered_prompts(folder, "heldout")) == len(scored)
    assert json.loads(out.read_text())["config"]["per_workload"] == 1


def test_an_export_interrupted_while_it_installs_a_draft_leaves_the_old_one_in_place(tmp_path, monkeypatch):
    """install_staged deleted a draft's old folder (a long rmtree) before moving the new one in: a Ctrl-C between
    the two left the zoo without a draft its registry.yaml lists."""
    import os

    from memspec_ros.zoo.registry_io import install_staged

    out, staging = tmp_path / "zoo", tmp_path / "zoo" / ".export-partial"
    for root, text in ((out, "old"), (staging, "new")):
        for name in ("general", "code"):
            (root / "drafts" / name).mkdir(parents=True)
            (root / "drafts" / name / "model.safetensors").write_text(f"{text} {name}")
    real = os.replace

    def interrupted(src, dst):
        if Path(src) == staging / "drafts" / "code":  # the new code draft's move
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        install_staged(staging, out, [Path("drafts/general"), Path("drafts/code")])
    monkeypatch.undo()
    assert (out / "drafts" / "general" / "model.safetensors").read_text() == "new general"
    assert (out / "drafts" / "code" / "model.safetensors").read_text() == "old code"  # as it was, not missing
    install_staged(staging, out, [Path("drafts/code")])  # run again: the rest goes in
    assert (out / "drafts" / "code" / "model.safetensors").read_text() == "new code" and not staging.exists()


def test_a_domain_whose_only_answer_is_kept_for_validation_is_refused_by_name(tiny_build, monkeypatch):
    """A domain's one answer went to validation (split_validation keeps one per domain there): its draft's
    fine-tuning was refused after the general draft's minutes as "no teacher answers to train on", naming neither
    the draft nor what to do."""
    build = ChatZooBuild(tiny_build)
    answers = load_answers(tiny_build.work_dir / "teacher", "train")
    lone = next(a for a in answers if a.domain == "law")
    monkeypatch.setattr(build, "learning_answers", lambda: [a for a in answers if a.domain != "law"] + [lone])
    with pytest.raises(ValueError, match=r"no training answers for law: .*--teacher-requests"):
        build._split(("law",))
    train_set, val = build._split(("code",))  # the other domains as before
    assert train_set and val


def test_a_build_refuses_to_export_over_a_folder_that_is_no_zoo_it_made(tiny_target, tmp_path, monkeypatch):
    """--out naming any folder had its drafts/ and workloads/ replaced without a word, and a toy zoo's marker
    survived the export, so a later build-toy export overwrote the chat zoo."""
    import os

    from memspec_ros.zoo.build import TOY_MARKER
    from memspec_ros.zoo.cli import main

    path, _, _ = tiny_target
    ran = []
    monkeypatch.setattr(ChatZooBuild, "run", lambda self, stages: ran.append(stages))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "registry.yaml").write_text("drafts: []\n")
    (tmp_path / "toy" / TOY_MARKER).write_text("")
    for out, said in (("mine", "holds other files (notes.txt) and no zoo"), ("toy", f"holds a toy zoo ({TOY_MARKER})")):
        with pytest.raises(SystemExit, match=re.escape(said)):
            main(["build", "--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / out), "--target", str(path)])
    assert ran == []  # refused before any stage
    # the stages that do not write --out run; a zoo a build made (or a new folder) is exported into
    main(["build", "--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / "mine"), "--target", str(path),
          "--stages", "workloads"])
    # an export cut short (the drafts move in first, build_config.json and registry.yaml last), and a zoo that only
    # its datastore stage wrote so far (it may run before export)
    from memspec_ros.zoo.registry_io import install_staged

    staging = tmp_path / "cut" / ".export-partial"
    (staging / "drafts" / "general").mkdir(parents=True)
    (staging / "build_config.json").write_text("{}")
    real_replace = os.replace

    def cut(src, dst):
        if Path(src).name == "build_config.json":
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", cut)
    with pytest.raises(KeyboardInterrupt):
        install_staged(staging, tmp_path / "cut", [Path("drafts/general"), Path("build_config.json")])
    monkeypatch.setattr(os, "replace", real_replace)
    assert sorted(p.name for p in (tmp_path / "cut").iterdir()) == [".export-partial", "drafts"]
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "datastore.safetensors").write_bytes(b"")
    for out in ("cut", "store"):
        main(["build", "--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / out), "--target", str(path)])
    assert len(ran) == 3
