"""γ from measured costs: how many tokens the draft should propose, iteration by iteration.

With per-token acceptance rate α, an iteration that proposes γ tokens commits
on average ``(1 - α^(γ+1)) / (1 - α)`` tokens (the accepted run plus the target's
own token) and costs ``γ·t_draft + t_verify(γ+1)``. The best γ maximises their
ratio, and γ = 0 (the target alone, ``1 / t_verify(1)``) is one of the
candidates: where verifying extra rows is expensive (the int4 kernel pays for
every row) or the draft is poor, not drafting is the fastest choice.

The costs are measured once per model on this machine (the same timing the
``auto`` forward path uses). A draft's cost per proposed token is then
corrected by what its iterations really took: that includes catching up on
tokens it did not propose (after copied iterations, runtime/lookup.py, it
must first read the copies), which the isolated timing misses. In a one-off
profile on the real zoo (int4, 10 held-out prompts, with a datastore) the bundled
drafts took 4.4 ms per iteration for 2 tokens against 1 ms per token timed alone.
α is estimated per draft from the running acceptance, with recent iterations
weighted more (acceptance changes within an answer), and a draft whose best γ
has fallen to 0 is still run with γ = 1 now and then (every PROBE_EVERY such
iterations) so its estimate can recover; a draft the policy does not run is not
probed. This
is the rule of adaptive-lookahead work (SpecDec++, DISCO) reduced to its
measured parts.

Within an iteration the draft also stops on its own confidence (:func:`row_pays`,
:func:`draft_pays`): a proposal is verified only if the draft's probability that
it and every proposal before it are accepted buys its verify row at the target's
own rate. The distilled drafts' probabilities are calibrated
(``scripts/draft_confidence.py 6 10 0.2``, AMD EPYC): at the 2,987 answer positions of
the int4 target's greedy answers to 30 held-out requests, each domain's own draft's
first proposal matched the target's token 17% of the time at draft probability
0-0.2, 41% at 0.2-0.4, 82% at 0.6-0.8 and 99% above 0.9. Replayed over those answers
at that machine's int4 forward costs, the running-acceptance gamma committed 1.164x
the target alone's tokens per millisecond (GMEAN of five domains), and with the
stop 1.209x. In the engine itself (``scripts/ab_confidence_stop.py``) the stop gave 1.036x on
int4 and 1.101x on fp32 at first, but that script warmed up the `general` draft alone, so the
other drafts' one-off forward timings and first-forward setup fell into whichever adaptive arm
ran them first (the stop-less one for three of the four domain drafts). With every draft warmed
(session 55, 30 held-out prompts, a 2 vCPU AMD EPYC with AVX512): 0.985x on int4 (182.2 against
184.9 tok/s; the target alone 140.6) and 1.005x on fp32 (51.0 against 50.8; alone 34.4), outputs
identical. The stop proposes 15% fewer tokens (1,881 against 2,216 on int4) for the same
commits, but on these drafts that time is not measurably won back: the stop is level with
proposing every token.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from .path_choice import forward_cost_curve, time_forward

PRIOR_TRIALS = 2.0  # the estimate starts at alpha = 0.5 worth two proposals, so one iteration cannot swing it
DECAY = 0.9  # weight of past evidence per iteration: about the last ten iterations count
PROBE_EVERY = 8  # while gamma is 0, propose one token every this many iterations to keep alpha current


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens an iteration commits on average: the accepted prefix of gamma proposals plus one."""
    if gamma == 0:
        return 1.0
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


@dataclass
class ForwardCosts:
    """Measured milliseconds: ``verify_ms[k - 1]`` for a k-token target forward, ``draft_ms`` per draft token."""

    verify_ms: list[float]
    draft_ms: float

    def iteration_ms(self, gamma: int) -> float:
        return gamma * self.draft_ms + self.verify_ms[min(gamma, len(self.verify_ms) - 1)]


def best_gamma(costs: ForwardCosts, alpha: float, max_gamma: int) -> int:
    """The gamma in 0..max_gamma with the most committed tokens per millisecond."""
    return max(range(max_gamma + 1), key=lambda g: expected_tokens(alpha, g) / costs.iteration_ms(g))


def row_pays(costs: ForwardCosts, k: int, confidence: float, extra_ms: float = 0.0) -> bool:
    """Whether a k-th proposed token is worth its row in the verify (and ``extra_ms`` besides). With
    ``confidence`` the chance that it is accepted together with every proposal before it, the row's extra cost
    must buy at least the tokens a one-token target forward commits in that time (one per ``verify_ms[0]``)."""
    return confidence * costs.verify_ms[0] >= costs.verify_ms[k] - costs.verify_ms[k - 1] + extra_ms


def draft_pays(costs: ForwardCosts, k: int, confidence: float) -> bool:
    """Whether drafting a k-th token can pay: at best it is as likely as the proposals before it
    (``confidence``), and it costs a draft forward besides its row."""
    return row_pays(costs, k, confidence, costs.draft_ms)


@dataclass
class AcceptanceEstimate:
    """Per-token acceptance from (proposed, accepted) counts, decayed so recent iterations count more.

    A proposal position is a trial up to and including the first rejection: an iteration that accepts
    ``a`` of ``g`` proposals ran ``a`` successful trials and, if ``a < g``, one failed one."""

    successes: float = PRIOR_TRIALS / 2
    trials: float = PRIOR_TRIALS

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.successes = DECAY * self.successes + accepted
        self.trials = DECAY * self.trials + accepted + (1 if accepted < proposed else 0)

    @property
    def alpha(self) -> float:
        return self.successes / self.trials


# per model object and torch thread count (the costs change with the threads a forward gets)
_TARGET_COSTS: weakref.WeakKeyDictionary[torch.nn.Module, dict[int, list[float]]] = weakref.WeakKeyDictionary()
_DRAFT_COSTS: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[int, bool], float]] = weakref.WeakKeyDictionary()


def target_costs(target: torch.nn.Module, max_gamma: int) -> list[float]:
    """Milliseconds of a 1..max_gamma+1-token target forward, measured once per model object and thread count.

    About a second for a 135 M target, so the controller calls it before a generation is timed (at
    construction, and before each generation in case gamma grew); measured inside the first iteration
    instead, it halved the first goal's decode speed in the demo (19.8 against 45 tok/s, 64 tokens)."""
    vocab = int(getattr(target.config, "vocab_size", 2))
    per_target = _TARGET_COSTS.setdefault(target, {})
    threads = torch.get_num_threads()
    known = per_target.get(threads, [])
    if len(known) < max_gamma + 1:
        # the whole curve again, not the new sizes alone: its sizes must be timed in the same interleaved rounds
        known = per_target[threads] = forward_cost_curve(target, max_gamma + 1, vocab)
    return known[: max_gamma + 1]


def measure_costs(target: torch.nn.Module, draft: torch.nn.Module, max_gamma: int,
                  lean_draft: bool = True) -> ForwardCosts:
    """The pair's forward times: the target's from :func:`target_costs`, the draft's measured once per model
    object, thread count and forward (``lean_draft`` False: transformers', about twice the lean one's time) at
    the draft's first iteration (a few milliseconds)."""
    verify_ms = target_costs(target, max_gamma)
    per_draft = _DRAFT_COSTS.setdefault(draft, {})
    key = (torch.get_num_threads(), lean_draft)
    if key not in per_draft:
        per_draft[key] = time_forward(draft, 1, int(getattr(target.config, "vocab_size", 2)), lean=lean_draft)
    return ForwardCosts(verify_ms=verify_ms, draft_ms=per_draft[key])


@dataclass
class GammaChooser:
    """Chooses each iteration's gamma for a generation from measured costs and running acceptance."""

    max_gamma: int
    estimates: dict[str, AcceptanceEstimate] = field(default_factory=dict)
    _idle: dict[str, int] = field(default_factory=dict)  # per draft: iterations since it last proposed
    _draft_ms: dict[str, float] = field(default_factory=dict)  # per draft: observed ms per proposed token

    def costs(self, measured: ForwardCosts, draft_name: str) -> ForwardCosts:
        """``measured`` with the draft's cost per token replaced by what its iterations took, once observed."""
        observed = self._draft_ms.get(draft_name)
        return measured if observed is None else ForwardCosts(verify_ms=measured.verify_ms, draft_ms=observed)

    def observe_cost(self, draft_name: str, proposed: int, draft_ms: float) -> None:
        """An iteration's drafting time for the ``proposed`` draft forwards it timed (a switch's catch-up is not a
        draft token's cost, and is timed apart); recent ones weigh more."""
        if proposed <= 0:
            return
        per_token = draft_ms / proposed
        known = self._draft_ms.get(draft_name)
        self._draft_ms[draft_name] = per_token if known is None else DECAY * known + (1 - DECAY) * per_token

    def alpha(self, draft_name: str) -> float:
        return self.estimates.setdefault(draft_name, AcceptanceEstimate()).alpha

    def choose(self, costs: ForwardCosts, draft_name: str, limit: int | None = None) -> int:
        """The best gamma in 0..min(limit, max_gamma); now and then 1 instead of 0, to keep alpha current."""
        most = self.max_gamma if limit is None else min(limit, self.max_gamma)
        gamma = best_gamma(costs, self.alpha(draft_name), most)
        if gamma == 0 and most > 0 and self._probe_due(draft_name):
            return 1
        return gamma

    def _best(self, costs: ForwardCosts, draft_name: str, limit: int | None = None) -> tuple[int, float]:
        """``draft_name``'s best gamma in 0..min(limit, max_gamma) and the committed tokens per millisecond expected
        at it."""
        most = self.max_gamma if limit is None else min(limit, self.max_gamma)
        alpha = self.alpha(draft_name)
        gamma = best_gamma(costs, alpha, most)
        return gamma, expected_tokens(alpha, gamma) / costs.iteration_ms(gamma)

    def rate(self, costs: ForwardCosts, draft_name: str, limit: int | None = None) -> float:
        """Committed tokens per millisecond expected of ``draft_name`` at its best gamma (0..min(limit, max_gamma))."""
        return self._best(costs, draft_name, limit)[1]

    def choose_copy(self, costs: ForwardCosts, name: str, limit: int, rival: str = "",
                    rival_costs: ForwardCosts | None = None) -> int:
        """How many of ``limit`` copied tokens to propose (``name``: their acceptance estimate, ``costs``: the
        target's with a free draft): the best gamma when it beats a plain step and, given a ``rival`` draft that
        would run instead, that draft's expected rate too; else 0, but 1 (or the best gamma) every PROBE_EVERY
        declined copies, so their acceptance stays current. One decision and one count: a probe that a second
        test could decline again was never made, and the copies stayed off for the rest of the generation."""
        gamma, rate = self._best(costs, name, limit)
        if gamma > 0 and (rival_costs is None or rate >= self.rate(rival_costs, rival)):
            return gamma
        return max(gamma, 1) if min(limit, self.max_gamma) > 0 and self._probe_due(name) else 0

    def _probe_due(self, draft_name: str) -> bool:
        """One more time ``draft_name`` was passed over; True (and the count restarts) every PROBE_EVERY times."""
        idle = self._idle[draft_name] = self._idle.get(draft_name, 0) + 1
        if idle >= PROBE_EVERY:
            self._idle[draft_name] = 0
            return True
        return False

    def observe(self, draft_name: str, proposed: int, accepted: int) -> None:
        if proposed > 0:
            self._idle[draft_name] = 0
        self.estimates.setdefault(draft_name, AcceptanceEstimate()).observe(proposed, accepted)
