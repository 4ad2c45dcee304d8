"""Closed-loop evaluation speed: N Meta-World episodes one at a time vs side by side (``loongforge eval --batch``).

Both sides are :func:`loongforge_embodied.sim.evaluate.evaluate` on the same policy checkpoint, seeds and options in
one process: ``--batch 1`` is the serial evaluation (what ``loongforge eval`` did before batching: one policy call
per episode per chunk) and ``--batch E`` runs E episodes in lockstep with one policy call for all of them per
chunk. Runs are interleaved (serial, batched, serial, ...) so that the load of a shared machine falls on both; the
report gives the median of each, their ratio, where the time went (policy calls vs the rest: simulator, setup) and
checks that both sides gave every seed the same success and length (returns agree to float rounding: a batched
matmul may round the last bits differently).

A checkpoint to run it on (the guide's, ~1 min on 2 cores)::

    loongforge collect data/metaworld/reach-v3-5 --env reach-v3 --episodes 5
    loongforge train configs/embodied-metaworld-reach.yaml task.data=data/metaworld/reach-v3-5 \\
        task.held_out_episodes=1 training.steps=20 logging.interval=10 checkpoint.interval=20 task.eval.frames=16
    python benchmarks/embodied_eval_speed.py runs/embodied-metaworld-reach/checkpoints --episodes 8
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np


class TimedPolicy:
    """A policy whose ``act_batch`` calls are timed (the rest of an evaluation is the simulator and setup)."""

    def __init__(self, policy: Any) -> None:
        self.policy, self.metadata, self.seconds, self.calls = policy, policy.metadata, 0.0, 0

    def act_batch(self, *args: Any) -> np.ndarray:
        start = time.perf_counter()
        try:
            return self.policy.act_batch(*args)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a policy checkpoint (or a run's checkpoints/ directory)")
    parser.add_argument("--env", default="reach-v3")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--first-seed", type=int, default=1000)
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--replan", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="Euler steps per chunk")
    parser.add_argument("--batch", type=int, default=8, help="episodes side by side on the batched side")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each side (interleaved)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()

    import torch
    from loongforge_embodied.sim.evaluate import evaluate
    from loongforge_embodied.sim.policy import CheckpointPolicy

    if args.threads:
        torch.set_num_threads(args.threads)
    policy = CheckpointPolicy(args.checkpoint, steps=args.steps)
    seeds = list(range(args.first_seed, args.first_seed + args.episodes))
    sides = {"serial": 1, "batched": args.batch}
    times: dict[str, list[float]] = {name: [] for name in sides}
    acting: dict[str, list[float]] = {name: [] for name in sides}
    results: dict[str, dict[str, Any]] = {}
    print(f"{args.episodes} episodes of {args.env}, at most {args.max_steps} steps, replan {args.replan}, "
          f"{args.steps} Euler steps; torch threads {torch.get_num_threads()}", flush=True)
    for repeat in range(args.repeats):
        for name, batch in sides.items():
            timed = TimedPolicy(policy)
            start = time.perf_counter()
            results[name] = evaluate(timed, args.env, seeds, replan=args.replan, max_steps=args.max_steps,
                                     batch=batch)
            times[name].append(time.perf_counter() - start)
            acting[name].append(timed.seconds)
            print(f"run {repeat + 1} {name:>7} (batch {batch}): {times[name][-1]:7.2f} s, policy "
                  f"{timed.seconds:6.2f} s in {timed.calls} calls", flush=True)
    serial, batched = (results[name]["per_episode"] for name in sides)
    same = [(r["seed"], r["success"], r["steps"]) for r in serial] == [(r["seed"], r["success"], r["steps"])
                                                                        for r in batched]
    drift = max(abs(a["return"] - b["return"]) for a, b in zip(serial, batched, strict=True))
    for name in sides:
        print(f"{name:>7}: median {statistics.median(times[name]):.2f} s (policy {statistics.median(acting[name]):.2f}"
              f" s), success {results[name]['successes']}/{args.episodes}, mean return "
              f"{results[name]['mean_return']:.4f}")
    print(f"per-seed success and length equal: {same}; largest return difference {drift:.2e}")
    print(f"batched is {statistics.median(times['serial']) / statistics.median(times['batched']):.2f}x faster "
          f"than serial")
    if not same:
        raise SystemExit("the batched evaluation changed an episode's outcome")


if __name__ == "__main__":
    main()
