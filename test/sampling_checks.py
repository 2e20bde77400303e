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
