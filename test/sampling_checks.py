"""Chi-square checks that sampled outputs have the target's own distribution (the lossless sampling rule).

Shared by every test that samples through the engine: the statistic, its critical value and the target's exact
probability of every short continuation. Seeds are fixed in those tests, so a run fails only on real bias (or, on
another CPU whose float rounding draws other samples, with the small probability the critical value leaves).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from itertools import product

import torch

from memspec_ros.runtime.speculative import SamplingConfig, warp_probs


def chi2(observed: Counter, expected: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic over ``n`` samples with the bins expected below 5 pooled into one; (statistic, degrees
    of freedom). Every observed outcome must be one of ``expected``'s, and possible: one of probability 0 fails at
    once (pooled with others of probability 0 it added nothing to the statistic). A pooled bin still expected below
    5 is merged into the smallest kept bin: its term alone is heavy-tailed, a false failure on another CPU's draws."""
    assert sum(observed.values()) == n and set(observed) <= set(expected)
    impossible = [key for key in observed if expected[key] <= 0]
    assert not impossible, f"outcomes of probability 0 drawn: {impossible[:5]}"
    bins: list[list[float]] = []  # [observed, expected]
    pooled = [0.0, 0.0]
    for key, prob in expected.items():
        exp = prob * n
        target = pooled if exp < 5 else None
        if target is None:
            bins.append([observed.get(key, 0), exp])
        else:
            target[0] += observed.get(key, 0)
            target[1] += exp
    if pooled[1] > 0:
        if pooled[1] < 5 and bins:
            smallest = min(bins, key=lambda b: b[1])
            smallest[0] += pooled[0]
            smallest[1] += pooled[1]
        else:
            bins.append(pooled)
    return sum((o - e) ** 2 / e for o, e in bins), len(bins) - 1


def chi2_critical(dof: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at normal quantile ``z`` (3.09: 0.999; 3.72:
    0.9999)."""
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def exact_joint(target, context: list[int], sampling: SamplingConfig, length: int = 3) -> dict[tuple[int, ...], float]:
    """The target's exact probability of every ``length``-token continuation of ``context`` after warping:
    p(t1 | context) p(t2 | context, t1) ..., for a chi-square against sampled generations."""
    exact: dict[tuple[int, ...], float] = {}
    with torch.no_grad():
        for seq in product(range(target.config.vocab_size), repeat=length):
            logits = target(torch.tensor([context + list(seq)])).logits[0]
            prob = 1.0
            for j, token in enumerate(seq):
                prob *= float(warp_probs(logits[len(context) - 1 + j], sampling)[token])
            exact[seq] = prob
    return exact


def check_given_first(target, prompt: list[int], sampling: SamplingConfig, run, draws: int, z: float = 3.09,
                      several: bool = True, second_alone: bool = False) -> list[tuple[list[int], object]]:
    """Chi-square of generated tokens 2-4 given the first, over every one of the ``draws`` generations ``run(seed)``
    (sessions of 4 new tokens). The first token is the prefill's, drawn by the target alone; the generations are
    grouped by it, each group's counts are compared with the target's exact joint after that token, and the groups'
    statistics and degrees of freedom add up (independent multinomials, given the first tokens). Every draw counts:
    keeping only the generations whose first token was one chosen token threw away two in three of them.

    Four tokens, so that after the prefill's token an iteration can verify two or more proposals: with three, the
    length cap left one proposal per iteration, and a rule wrong only at a later proposal (a rejection after an
    accepted token, the bonus row after several) went unseen; ``several``: assert such iterations happened.
    ``second_alone``: also the second token's own distribution (fewer bins, more power against a bias there).
    Returns every generation's (ids, stats) for the caller's own checks."""
    counts: dict[int, Counter] = defaultdict(Counter)
    runs: list[tuple[list[int], object]] = []
    for seed in range(draws):
        session = run(seed)
        ids = list(session.generated_ids)
        assert len(ids) == 4, ids
        counts[ids[0]][tuple(ids[1:])] += 1
        runs.append((ids, session.stats))
    if several:
        drafted = sum(any(it.proposed >= 2 for it in stats.iterations) for _, stats in runs)
        assert drafted > draws // 4, drafted
    joint, second = [0.0, 0], [0.0, 0]  # statistic, degrees of freedom
    for first, observed in counts.items():
        exact = exact_joint(target, prompt + [first], sampling)
        n = sum(observed.values())
        for total, (stat, dof) in ((joint, chi2(observed, exact, n)),
                                   (second, chi2(_marginal(observed), _marginal(exact), n))):
            total[0] += stat
            total[1] += dof
    assert joint[1] > 0
    assert joint[0] < chi2_critical(joint[1], z), joint
    if second_alone:
        assert second[0] < chi2_critical(second[1], z), second
    return runs


def _marginal(joint: dict) -> dict:
    """The first element's distribution (counts or probabilities) of a joint over tuples."""
    out: dict = defaultdict(float)
    for key, value in joint.items():
        out[key[0]] += value
    return dict(out)
