"""The target's own answers to chat requests, computed once and stored with top-k soft labels.

Distilling a draft from a 49,152-token target with the target run live costs
two full-vocabulary softmaxes per position per step (about 6 s per 8x128-token
step here); running the teacher once and storing its greedy answer and its
top-k log-probabilities per answer position makes every later training step
a small draft's own cost.  The same answers are the held-out references of
the acceptance matrix (teacher-forced, which is exact for greedy acceptance).

Requests are answered in batches of similar prompt length, left-padded, with a
logits processor that records the top-k of the target's raw logits at each
step.  Batched padded greedy decoding can differ from unpadded decoding in a
late digit; the answers are training data and references for draft agreement,
never a claim about losslessness (the engine's tests check that).

Output: ``<out_dir>/<split>-<chunk>.safetensors`` shards (resumable: finished
shards are skipped) holding, for each request, its prompt ids and answer ids
concatenated flat with offsets, and ``top_ids``/``top_logp`` per answer token.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from memspec_ros.runtime.atomic_write import held_lock, written_aside
from memspec_ros.runtime.chat import end_token_ids, prompt_ids
from memspec_ros.runtime.jsonl import read_jsonl
from memspec_ros.runtime.model_source import earlier_identities


@dataclass
class TeacherConfig:
    max_new_tokens: int = 128
    batch_size: int = 32
    top_k: int = 8
    chunk_requests: int = 128  # requests per shard: the unit of resumption
    threads: int = 0  # 0: torch's default


@dataclass
class Answer:
    """One request answered: prompt and answer token ids, top-k labels per answer token."""

    prompt_ids: list[int]
    answer_ids: list[int]
    top_ids: torch.Tensor  # [len(answer_ids), k] int32
    top_logp: torch.Tensor  # [len(answer_ids), k] float16
    domain: str = ""
    # the request as (role, text) turns where known (a datastore's requests file; teacher shards keep ids only)
    messages: tuple[tuple[str, str], ...] = ()


def chat_prompt_ids(tokenizer, messages: Sequence[dict], system_prompt: str = "") -> list[int]:
    """The token ids the target sees for a chat, built exactly as the node builds a goal's."""
    return prompt_ids(tokenizer, "", [(m["role"], m["content"]) for m in messages], system_prompt=system_prompt)


class _TopK:
    """A logits processor that keeps the top-k log-probabilities of every step and changes nothing."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(scores.float(), dim=-1)
        values, ids = logp.topk(self.k, dim=-1)
        self.steps.append((ids.to(torch.int32), values.to(torch.float16)))
        return scores


@torch.inference_mode()
def answer_batch(model, prompts: list[list[int]], cfg: TeacherConfig, eos_ids: set[int], pad_id: int) -> list[Answer]:
    from transformers import LogitsProcessorList

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    recorder = _TopK(cfg.top_k)
    dev = next(model.parameters()).device  # a GPU answers a build's requests in minutes (--device cuda)
    out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), do_sample=False,
                         max_new_tokens=cfg.max_new_tokens, logits_processor=LogitsProcessorList([recorder]),
                         pad_token_id=pad_id, eos_token_id=sorted(eos_ids)).cpu()
    top_ids = torch.stack([s[0] for s in recorder.steps], dim=1).cpu()  # [B, steps, k]
    top_logp = torch.stack([s[1] for s in recorder.steps], dim=1).cpu()
    answers = []
    for i, p in enumerate(prompts):
        gen = out[i, width:].tolist()
        n = len(gen)
        for j, t in enumerate(gen):
            if t in eos_ids:
                n = j + 1  # keep the end-of-turn token: drafts should learn to propose it
                break
        answers.append(Answer(p, gen[:n], top_ids[i, :n].clone(), top_logp[i, :n].clone()))
    return answers


def save_shard(path: Path, answers: list[Answer], meta: dict) -> None:
    from safetensors.torch import save_file

    def offsets(lengths: list[int]) -> torch.Tensor:
        return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)

    tensors = {
        "prompt_ids": torch.tensor([t for a in answers for t in a.prompt_ids], dtype=torch.int32),
        "prompt_offsets": offsets([len(a.prompt_ids) for a in answers]),
        "answer_ids": torch.tensor([t for a in answers for t in a.answer_ids], dtype=torch.int32),
        "answer_offsets": offsets([len(a.answer_ids) for a in answers]),
        "top_ids": torch.cat([a.top_ids for a in answers]).contiguous(),
        "top_logp": torch.cat([a.top_logp for a in answers]).contiguous(),
    }
    # its existence marks the chunk answered; a write that fails (a full disk) leaves no temporary file behind
    with written_aside(path, sync=True) as tmp:
        save_file(tensors, str(tmp), metadata={"meta": json.dumps(meta)})


def load_shard(path: Path) -> list[Answer]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
        domains = json.loads(f.metadata()["meta"])["domains"]
    po, ao = t["prompt_offsets"].tolist(), t["answer_offsets"].tolist()
    return [Answer(t["prompt_ids"][po[i]:po[i + 1]].tolist(), t["answer_ids"][ao[i]:ao[i + 1]].tolist(),
                   t["top_ids"][ao[i]:ao[i + 1]], t["top_logp"][ao[i]:ao[i + 1]], domains[i])
            for i in range(len(domains))]


def load_answers(out_dir: Path, split: str) -> list[Answer]:
    return [a for shard in sorted(out_dir.glob(f"{split}-*.safetensors")) for a in load_shard(shard)]


def requests_digest(requests: Path, count: int) -> str:
    """sha256 of the first ``count`` rows of a requests file (its non-empty lines, as written): what a datastore's
    answers pair with by position, recorded in the file so that other requests are refused, not mispaired."""
    import hashlib

    lines = [line for line in Path(requests).read_text(encoding="utf-8").splitlines() if line.strip()][:count]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def datastore_answers(datastore: Path, tokenizer, requests: Path | None = None, target: str | None = None
                      ) -> list[Answer]:
    """The training answers a zoo's datastore file keeps, paired with their requests: it holds the target's
    greedy answer to row ``i`` of the zoo's ``workloads/train_requests.jsonl`` (``requests``, by default beside
    the file) as answer ``i`` (the build's datastore stage). Only the greedy tokens are kept, so each answer's
    one label is its own token (top-1). With ``target``, a datastore made by another target (another model of the
    same tokenizer: a larger SmolLM2, another quantization) is refused, as the teacher's shards are."""
    from memspec_ros.runtime.datastore import read_answers
    from memspec_ros.runtime.models import tokenizer_fingerprint

    requests = requests or Path(datastore).parent / "workloads" / "train_requests.jsonl"
    if not requests.is_file():
        raise FileNotFoundError(f"no training requests at {requests}: the datastore's answers pair with the zoo's"
                                " workloads/train_requests.jsonl (pass the zoo's models/datastore.safetensors)")
    stored, meta = read_answers(datastore, tokenizer_fingerprint(tokenizer))
    rows = read_jsonl(requests)
    if len(stored) > len(rows):  # the answers after the last request were dropped without a word
        raise ValueError(f"{datastore} holds {len(stored)} answers but {requests} only {len(rows)} requests: the"
                         " datastore was made for other requests; give the zoo it was built with")
    # answer i goes with row i: requests rebuilt on another machine (other sources, another Python's stdlib) paired
    # each answer with another request, with the count alone checked (a datastore made before session 44 has no
    # digest: its count is all that can be checked)
    if meta.get("requests_sha256") and meta["requests_sha256"] != requests_digest(requests, len(stored)):
        raise ValueError(f"{datastore} was made for other training requests than {requests} (their digest differs):"
                         " give the zoo it was built with, or rebuild its datastore stage")
    if target is not None and meta.get("target_digest"):  # (a datastore made before session 58 records none)
        from memspec_ros.runtime.model_source import answers_identity

        if meta["target_digest"] != (this := answers_identity(target)):
            raise ValueError(f"{datastore} holds the answers of another target (digest {meta['target_digest'][:12]},"
                             f" {target} is {this[:12]}): labels from them would teach the predictor another model's"
                             " acceptance. Give that target, or this target's own zoo")
    answers = []
    for row, tokens in zip(rows, stored, strict=False):  # the datastore holds the first len(stored) requests
        ids = tokens.tolist()
        if not ids:  # withheld (its request asks what a held-out one asks: chat_workloads.withhold_heldout)
            continue
        answers.append(Answer(chat_prompt_ids(tokenizer, row["messages"]), ids,
                              torch.tensor(ids, dtype=torch.int32)[:, None],
                              torch.zeros((len(ids), 1), dtype=torch.float16), row["domain"],
                              tuple((m["role"], m["content"]) for m in row["messages"])))
    return answers


def teacher_folder_answers(folder: Path, tokenizer, target: str, requests: Path | None = None) -> list[Answer]:
    """The training answers a zoo build's teacher folder holds, checked as the build checks them: made by
    ``target`` (its digest), at one length, for the rows of the work dir's ``workloads/train_requests.jsonl``
    (``requests``) in order. Answers to requests that ask what a held-out request asks are left out, as the build's
    drafts and datastore leave them out: a predictor trained on them is scored on requests it has seen."""
    from memspec_ros.runtime.model_source import answers_identity

    from .chat_workloads import asks_heldout

    folder = Path(folder)
    requests = requests or folder.parent / "workloads" / "train_requests.jsonl"
    if not requests.is_file():
        raise FileNotFoundError(f"no training requests at {requests}: a teacher folder's answers pair with its build's"
                                " workloads/train_requests.jsonl (give <work dir>/teacher of a memspec-zoo build)")
    limits = answered_limits(folder, "train")
    if len(limits) > 1:
        raise ValueError(f"the train answers in {folder} were made with several lengths (max_new_tokens"
                         f" {sorted(limits)}): folders were mixed; give one build's teacher folder")
    answers = load_answers(folder, "train")
    rows = read_jsonl(requests)
    if len(rows) < len(answers):
        raise ValueError(f"{folder} holds {len(answers)} training answers but {requests} only {len(rows)} requests:"
                         " the answers were made for other requests; give the work dir they were built in")
    # raises for answers made by another target or for other requests (rows in another order, rewritten)
    answered_rows([chat_prompt_ids(tokenizer, r["messages"]) for r in rows[: len(answers)]], folder, "train",
                  target_digest=answers_identity(target))
    held = asks_heldout(requests, requests.parent)
    return [a for a, asks in zip(answers, held, strict=False) if not asks]


def answered_prompts(out_dir: Path, split: str) -> list[list[int]]:
    """The prompt ids of every answer already stored for ``split``, in shard order (the rows answered so far)."""
    from safetensors import safe_open

    prompts: list[list[int]] = []
    for shard in sorted(Path(out_dir).glob(f"{split}-*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            ids, offsets = f.get_tensor("prompt_ids").tolist(), f.get_tensor("prompt_offsets").tolist()
        prompts += [ids[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
    return prompts


def _shard_metas(out_dir: Path, split: str) -> list[dict]:
    """The metadata ``save_shard`` stored in each ``split`` shard, in shard order."""
    from safetensors import safe_open

    metas = []
    for shard in sorted(Path(out_dir).glob(f"{split}-*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            metas.append(json.loads((f.metadata() or {}).get("meta", "{}")))
    return metas


def answered_limits(out_dir: Path, split: str) -> set[int]:
    """The max_new_tokens the stored ``split`` answers were made with (one value, unless folders were mixed)."""
    return {int(m["max_new_tokens"]) for m in _shard_metas(out_dir, split) if "max_new_tokens" in m}


def answered_settings(out_dir: Path, split: str) -> list[dict]:
    """The decoding settings the stored ``split`` answers were made with, each once, in shard order: batched,
    left-padded greedy decoding may split a near-tie otherwise at another batch size or on another device, so a
    build resumed with others holds answers of both (build_config.json records this list). Shards made before
    they were recorded count as {}."""
    seen: list[dict] = []
    for meta in _shard_metas(out_dir, split):
        made = {k: meta[k] for k in ("batch_size", "device") if k in meta}
        if made not in seen:
            seen.append(made)
    return seen


def answered_targets(out_dir: Path, split: str) -> set[str]:
    """The identities (model_source.answers_identity) of the targets the stored ``split`` answers were made by, where
    their shards record one."""
    return {m["target_digest"] for m in _shard_metas(out_dir, split) if m.get("target_digest")}


def answered_rows(prompts: list[list[int]], out_dir: Path, split: str, max_new_tokens: int | None = None,
                  target_digest: str | None = None) -> int:
    """How many of the requests (their prompt ids, in order) the stored ``split`` answers already cover; raises if
    the stored answers were made for other requests, or (with ``target_digest``) by another target."""
    other = answered_targets(out_dir, split) - {target_digest} if target_digest else set()
    if other and other <= earlier_identities(target_digest):
        raise ValueError(f"the {split} answers in {out_dir} were made by this target's weights, recorded before all of"
                         " its config, generation_config, tokenizer and chat template files were part of its"
                         " identity: those decide where an answer stops, so the answers cannot be shown to be this"
                         " target's. Answer into another folder, or remove that one")
    if other:  # another model with the same tokenizer (a larger SmolLM2, another quantization) was taken silently
        raise ValueError(f"the {split} answers in {out_dir} were made by another target (digest"
                         f" {', '.join(sorted(d[:12] for d in other))}, this one {target_digest[:12]}): answer into"
                         " another folder, or remove that one")
    done = answered_prompts(out_dir, split)
    other = answered_limits(out_dir, split) - {max_new_tokens} if max_new_tokens is not None else set()
    if other:  # the stored answers are cut at another length: resumed or reused, they were taken silently
        # the harmless way first: the answers took minutes to hours, and a build cannot pick another folder
        keep = f"run with --max-new-tokens {next(iter(other))} (the length they were made with), " \
            if len(other) == 1 else ""
        raise ValueError(f"the {split} answers in {out_dir} were made with max_new_tokens {sorted(other)}, not"
                         f" {max_new_tokens}: {keep}answer into another folder, or remove that one")
    mismatch = next((i for i, (a, b) in enumerate(zip(done, prompts, strict=False)) if a != b), None)
    if mismatch is not None:
        raise ValueError(f"the {split} answers in {out_dir} were made for other requests (stored answer {mismatch}"
                         f" has another prompt than request {mismatch}): answer these requests into another folder,"
                         " or remove that one")
    return min(len(done), len(prompts))


def answer_requests(model, tokenizer, rows: list[dict], out_dir: Path, split: str, cfg: TeacherConfig,
                    progress=None, target_digest: str | None = None) -> int:
    """Answer every row (``domain``, ``messages``) into shards; returns the number of answer tokens made now.

    Resumable by rows, not by file names: the shards already there must hold the first rows' requests (their
    stored prompts are compared), and only the rows after them are answered, in new shards numbered on. So a
    resumed run may use another ``chunk_requests`` (a GPU wants larger ones), and shards made for another
    request list are refused instead of being taken for these rows' answers."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = out_dir / f".{split}.lock"
    # one process answers into a folder at a time: two (two acceptance runs on one answers cache) numbered their
    # shards alike and wrote one temporary file; the second resumes after whatever the first answered
    with held_lock(lock, lambda: print(f"[teacher] another process is answering into {out_dir}: waiting for it",
                                       flush=True)):
        return _answer_requests(model, tokenizer, rows, out_dir, split, cfg, progress, target_digest)


def _answer_requests(model, tokenizer, rows: list[dict], out_dir: Path, split: str, cfg: TeacherConfig,
                     progress, target_digest: str | None) -> int:
    prompts = [chat_prompt_ids(tokenizer, r["messages"]) for r in rows]
    covered = answered_rows(prompts, out_dir, split, cfg.max_new_tokens, target_digest)
    if progress is not None:
        progress.update(covered)
    eos_ids = set(end_token_ids(tokenizer, model))
    pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    made = 0
    settings = {"batch_size": cfg.batch_size, "device": str(next(model.parameters()).device)}
    before = [s for s in answered_settings(out_dir, split) if s != settings] if 0 < covered < len(rows) else []
    if before:  # said, and recorded per shard: a build's answers then come from both settings
        print(f"[teacher] resuming {out_dir} with {settings}; its first {covered} answers were made with"
              f" {', '.join(map(str, before))} (greedy decoding may part at a near-tie between them)", flush=True)
    next_shard = len(list(out_dir.glob(f"{split}-*.safetensors")))
    for start in range(covered, len(rows), cfg.chunk_requests):
        path = out_dir / f"{split}-{next_shard:05d}.safetensors"
        next_shard += 1
        chunk = rows[start:start + cfg.chunk_requests]
        chunk_prompts = prompts[start:start + cfg.chunk_requests]
        order = sorted(range(len(chunk)), key=lambda i: len(chunk_prompts[i]))  # similar lengths pad little
        answers: list[Answer | None] = [None] * len(chunk)
        t0 = time.perf_counter()
        for b in range(0, len(order), cfg.batch_size):
            idx = order[b:b + cfg.batch_size]
            batch = answer_batch(model, [chunk_prompts[i] for i in idx], cfg, eos_ids, pad_id)
            for i, a in zip(idx, batch, strict=True):
                a.domain = chunk[i]["domain"]
                answers[i] = a
            if progress is not None:
                progress.update(len(idx))
        tokens = sum(len(a.answer_ids) for a in answers)
        made += tokens
        save_shard(path, answers, {"domains": [r["domain"] for r in chunk], "seconds": time.perf_counter() - t0,
                                   "tokens": tokens, "top_k": cfg.top_k, "max_new_tokens": cfg.max_new_tokens,
                                   **settings,
                                   **({"target_digest": target_digest} if target_digest else {})})
    return made


def main(argv: list[str] | None = None) -> int:
    import argparse

    from tqdm import tqdm

    from ..runtime.model_source import answers_identity, resolve_model_path
    from ..runtime.models import ModelSpec, load_model, load_tokenizer

    ap = argparse.ArgumentParser(description="answer chat requests with the target, store top-k labels")
    ap.add_argument("--target", required=True)
    ap.add_argument("--requests", type=Path, nargs="+", required=True, help="JSONL files of chat requests")
    ap.add_argument("--split", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch-size", type=int, default=TeacherConfig.batch_size)
    ap.add_argument("--max-new-tokens", type=int, default=TeacherConfig.max_new_tokens)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    path = resolve_model_path(a.target)
    model = load_model(ModelSpec(str(path))).model
    tok = load_tokenizer(path)
    rows = [row for f in a.requests for row in read_jsonl(f)]
    cfg = TeacherConfig(batch_size=a.batch_size, max_new_tokens=a.max_new_tokens)
    with tqdm(total=len(rows), desc=f"teacher {a.split}", unit="req") as bar:
        made = answer_requests(model, tok, rows, a.out, a.split, cfg, bar, answers_identity(a.target))
    print(f"{made} answer tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
