"""The chi-square goodness of fit every sampling-exactness check uses (the tests' and the device
check's): torch only, so it runs where scipy is not installed; tests/integration/test_sampling_exact.py checks
it against scipy.stats.chisquare."""
from __future__ import annotations

import torch


def chisquare_p(counts, probs, min_expected: float = 5.0) -> float:
    """p-value of `counts` against `probs` (same shape, any; tensors, arrays or lists), every bin
    with expected count under `min_expected` merged into one. A count in a zero-probability bin
    gives 0."""
    counts = torch.as_tensor(counts, dtype=torch.float64).flatten()
    probs = torch.as_tensor(probs, dtype=torch.float64).flatten()
    probs = probs / probs.sum()
    if counts[probs <= 1e-12].sum() > 0:
        return 0.0
    exp = probs * counts.sum()
    small = exp < min_expected
    obs_b = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp_b = torch.cat([exp[~small], exp[small].sum().reshape(1)])
    keep = exp_b > 0
    obs_b, exp_b = obs_b[keep], exp_b[keep]
    if len(obs_b) < 2:
        return 1.0
    stat = ((obs_b - exp_b) ** 2 / exp_b).sum()
    return float(torch.special.gammaincc(torch.tensor((len(obs_b) - 1) / 2, dtype=torch.float64), stat / 2))
