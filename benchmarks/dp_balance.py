"""Data-parallel load balancing vs the sampler's placement, on fixed-seed text / image / video length mixes.

Baseline: the batch sampler's placement (each rank takes an equal, consecutive slice of the shuffled global
batch). For every mix and data-parallel size it prints the predicted ``max / mean`` rank load before and after
the LPT plan, the plan's distance to the lower bound ``max(total / ranks, largest sample)``, the implied step-time
gain (synchronous DP waits for the slowest rank: ``max load before / max load after``) and the solver latency
(median of ``--repeats`` solves). A second table shows how well the cost model is fitted from noisy per-rank and
per-step timings, and what a plan made with the fitted coefficients costs under the true ones. Usage::

    python benchmarks/dp_balance.py                       # 4096 samples, 8 / 64 / 512 ranks
    python benchmarks/dp_balance.py --samples 8192 --ranks 1024 --repeats 9

Cost model: ``a = 4e-5, b = 1, c = 50`` (token units; attention equals the dense layers at 25k tokens, as in a
7B model; 50 token-equivalents of per-sample overhead).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from loongforge_balance.dp_balance import CostModel, evaluate, fit_cost_model, fit_from_steps, lpt_plan
from loongforge_balance.dp_balance.synthetic import MIXES, vlm_lengths

COST = CostModel(a=4e-5, b=1.0, c=50.0)


def balance_table(samples: int, ranks: list[int], repeats: int) -> None:
    print(f"{'mix':6} {'ranks':>5} {'max/mean before':>16} {'after':>7} {'max/bound':>10} {'step-time gain':>15} "
          f"{'solver ms':>10}")
    for mix in MIXES:
        lengths = vlm_lengths(samples, mix, seed=0)
        costs = COST.costs(lengths)
        for r in ranks:
            sampler = evaluate(np.arange(samples) * r // samples, costs, lengths, r)
            seconds = []
            for _ in range(repeats):
                start = time.perf_counter()
                plan = lpt_plan(costs, lengths, r)
                seconds.append(time.perf_counter() - start)
            print(f"{mix:6} {r:5d} {sampler.imbalance:16.3f} {plan.imbalance:7.4f} {plan.gap:10.5f} "
                  f"{sampler.max_load / plan.max_load:14.2f}x {statistics.median(seconds) * 1e3:10.1f}")


def _rank_draw(rng: np.random.Generator, pool: np.ndarray) -> np.ndarray:
    return rng.choice(pool, size=int(rng.integers(1, 12)))


def _error(fitted: CostModel, true: CostModel) -> float:
    return max(abs(getattr(fitted, k) - getattr(true, k)) / getattr(true, k) for k in ("a", "b", "c"))


def _gap_with(fitted: CostModel, true: CostModel, lengths: np.ndarray, ranks: int) -> float:
    """Max / lower bound under the true costs of the plan made with the fitted ones."""
    plan = lpt_plan(fitted.costs(lengths), lengths, ranks)
    return evaluate(plan.ranks, true.costs(lengths), lengths, ranks).gap


def fit_table(seeds: int) -> None:
    true = CostModel(a=4e-9, b=1e-4, c=2e-2)  # seconds
    check = vlm_lengths(4096, "vlm", seed=99)
    print(f"\n{'measurement':34} {'noise':>6} {'max coeff. error (median / worst)':>34} {'plan max/bound':>15}")
    cases = [
        ("per-rank, 8 steps x 32 ranks", "rank", 256, 0.01),
        ("per-rank, 8 steps x 32 ranks", "rank", 256, 0.02),
        ("step time, 16 steps x 8 ranks", "step", 16, 0.005),
        ("step time, 128 steps x 8 ranks", "step", 128, 0.005),
    ]
    for label, kind, count, noise in cases:
        errors, gaps = [], []
        for seed in range(seeds):
            rng = np.random.default_rng(seed)
            pool = vlm_lengths(2048, "vlm", seed=seed)
            if kind == "rank":
                draws = [_rank_draw(rng, pool) for _ in range(count)]
                times = [true.costs(d).sum() * rng.normal(1, noise) for d in draws]
                fitted = fit_cost_model(draws, times)
            else:
                steps = [[_rank_draw(rng, pool) for _ in range(8)] for _ in range(count)]
                times = [(max(true.costs(d).sum() for d in s) + 0.05) * rng.normal(1, noise) for s in steps]
                fitted, _ = fit_from_steps(steps, times)
            errors.append(_error(fitted, true))
            gaps.append(_gap_with(fitted, true, check, 64))
        print(f"{label:34} {noise:6.3f} {statistics.median(errors):16.3f} / {max(errors):6.3f}{'':10} "
              f"{max(gaps):15.5f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fit-seeds", type=int, default=10)
    args = parser.parse_args()
    balance_table(args.samples, args.ranks, args.repeats)
    fit_table(args.fit_seeds)


if __name__ == "__main__":
    main()
