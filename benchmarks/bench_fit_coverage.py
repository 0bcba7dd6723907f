"""How often the sweep's Chinchilla intervals cover the true constants (issue 21).

Synthetic losses from Hoffmann et al.'s constants on the built-in sweep's grid (4 sizes x 3
budgets), 1% multiplicative noise, one fit and ``--refits`` parametric bootstrap refits per
noise draw: the share of draws whose 90% and 95% intervals hold the true E, alpha and beta.
Minutes of CPU (each refit ~0.3 s on one core), so a benchmark, not a test; the Kaplan
interval's coverage is fast and is tested (tests/test_fit_honesty.py).

    python benchmarks/bench_fit_coverage.py --threads 1 --draws 24 --refits 40
"""

from __future__ import annotations

import argparse
import itertools
import math

import numpy as np
import torch

from blockformer.scaling import fit_chinchilla
from blockformer.scaling.fit import GRID, bootstrap_samples, percentile_intervals

from common import cpu_kind

TRUE = dict(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)  # Hoffmann et al.'s constants
LEVELS, CHECKED = (0.90, 0.95), ("E", "alpha", "beta")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--draws", type=int, default=24, help="noise draws (each one fit and its refits)")
    p.add_argument("--refits", type=int, default=40, help="parametric bootstrap refits per draw")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    n, d = np.repeat([1e7, 3e7, 1e8, 3e8], 3), np.tile([1e9, 3e9, 1e10], 4)
    clean = TRUE["E"] + TRUE["A"] / n ** TRUE["alpha"] + TRUE["B"] / d ** TRUE["beta"]
    starts = torch.tensor(list(itertools.product(*GRID.values())), dtype=torch.float64)
    hits = {(level, c): 0 for level in LEVELS for c in CHECKED}
    for seed in range(args.draws):
        loss = clean * np.exp(np.random.default_rng(seed).normal(0, 0.01, n.shape))
        fit = fit_chinchilla(n, d, loss, bootstrap=0)
        theta = torch.tensor([math.log(fit.A), math.log(fit.B), math.log(fit.E), fit.alpha, fit.beta],
                             dtype=torch.float64)
        samples = bootstrap_samples(fit, theta, n, d, loss, 1e-3, torch.cat([theta[None], starts]), args.refits, seed)
        for level, c in hits:
            lo, hi = percentile_intervals(samples, level)[c]
            hits[level, c] += lo <= TRUE[c] <= hi
    print(f"{args.threads} thread(s), CPU {cpu_kind()}\n")
    print(f"| nominal | {' | '.join(CHECKED)} | (binomial sd over {args.draws} draws) |")
    print(f"|---|{'---:|' * len(CHECKED)}---:|")
    for level in LEVELS:
        rates = " | ".join(f"{hits[level, c] / args.draws:.0%}" for c in CHECKED)
        print(f"| {level:.0%} | {rates} | {math.sqrt(level * (1 - level) / args.draws):.2f} |")


if __name__ == "__main__":
    main()
