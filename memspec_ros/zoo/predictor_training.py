"""Train the Prediction Engine's ranking head from exact speculative-decoding traces.

Greedy output does not depend on the draft, so for each training prompt the
target's greedy continuation is fixed and every draft's acceptance at every
position is known exactly from one teacher-forced draft forward (see oracle.py).
Walking the continuation in scheduling intervals of N iterations, each context
x_i = [prompt ; last T tokens] is labelled with the draft that accepts the most
tokens over the rest of the output (``--label-horizon 0``, the default) or commits the
most over the next H intervals (1: the paper's highest decoding utility over the next
interval); ties go to the draft that is best over the whole output. The walk follows
the labelled draft one interval at a time, as Oracle-Dynamic would. On the bundled zoo
the next interval's winner is mostly noise (which draft wins it is not predictable
even from the previous interval's exact outcome), and a head trained on a longer
horizon ran MemSpec faster on every held-out workload (docs/results/README.md; the
bundled head's labels were each request's best whole-output draft, see there).

The prompt half pools the prompt's last W positions (``--prompt-tokens``, 16): the latest request's end and
the reply's header. Pooled over the whole prompt, a system prompt or an earlier turn outweighed the request
the generation answers. Every training request is also traced as the latest turn after another training
request of another domain and the target's answer to it (:func:`conversation_forms`), trained on and scored on
the held-out prompts ("after an earlier turn" in the report). Why: docs/results/predictor-window.txt
(scripts/predictor_window_features.py, session 35, on the bundled zoo's training split), where W = 16 alone took
held-out top-1 after an earlier turn from 48.1% (whole prompt) to 82.9%, and training on conversation forms (there
also under system prompts) to 84.5%.

The encoder stays frozen; only the small head is trained (full batch, seeded,
deterministic). Held-out contexts come from held-out *prompts*, so the reported
accuracy is on prompts the head never saw. Three heads are trained per encoder to
reproduce the paper's Table 2 (prompt only, recent only, prompt + recent); the
prompt + recent head is saved as the runtime predictor.

    memspec-train-predictor --answers models/datastore.safetensors --max-prompts 900 --out models/predictor

(the bundled zoo's: its datastore holds the target's answers to the training requests, so nothing is decoded),
or ``--prompts FILE`` to decode the target on training requests of your own.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from memspec_ros.runtime.atomic_write import publish_dir, write_text_atomic
from memspec_ros.runtime.chat import end_token_ids
from memspec_ros.runtime.loader import PREDICTOR_PREFERENCE, find_predictor
from memspec_ros.runtime.oracle import ContinuationCache, draft_agreement, interval_walk
from memspec_ros.runtime.predictor import (
    ENCODERS,
    HEAD_CONFIG,
    INPUTS,
    HeadConfig,
    MiniLMEncoder,
    RankingHead,
    mask_input,
    pooled_hidden_features,
    target_fingerprint,
)

from ..argtypes import controller_limit, int_in, non_negative_int, positive_int, unwritable


@dataclass
class TraceContext:
    """One scheduling point of one training prompt."""

    prompt_index: int
    interval: int
    position: int  # generated tokens committed before this point
    utilities: dict[str, int]  # tokens each draft would commit over the next N iterations
    label: str


@dataclass
class PromptTrace:
    prompt_ids: list[int]
    continuation: list[int]
    agreement: dict[str, list[bool]]
    contexts: list[TraceContext] = field(default_factory=list)
    messages: list[tuple[str, str]] = field(default_factory=list)  # the request's turns, where known
    domain: str = ""  # where known (a conversation form's earlier turn is of another domain)


# what a report's labels are (figures.py reads it): a report without it, from before window_score, labelled every
# context of a request with that request's best whole-output draft at horizon 0
LABEL_RULE = "committed, then accepted, over the window"


def window_score(agree: Sequence[bool], position: int, gamma: int, iterations: int) -> tuple[int, int]:
    """A draft over the next ``iterations`` from ``position``: (tokens committed, tokens accepted); the second
    decides where every draft reaches the output's end inside the window."""
    committed, accepted = interval_walk(agree, position, gamma, iterations)
    return committed, sum(accepted)


def trace_prompt(index: int, prompt_ids: list[int], continuation: list[int], agreement: dict[str, list[bool]],
                 drafts: list[str], gamma: int, interval: int, horizon: int = 1) -> PromptTrace:
    """Label every scheduling point of one prompt with its best draft (ties: best whole-output draft).

    ``horizon``: the intervals a label looks ahead, 1 the paper's next interval (the most tokens committed in it),
    H > 1 the next H intervals, 0 the rest of the output; the walk follows the labelled draft one interval at a
    time either way. Over a window that reaches the output's end every draft commits all that is left, so there
    the draft that needs the fewest iterations (accepts the most tokens) wins; over the rest of the output that is
    every context (horizon 0 labelled every context of a request with its best whole-output draft until this
    rule)."""
    whole = {d: sum(interval_walk(agreement[d], 1, gamma, len(continuation))[1]) for d in drafts}
    order = sorted(drafts, key=lambda d: -whole[d])
    trace = PromptTrace(prompt_ids, continuation, agreement)
    ahead = horizon * interval if horizon > 0 else len(continuation)  # iterations a label counts
    position, i = 1, 0  # the first token comes from prefill
    while position < len(continuation):
        utilities = {d: interval_walk(agreement[d], position, gamma, interval)[0] for d in drafts}
        scores = {d: (utilities[d],) for d in drafts} if ahead == interval else {
            d: window_score(agreement[d], position, gamma, ahead) for d in drafts}
        label = max(order, key=lambda d: scores[d])  # max keeps the first of equals: whole-output order
        trace.contexts.append(TraceContext(index, i, position, utilities, label))
        position += utilities[label]
        i += 1
    return trace


def collect_traces(target, drafts: dict[str, torch.nn.Module], prompts: list[list[int]], max_new_tokens: int,
                   gamma: int, interval: int, eos_token_ids=(), progress: bool = True,
                   cache: ContinuationCache | None = None, horizon: int = 1,
                   messages: Sequence[Sequence[tuple[str, str]]] | None = None,
                   domains: Sequence[str] | None = None) -> list[PromptTrace]:
    """``messages``, ``domains``: each prompt's turns and domain (for :func:`conversation_forms`), where known."""
    from tqdm import tqdm

    cache = cache or ContinuationCache(None, "")  # in memory only
    traces = []
    bar = tqdm(prompts, desc="traces", disable=not progress, file=sys.stderr, mininterval=2)
    for index, prompt_ids in enumerate(bar):
        continuation = cache.continuation(target, prompt_ids, max_new_tokens, eos_token_ids)
        if len(continuation) < 2:
            continue
        agreement = {name: draft_agreement(model, prompt_ids, continuation) for name, model in drafts.items()}
        traces.append(trace_prompt(index, prompt_ids, continuation, agreement, list(drafts), gamma, interval, horizon))
        traces[-1].messages = list(messages[index]) if messages is not None else []
        traces[-1].domain = domains[index] if domains is not None else ""
    return traces


@torch.inference_mode()
def hidden_features(target, traces: list[PromptTrace], recent_tokens: int, progress: bool = True,
                    prompt_tokens: int = 0) -> list[torch.Tensor]:
    """[prompt mean ; recent mean] of the target's final hidden states, as the runtime hook sees them."""
    from tqdm import tqdm

    decoder = getattr(target, "model", None) or target.get_decoder()
    device = next(target.parameters()).device
    rows = []
    for trace in tqdm(traces, desc="target-hidden features", disable=not progress, file=sys.stderr, mininterval=2):
        ids = torch.tensor([trace.prompt_ids + trace.continuation], device=device)
        hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state[0].float()
        for ctx in trace.contexts:
            generated = ctx.position if ctx.interval > 0 else 0
            rows.append(pooled_hidden_features(hidden, len(trace.prompt_ids), generated, recent_tokens, prompt_tokens))
    return rows


@torch.inference_mode()
def minilm_features(encoder: MiniLMEncoder, traces: list[PromptTrace], recent_tokens: int,
                    progress: bool = True, batch: int = 64) -> list[torch.Tensor]:
    from tqdm import tqdm

    rows = []
    for trace in tqdm(traces, desc="minilm features", disable=not progress, file=sys.stderr, mininterval=2):
        encoder.begin(trace.prompt_ids)
        prompt_vec = encoder.prompt_features(trace.prompt_ids)
        texts = [encoder.decode(trace.continuation[max(0, c.position - recent_tokens): c.position])
                 for c in trace.contexts if c.interval > 0]
        recent = [encoder.embed_texts(texts[i:i + batch]) for i in range(0, len(texts), batch)]
        recent_vecs = torch.cat(recent) if recent else torch.zeros(0, encoder.dim)
        k = 0
        for ctx in trace.contexts:
            if ctx.interval == 0:
                rows.append(torch.cat([prompt_vec, torch.zeros(encoder.dim)]))
            else:
                rows.append(torch.cat([prompt_vec, recent_vecs[k]]))
                k += 1
    return rows


@dataclass
class TrainConfig:
    hidden: int = 128
    epochs: int = 300
    lr: float = 3e-3
    weight_decay: float = 1e-3
    seed: int = 0
    heldout_fraction: float = 0.2


def split_prompts(prompts: Sequence[Sequence[int]], fraction: float, seed: int) -> set[int]:
    """Held-out prompt indices: whole prompts, so no context of a held-out prompt is trained on, and a prompt
    given twice (the training requests repeat some: greedy answers, so the same contexts and labels) on one side
    only. About ``fraction`` of the distinct prompts are held out."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, ids in enumerate(prompts):
        groups.setdefault(tuple(ids), []).append(i)
    distinct = list(groups.values())
    random.Random(seed).shuffle(distinct)
    return {i for group in distinct[: max(1, int(round(len(distinct) * fraction)))] for i in group}


def train_head(features: torch.Tensor, labels: torch.Tensor, head_config: HeadConfig, cfg: TrainConfig,
               progress: bool = True) -> RankingHead:
    """Full-batch AdamW on frozen features, seeded: the same data gives the same head."""
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    head = RankingHead(head_config)
    head.train()
    optim = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    x = mask_input(features, head_config.input)
    for _ in tqdm(range(cfg.epochs), desc=f"head [{head_config.encoder}, {head_config.input}]",
                  disable=not progress, file=sys.stderr, mininterval=2):
        optim.zero_grad()
        loss = torch.nn.functional.cross_entropy(head(x), labels)
        loss.backward()
        optim.step()
    return head.eval().requires_grad_(False)


@torch.inference_mode()
def evaluate(head: RankingHead, features: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    if len(labels) == 0:
        return {"top1": 0.0, "top2": 0.0, "contexts": 0}
    logits = head(mask_input(features, head.config.input))
    top = logits.topk(min(2, logits.shape[-1]), dim=-1).indices
    top1 = (top[:, 0] == labels).float().mean().item()
    top2 = (top == labels.unsqueeze(-1)).any(-1).float().mean().item()
    return {"top1": top1, "top2": top2, "contexts": int(len(labels))}


def read_prompts(path: str | Path, limit: int = 0, seed: int | None = None, row_check=None) -> list[dict]:
    """JSON-lines prompts; with ``limit`` the first N, or a seeded random N (file order kept) when
    ``seed`` is given, so a subset of a domain-sorted file still covers every domain."""
    from .workloads import read_jsonl, request_problem

    rows = read_jsonl(path, row_check=row_check or request_problem)
    if not rows:
        raise ValueError(f"{path} has no prompts: expected JSON lines with a 'prompt' field")
    if limit and limit < len(rows):
        if seed is None:
            return rows[:limit]
        keep = sorted(random.Random(seed).sample(range(len(rows)), limit))
        return [rows[i] for i in keep]
    return rows


def traces_from_answers(drafts: dict[str, torch.nn.Module], answers, gamma: int, interval: int,
                        progress: bool = True, horizon: int = 1) -> list[PromptTrace]:
    """Traces over the target's stored chat answers (``memspec-zoo build``'s teacher): no decoding here."""
    from tqdm import tqdm

    from .chat_drafts import answer_agreement

    traces = []
    for index, a in enumerate(tqdm(answers, desc="traces", disable=not progress, file=sys.stderr, mininterval=2)):
        if len(a.answer_ids) < 2:
            continue
        agreement = {name: answer_agreement(model, a) for name, model in drafts.items()}
        traces.append(trace_prompt(index, a.prompt_ids, a.answer_ids, agreement, list(drafts), gamma, interval,
                                   horizon))
        traces[-1].messages = list(a.messages)
        traces[-1].domain = a.domain
    return traces


def conversation_forms(tokenizer, traces: Sequence[PromptTrace], seed: int,
                       earlier_pool: Sequence[int] | None = None) -> list[PromptTrace] | str:
    """Each trace's request as the latest turn of a conversation, as the node sends a goal with history: after
    one earlier turn, a request drawn (seeded) from ``earlier_pool`` (trace indices, by default all: give the
    training prompts', so that no held-out request's text is trained on) of another domain where the traces know
    theirs, and the target's own answer to it. A candidate whose answer has no text, or that the node would
    refuse (ChatError), is passed over. The continuation and labels stay the request alone's: an approximation
    (after an earlier turn the target may answer a little differently), kept because decoding every conversation
    again would cost the whole trace budget anew. A head trained on these ranks a request, not the conversation's
    mean (scripts/predictor_conversations.py). Returns the reason instead where they cannot be built (no chat
    template, requests known only as token ids)."""
    from memspec_ros.runtime.chat import ChatError, has_chat_template, prompt_ids

    if not has_chat_template(tokenizer):
        return "the target's tokenizer has no chat template"
    if len(traces) < 2 or any(not t.messages for t in traces):
        return "the requests' text is unknown (teacher shards keep token ids only: pass the datastore or --prompts)"
    answers = {}
    for j in range(len(traces)) if earlier_pool is None else earlier_pool:
        text = tokenizer.decode(traces[j].continuation, skip_special_tokens=True)
        if text.strip():
            answers[j] = text
    rng = random.Random(seed)
    forms = []
    for i, trace in enumerate(traces):
        candidates = [j for j in answers if j != i and (not trace.domain or traces[j].domain != trace.domain)]
        candidates = candidates or [j for j in answers if j != i]  # one domain only: any other request
        rng.shuffle(candidates)
        system = [m for m in trace.messages if m[0] == "system"]
        request = [m for m in trace.messages if m[0] != "system"]
        for j in candidates:
            turns = [m for m in traces[j].messages if m[0] != "system"]
            try:
                ids = prompt_ids(tokenizer, "", [*system, *turns, ("assistant", answers[j]), *request])
            except ChatError:
                continue
            forms.append(replace(trace, prompt_ids=ids))
            break
        else:
            return f"no earlier request makes a conversation the node would take with request {i}"
    return forms


def run(args: argparse.Namespace) -> dict:
    from memspec_ros.runtime.models import ModelSpec, load_model, load_tokenizer
    from memspec_ros.runtime.registry import DraftRegistry

    torch.manual_seed(args.seed)
    registry = DraftRegistry.from_yaml(args.registry, validate=False)
    target_path = args.target or registry.target_path
    if not target_path:
        raise SystemExit(f"{args.registry} names no target: pass --target DIR")
    tokenizer = load_tokenizer(target_path)
    stored = None
    if args.answers:  # read before the models load (minutes on a CPU): a datastore without its requests beside
        # it, or made for another tokenizer, failed after them
        from memspec_ros.runtime.datastore import DatastoreError

        from .teacher import datastore_answers, teacher_folder_answers

        source = Path(args.answers)
        try:
            # a zoo's datastore, or its build's teacher folder: the target's greedy answers to its training requests
            stored = (datastore_answers(source, tokenizer, target=str(target_path)) if source.is_file()
                      else teacher_folder_answers(source, tokenizer, target_path))
        except (OSError, ValueError, DatastoreError) as exc:
            raise SystemExit(f"memspec-train-predictor: --answers {source}: {exc}") from None
    cache = ContinuationCache(args.continuations or None, target_path)  # the target's digest: before the loads
    target = load_model(ModelSpec(str(target_path))).model
    drafts = {e.name: load_model(ModelSpec(e.path)).model for e in registry.entries()}
    t0 = time.perf_counter()
    if stored is not None:
        answers = unseen_by_drafts(stored, Path(args.registry).parent) if args.unseen_by_drafts else stored
        if args.max_prompts and args.max_prompts < len(answers):
            keep = sorted(random.Random(args.seed).sample(range(len(answers)), args.max_prompts))
            answers = [answers[i] for i in keep]
        traces = traces_from_answers(drafts, answers, args.gamma, args.interval, progress=not args.quiet,
                                     horizon=args.label_horizon)
        prompts = [t.prompt_ids for t in traces]
        traces = [replace(t, contexts=[replace(c, prompt_index=i) for c in t.contexts]) for i, t in enumerate(traces)]
    else:
        from memspec_ros.runtime.chat import ChatError, prompt_ids

        rows = read_prompts(args.prompts, args.max_prompts, seed=args.seed)
        # as the node sends them (the chat template where the target has one): the features the head is trained
        # on are those it will rank on; a prompt past --max-prompt-tokens is left out, not cut (its hidden states
        # would lack their left context)
        every, turns, domains, refused = [], [], [], []
        for n, r in enumerate(rows, 1):
            messages = [(m["role"], m["content"]) for m in r.get("messages", [])]
            try:
                every.append(prompt_ids(tokenizer, r.get("prompt", ""), messages))
            except ChatError as exc:  # a row the node would reject (a forged turn, prompt and messages both)
                refused.append(f"row {n}: {exc}")
                continue
            turns.append(messages or [("user", r.get("prompt", ""))])  # a prompt-only goal is one user turn
            domains.append(str(r.get("domain", "")))
        if refused:
            print(f"{len(refused)} of {len(rows)} prompts left out, as the node would reject them; the first:"
                  f" {refused[0]}", file=sys.stderr)
        kept = [i for i, ids in enumerate(every) if len(ids) <= args.max_prompt_tokens]
        prompts, turns, domains = [every[i] for i in kept], [turns[i] for i in kept], [domains[i] for i in kept]
        if not every:
            raise SystemExit(f"every prompt of {args.prompts} was refused, as the node would refuse it; the first:"
                             f" {refused[0]}")
        if not prompts:
            raise SystemExit(f"every prompt of {args.prompts} is longer than --max-prompt-tokens"
                             f" {args.max_prompt_tokens}")
        if len(prompts) < len(every):
            print(f"{len(every) - len(prompts)} of {len(every)} prompts longer than --max-prompt-tokens"
                  f" {args.max_prompt_tokens} left out", file=sys.stderr)
        # every id that ends the node's generation (the model's generation_config too, as the teacher and the
        # runtime use): the tokenizer's eos alone let an end-of-turn id listed only there run on to the budget
        eos = end_token_ids(tokenizer, target)
        traces = collect_traces(target, drafts, prompts, args.max_new_tokens, args.gamma, args.interval, eos,
                                progress=not args.quiet, cache=cache, horizon=args.label_horizon, messages=turns,
                                domains=domains)
        try:
            cache.save()
        except OSError as exc:  # the head is still trained from them: the decoding was not for nothing
            print(f"memspec-train-predictor: could not save the continuations to {cache.path} ({exc}); the head"
                  " is trained from them all the same", file=sys.stderr)
    trace_seconds = time.perf_counter() - t0
    names = list(drafts)
    contexts = [c for t in traces for c in t.contexts]
    labels = torch.tensor([names.index(c.label) for c in contexts])
    heldout = split_prompts(prompts, args.heldout_fraction, args.seed)
    test_mask = torch.tensor([c.prompt_index in heldout for c in contexts])
    if not len(contexts) or bool(test_mask.all()) or not bool(test_mask.any()):
        # an empty side trained a random head (published as the runtime's) or scored nothing (0% shown as measured)
        side = "no context to train on" if len(contexts) and bool(test_mask.all()) else "no held-out context to score"
        raise SystemExit(f"{len(traces)} prompts with contexts, {len(heldout)} of {len(prompts)} held out: {side};"
                         " give more distinct prompts (or another --heldout-fraction)")
    cfg = TrainConfig(hidden=args.hidden, epochs=args.epochs, seed=args.seed, heldout_fraction=args.heldout_fraction)
    label_counts = {n: int((labels == i).sum()) for i, n in enumerate(names)}
    train_counts = torch.bincount(labels[~test_mask], minlength=len(names))
    majority = int(train_counts.argmax())  # the baseline a head must beat: always the commonest label
    heldout_labels = labels[test_mask]
    majority_top1 = float((heldout_labels == majority).float().mean()) if len(heldout_labels) else 0.0
    # the held-out prompts among those traced (a prompt whose answer was too short for a context has no trace)
    heldout_traced = sum(1 for t in traces if t.contexts and t.contexts[0].prompt_index in heldout)
    report: dict = {"prompts": len(traces), "contexts": len(contexts), "heldout_prompts": heldout_traced,
                    "label_horizon_intervals": args.label_horizon, "label_rule": LABEL_RULE,
                    "answers_unseen_by_drafts": bool(getattr(args, "unseen_by_drafts", False)),
                    "label_counts": label_counts, "majority_label": names[majority],
                    "majority_top1": majority_top1, "trace_seconds": trace_seconds,
                    "continuations_from_cache": cache.hits, "prompt_tokens": args.prompt_tokens, "encoders": {}}
    # every request again as the latest turn of a conversation: scored on the held-out prompts (their contexts
    # and labels are the request alone's, so the rows line up with ``contexts``) and, by default, trained on
    # (a trace's contexts carry its prompt's index: with --prompts a prompt answered in under 2 tokens has none)
    training = [i for i, t in enumerate(traces) if t.contexts and t.contexts[0].prompt_index not in heldout]
    conversations = conversation_forms(tokenizer, traces, args.seed, training)
    if isinstance(conversations, str):
        print(f"no conversation forms: {conversations}", file=sys.stderr)
        report["conversations"] = {"skipped": conversations}
    else:
        report["conversations"] = {"trained_on": args.conversation_training, "encoders": {}}

    out = Path(args.out)
    heads: dict[str, RankingHead] = {}  # published together after the last encoder (_publish)
    for encoder_name in args.encoders:
        # MiniLM loaded once for the requests alone and their conversation forms
        minilm = (MiniLMEncoder(lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                                prompt_tokens=args.prompt_tokens) if encoder_name == "minilm" else None)

        def features(chosen: list[PromptTrace], minilm: MiniLMEncoder | None = minilm) -> torch.Tensor:
            if minilm is not None:
                return torch.stack(minilm_features(minilm, chosen, args.recent_tokens, progress=not args.quiet))
            return torch.stack(hidden_features(target, chosen, args.recent_tokens, progress=not args.quiet,
                                               prompt_tokens=args.prompt_tokens))

        feats = features(traces)
        train_x, train_y = feats[~test_mask], labels[~test_mask]
        conv_feats = None
        if not isinstance(conversations, str):
            conv_feats = features(conversations)
            if args.conversation_training:
                train_x = torch.cat([train_x, conv_feats[~test_mask]])
                train_y = torch.cat([train_y, train_y])
        results: dict[str, dict[str, float]] = {}
        conv_results: dict[str, dict[str, float]] = {}
        best: RankingHead | None = None
        for which in INPUTS:
            config = HeadConfig(encoder=encoder_name, drafts=names, in_dim=int(feats.shape[-1]), hidden=args.hidden,
                                input=which, recent_tokens=args.recent_tokens, prompt_tokens=args.prompt_tokens,
                                interval=args.interval, label_horizon=args.label_horizon, gamma=args.gamma,
                                truncation_side="left",
                                target=target_fingerprint(target) if encoder_name == "target-hidden" else [])
            head = train_head(train_x, train_y, config, cfg, progress=not args.quiet)
            results[which] = evaluate(head, feats[test_mask], labels[test_mask])
            if conv_feats is not None:
                conv_results[which] = evaluate(head, conv_feats[test_mask], labels[test_mask])
            if which == "prompt+recent":
                best = head
        assert best is not None
        best.config.metrics = {f"{which}/{m}": float(v) for which, r in results.items() for m, v in r.items()}
        best.config.metrics.update({f"{which}/conversation_{m}": float(v)
                                    for which, r in conv_results.items() for m, v in r.items() if m != "contexts"})
        heads[encoder_name] = best
        report["encoders"][encoder_name] = results
        if conv_results:
            report["conversations"]["encoders"][encoder_name] = conv_results
    report["train_config"] = asdict(cfg)
    _publish(out, heads, report)
    return report


def _publish(out: Path, heads: dict[str, RankingHead], report: dict) -> None:
    """Every head and the report written aside, then moved into place: a run cut during its second encoder had left
    one new head beside an old one and the old report."""
    out.mkdir(parents=True, exist_ok=True)
    staged = {name: out / f".{name}.partial" for name in heads}
    for name, head in heads.items():
        if staged[name].exists():
            shutil.rmtree(staged[name])
        head.save(staged[name])  # every head written before any is swapped in: a failure leaves the old set
    for name, path in staged.items():  # each head swapped in whole (publish_dir's rename aside): a node loading
        publish_dir(out / name, lambda staging, path=path: os.replace(path, staging))  # it never sees one half gone
    write_text_atomic(out / "report.json", json.dumps(report, indent=2) + "\n")
    # a head of another encoder left from an earlier run is not in this report, yet may be the one loaded
    older = [sub for sub in PREDICTOR_PREFERENCE if sub and sub not in heads and (out / sub / HEAD_CONFIG).is_file()]
    if older:
        first = (f"; a node given {out} loads that one first: remove it, or retrain it with --encoders"
                 if Path(find_predictor(out)).name not in heads else "")
        print(f"note: {', '.join(str(out / sub) for sub in older)} is left from an earlier run (report.json no longer"
              f" describes it){first}", file=sys.stderr)


def format_report(report: dict) -> str:
    lines = [
        f"{report['prompts']} prompts, {report['contexts']} contexts ({report['heldout_prompts']} prompts held out);"
        f" labels {report['label_counts']}",
        f"majority-label baseline ({report['majority_label']}): top-1 {100 * report['majority_top1']:.1f}%",
        f"{'encoder':<14}{'input':<15}{'top-1':>8}{'top-2':>8}   (paper: prompt 31.9/55.8, recent 57.1/79.3,"
        " prompt+recent 71.6/95.7)",
    ]
    for enc, results in report["encoders"].items():
        for which, r in results.items():
            lines.append(f"{enc:<14}{which:<15}{100 * r['top1']:>7.1f}%{100 * r['top2']:>7.1f}%")
    conversations = report.get("conversations", {})
    if "skipped" in conversations:
        lines.append(f"after an earlier turn: not scored ({conversations['skipped']})")
    elif conversations.get("encoders"):
        trained = "trained on" if conversations["trained_on"] else "not trained on"
        lines.append(f"the same held-out requests after an earlier turn of another request ({trained}):")
        for enc, results in conversations["encoders"].items():
            for which, r in results.items():
                lines.append(f"{enc:<14}{which:<15}{100 * r['top1']:>7.1f}%{100 * r['top2']:>7.1f}%")
    return "\n".join(lines)


def _fraction(text: str) -> float:
    """--heldout-fraction: strictly between 0 (nothing to score the head on) and 1 (nothing to train it on)."""
    value = float(text)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not a fraction strictly between 0 and 1")
    return value


# what --prompts decodes with (the target decodes them here); --answers were decoded by the zoo build
DECODE_DEFAULTS = {"max_prompt_tokens": 256, "max_new_tokens": 128, "continuations": None}


def unseen_by_drafts(answers: list, zoo: Path) -> list:
    """The answers the zoo's drafts never trained on: the build's validation bucket (chat_drafts.split_validation
    with the seed its build_config.json records), which only early stopping read. A domain draft agrees more with
    the answers it was fine-tuned on than with new ones, so labels from those favour it over ``general`` more than
    held-out requests do."""
    from .chat_drafts import split_validation

    unseen = split_validation(answers, seed=int(_build_config(zoo).get("seed", 0)))[1]
    if not unseen:
        raise SystemExit("memspec-train-predictor: --unseen-by-drafts left no answer")
    return unseen


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memspec-train-predictor", description=__doc__.split("\n\n")[0])
    from memspec_ros.runtime import bundled_zoo_dir

    p.add_argument("--registry", default=str(bundled_zoo_dir() / "registry.yaml"),
                   help="draft registry YAML (names the target; default: the bundled zoo's)")
    p.add_argument("--target", default=None, help="target model directory (default: the registry's target)")
    p.add_argument("--prompts", default=None,
                   help="training prompts, JSON lines with 'prompt' or chat 'messages' (disjoint from every"
                        " evaluation workload), sent through the chat template as the node sends them and decoded by"
                        " the target here; or --answers")
    p.add_argument("--out", default=None, help="writes <out>/<encoder>/ and <out>/report.json (default: the"
                                               " predictor/ folder beside --registry)")
    p.add_argument("--continuations", default=None, metavar="JSON",
                   help="cache file of the target's greedy continuations (keyed by its weights): reruns with"
                        " rebuilt drafts skip decoding the target (default: no cache)")
    p.add_argument("--answers", default=None, metavar="DIR|FILE",
                   help="a chat zoo's stored answers (<memspec-zoo build work dir>/teacher, split 'train'), or its"
                        " datastore file (models/datastore.safetensors: the same answers' greedy tokens): trace"
                        " those instead of decoding --prompts with the target")
    p.add_argument("--unseen-by-drafts", action="store_true",
                   help="with --answers: only the answers the zoo's drafts never trained on (its build's validation"
                        " bucket, every 20th): the drafts agree more with their own training answers, which biases"
                        " the labels towards the domain drafts")
    p.add_argument("--encoders", nargs="+", default=list(ENCODERS), choices=ENCODERS)
    p.add_argument("--max-prompts", type=non_negative_int, default=0, help="0: all; else a seeded random subset")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                   help=f"with --prompts: longer prompts are left out (default {DECODE_DEFAULTS['max_prompt_tokens']})")
    p.add_argument("--max-new-tokens", type=positive_int, default=None,
                   help=f"with --prompts: tokens the target decodes per prompt (default"
                        f" {DECODE_DEFAULTS['max_new_tokens']})")
    # within the controller's limits: a head trained at a T or N the node cannot be set to was refused at configure
    p.add_argument("--gamma", type=controller_limit("gamma"), default=4)
    p.add_argument("--interval", type=controller_limit("interval"), default=4,
                   help="N: iterations per scheduling interval")
    p.add_argument("--recent-tokens", type=_recent_tokens, default=32, help="T")
    p.add_argument("--prompt-tokens", type=non_negative_int, default=16, metavar="W",
                   help="the prompt half pools the prompt's last W positions, the latest request's end and the"
                        " reply's header, so earlier turns and a system prompt do not outweigh it (0: the whole"
                        " prompt, as heads before session 35)")
    p.add_argument("--conversation-training", action=argparse.BooleanOptionalAction, default=True,
                   help="also train on every training request as the latest turn after an earlier one (another"
                        " request and the target's answer); the held-out score after an earlier turn is reported"
                        " either way")
    p.add_argument("--label-horizon", type=non_negative_int, default=0, metavar="H",
                   help="a context's label is the draft that commits most over the next H intervals (0, the"
                        " default: accepts most over the rest of the output; 1: the paper's next interval, whose"
                        " winner is mostly"
                        " noise on drafts this alike: docs/results/README.md, 'The predictor's label horizon')")
    p.add_argument("--hidden", type=int_in(1, 65_536), default=128)  # a typo allocated terabytes after the tracing
    p.add_argument("--epochs", type=positive_int, default=300)
    p.add_argument("--heldout-fraction", type=_fraction, default=0.2,
                   help="share of the prompts held out to score the head, in (0, 1)")
    p.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0)  # torch.manual_seed's range
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch intra-op threads (1: small models on a shared CPU run far faster without contention)")
    p.add_argument("--quiet", action="store_true")
    return p


def _build_config(zoo: Path) -> dict:
    """The zoo's recorded build_config.json (--unseen-by-drafts reads the seed of its validation split)."""
    from .chat_build import recorded_build

    build = recorded_build(zoo)
    if build is None:
        raise SystemExit(f"memspec-train-predictor: --unseen-by-drafts needs the zoo's build_config.json (the seed of"
                         f" its validation split) beside {zoo / 'registry.yaml'}")
    return build


def _recent_tokens(text: str) -> int:
    """T of a head: at least 1 (a head pools some recent tokens), at most the controller's recent_tokens."""
    from memspec_ros.runtime.controller import LIMITS

    return int_in(1, LIMITS["recent_tokens"][1])(text)


def check_inputs(args: argparse.Namespace) -> None:
    """Every input file read and checked before a model loads (minutes on a CPU): the registry, the prompts' rows,
    the stored answers."""
    from memspec_ros.runtime.model_source import missing_source
    from memspec_ros.runtime.registry import DraftRegistry, RegistryError

    try:
        registry = DraftRegistry.from_yaml(args.registry, validate=False)
        if args.prompts:
            read_prompts(args.prompts)
    except (RegistryError, ValueError) as exc:
        raise SystemExit(f"memspec-train-predictor: {exc}") from None
    # the models themselves: a --target typo or a wheel not installed ended in a ModelDirectoryError traceback
    target = args.target or registry.target_path
    models = [("--target" if args.target else "the registry's target", target)] if target else []
    gone = [f"{what} {path} ({why})" for what, path in models + [(f"draft {e.name}", e.path)
                                                                 for e in registry.entries()]
            if (why := missing_source(path))]
    if gone:
        raise SystemExit(f"memspec-train-predictor: not here: {'; '.join(gone)}")
    if "minilm" in args.encoders:  # a missing package ended the run after minutes of tracing, in a traceback
        from memspec_ros.runtime.predictor import PredictorError, minilm_path

        try:
            minilm_path()
        except PredictorError as exc:
            raise SystemExit(f"memspec-train-predictor: {exc}; or leave it out: --encoders target-hidden") from None
    if args.continuations:  # written at the end of the decoding: a folder or an unwritable place lost all of it
        continuations = Path(args.continuations)
        if continuations.is_dir():  # (a read-only file is fine: written only where a continuation was missing)
            raise SystemExit(f"memspec-train-predictor: --continuations {continuations} is a folder: name a file")
        checked_continuations(continuations, "memspec-train-predictor")
    if args.unseen_by_drafts:  # found after the target and drafts had loaded
        _build_config(Path(args.registry).parent)
    answers = Path(args.answers) if args.answers else None
    if answers is not None and not answers.is_file() and not any(answers.glob("train-*.safetensors")):
        raise SystemExit(f"memspec-train-predictor: --answers {answers}: no stored training answers"
                         " (train-*.safetensors) there; give a zoo build's teacher folder or its"
                         " models/datastore.safetensors")
    requests = answers.parent / "workloads" / "train_requests.jsonl" if answers is not None else None
    if requests is not None and not requests.is_file():
        which = ("a datastore's answers pair with its zoo's workloads/train_requests.jsonl (give the zoo's"
                 " models/datastore.safetensors)") if answers.is_file() else (
                 "a teacher folder's answers pair with its build's workloads/train_requests.jsonl (give"
                 " <work dir>/teacher of a memspec-zoo build)")
        raise SystemExit(f"memspec-train-predictor: --answers {answers}: no training requests at {requests}: {which}")


def checked_continuations(path: Path, program: str) -> None:
    """SystemExit unless ``path`` is a continuations cache, or absent where it can be made (read before any model
    loads: the decoding of every prompt is written there)."""
    from memspec_ros.argtypes import unwritable
    from memspec_ros.runtime.oracle import read_continuations

    if path.is_file():
        try:
            read_continuations(path)
        except ValueError as exc:
            raise SystemExit(f"{program}: --continuations {exc}") from None
    elif where := unwritable(path.parent):  # found only at the end, in a traceback, with every continuation lost
        raise SystemExit(f"{program}: --continuations {path} cannot be made ({where} cannot be written): name a"
                         " file in a folder you can write to")


def _checked_out(given: str | None, default: Path) -> str:
    """--out, checked before any work (a file in its place failed after minutes of training, in a traceback). The
    default is the zoo's own predictor, the one the node loads: replacing it is said up front."""
    out = Path(given) if given else default
    if out.exists() and not out.is_dir():
        raise SystemExit(f"memspec-train-predictor: --out {out} is a file: name a folder")
    if (out / HEAD_CONFIG).is_file():  # the heads would go under it, and the node go on loading the old one there
        raise SystemExit(f"memspec-train-predictor: --out {out} holds a trained head itself ({HEAD_CONFIG}), which"
                         " the node would go on loading before the <encoder>/ subfolders trained here: move that"
                         f" head into {out}/<its encoder>/ (or remove it), or give another --out")
    blocked = unwritable(out)
    if blocked:
        raise SystemExit(f"memspec-train-predictor: --out {out}: {blocked} cannot be written to")
    if not given and find_predictor(out):
        print(f"memspec-train-predictor: the heads trained here replace the zoo's own in {out} (the predictor the node"
              " loads); give --out to write them elsewhere", file=sys.stderr)
    return str(out)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.answers and not args.prompts:  # before loading any model
        parser.error("give --answers (a zoo's models/datastore.safetensors or teacher folder) or --prompts FILE")
    if args.answers and args.prompts:  # one source of traces: the other was dropped silently
        parser.error("give --answers or --prompts, not both")
    if args.unseen_by_drafts and not args.answers:
        parser.error("--unseen-by-drafts selects among a zoo's stored --answers: give --answers")
    if args.prompts and not Path(args.prompts).is_file():
        parser.error(f"--prompts {args.prompts}: no such file")
    # settings of the target's decoding: stored answers were decoded already, so with --answers they would be dropped
    given = [f"--{k.replace('_', '-')}" for k in DECODE_DEFAULTS if getattr(args, k) is not None]
    if args.answers and given:
        parser.error(f"{', '.join(given)} only apply to --prompts (where the target decodes): the stored --answers"
                     " are decoded already")
    for key, default in DECODE_DEFAULTS.items():
        setattr(args, key, default if getattr(args, key) is None else getattr(args, key))
    args.encoders = list(dict.fromkeys(args.encoders))  # named twice: its features were extracted twice
    check_inputs(args)
    args.out = _checked_out(args.out, Path(args.registry).parent / "predictor")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    report = run(args)
    print(format_report(report))
    print(f"saved to {args.out}/<encoder>/ and {args.out}/report.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
