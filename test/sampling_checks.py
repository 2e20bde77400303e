"""Chi-square checks that sampled outputs have the target's own distribution (the lossless sampling rule).

Shared by every test that samples through the engine: the statistic, its critical value and the target's exact
probability of every short continuation. Seeds are fixed in those tests, so a run fails only on real bias (or, on
another CPU whose float rounding draws other samples, with the small probability the critical value leaves).
"""

from __future__ import annotations

from collections import Counter
from itertools import product

import torch

from memspec_ros.runtime.speculative import SamplingConfig, warp_probs


def chi2(observed: Counter, expected: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic over ``n`` samples with the bins expected below 5 pooled into one; (statistic, degrees
    of freedom). Every observed outcome must be one of ``expected``'s."""
    stat, pooled_obs, pooled_exp, bins = 0.0, 0, 0.0, 0
    for key, prob in expected.items():
        exp = prob * n
        if exp < 5:
            pooled_obs += observed.get(key, 0)
            pooled_exp += exp
            continue
        stat += (observed.get(key, 0) - exp) ** 2 / exp
        bins += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        bins += 1
    assert sum(observed.values()) == n and set(observed) <= set(expected)
    return stat, bins - 1


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


def check_after_likeliest_first(target, prompt: list[int], sampling: SamplingConfig, run, draws: int,
                                z: float = 3.09) -> None:
    """Chi-square of generated tokens 2-4 against their exact distribution, over the ``draws`` generations
    ``run(seed)`` (sessions of 4 new tokens) whose first token is the target's likeliest one. Four tokens, so that
    after the prefill's token an iteration can verify two or more proposals: with three, the length cap left one
    proposal per iteration, and a rule wrong only at a later proposal (a rejection after an accepted token, the
    bonus row after several) went unseen. Asserts that such iterations happened."""
    with torch.no_grad():
        first = int(warp_probs(target(torch.tensor([prompt])).logits[0, -1], sampling).argmax())
    exact = exact_joint(target, prompt + [first], sampling)
    counts: Counter = Counter()
    several = 0
    for seed in range(draws):
        session = run(seed)
        ids = session.generated_ids
        assert len(ids) == 4, ids
        if ids[0] == first:
            counts[tuple(ids[1:])] += 1
        several += any(it.proposed >= 2 for it in session.stats.iterations)
    n = sum(counts.values())
    assert n > 500 and several > draws // 4, (n, several)
    stat, dof = chi2(counts, exact, n)
    assert stat < chi2_critical(dof, z), (stat, dof)
