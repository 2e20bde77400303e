"""Policy benchmark: the paper's comparison of MemSpec against every baseline.

Protocol (the paper's section 4.1, scaled to the bundled zoo): greedy, batch 1,
N = 4, K = 2, gamma = 4, 128 new tokens, runtime state (draft cache, bandit
statistics) reset per prompt; per workload the tokens/s over all its prompts,
then the geometric mean across workloads. All policies run in one process
through the same controller loop, interleaved prompt by prompt with a rotating
order, so machine noise hits them alike.

Metrics (defined once, in runtime/stats.py): ``tokens_per_second`` is the
paper's (generated tokens per second of decoding: draft, verify and every wait,
switch and catch-up included; prompt encoding excluded); ``end_to_end`` adds
prefill and the first draft load. Each row also breaks its decode time down
(desired draft, fallback draft, prediction, load wait, catch-up, target verify,
other).

Storage: drafts are read through the storage tier ``storage`` (runtime/storage.py):
each load drops the file from the page cache and reads it paced to the medium
(emmc, sd, nvme: emulated edge media; local: this machine's disk). The JSON
records the medium, the measured load time per draft and its ratio to one
speculative iteration.

Oracle-Dynamic plans with measured costs: before the timed runs one untimed
General-Static generation measures the iterations (verify by proposals, draft
token, the rest of the loop), a draft's catch-up forward is timed over 1/4 to 2
times the prompts' median length (a switch's cost grows with the tokens the
incoming draft feeds), and each draft is loaded once through the storage tier; those costs (and K) go with every
prompt's oracle (``oracle_costs`` in the JSON).

Simulator validation (``simulator_validation``): every prompt's trace (the
target's greedy continuation and each draft's agreement, recorded for the
oracles) is replayed through runtime/simulator.py with the same policy objects
and a cost model fitted to these runs' own measurements; the JSON and the
printed table compare simulated with measured throughput per policy (end to end
and the paper's metric). Sweeps run on the simulator only as far as this holds.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..runtime.cache import registry_loader
from ..runtime.chat import prompt_ids
from ..runtime.controller import RuntimeConfig, RuntimeController, predictor_refusal
from ..runtime.loader import find_predictor, load_models
from ..runtime.models import ModelSpec, load_model
from ..runtime.oracle import GreedyOracle, ScheduleCosts
from ..runtime.policies import COST_AWARE, PAPER_POLICIES, RANKING_POLICIES, DraftPolicy, make_policy
from ..runtime.registry import DraftRegistry
from ..runtime.simulator import (
    CostModel,
    PromptTrace,
    SimConfig,
    Simulator,
    fit_line,
    live_recent_features,
    replay_predictor,
    target_hidden_states,
)
from ..runtime.stats import BREAKDOWN, GenerationStats, GenerationTotals
from ..runtime.storage import DraftStorage, load_to_iteration, storage_medium
from ..zoo.corpora import WORKLOADS

METRICS = {
    "tokens_per_second": "the paper's: tokens committed by draft-and-verify iterations over the decode wall time"
                         " (draft, verify, every wait, switch and catch-up included; prompt encoding excluded)",
    "end_to_end_tokens_per_second": "every generated token over the controller's whole call, from generate()'s"
                                    " entry (setup, the first draft load, prompt encoding) to its result"
                                    " (runtime/stats.py); this bench resets the draft cache before each timed"
                                    " generation, outside the timing",
}


VALIDATION_TOLERANCE = 0.10  # simulated vs measured end-to-end throughput per policy (issue 17)


@dataclass
class PolicyBenchConfig:
    policies: Sequence[str] = PAPER_POLICIES  # memspec-cost-aware on request (the paper harness runs it)
    workloads: Sequence[str] = WORKLOADS
    prompts: int = 4  # per workload (the paper: 100; pass --prompts 100 for the full protocol)
    runs: int = 1
    max_new_tokens: int = 128
    capacity: int = 2
    interval: int = 4
    gamma: int = 4
    recent_tokens: int = 32
    storage: str = "emmc"  # local | emmc | sd | nvme (runtime/storage.py)
    workloads_dir: str = ""  # folder of <name>.jsonl; empty: the zoo's held-out workloads (<zoo>/workloads)
    threads: int = 1
    trace_tokens: int = 0  # record each prompt's trace this far (0: max_new_tokens): the longest budget simulated
    simulate: bool = True  # replay the runs in the simulator and report how close it comes (simulator_validation)
    quantization: str = "none"  # the target's forward path (model.quantization): none | int8 | int4
    draft_quantization: str = "none"  # the drafts' (drafts.quantization): none | int8 | int4


def pooled_shares(totals: GenerationTotals) -> tuple[float | None, float | None]:
    """The fallback share of drafted iterations and prediction's share of decode time, pooled (stats.py's
    definitions), for the benches' JSON and goals: None where there is no denominator (nothing drafted or decoded,
    e.g. every load failed and the target ran alone), where 0.0 met the goals' "at most"."""
    return (totals.fallback_fraction if totals.preferred_iterations else None,
            totals.prediction_overhead if totals.decode_seconds > 0 else None)


@dataclass
class PolicyRow:
    """One policy on one workload, summed over its prompts and runs."""

    totals: GenerationTotals = field(default_factory=GenerationTotals)
    switches: int = 0
    lossless: bool = True

    def summary(self) -> dict:
        # every share pooled over the prompts (the figures' and goals' definition), not a mean of per-prompt shares
        fallback, prediction = pooled_shares(self.totals)
        return {
            "tokens_per_second": self.totals.tokens_per_second,
            "end_to_end_tokens_per_second": self.totals.end_to_end_tokens_per_second,
            "mean_accepted": self.totals.mean_accepted,
            "fallback_fraction": fallback,
            "prediction_overhead": prediction,
            "load_wait_seconds": self.totals.breakdown["load_wait"],
            "draft_switches": self.switches,
            "lossless": self.lossless,
            "decode_seconds": self.totals.decode_seconds,
            "time_breakdown_seconds": dict(self.totals.breakdown),
            "time_breakdown_fraction": self.totals.breakdown_fractions(),
        }


def gmean(values: Sequence[float]) -> float:
    """The geometric mean; 0 if any value is 0 (a policy that stalled on one workload is not averaged over fewer
    workloads than the others)."""
    values = list(values)
    if not values or min(values) <= 0:
        return 0.0
    return math.exp(statistics.fmean(math.log(v) for v in values))


def domain_workloads(workloads: Sequence[str]) -> list[str]:
    """The workloads every GMEAN is over: every one but ``mixed`` (the paper's five domains on the zoo's folder;
    a folder of other workloads keeps all of its own: picking the five's names out of it judged ``code, kitchen,
    navigation`` on ``code`` alone), or every one if ``mixed`` is all there is."""
    return [w for w in workloads if w != "mixed"] or list(workloads)


# -- workloads: any folder of <name>.jsonl ------------------------------------------------------------

def workloads_in(folder: Path) -> list[str]:
    """The workload names in a folder: its <name>.jsonl files, training files (train*) left out."""
    return sorted(p.stem for p in Path(folder).glob("*.jsonl") if not p.stem.startswith("train"))


def read_workload(path: Path, limit: int) -> list[dict]:
    """The first ``limit`` rows of a workload file: {"domain", "prompt"} rows or chat rows ({"messages": [...]})."""
    from ..zoo.workloads import read_jsonl, request_problem

    return read_jsonl(path, limit, request_problem)


def row_prompt_ids(tokenizer, row: dict) -> list[int]:
    """A row's token ids as the node builds a goal's: its prompt, else its chat messages (chat template)."""
    if row.get("prompt"):
        return prompt_ids(tokenizer, row["prompt"])
    return prompt_ids(tokenizer, "", [(m["role"], m["content"]) for m in row["messages"]])


def read_workloads(folder: Path, names: Sequence[str], limit: int) -> dict[str, list[dict]]:
    """The first ``limit`` rows of each named workload in ``folder``; a missing file names the ones there."""
    missing = [w for w in names if not (Path(folder) / f"{w}.jsonl").is_file()]
    if missing:
        raise FileNotFoundError(f"no {', '.join(w + '.jsonl' for w in missing)} in {folder}"
                                f" (it has: {', '.join(workloads_in(folder)) or 'no workload files'})")
    return {w: read_workload(Path(folder) / f"{w}.jsonl", limit) for w in names}


def workload_prompts(folder: Path, names: Sequence[str], limit: int, tokenizer) -> dict[str, list[list[int]]]:
    """Token ids of the first ``limit`` prompts of each named workload in ``folder``."""
    return {w: [row_prompt_ids(tokenizer, r) for r in rows] for w, rows in read_workloads(folder, names, limit).items()}


def catchup_line(draft, tokens: int, rounds: int = 3) -> tuple[float, float]:
    """(seconds at no tokens, seconds per token) of a draft's catch-up: one forward over a fresh KV cache, as a
    draft switched in runs it, timed at 1/4, 1/2, 1 and 2 times ``tokens`` (the fastest of ``rounds`` per size:
    other load only ever adds time), and a line fitted through them."""
    from ..runtime.path_choice import timed_forwards

    sizes = sorted({max(1, tokens // 4), max(1, tokens // 2), max(1, tokens), max(2, 2 * tokens)})
    vocab = int(getattr(draft.config, "vocab_size", 2))
    times = timed_forwards(draft, sizes, vocab, rounds, context=0, keep=1)
    return fit_line(sizes, [min(t) for t in times])


def vocab_size(target) -> int:
    """The target's logit width, which a draft must share (0: unknown, unchecked)."""
    return int(getattr(target.config, "vocab_size", 0) or 0)


def loader_options(models, quantization: str) -> dict:
    """What the controller's own loader would be made with (cache.registry_loader): the models' draft dtype and
    device, the drafts' forward path and the target's logit width each draft is checked against. The bench's
    loaders, timed and timing, read through its storage with these."""
    return {"dtype": models.draft_dtype, "device": models.device, "quantization": quantization,
            "target_vocab_size": vocab_size(models.target.model)}


def timed_loads(registry: DraftRegistry, storage: DraftStorage, **options) -> dict[str, float]:
    """Seconds each draft's load takes as the cache's loader does it: the read through the storage tier and
    everything after it (the compatibility checks, the lean forward built on the loader thread: 1-5 ms the
    storage's own record of read and build left out). Each is loaded once untimed first (a first load builds the
    runtime form later ones read); the storage's records of these loads are dropped (a bench's storage summary
    holds its timed runs' loads only). ``options``: :func:`loader_options`, as the timed runs' loader has them."""
    load = registry_loader(registry, storage=storage, **options)
    names = [entry.name for entry in registry]
    for name in names:
        load(name)
    seconds = {}
    for name in names:
        t0 = time.perf_counter()
        load(name)
        seconds[name] = time.perf_counter() - t0
    storage.take_records()
    return seconds


def storage_block(summary: dict, modelled: dict[str, float]) -> dict:
    """The bench's storage figures: the loads of its timed runs (``summary``, read and build on the loader thread
    while the decode thread competes for the CPU) beside ``modelled``, each draft's whole load timed alone
    (:func:`timed_loads`): what the cost model, Oracle-Dynamic's plan, the simulator and the storage item charge.
    Two measurements of one thing, named apart so that no page quotes one for the other."""
    return summary | {"modelled_load_seconds": statistics.fmean(modelled.values()) if modelled else 0.0,
                      "modelled_load_to_iteration": load_to_iteration(modelled, summary["iteration_seconds"])}


def measure_costs(controller: RuntimeController, storage: DraftStorage, registry: DraftRegistry, ids: list[int],
                  max_new_tokens: int, capacity: int, gamma: int, options: dict | None = None,
                  catchup: tuple[float, float] = (0.0, 0.0)) -> ScheduleCosts:
    """Oracle-Dynamic's costs, measured here and now: one untimed General-Static generation (its iterations: verify
    by proposals, draft token, the rest of the loop), one cold load of every draft through the storage tier, loaded
    as the timed runs' cache loads it (its loader, after a first untimed load), and ``catchup``,
    a draft's catch-up line (:func:`catchup_line`). Priced like the simulator's cost model, from which the replays'
    Oracle-Dynamic plans (:meth:`BenchRun.policy`). ``options``: the loads' :func:`loader_options`."""
    controller.reconfigure(policy="general-static")
    stats = controller.generate(ids, max_new_tokens).stats
    loads = timed_loads(registry, storage, **(options or {}))
    model = CostModel.measure([("general-static", stats)], loads)
    base, per_token = catchup  # one generation has one catch-up: no line to fit from it
    return replace(model, catchup_base_seconds=base, catchup_token_seconds=per_token).schedule_costs(capacity, gamma)


@dataclass
class BenchRun:
    """A policy bench's result and what the simulator needs to replay it (runtime/simulator.py)."""

    result: dict
    cfg: PolicyBenchConfig
    traces: list[PromptTrace]
    costs: CostModel  # fitted to the timed runs
    schedule_costs: ScheduleCosts  # what Oracle-Dynamic planned with
    predictor: object | None  # the ranking head over recorded contexts (the live one's view)
    domains: dict[str, str]
    registry: DraftRegistry
    runs: list[tuple[str, str, tuple[int, ...], GenerationStats]]  # (policy, workload, prompt, stats), every timed run
    loader_options: dict = field(default_factory=dict)  # how its drafts were loaded (loader_options)

    def __post_init__(self) -> None:
        if not self.loader_options:  # a run rebuilt without them (scripts/): at least the drafts' forward path
            self.loader_options = {"quantization": self.cfg.draft_quantization}

    def sim_config(self, **changes) -> SimConfig:
        base = dict(capacity=self.cfg.capacity, interval=self.cfg.interval, gamma=self.cfg.gamma,
                    recent_tokens=self.cfg.recent_tokens, max_new_tokens=self.cfg.max_new_tokens)
        return SimConfig(**(base | changes))

    def policy(self, name: str, config: SimConfig, costs: CostModel | None = None,
               schedule: ScheduleCosts | None = None) -> DraftPolicy:
        """A fresh policy object, as the controller makes one per generation. Oracles plan with ``schedule``, else
        with the costs the replay charges (a sweep's Oracle-Dynamic is the best schedule under them); a replay
        that validates the real runs passes ``schedule_costs``, what the timed Oracle-Dynamic planned with."""
        schedule = schedule or (costs or self.costs).schedule_costs(config.capacity, config.gamma)
        by_prompt = {tuple(t.prompt_ids): t for t in self.traces}

        def oracle_for(ids):
            return by_prompt[tuple(ids)].oracle(config.max_new_tokens, config.gamma, config.interval, schedule)

        return make_policy(name, predictor=self.predictor, oracle_for=oracle_for, ucb_c=config.ucb_c)

    def refusal(self, policies: Sequence[str], **changes) -> str:
        """Why the controller would refuse one of ``policies`` with this predictor under ``changes`` ("" if none):
        a head whose labels span intervals of its own N ranks at no other N."""
        config = self.sim_config(**changes)
        reasons = [f"{p}: {r}" for p in policies
                   if (r := predictor_refusal(p, self.predictor, config.recent_tokens, config.interval))]
        return "; ".join(reasons)

    def simulate(self, policies: Sequence[str], costs: CostModel | None = None, **changes) -> dict:
        """{policy: {workload: GenerationTotals}} for ``policies`` replayed with ``changes`` to K, N, budget, ...;
        ValueError for a configuration the controller refuses (:meth:`refusal`)."""
        refused = self.refusal(policies, **changes)
        if refused:
            raise ValueError(f"the controller refuses {refused}")
        config = self.sim_config(**changes)
        sim = Simulator(costs or self.costs, config, self.domains, list(self.domains))
        return {p: sim.run(lambda p=p: self.policy(p, config, costs), self.traces) for p in policies}


def prompts_label(config: dict, unit: str = "prompts/workload") -> str:
    """How many prompts ran per workload, for titles and the results page: ``prompts``, and the workloads that had
    fewer rows (they ran what they had: a title that said ``prompts`` for them was not what ran)."""
    short = {w: n for w, n in (config.get("prompts_run") or {}).items() if n < config["prompts"]}
    fewer = f" ({', '.join(f'{w} {n}' for w, n in short.items())})" if short else ""
    return f"{'up to ' if short else ''}{config['prompts']} {unit}{fewer}"


def run_policy_bench(zoo: Path, cfg: PolicyBenchConfig, predictor_dir: Path | None, progress=None) -> dict:
    return collect_policy_bench(zoo, cfg, predictor_dir, progress).result


def collect_policy_bench(zoo: Path, cfg: PolicyBenchConfig, predictor_dir: Path | None, progress=None) -> BenchRun:
    """The timed runs (and, with ``cfg.simulate``, the simulator's validation against them)."""
    import time

    import torch
    from tqdm import tqdm

    torch.set_num_threads(cfg.threads)
    folder = Path(cfg.workloads_dir) if cfg.workloads_dir else zoo / "workloads"
    storage = DraftStorage(storage_medium(cfg.storage))
    models = load_models(zoo / "registry.yaml", predictor_path=find_predictor(predictor_dir),
                         quantization=cfg.quantization)
    tokenizer, target, registry, predictor = models.tokenizer, models.target, models.registry, models.predictor
    if getattr(predictor, "recent_tokens", 0):  # the window T the head was trained on: the controller holds us to it
        cfg = replace(cfg, recent_tokens=predictor.recent_tokens)
    policies = [p for p in cfg.policies if predictor is not None or p not in RANKING_POLICIES]
    skipped = sorted(set(cfg.policies) - set(policies))
    if not policies:
        raise ValueError(f"{', '.join(skipped)} need the predictor and the zoo has none: train one"
                         " (memspec-train-predictor) or name it with --predictor")
    eos = models.end_token_ids
    trace_tokens = max(cfg.trace_tokens, cfg.max_new_tokens)

    # future knowledge for the oracles (exact under greedy): every draft once, outside the timed runs;
    # recorded to trace_tokens, a budget's oracle is its prefix (greedy output does not depend on the budget)
    drafts = {e.name: load_model(ModelSpec(str(e.path), quantization=cfg.draft_quantization)).model for e in registry}
    # the chat template where the target has one, as the node sends them
    prompts = workload_prompts(folder, cfg.workloads, cfg.prompts, tokenizer)
    if progress is not None:  # the timed generations, now that the policies and the prompts read are known
        progress.total = len(policies) * sum(len(v) for v in prompts.values()) * cfg.runs
        progress.refresh()
    traces: list[PromptTrace] = []
    hidden = predictor is not None and predictor.config.encoder == "target-hidden"
    pairs = [(w, ids) for w, ids_list in prompts.items() for ids in ids_list]
    if not any(prompts.get(w) for w in cfg.workloads):  # before the traces: a median over none raised first
        raise ValueError(f"the workloads {', '.join(cfg.workloads)} in {folder} have no prompts")
    # the target's greedy answer and every draft's agreement per prompt: minutes on the paper's 144 prompts
    for w, ids in tqdm(pairs, desc="oracle traces", unit="prompt", disable=progress is None, leave=False):
        oracle = GreedyOracle.compute(target.model, drafts, ids, trace_tokens, cfg.gamma, cfg.interval, eos)
        trace = PromptTrace.from_oracle(w, ids, oracle, eos)
        if hidden:
            trace.hidden = target_hidden_states(target.model, ids, trace.continuation)
        traces.append(trace)
    # a switched-in draft's catch-up over prompts of this bench's lengths (every draft has one architecture)
    catchup = catchup_line(next(iter(drafts.values())), round(statistics.median(len(t.prompt_ids) for t in traces)))
    del drafts
    oracles = {tuple(t.prompt_ids): t.oracle(cfg.max_new_tokens, cfg.gamma, cfg.interval, None) for t in traces}

    # the paper's protocol: every generation starts from nothing, the target's KV cache too (each policy runs the
    # same prompt in turn, and all but the first would reuse its KV: runtime/prompt_cache.py)
    config = RuntimeConfig(policy=policies[0], capacity=cfg.capacity, interval=cfg.interval, gamma=cfg.gamma,
                           recent_tokens=cfg.recent_tokens, reset_cache_per_generation=True, prompt_cache=False)
    # the loader the controller would make itself (its dtype, device and check against the target's width), through
    # the bench's storage, whose records the bench reads
    options = loader_options(models, cfg.draft_quantization)
    controller = models.controller(config, loader=registry_loader(registry, storage=storage, **options),
                                   oracle_for=lambda ids: oracles[tuple(ids)])
    rows = {w: {p: PolicyRow() for p in policies} for w in cfg.workloads}
    runs: list[tuple[str, str, tuple[int, ...], GenerationStats]] = []
    live_recent = None
    try:
        first = next(ids for w in cfg.workloads for ids in prompts[w])
        costs = measure_costs(controller, storage, registry, first, cfg.max_new_tokens, cfg.capacity, cfg.gamma,
                              options, catchup)
        ranking = next((p for p in policies if p in RANKING_POLICIES), None)
        if ranking is not None:  # the predictor's first ranking (its lazy set-up) is no policy's cost: paid untimed
            controller.reconfigure(policy=ranking)
            controller.generate(first, 2 * cfg.interval)
            controller.cache.reset()
            storage.take_records()  # its loads are not the timed runs'
        names = [e.name for e in registry]  # the controller's candidates, in registry order
        for oracle in oracles.values():
            oracle.costs = costs
            if "oracle-dynamic" in policies:  # hindsight planning is no cost of decoding: solved before the timing
                oracle.plan([d for d in names if d in oracle.agreement], cfg.capacity)
        turn = 0  # one rotation over every prompt of every workload: each policy takes each place in the order
        for _ in range(cfg.runs):
            for w in cfg.workloads:
                for ids in prompts[w]:
                    k, turn = turn % len(policies), turn + 1
                    for policy in policies[k:] + policies[:k]:
                        controller.reconfigure(policy=policy)
                        # the protocol's reset, outside the timing: the run before may have left a prefetch in
                        # flight, and generate()'s own reset would wait for it inside this policy's end to end
                        controller.cache.reset()
                        result = controller.generate(ids, cfg.max_new_tokens)
                        s, row = result.stats, rows[w][policy]
                        runs.append((policy, w, tuple(ids), s))
                        row.totals.add(s)
                        row.switches += s.draft_switches
                        row.lossless &= result.token_ids == oracles[tuple(ids)].continuation
                        if progress is not None:
                            progress.update(1)
        loads = storage.take_records()  # the timed runs' loads only
        if hidden and any(p in RANKING_POLICIES for p in policies):
            # does the live predictor see the recent tokens? (its hook needs the target's module forward)
            controller.reconfigure(policy="memspec")
            controller.cache.reset()
            probe = controller.generate(first, min(cfg.max_new_tokens, 6 * cfg.interval))
            live_recent = live_recent_features(predictor, first, probe.token_ids)
            storage.take_records()
    finally:
        controller.close()
    over = domain_workloads(cfg.workloads)  # the goals' GMEAN, also the one printed (figures.py uses it too)
    # the breakdown pools the same workloads as the GMEAN and the paper's figure 7
    per_policy = {p: _merged(rows[w][p].totals for w in over) for p in policies}
    # fitted to every timed run: the simulator's costs, and the one speculative iteration (gamma draft tokens and
    # their verify) that every load is counted in, here, in the figures and in Oracle-Dynamic's plan
    fitted = CostModel.measure([(p, s) for p, _, _, s in runs], costs.load_seconds, storage.medium.name)
    table = {w: {p: rows[w][p].summary() for p in policies} for w in cfg.workloads}
    geo = {p: gmean([table[w][p]["tokens_per_second"] for w in over]) for p in policies}
    geo_e2e = {p: gmean([table[w][p]["end_to_end_tokens_per_second"] for w in over]) for p in policies}
    ratios = {}
    for mine in ("memspec", COST_AWARE):
        if mine in geo:
            ratios |= {f"{mine}_vs_{p}": geo[mine] / geo[p] for p in policies if p != mine and geo[p] > 0}
    result = {
        "config": asdict(cfg) | {"zoo": str(zoo), "policies": policies, "workloads": list(cfg.workloads),
                                 "workloads_dir": str(folder), "skipped_policies": skipped,
                                 "prompts_run": {w: len(ids) for w, ids in prompts.items()}},
        "metrics": METRICS,
        "workloads": table,
        "gmean_workloads": over,
        "gmean_tokens_per_second": geo,
        "gmean_end_to_end_tokens_per_second": geo_e2e,
        "ratios": ratios,
        "time_breakdown": {p: {"parts": list(BREAKDOWN), "fraction": per_policy[p].breakdown_fractions(),
                               "seconds": per_policy[p].breakdown, "over": over} for p in policies},
        "storage": storage_block(storage.summary(loads, fitted.iteration_seconds(cfg.gamma)), costs.load_seconds),
        "oracle_costs": asdict(costs) | {"load_seconds": dict(costs.load_seconds)},
        "predictor": None if predictor is None else {
            "encoder": predictor.config.encoder, "input": predictor.config.input,
            "recent_features_live": live_recent},
        "lossless": all(table[w][p]["lossless"] for w in cfg.workloads for p in policies),
    }
    bench = BenchRun(
        result=result, cfg=cfg, traces=traces,
        costs=fitted,
        schedule_costs=costs,
        predictor=replay_predictor(predictor, traces, recent=live_recent is not False),
        domains={e.name: e.domain for e in registry.entries()}, registry=registry, runs=runs,
        loader_options=options,
    )
    models.close()
    if cfg.simulate:
        if progress is not None:
            progress.write("replaying every timed generation in the simulator (its validation)")
        t0 = time.perf_counter()
        result["simulator_validation"] = validate_simulator(bench)
        result["simulator_validation"]["simulation_seconds"] = time.perf_counter() - t0
    return bench


def validate_simulator(bench: BenchRun) -> dict:
    """Simulated vs measured throughput per policy, run for run on the same prompts.

    Replays of every timed generation with the cost model fitted to these runs: ``speed_matched`` scales its compute
    times by the speed the machine had during that generation (its measured target verify time over the model's,
    CostModel.speed_of: on a shared machine the other jobs change it from run to run), ``pooled`` uses the model as
    it is. ``held_out`` fits the model on the even-numbered prompts of each workload only and replays the others at
    the fitted speed against those same generations' measurements: no figure of a checked run enters its replay, so
    it is the validation that gates (``gate``). Speed matching would take the checked run's own verify time, most
    of its decode time, and make that part agree by construction; ``held_out_speed_matched`` does so, for telling
    the machine's drift apart from the model's errors. Everything a policy decides (drafts, switches, waits,
    catch-ups, accepted tokens) comes from the replay. Each GMEAN is over the same workloads on both sides
    (domain_workloads).
    """
    result = bench.result
    policies = result["config"]["policies"]
    workloads = result["config"]["workloads"]
    over = domain_workloads(workloads)
    config = bench.sim_config()
    by_prompt = {tuple(t.prompt_ids): t for t in bench.traces}
    position: dict[tuple[int, ...], int] = {}  # each prompt's place in its workload
    placed: dict[str, int] = {}
    for trace in bench.traces:
        if tuple(trace.prompt_ids) not in position:
            position[tuple(trace.prompt_ids)] = placed.get(trace.workload, 0)
            placed[trace.workload] = placed.get(trace.workload, 0) + 1
    fitting = [(p, s) for p, _, ids, s in bench.runs if position[ids] % 2 == 0]
    held_costs = CostModel.measure(fitting, bench.costs.load_seconds, bench.costs.medium)

    def replay(costs: CostModel, runs, speed_matched: bool) -> tuple[dict, dict, list[float]]:
        sim = Simulator(costs, config, bench.domains, list(bench.domains))
        measured = {p: {w: GenerationTotals() for w in workloads} for p in policies}
        simulated = {p: {w: GenerationTotals() for w in workloads} for p in policies}
        speeds = []
        for policy, w, ids, stats in runs:
            speed = costs.speed_of(stats) if speed_matched else 1.0
            speeds.append(speed)
            measured[policy][w].add(stats)
            # the schedule the measured Oracle-Dynamic followed: re-planned under the fitted costs (0.71 against
            # 0.55 iterations for a 300-token catch-up in the committed run) it switched less than the one measured
            replayed = bench.policy(policy, config, schedule=bench.schedule_costs)
            simulated[policy][w].add(sim.generate(replayed, by_prompt[ids], costs.scaled(speed)))
        return measured, simulated, speeds

    def compare(measured: dict, simulated: dict) -> dict:
        # the workloads every policy has runs on (the held-out half of a one-prompt workload has none): a GMEAN
        # with a workload of no runs would be 0, and every error undefined
        covered = [w for w in over if all(measured[p][w].generations for p in policies)]
        rows = {}
        for p in policies:
            per_workload = {w: {"measured_end_to_end": measured[p][w].end_to_end_tokens_per_second,
                                "simulated_end_to_end": simulated[p][w].end_to_end_tokens_per_second,
                                "measured_tokens_per_second": measured[p][w].tokens_per_second,
                                "simulated_tokens_per_second": simulated[p][w].tokens_per_second}
                            for w in workloads}
            row = {}
            for name in ("end_to_end", "tokens_per_second"):
                real = gmean([per_workload[w][f"measured_{name}"] for w in covered])
                sim = gmean([per_workload[w][f"simulated_{name}"] for w in covered])
                row |= {f"measured_{name}": real, f"simulated_{name}": sim,
                        f"error_{name}": sim / real - 1 if real > 0 else None}
            rows[p] = row | {"workloads": per_workload}
        errors = [abs(r["error_end_to_end"]) for r in rows.values() if r["error_end_to_end"] is not None]
        # a policy left uncompared (no measured throughput) fails the gate: the others' errors bound nothing of it
        compared = bool(errors) and len(errors) == len(rows)
        # the paper's metric too: the sweeps (figures 10-12) publish simulated decode throughput, which the gate,
        # end to end as issue 17 defines it (prefill and setup diluting a decode error), does not bound; reported
        decode = [abs(r["error_tokens_per_second"]) for r in rows.values() if r["error_tokens_per_second"] is not None]
        return {"policies": rows, "gmean_over": covered, "max_abs_error_end_to_end": max(errors) if errors else None,
                "max_abs_error_tokens_per_second": max(decode) if decode else None,
                "within_tolerance": compared and max(errors) <= VALIDATION_TOLERANCE}

    measured, matched_sim, speeds = replay(bench.costs, bench.runs, True)
    _, pooled_sim, _ = replay(bench.costs, bench.runs, False)
    held_runs = [run for run in bench.runs if position[run[2]] % 2 == 1]
    held = compare(*replay(held_costs, held_runs, False)[:2]) if held_runs and fitting else None
    held_matched = compare(*replay(held_costs, held_runs, True)[:2]) if held_runs and fitting else None
    pooled = compare(measured, pooled_sim)
    # the gate: the held-out replay; with one prompt per workload nothing is held out, and the in-sample pooled
    # replay is all there is (said so)
    # (a held-out replay covering no workload, where every workload had one prompt but one that is left out of the
    # GMEAN, has nothing to say: the pooled one is the gate then, as with one prompt everywhere)
    gate_kind, gate = (("held out: fitted on each workload's even-numbered prompts, the others replayed at the fitted"
                        " speed", held) if held is not None and held["gmean_over"]
                       else ("pooled, in sample: no prompt to hold out", pooled))
    return {
        "definition": "per policy, the GMEAN over the workloads (the same ones on both sides: " + ", ".join(over)
                      + ") of simulated vs measured throughput, each timed generation replayed once on its prompt's"
                      " recorded trace with the same policy object and a cost model fitted to these runs"
                      " (runtime/simulator.py); the top-level rows (speed_matched) scale each replay's compute times"
                      " by the machine speed measured in that generation (its target verify time over the model's,"
                      " which makes the verify part agree by construction), pooled does not; held_out fits the model"
                      " on each workload's even-numbered prompts and replays the others at the fitted speed against"
                      " their own measurements (no figure of a checked run in its replay): it is the gate;"
                      " held_out_speed_matched is the same replay speed-matched",
        "tolerance": VALIDATION_TOLERANCE,
        "gate": {"kind": gate_kind, "max_abs_error_end_to_end": gate["max_abs_error_end_to_end"],
                 "max_abs_error_tokens_per_second": gate["max_abs_error_tokens_per_second"],
                 "within_tolerance": gate["within_tolerance"]},
        **compare(measured, matched_sim),
        "pooled": pooled,
        "held_out": held,
        "held_out_speed_matched": held_matched,
        "machine_speed": {"min": min(speeds, default=1.0), "max": max(speeds, default=1.0),
                          "stdev": statistics.pstdev(speeds) if speeds else 0.0},
        "cost_model": bench.costs.to_json(),
    }


def share(x: float | None, signed: bool = False) -> str:
    """A share or an error as a percentage; n/a where it is undefined (no runs to compare)."""
    return "n/a" if x is None else f"{x:+.1%}" if signed else f"{x:.1%}"


def validation_gate(validation: dict) -> dict:
    """The validation's gate; a run from before the held-out gate (no ``gate`` key) was judged speed-matched."""
    return validation.get("gate") or {"kind": "speed-matched (a run from before the held-out gate)",
                                      "max_abs_error_end_to_end": validation["max_abs_error_end_to_end"],
                                      "within_tolerance": validation["within_tolerance"]}


def validation_table(validation: dict) -> str:
    """The validation as printed by the benches."""
    speed = validation.get("machine_speed", {})
    lines = [f"simulator vs measured, speed-matched (GMEAN over workloads; tolerance {validation['tolerance']:.0%}"
             f" end to end; this machine's speed ranged {speed.get('min', 1):.2f}x-{speed.get('max', 1):.2f}x"
             " of the fitted model over the runs):",
             f"{'policy':>20} {'e2e real':>9} {'e2e sim':>9} {'error':>7} {'decode real':>12} {'decode sim':>11}"
             f" {'error':>7}"]
    for p, r in validation["policies"].items():
        lines.append(f"{p:>20} {r['measured_end_to_end']:9.2f} {r['simulated_end_to_end']:9.2f}"
                     f" {share(r['error_end_to_end'], True):>7} {r['measured_tokens_per_second']:12.2f}"
                     f" {r['simulated_tokens_per_second']:11.2f} {share(r['error_tokens_per_second'], True):>7}")
    gate, matched = validation_gate(validation), validation.get("held_out_speed_matched")
    lines.append(f"largest end-to-end error, speed-matched {share(validation['max_abs_error_end_to_end'])}"
                 f"; pooled (no speed matching) {share(validation['pooled']['max_abs_error_end_to_end'])}"
                 + (f"; held out speed-matched {share(matched['max_abs_error_end_to_end'])}" if matched else ""))
    lines.append(f"gate ({gate['kind']}): largest end-to-end error {share(gate['max_abs_error_end_to_end'])}, "
                 + ("within" if gate["within_tolerance"] else "OUTSIDE") + " the tolerance"
                 + (f"; largest decode-throughput error {share(gate['max_abs_error_tokens_per_second'])} (the"
                    " sweeps' metric; reported, not gated)" if gate.get("max_abs_error_tokens_per_second") is not None
                    else ""))
    return "\n".join(lines)


def _merged(totals) -> GenerationTotals:
    out = GenerationTotals()
    for t in totals:
        out = out.merge(t)
    return out


def plot_policy_bench(result: dict, path: Path) -> None:
    """Grouped bars: tokens/s per workload and policy, plus the geometric mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = result["config"]["policies"]
    # the GMEAN is over the domain workloads only (domain_workloads), not every bar beside it: say which
    groups = list(result["workloads"]) + ["GMEAN of\n" + ", ".join(result["gmean_workloads"])]
    values = {p: [result["workloads"][w][p]["tokens_per_second"] for w in result["workloads"]]
              + [result["gmean_tokens_per_second"][p]] for p in policies}
    fig, ax = plt.subplots(figsize=(11, 4.2))
    width = 0.8 / len(policies)
    for j, p in enumerate(policies):
        ax.bar([g + j * width for g in range(len(groups))], values[p], width, label=p)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups)
    ax.set_ylabel("steady-state tokens/s")
    cfg = result["config"]
    storage = result.get("storage", {})
    medium = f"storage {storage.get('medium', cfg.get('storage'))}" + (" (emulated)" if storage.get("emulated") else "")
    ax.set_title(
        f"Policies on {Path(cfg['zoo']).name}/"
        + (f", workloads from {Path(cfg['workloads_dir']).name}/" if cfg.get("workloads_dir") else "")
        + f" (K={cfg['capacity']}, N={cfg['interval']}, gamma={cfg['gamma']}, "
        f"{cfg['max_new_tokens']} tokens, {prompts_label(cfg)}, {medium})",
        fontsize=9,
    )
    ax.legend(ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
