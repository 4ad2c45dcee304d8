"""Closed-loop success rate of a policy on Meta-World seeds it never trained on.

``loongforge eval CKPT --env reach-v3 --seeds 20 --first-seed 1000`` runs, for each seed
``first_seed ... first_seed + seeds - 1``: reset the seeded episode, ask the policy for an action chunk, execute
its first ``--replan`` actions (receding horizon), ask again, until the task reports success or ``--max-steps``
steps have run. The policy is the checkpoint loaded in this process, or with ``loongforge eval ws://host:port`` a
policy server (:mod:`loongforge_embodied.sim.server`); both give the same numbers. ``--baseline random`` also runs
uniform random actions on the same seeds (chance level); ``loongforge eval random`` runs them alone. Prints one line
per seed and the success rate, and writes a JSON report (``--output``).

Sampling noise is seeded per chunk from (``--sample-seed``, episode seed, step): a rerun reproduces every action.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from loongforge.commands import add_trust_code_option

from loongforge_embodied.sim.metaworld_env import MetaWorldEnv

CAMERA_PREFIX = "observation.images."


def chunk_seed(sample_seed: int, episode_seed: int, step: int) -> int:
    """The sampling seed of the chunk asked for at ``step`` of ``episode_seed``'s episode (CRC32 of the three)."""
    return zlib.crc32(f"{sample_seed}/{episode_seed}/{step}".encode())


def run_episode(env: MetaWorldEnv, policy: Any, seed: int, *, replan: int, max_steps: int,
                sample_seed: int = 0) -> dict[str, Any]:
    """One closed-loop episode: ``{"seed", "success", "steps"}`` (steps taken; at success, the step count)."""
    observation = env.reset(seed)
    step = 0
    while step < max_steps:
        chunk = policy.act(env.task, observation.state.astype(np.float32), _images(observation.images),
                           seed=chunk_seed(sample_seed, seed, step))
        for action in chunk[:replan]:
            observation, success = env.step(action)
            step += 1
            if success:
                return {"seed": seed, "success": True, "steps": step}
            if step >= max_steps:
                break
    return {"seed": seed, "success": False, "steps": step}


def evaluate(policy: Any, env_name: str, seeds: Sequence[int], *, replan: int = 5, max_steps: int = 200,
             sample_seed: int = 0, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run :func:`run_episode` on every seed; returns the per-seed results and the success rate."""
    meta = policy.metadata
    if not 1 <= replan <= meta["horizon"]:
        raise ValueError(f"replan {replan} must be between 1 and the policy's horizon {meta['horizon']}")
    cameras = [key.removeprefix(CAMERA_PREFIX) for key in meta.get("cameras") or []]
    env = MetaWorldEnv(env_name, cameras=cameras, image_size=meta.get("image_size") or 64)
    if not 1 <= max_steps <= env.max_steps:
        raise ValueError(f"max_steps {max_steps} must be between 1 and Meta-World's limit {env.max_steps}")
    results, start = [], time.perf_counter()
    for seed in seeds:
        result = run_episode(env, policy, seed, replan=replan, max_steps=max_steps, sample_seed=sample_seed)
        results.append(result)
        if log:
            log(f"{meta['model']} seed {seed}: {'success' if result['success'] else 'failure'} after "
                f"{result['steps']} steps")
    env.close()
    successes = sum(r["success"] for r in results)
    return {"policy": meta["model"], "env": env_name, "seeds": list(seeds), "replan": replan, "max_steps": max_steps,
            "sample_seed": sample_seed, "success_rate": successes / max(1, len(results)), "successes": successes,
            "episodes": results, "seconds": round(time.perf_counter() - start, 2)}


def _images(images: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {CAMERA_PREFIX + cam: image for cam, image in images.items()}


def configure(parser: argparse.ArgumentParser) -> None:
    """The options of ``loongforge eval SOURCE`` for a policy (and of ``python -m``)."""
    parser.add_argument("--env", default="reach-v3")
    parser.add_argument("--seeds", type=int, default=20, help="how many seeds")
    parser.add_argument("--first-seed", type=int, default=1000, help="first seed (keep clear of the training seeds)")
    parser.add_argument("--replan", type=int, default=5, help="actions executed from each chunk before asking again")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--steps", type=int, default=10, help="Euler steps per chunk (in-process policy)")
    parser.add_argument("--sample-seed", type=int, default=0)
    parser.add_argument("--baseline", choices=("random",), help="also evaluate uniform random actions")
    parser.add_argument("--output", default=None, help="JSON report (default metaworld-eval-<env>.json)")


def run(args: argparse.Namespace) -> int:
    """``loongforge eval SOURCE``: ``args.source`` is what :func:`loongforge_embodied.commands.claims_eval`
    accepted: a checkpoint, a policy server's address, or ``random``."""
    from loongforge_embodied.commands import RANDOM_SOURCE, is_random, is_server

    args.server = args.source if is_server(args.source) else None
    args.checkpoint = None if is_server(args.source) or is_random(args.source) else args.source
    args.baseline = RANDOM_SOURCE if is_random(args.source) else args.baseline
    closed_loop(args)
    return 0


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``python -m loongforge_embodied.sim.evaluate``, kept for old scripts; ``loongforge eval`` is the documented
    way."""
    parser = argparse.ArgumentParser(description="closed-loop Meta-World success rate of a policy")
    parser.add_argument("checkpoint", nargs="?", help="policy checkpoint (omit with --server, or for a baseline alone)")
    parser.add_argument("--server", help="ws://host:port of a policy server instead of loading the checkpoint here")
    add_trust_code_option(parser)
    configure(parser)
    args = parser.parse_args(argv)
    if args.checkpoint and args.server:
        parser.error("give a checkpoint or --server, not both")
    if not (args.checkpoint or args.server or args.baseline):
        parser.error("nothing to evaluate: give a checkpoint, --server or --baseline random")
    return closed_loop(args)


def closed_loop(args: argparse.Namespace) -> dict[str, Any]:
    """Evaluate ``args.checkpoint`` or ``args.server`` and/or the random baseline; print and write the report."""
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    say = lambda line: print(line, flush=True)  # noqa: E731
    report: dict[str, Any] = {}
    horizon = 10
    if args.checkpoint or args.server:
        policy = _policy(args)
        try:
            report["policy"] = evaluate(policy, args.env, seeds, replan=args.replan, max_steps=args.max_steps,
                                        sample_seed=args.sample_seed, log=say)
        finally:
            if hasattr(policy, "close"):
                policy.close()
        horizon = policy.metadata["horizon"]
        say(f"policy success rate: {report['policy']['success_rate']:.0%} ({report['policy']['successes']}/"
            f"{len(seeds)}) on {args.env} seeds {seeds[0]}..{seeds[-1]}")
    if args.baseline == "random":
        from loongforge_embodied.sim.policy import RandomPolicy

        report["random"] = evaluate(RandomPolicy(horizon=horizon), args.env, seeds,
                                    replan=min(args.replan, horizon), max_steps=args.max_steps,
                                    sample_seed=args.sample_seed)
        say(f"random baseline success rate: {report['random']['success_rate']:.0%}")
    output = Path(args.output or f"metaworld-eval-{args.env}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=1))
    print(f"report: {output}", file=sys.stderr)
    return report


def _policy(args) -> Any:
    if args.server:
        from loongforge_embodied.sim.client import PolicyClient

        return PolicyClient(args.server)
    from loongforge_embodied.sim.policy import CheckpointPolicy

    return CheckpointPolicy(args.checkpoint, steps=args.steps, trust_code=args.trust_code)


if __name__ == "__main__":
    main()
