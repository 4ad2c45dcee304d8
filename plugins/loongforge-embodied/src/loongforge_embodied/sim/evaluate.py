"""Closed-loop success rate of a policy on seeds (initial states) it never trained on, in any simulator of
:mod:`loongforge_embodied.sim.environment` (``--env reach-v3``, ``--env libero:libero_object/0``, ...).

``loongforge eval CKPT --env reach-v3 --seeds 20 --first-seed 1000`` runs, for each seed
``first_seed ... first_seed + seeds - 1``: reset the seeded episode, ask the policy for an action chunk, execute
its first ``--replan`` actions (receding horizon), ask again, until the task reports success or ``--max-steps``
steps have run. ``--batch E`` (default 8) runs E seeds side by side, the policy acting on all of them in one call
per chunk (:func:`run_episodes`); every episode's numbers are those it has alone. The policy is the checkpoint
loaded in this process, or with ``loongforge eval ws://host:port`` a
policy server (:mod:`loongforge_embodied.sim.server`); both give the same numbers. ``--baseline random`` also runs
uniform random actions on the same seeds (chance level); ``loongforge eval random`` runs them alone.

What it leaves in ``--out DIR`` (default ``metaworld-eval-<env>``): ``summary.json`` with, per evaluated policy,
the episode count, successes, success rate, mean return and mean length and one row per episode (seed, success,
steps, return, video); the same rows are printed as a table. With ``--videos`` (or ``--video-dir``) every episode
of the evaluated policy is also filmed from one camera (:mod:`loongforge_embodied.sim.recording`) as
``videos/episode-000-success.mp4`` and so on, the random baseline's beside them in ``videos/random/`` (in
``videos/`` when it runs alone); a world-action model's imagined frames go beside each rollout as
``episode-000-success-predicted.mp4`` (a row's ``predicted_video``: per chunk, the frame the policy saw and the
frames it predicted, left to right). A progress line per episode carries the running success rate. The totals go to the
experiment trackers too (``--trackers``, opened in ``--out``) as ``eval/<policy|random>/<metric>`` at the
checkpoint's training step.

Sampling noise is seeded per chunk from (``--sample-seed``, episode seed, step): a rerun reproduces every action,
and recording videos does not change them.
"""

from __future__ import annotations

import argparse
import json
import time
import zlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from loongforge.errors import LoongForgeError
from loongforge.progress import job_progress
from loongforge.train.trackers import check_tracker

from loongforge_embodied.sim.environment import Observation, SimEnvironment, adapter_class, make_env
from loongforge_embodied.sim.metaworld_env import use_headless_gl
from loongforge_embodied.sim.recording import VIDEO_FORMATS, RolloutRecorder

CAMERA_PREFIX = "observation.images."
#: ``summary.json`` inside ``--out``.
SUMMARY_FILE = "summary.json"
#: The totals of each evaluated policy that go to the trackers (as ``eval/<policy>/<metric>``).
TRACKED = ("success_rate", "mean_return", "mean_length", "episodes")
#: Episode seeds must be below this (Meta-World seeds numpy's legacy RNG with them; other simulators check their
#: own ranges, e.g. LIBERO's stored initial states).
MAX_SEED = 2**32


class EvaluationError(LoongForgeError):
    """Evaluation options that cannot work (replan longer than the policy's chunk, too many steps, ...)."""


def chunk_seed(sample_seed: int, episode_seed: int, step: int) -> int:
    """The sampling seed of the chunk asked for at ``step`` of ``episode_seed``'s episode (CRC32 of the three)."""
    return zlib.crc32(f"{sample_seed}/{episode_seed}/{step}".encode())


@dataclass
class _Episode:
    """One episode under way in a batched evaluation: where it stands and the actions left of its last chunk."""

    index: int
    seed: int
    env: SimEnvironment
    observation: Observation
    steps: int = 0
    total: float = 0.0
    planned: list[np.ndarray] = field(default_factory=list)

    def row(self, success: bool) -> dict[str, Any]:
        return {"seed": self.seed, "success": success, "steps": self.steps, "return": self.total}


def run_episodes(envs: Sequence[SimEnvironment], policy: Any, seeds: Sequence[int], *, replan: int, max_steps: int,
                 sample_seed: int = 0, recorder: RolloutRecorder | None = None,
                 on_done: Callable[[int, dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Closed-loop episodes of ``seeds``, ``len(envs)`` at a time in lockstep; one row per seed, in seed order:
    ``{"seed", "success", "steps", "return"}`` (steps taken -- at success, the step count -- and the summed reward).

    Why lockstep: acting is the cost (a policy forward per Euler step, the simulator takes ~1 ms a step), and a
    batch of E observations costs the policy little more than one. So each round, every episode whose chunk is
    used up (each executes ``replan`` actions of a chunk, then asks again) is asked for in one
    ``policy.act_batch`` call, then every episode takes one step; a finished episode's environment starts the
    next seed. An episode's chunks are seeded from (``sample_seed``, its seed, its step) and each episode has its
    own simulator, so a row does not depend on how many run beside it. ``recorder`` films each episode's reset
    frame and every step's frame, and with a policy that imagines frames (a world-action model's
    ``predicted_frames``) each chunk's observed and predicted frames; ``on_done(index, row)`` hears of each finished
    episode."""
    queue = iter(enumerate(seeds))
    rows: list[dict[str, Any]] = [{} for _ in seeds]
    running: list[_Episode] = []

    def start(env: SimEnvironment) -> None:
        index, seed = next(queue, (None, None))
        if index is None:
            return
        running.append(_Episode(index, seed, env, env.reset(seed)))
        if recorder:
            recorder.capture(env, index)

    for env in envs:
        start(env)
    while running:
        asking = [episode for episode in running if not episode.planned]
        if asking:
            chunks = policy.act_batch(asking[0].env.task,
                                      np.stack([e.observation.state.astype(np.float32) for e in asking]),
                                      [_images(e.observation.images) for e in asking],
                                      [chunk_seed(sample_seed, e.seed, e.steps) for e in asking])
            for episode, chunk in zip(asking, chunks, strict=True):
                episode.planned = list(chunk[:replan])
            if recorder and policy.predicted_frames is not None:
                for episode, frames in zip(asking, policy.predicted_frames, strict=True):
                    recorder.imagine(episode.index, next(iter(episode.observation.images.values())), frames)
        for episode in list(running):
            episode.observation, success = episode.env.step(episode.planned.pop(0))
            episode.steps, episode.total = episode.steps + 1, episode.total + episode.observation.reward
            if recorder:
                recorder.capture(episode.env, episode.index)
            if success or episode.steps >= max_steps:
                rows[episode.index] = episode.row(success)
                running.remove(episode)
                if on_done:
                    on_done(episode.index, rows[episode.index])
                start(episode.env)
    return rows


def evaluate(policy: Any, env_name: str, seeds: Sequence[int], *, replan: int = 5, max_steps: int = 200,
             sample_seed: int = 0, recorder: RolloutRecorder | None = None, batch: int = 8) -> dict[str, Any]:
    """Run :func:`run_episodes` on every seed, ``batch`` episodes at a time (with progress); returns the summary
    (see the module docstring). A row's ``video`` is the file ``recorder`` wrote for it (absent without one)."""
    meta = policy.metadata
    if not 1 <= replan <= meta["horizon"]:
        raise EvaluationError(f"--replan {replan} must be between 1 and the policy's horizon {meta['horizon']}")
    cameras = [key.removeprefix(CAMERA_PREFIX) for key in meta.get("cameras") or []]
    envs: list[SimEnvironment] = []
    start = time.perf_counter()
    try:
        for _ in range(min(batch, len(seeds))):
            envs.append(make_env(env_name, cameras=cameras, image_size=meta.get("image_size") or 64))
        if not 1 <= max_steps <= envs[0].max_steps:
            raise EvaluationError(f"--max-steps {max_steps} must be between 1 and {env_name}'s limit "
                                  f"{envs[0].max_steps}")
        if meta["action_dim"] != envs[0].action_dim:
            raise EvaluationError(f"the policy {meta['model']} acts with {meta['action_dim']} values; {env_name} "
                                  f"takes {envs[0].action_dim}")
        with job_progress(f"{meta['model']} on {env_name}", total=len(seeds), unit="episode") as progress:
            successes, done = 0, 0

            def finished(index: int, row: dict[str, Any]) -> None:
                nonlocal successes, done
                if recorder:
                    row["video"] = str(recorder.finish(index, row["success"]))
                    predicted = recorder.finish_predicted(index, row["success"])
                    if predicted:
                        row["predicted_video"] = str(predicted)
                successes, done = successes + row["success"], done + 1
                progress.advance(note=f"success {successes}/{done} ({successes / done:.0%})")

            rows = run_episodes(envs, policy, seeds, replan=replan, max_steps=max_steps, sample_seed=sample_seed,
                                recorder=recorder, on_done=finished)
    finally:
        for env in envs:
            env.close()
    successes = sum(r["success"] for r in rows)
    return {"policy": meta["model"], "env": env_name, "seeds": list(seeds), "replan": replan, "max_steps": max_steps,
            "sample_seed": sample_seed, "episodes": len(rows), "successes": successes,
            "success_rate": successes / max(1, len(rows)),
            "mean_return": float(np.mean([r["return"] for r in rows])) if rows else 0.0,
            "mean_length": float(np.mean([r["steps"] for r in rows])) if rows else 0.0,
            "per_episode": rows, "seconds": round(time.perf_counter() - start, 2)}


def _images(images: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {CAMERA_PREFIX + cam: image for cam, image in images.items()}


def configure(parser: argparse.ArgumentParser) -> None:
    """The options of ``loongforge eval SOURCE`` for a policy, a policy server or ``random``."""
    parser.add_argument("--env", default="reach-v3",
                        help="environment: a Meta-World v3 task (default reach-v3), libero:<suite>/<task>, "
                             "calvin:<subtask> or simpler:<task>")
    parser.add_argument("--seeds", type=int, default=20, help="how many seeds (episodes)")
    parser.add_argument("--first-seed", type=int, default=1000, help="first seed (keep clear of the training seeds)")
    parser.add_argument("--batch", type=int, default=8, metavar="E",
                        help="episodes run side by side, the policy acting on all of them in one call (default 8; "
                             "1 runs one episode at a time; the results are the same)")
    parser.add_argument("--replan", type=int, default=5, help="actions executed from each chunk before asking again")
    parser.add_argument("--max-steps", type=int, default=200, help="steps before an episode counts as failed (200)")
    parser.add_argument("--steps", type=int, default=10, help="Euler steps per chunk (in-process policy)")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="torch intra-op threads of the in-process policy (default: torch's own, one per core); "
                             "a small policy on a busy machine acts faster with 1")
    parser.add_argument("--sample-seed", type=int, default=0, help="seed of the policy's sampling noise (default 0)")
    parser.add_argument("--baseline", choices=("random",), help="also evaluate uniform random actions")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help=f"where {SUMMARY_FILE} (and videos/) go (default metaworld-eval-<env>)")
    parser.add_argument("--trackers", nargs="*", metavar="NAME",
                        help="experiment trackers (as logging.trackers) that get the results in DIR as eval/<policy>/"
                             "<metric> at the checkpoint's step (default: the checkpoint's logging.trackers; "
                             "tensorboard for a server or random; no NAME: none)")
    video = parser.add_argument_group("rollout videos", "Rendering needs an OpenGL platform: EGL is chosen on a "
                                      "machine without a display; Mesa's software EGL takes ~0.5 s a frame on a "
                                      "busy 2-core CPU.")
    video.add_argument("--videos", action="store_true",
                       help="film every episode into <out>/videos (the random baseline's into videos/random)")
    video.add_argument("--video-dir", metavar="DIR", help="film every episode into DIR (implies --videos)")
    video.add_argument("--video-camera", help="camera to film (default: the environment's, e.g. corner for "
                       "Meta-World, agentview for LIBERO)")
    video.add_argument("--video-size", type=_at_least(16), default=128, help="frame side in pixels (default 128)")
    video.add_argument("--video-fps", type=_at_least(1), default=20,
                       help="playback rate (default 20: Meta-World acts at 80 Hz, so 4x slow motion)")
    video.add_argument("--video-format", choices=VIDEO_FORMATS, default="mp4", help="mp4 (H.264) or gif")


def _at_least(low: int):
    """An argparse ``type``: an integer ``>= low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def run(args: argparse.Namespace) -> int:
    """``loongforge eval SOURCE``: ``args.source`` is what :func:`loongforge_embodied.commands.claims_eval`
    accepted: a checkpoint, a policy server's address, or ``random``."""
    from loongforge_embodied.commands import RANDOM_SOURCE, is_random, is_server

    args.server = args.source if is_server(args.source) else None
    args.checkpoint = None if is_server(args.source) or is_random(args.source) else args.source
    args.baseline = RANDOM_SOURCE if is_random(args.source) else args.baseline
    closed_loop(args)
    return 0


def closed_loop(args: argparse.Namespace) -> dict[str, Any]:
    """Evaluate ``args.checkpoint`` or ``args.server`` and/or the random baseline; print the tables, write
    ``summary.json`` and log the totals to the trackers. Returns the summary."""
    seeds = _seeds(args)
    if args.batch < 1:
        raise EvaluationError(f"--batch {args.batch} must be at least 1 (episodes run side by side)")
    if args.threads is not None and args.threads < 1:
        raise EvaluationError(f"--threads {args.threads} must be at least 1")
    for name in args.trackers or []:
        check_tracker(name, where="--trackers")
    out = Path(args.out or f"metaworld-eval-{args.env}")
    recorder = _recorder(args, out)
    summary: dict[str, Any] = {}
    horizon, step, logging = 10, 0, None
    if args.checkpoint or args.server:
        with _policy(args) as policy:
            summary["policy"] = evaluate(policy, args.env, seeds, replan=args.replan, max_steps=args.max_steps,
                                         sample_seed=args.sample_seed, recorder=recorder, batch=args.batch)
            horizon, step = policy.metadata["horizon"], int(policy.metadata.get("train_step", 0))
            logging = policy.logging if args.checkpoint else None
    if args.baseline == "random":
        from loongforge_embodied.sim.policy import RandomPolicy

        summary["random"] = evaluate(RandomPolicy(horizon=horizon, action_dim=adapter_class(args.env).action_dim),
                                     args.env, seeds,
                                     replan=min(args.replan, horizon), max_steps=args.max_steps,
                                     sample_seed=args.sample_seed, batch=args.batch,
                                     recorder=recorder and (recorder.beside("random") if summary else recorder))
    for result in summary.values():
        for row in result["per_episode"]:
            for key in ("video", "predicted_video"):
                if key in row:
                    row[key] = _shown(Path(row[key]), out)
    out.mkdir(parents=True, exist_ok=True)
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=1))
    for name, result in summary.items():
        print_summary("random baseline" if name == "random" else "policy", result)
    print(f"summary: {out / SUMMARY_FILE}", flush=True)
    _log_to_trackers(summary, out, step, args.trackers, logging)
    return summary


def _seeds(args: argparse.Namespace) -> list[int]:
    """The episode seeds ``--first-seed`` and ``--seeds`` ask for, checked (Meta-World seeds numpy's legacy RNG,
    which takes ``0 <= seed < 2**32``)."""
    if args.seeds < 1:
        raise EvaluationError(f"--seeds {args.seeds} must be at least 1 (the number of episodes)")
    last = args.first_seed + args.seeds - 1
    if args.first_seed < 0 or last >= MAX_SEED:
        raise EvaluationError(f"--first-seed {args.first_seed} --seeds {args.seeds} gives seeds {args.first_seed}.."
                              f"{last}; seeds must lie in 0..{MAX_SEED - 1}")
    return list(range(args.first_seed, last + 1))


def _log_to_trackers(summary: dict[str, Any], out: Path, step: int, names: list[str] | None,
                     logging: Any) -> None:
    """The totals of each evaluated policy (``policy``, ``random``) to the trackers, opened in ``out``, as
    ``eval/<name>/<metric>`` at ``step`` (the checkpoint's training step), so evaluations of a run's checkpoints
    line up as curves beside its training metrics. ``names`` (``--trackers``) default to the checkpoint's
    ``logging.trackers`` (``logging``: its settings, ``None`` for a server or ``random``)."""
    from loongforge.config.schema import LoggingConfig
    from loongforge.train.trackers import open_named_trackers

    logging = logging or LoggingConfig()
    if names is None:
        names = [name for name in logging.trackers if name != "tensorboard" or logging.tensorboard]
    if not names:
        return
    trackers = open_named_trackers(list(dict.fromkeys(names)), out, logging, start_step=step)
    locations = trackers.locations()
    try:
        trackers.scalars(step, {f"{name}/{metric}": float(result[metric]) for name, result in summary.items()
                                for metric in TRACKED}, "eval")
    finally:
        trackers.close()
    for name, location in locations.items():
        print(f"{name}: {location}", flush=True)


def print_summary(label: str, result: dict[str, Any]) -> None:
    """The per-episode table of one evaluated policy and its totals line (the numbers of ``summary.json``)."""
    rows = result["per_episode"]
    print(f"{label}: {result['policy']} on {result['env']} (replan {result['replan']}, at most "
          f"{result['max_steps']} steps)")
    print(f"{'episode':>7}  {'seed':>6}  {'result':<7}  {'steps':>5}  {'return':>9}  video")
    for index, row in enumerate(rows):
        print(f"{index:>7}  {row['seed']:>6}  {'success' if row['success'] else 'failure':<7}  {row['steps']:>5}  "
              f"{row['return']:>9.2f}  {row.get('video', '-')}")
    print(f"{label} success rate: {result['success_rate']:.0%} ({result['successes']}/{result['episodes']}) on "
          f"{result['env']} seeds {rows[0]['seed']}..{rows[-1]['seed']}; mean return {result['mean_return']:.2f}, "
          f"mean length {result['mean_length']:.1f} steps", flush=True)


def _recorder(args: argparse.Namespace, out: Path) -> RolloutRecorder | None:
    """The recorder ``--videos`` / ``--video-dir`` ask for (``None`` without them), its options checked."""
    if not (args.videos or args.video_dir):
        return None
    if args.video_format == "mp4" and args.video_size % 2:
        raise EvaluationError(f"--video-size {args.video_size} is odd; H.264 (mp4) needs an even frame side")
    use_headless_gl()  # before the simulator imports MuJoCo
    return RolloutRecorder(Path(args.video_dir) if args.video_dir else out / "videos", camera=args.video_camera,
                           size=args.video_size, fps=args.video_fps, format=args.video_format)


def _shown(path: Path, out: Path) -> str:
    """A video's path as ``summary.json`` gives it: relative to the summary when it lies under ``out``."""
    return path.relative_to(out).as_posix() if path.is_relative_to(out) else str(path)


def _policy(args: argparse.Namespace) -> AbstractContextManager[Any]:
    """The policy to evaluate, as a context manager (a server connection is closed after the episodes)."""
    if args.server:
        from loongforge_embodied.sim.client import PolicyClient

        return PolicyClient(args.server)
    from loongforge_embodied.sim.policy import CheckpointPolicy

    policy = CheckpointPolicy(args.checkpoint, steps=args.steps, trust_code=args.trust_code)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return nullcontext(policy)


if __name__ == "__main__":  # the old front-end: say where it went rather than exit 0 having done nothing
    raise SystemExit("python -m loongforge_embodied.sim.evaluate is now `loongforge eval CHECKPOINT ...`")
