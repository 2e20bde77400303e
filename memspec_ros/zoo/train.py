"""Training the zoo: the target by next-token loss, the drafts by distillation.

The paper's drafts are distilled from the target; here every draft is trained
to match the target's next-token distribution (forward KL on logits), the
general one on the whole mix and each domain one on its domain, starting from
the general draft so a short budget suffices.  Budgets are steps *or*
minutes, so the same code builds the 2-core default zoo and a larger one on a
GPU.  Checkpoints are plain safetensors (weights, optimizer state flattened)
plus a JSON of counters: resuming never unpickles anything.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from memspec_ros.runtime.atomic_write import write_text_atomic, written_aside

from .errors import ZooSetupError
from .rollouts import RolloutStreams, topk_kl


@dataclass
class ArchConfig:
    """A Llama architecture; deep & narrow targets cost little to train, much to run."""

    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    max_positions: int = 1024

    def llama_config(self, tok):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=len(tok),
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=self.max_positions,
            tie_word_embeddings=True,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
        )


TARGET_ARCH = ArchConfig(hidden_size=256, num_layers=16, intermediate_size=688, num_heads=4, num_kv_heads=4)
DRAFT_ARCH = ArchConfig(hidden_size=128, num_layers=2, intermediate_size=344, num_heads=2, num_kv_heads=2)


@dataclass
class TrainConfig:
    """One training run; stop at ``max_steps`` or ``max_minutes``, whichever comes first."""

    max_steps: int = 100_000  # this default means "as many as the minutes allow": the minutes are the budget
    max_minutes: float = 30.0
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    temperature: float = 1.0  # distillation temperature
    checkpoint_every: int = 50
    validate_every: int = 100  # steps between validations when train() gets a ``validate``
    # the cosine schedule needs a horizon; with a minutes budget it is estimated
    # from the measured step time after ``warmup_steps``
    device: str = "cpu"
    # torch.compile the training forward: 2.31 -> 1.95 s per target step on the 2-core CPU
    # (measured), after ~1 minute of compiling; falls back to eager where it cannot compile
    compile: bool = False
    # validate before the first step too, so a fine-tuning that only hurts ends at its start
    validate_start: bool = False


class TokenStreams:
    """Per-source token streams; a batch samples windows by source weight."""

    def __init__(self, streams: dict[str, torch.Tensor], weights: dict[str, float], seed: int):
        self.names = [n for n in streams if weights.get(n, 0) > 0]
        self.streams = streams
        w = torch.tensor([weights[n] for n in self.names], dtype=torch.float64)
        self.probs = w / w.sum()
        self.gen = torch.Generator().manual_seed(seed)

    def batch(self, batch_size: int, seq_len: int) -> torch.Tensor:
        picks = torch.multinomial(self.probs, batch_size, replacement=True, generator=self.gen)
        rows = []
        for k in picks.tolist():
            s = self.streams[self.names[k]]
            off = int(torch.randint(0, len(s) - seq_len - 1, (1,), generator=self.gen))
            rows.append(s[off : off + seq_len])
        return torch.stack(rows).long()

    def state(self) -> torch.Tensor:
        return self.gen.get_state()

    def load_state(self, state: torch.Tensor) -> None:
        self.gen.set_state(state)


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def _save_checkpoint(path: Path, model, opt, data, meta: dict, best: dict[str, torch.Tensor] | None = None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    # named_parameters() lists tied weights (embedding = LM head) once; safetensors refuses aliases
    tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in model.named_parameters()}
    tensors.update({f"best.{k}": v.cpu().contiguous() for k, v in (best or {}).items()})
    names = {p: n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"opt.{names[p]}.{k}"] = (
                    v.detach().cpu().contiguous().reshape(-1) if v.dim() == 0 else v.detach().cpu().contiguous()
                )
    tensors["rng.data"] = data.state()
    # the counters travel inside the state file (one rename publishes weights and step together: a crash between
    # two files resumed step-N weights with an older step); meta.json beside it is a readable copy
    text = json.dumps(meta, indent=1)
    with written_aside(path / "state.safetensors", sync=True) as tmp:  # a failed write leaves no temporary file
        save_file(tensors, str(tmp), metadata={"meta": text})
    write_text_atomic(path / "meta.json", text)


# what decides a trained model among TrainConfig's fields (the device and the time cap only decide how fast it gets
# there; max_steps sets the cosine horizon; the validation steps decide which step's weights are kept)
RESULT_FIELDS = ("max_steps", "batch_size", "seq_len", "lr", "min_lr_ratio", "warmup_steps", "weight_decay",
                 "grad_clip", "seed", "temperature", "validate_every", "validate_start")


def run_identity(cfg: TrainConfig, extra: dict | None = None) -> dict:
    """``cfg``'s result fields and ``extra``, as JSON gives them back (lists, not tuples): what a run is."""
    config = asdict(cfg)
    return json.loads(json.dumps({**{f: config[f] for f in RESULT_FIELDS if f in config}, **(extra or {})}))


def identity_changes(was: dict, now: dict) -> str:
    """'field old -> new' for every field recorded in both that differs, or that only one records."""
    def shown(value) -> str:
        return ",".join(map(str, value)) if isinstance(value, list) else str(value)

    keys = [k for k in now if k not in was or was[k] != now[k]] + [k for k in was if k not in now]
    return ", ".join(f"{k} {shown(was.get(k, '(none)'))} -> {shown(now.get(k, '(none)'))}" for k in keys) or "none"


# identity fields added after runs were recorded without them: such a record is compared without the field (its
# build cannot say; refusing it would take every draft of an existing work dir for another run's)
LATER_IDENTITY_FIELDS = ("answers_digest", "validate_every", "validate_start")


def as_recorded(was: dict, identity: dict) -> dict:
    """``identity`` as the record ``was`` can be compared with: without the later fields it does not hold."""
    return {k: v for k, v in identity.items() if k in was or k not in LATER_IDENTITY_FIELDS}


def _resumable_as(meta: dict, identity: dict) -> bool:
    """Whether the checkpointed run ``meta`` may go on as the run ``identity``: the same run, or the same with a
    lower step budget while it is unfinished and has not passed it (its cosine horizon is cut to the budget; a
    higher one would still have ended at the old horizon, and neither a finished run nor one past the budget can
    take back steps: one at step 600 resumed with 500 was marked done at 600, recorded as a 500-step run)."""
    was = meta["identity"]
    identity = as_recorded(was, identity)
    if was == identity:
        return True
    others_same = {k: v for k, v in was.items() if k != "max_steps"} == \
        {k: v for k, v in identity.items() if k != "max_steps"}
    return others_same and not meta.get("done") and meta.get("step", 0) <= identity.get("max_steps", 0) \
        <= meta.get("total", 0)


def check_cap(meta: dict, cfg: TrainConfig, where: Path) -> None:
    """ValueError where a run the minutes cut short meets a larger cap: the time cap is not part of a run's identity
    (it decides only how fast a run gets to its steps), except where it ended the run, or fitted the schedule of an
    unfinished one. A rebuild with more minutes then logged "cached" or went on to the old horizon, and the build's
    record named minutes the shipped draft never had."""
    cut = meta.get("cut_at_minutes") if meta.get("done") else meta.get("fitted_minutes")
    if cut is None or cfg.max_minutes <= cut:
        return
    what = (f"stopped at step {meta.get('step')} of {cfg.max_steps} at its {cut:g}-minute cap" if meta.get("done")
            else f"fitted its schedule to {meta.get('total')} of {cfg.max_steps} steps for a {cut:g}-minute cap")
    raise ValueError(f"the run in {where} {what}; {cfg.max_minutes:g} minutes would train it further: remove {where}"
                     f" to train it again with them, or keep the {cut:g} minutes it had")


def _load_checkpoint(path: Path, model, opt, data, desc: str,
                     identity: dict | None = None) -> tuple[dict | None, dict[str, torch.Tensor] | None]:
    """Restores model, optimizer and data state of the run ``desc`` (of ``identity``, where given and the
    checkpoint records one); returns (meta, best validated parameters or None)."""
    if not (path / "state.safetensors").exists():
        return None, None
    from safetensors import safe_open

    with safe_open(str(path / "state.safetensors"), framework="pt") as f:
        stored = (f.metadata() or {}).get("meta")
    # a checkpoint written before the counters moved into the state file: its meta.json
    meta = json.loads(stored if stored is not None else (path / "meta.json").read_text(encoding="utf-8"))
    if meta.get("desc", desc) != desc:
        # checked before loading anything: a finished run of another phase would otherwise be
        # taken for this one and "skipped"
        raise ZooSetupError(f"checkpoint {path} belongs to the run '{meta['desc']}', not '{desc}': move it away"
                           " or use a fresh --work-dir")
    if identity is not None and "identity" in meta and not _resumable_as(meta, identity):
        # checked before loading anything too: other weights' shapes would fail load_state_dict opaquely
        changes = identity_changes(meta["identity"], identity)
        raise ValueError(f"checkpoint {path} is a run with other settings ({changes}):"
                         f" remove {path} to train again with these, or go on with the settings it was started with")
    tensors = load_file(str(path / "state.safetensors"))
    missing, unexpected = model.load_state_dict(
        {k[6:]: v for k, v in tensors.items() if k.startswith("model.")}, strict=False
    )
    if unexpected or any(k != "lm_head.weight" and "rotary" not in k for k in missing):
        raise ZooSetupError(f"checkpoint {path} does not match the model: missing {missing}, unexpected {unexpected}")
    params = dict(model.named_parameters())
    for name, p in params.items():
        st = {}
        for k in ("step", "exp_avg", "exp_avg_sq"):
            key = f"opt.{name}.{k}"
            if key in tensors:
                v = tensors[key].to(p.device)
                st[k] = v.reshape(()) if k == "step" else v
        if st:
            opt.state[p] = st
    data.load_state(tensors["rng.data"])
    best = {k[5:]: v for k, v in tensors.items() if k.startswith("best.")} or None
    return meta, best


ADAM_BETAS = (0.9, 0.95)
LOSS_EMA = (0.98, 0.02)  # the loss shown and logged: weights of its running value and of the new step's loss
LOSS_LOG_EVERY = 50  # steps between entries of meta["losses"]
TIMED_FROM_STEP = 2  # steps up to this one include allocator/thread warm-up: time per step is measured after
HORIZON_MARGIN = 0.97  # the cosine horizon fitted to the time budget keeps 3% of it spare
FIT_HORIZON_AT = 6  # earliest step the horizon is fitted at (its time per step measured over >= 4 steps)
NO_TIME_BUDGET = 1e6  # max_minutes at or above this: only max_steps ends the run (its horizon is not fitted)


class _BestParameters:
    """Early stopping: ``validate(model)`` (higher is better) at a step; the best step's parameters are kept."""

    def __init__(self, model, meta: dict, validate: Callable[[torch.nn.Module], float] | None,
                 best: dict[str, torch.Tensor] | None) -> None:
        self.model, self.meta, self.validate, self.best = model, meta, validate, best

    def check(self, step: int) -> None:
        score = self.validate(self.model)
        self.meta.setdefault("validation", []).append([step, round(score, 5)])
        if self.meta.get("best_step") is None or score > self.meta["best_score"]:
            self.meta.update(best_step=step, best_score=score)
            self.best = {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def keep_best(self, step: int, desc: str, log: Callable[[str], None]) -> None:
        """Validate the last step (unless just done) and put the best step's parameters back."""
        meta = self.meta
        if not meta.get("validation") or meta["validation"][-1][0] != step:
            self.check(step)
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(self.best[n])
        log(f"{desc}: validation {meta['validation'][-1][1]:.4f} at the last step, best {meta['best_score']:.4f} "
            f"at step {meta['best_step']}: keeping step {meta['best_step']}")


def _optimizer(model, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=ADAM_BETAS,
    )


def _loss(fwd, batch, teacher, cfg: TrainConfig, dev: torch.device) -> torch.Tensor:
    """The step's loss: top-k KL on rollouts, next-token CE without a teacher, full KL to the teacher."""
    if isinstance(batch, tuple):
        # rollouts (see rollouts.py): the target's distribution on its own continuations
        x, y, top_ids, top_logp = (t.to(dev) for t in batch)
        return topk_kl(fwd(input_ids=x[:, :-1]).logits, y, top_ids, top_logp)
    if teacher is None:
        x = batch.to(dev)
        return fwd(input_ids=x[:, :-1], labels=x[:, :-1]).loss
    inp = batch[:, :-1].to(dev)
    with torch.no_grad():
        t_logits = teacher(input_ids=inp).logits.float() / cfg.temperature
    s_logits = fwd(input_ids=inp).logits.float() / cfg.temperature
    return F.kl_div(
        F.log_softmax(s_logits, -1).flatten(0, 1),
        F.log_softmax(t_logits, -1).flatten(0, 1),
        log_target=True,
        reduction="batchmean",
    ) * (cfg.temperature**2)


def _step_loss(fwd, model, batch, loss_of: Callable, desc: str, log: Callable[[str], None]):
    """(forward used, loss): the compiled forward, or the model's own if compiling fails (same loss)."""
    try:
        return fwd, loss_of(fwd, batch)
    except Exception as e:
        if fwd is model:
            raise
        # inductor needs a working C++ compiler; the eager step computes the same loss
        log(f"{desc}: torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:160]}); training eagerly")
        return model, loss_of(model, batch)


def train(
    model,
    data: TokenStreams | RolloutStreams,
    cfg: TrainConfig,
    ckpt_dir: Path,
    teacher=None,
    desc: str = "train",
    log: Callable[[str], None] = print,
    validate: Callable[[torch.nn.Module], float] | None = None,
    identity: dict | None = None,
) -> dict:
    """Train in place; resumable from ``ckpt_dir``. Returns the run's summary.

    ``identity`` (JSON values) names what decides the result besides ``cfg``'s fields in :data:`RESULT_FIELDS`
    (the data, the architecture, the starting weights): a checkpoint of a run with another identity or other such
    settings is refused, not resumed (a resumed run kept its old horizon and data and then recorded the new ones).

    With a ``teacher`` the loss is KL(teacher || student) over the vocabulary
    at every position (distillation); without, next-token cross-entropy.
    With ``RolloutStreams`` data the loss is the same KL on the target's own
    continuations, over its top-k tokens stored with them (on-policy
    distillation, no teacher forward needed: the labels were computed when
    the data was made).

    ``validate`` (higher is better) runs every ``cfg.validate_every`` steps and
    at the end; the model ends with the best validated parameters (early
    stopping: a domain's ~900 training continuations can be memorised, as
    argmax-only training did within 50 steps on code).
    """
    torch.manual_seed(cfg.seed)
    dev = torch.device(cfg.device)
    model.to(dev).train()
    if teacher is not None:
        teacher.to(dev).eval()
    opt = _optimizer(model, cfg)
    identity = run_identity(cfg, identity)
    meta, best = _load_checkpoint(ckpt_dir, model, opt, data, desc, identity)
    meta = meta or {"step": 0, "elapsed_s": 0.0, "total": cfg.max_steps, "losses": [], "desc": desc}
    meta["identity"] = identity  # the run it goes on as (a resumed one may have a lower step budget)
    check_cap(meta, cfg, ckpt_dir)
    if meta.get("done"):
        log(f"{desc}: already trained ({meta['step']} steps), skipping")
        return meta
    keeper = _BestParameters(model, meta, validate, best)
    # a resumed run keeps its fitted horizon but never exceeds the step budget it is given now
    step, elapsed, total = meta["step"], meta["elapsed_s"], min(meta["total"], cfg.max_steps)
    if cfg.validate_start and validate is not None and step == 0 and not meta.get("validation"):
        keeper.check(step)  # the starting point competes too: fine-tuning that only hurts keeps the start
    meta_start, t_first = step, time.time()
    budget_s = cfg.max_minutes * 60
    bar = tqdm(total=total, initial=step, desc=desc, mininterval=5, dynamic_ncols=True)
    t0 = time.time() - elapsed
    ema = meta.get("loss_ema")  # the running loss goes on from the checkpoint's: a resumed run's final loss is the same
    # the cosine horizon is fitted once, a few timed steps into the run; a run checkpointed before that (warm-up
    # longer than the checkpoint interval) fits it after its resume, timing the steps since (older checkpoints,
    # which did not record it, had it fitted when they were past the fitting step)
    timed_from = meta_start + TIMED_FROM_STEP
    fit_at = max(cfg.warmup_steps, timed_from + FIT_HORIZON_AT - TIMED_FROM_STEP)
    fitted = meta.get("horizon_fitted", meta_start >= max(cfg.warmup_steps, FIT_HORIZON_AT))

    def loss_of(fwd, batch) -> torch.Tensor:
        return _loss(fwd, batch, teacher, cfg, dev)

    # the compiled module shares the model's parameters: checkpoints and validation use ``model``
    fwd = torch.compile(model) if cfg.compile else model
    while step < total and (time.time() - t0) < budget_s:
        batch = data.batch(cfg.batch_size, cfg.seq_len + 1)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, cfg)
        fwd, loss = _step_loss(fwd, model, batch, loss_of, desc, log)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else LOSS_EMA[0] * ema + LOSS_EMA[1] * loss.item()
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", refresh=False)
        if step == timed_from:
            t_first = time.time()
        if step == fit_at and cfg.max_minutes < NO_TIME_BUDGET and not fitted:
            # fit the cosine horizon to the time budget, measured on this machine
            per_step = (time.time() - t_first) / (step - timed_from)
            horizon = step + int((budget_s - (time.time() - t0)) / per_step * HORIZON_MARGIN)
            total, fitted = min(cfg.max_steps, horizon), True
            bar.total = total
            log(f"{desc}: {per_step:.2f} s/step -> cosine horizon {total} steps")
            if total < cfg.max_steps:  # the schedule now ends where these minutes do: a larger cap cannot extend it
                meta["fitted_minutes"] = cfg.max_minutes
            if horizon < cfg.max_steps < TrainConfig.max_steps:  # a step budget the minutes cut short
                log(f"{desc}: the {cfg.max_minutes:g}-minute cap allows {total} of the {cfg.max_steps} steps on this"
                    " machine: the model trains less than its step budget intends (raise the minutes to keep it)")
        if step % LOSS_LOG_EVERY == 0:
            meta["losses"].append([step, round(ema, 4)])
        if validate is not None and step % cfg.validate_every == 0:
            keeper.check(step)
        if step % cfg.checkpoint_every == 0:
            meta.update(step=step, elapsed_s=time.time() - t0, total=total, loss_ema=ema, horizon_fitted=fitted)
            _save_checkpoint(ckpt_dir, model, opt, data, meta, keeper.best)
    bar.close()
    meta.update(step=step, elapsed_s=time.time() - t0, total=total, done=True, final_loss=ema, config=asdict(cfg),
                loss_ema=ema, horizon_fitted=fitted)
    meta.pop("cut_at_minutes", None)
    if step < cfg.max_steps:  # the minutes ended it: a larger cap would have trained further (check_cap)
        meta["cut_at_minutes"] = cfg.max_minutes
    if validate is not None:
        keeper.keep_best(step, desc, log)
    _save_checkpoint(ckpt_dir, model, opt, data, meta, keeper.best)
    loss = "n/a (no step this run)" if ema is None else f"{ema:.3f}"  # a resumed run past its minutes
    log(f"{desc}: {step} steps in {meta['elapsed_s'] / 60:.1f} min, loss {loss}")
    return meta


@torch.no_grad()
def perplexity(model, docs_ids: Sequence[Sequence[int]], seq_len: int = 256, max_tokens: int = 40_000,
               device: str = "cpu") -> float:
    """Token-level perplexity over held-out documents (each cut into windows)."""
    model.to(device).eval()
    nll, n = 0.0, 0
    for ids in docs_ids:
        for i in range(0, len(ids) - 1, seq_len):
            x = torch.tensor(ids[i : i + seq_len + 1], device=device)[None]
            if x.shape[1] < 2:
                continue
            logits = model(input_ids=x[:, :-1]).logits.float()
            nll += F.cross_entropy(logits[0], x[0, 1:], reduction="sum").item()
            n += x.shape[1] - 1
            if n >= max_tokens:
                return math.exp(nll / n)
    return math.exp(nll / max(n, 1))
