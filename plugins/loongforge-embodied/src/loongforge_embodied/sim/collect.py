"""Record a simulator's scripted expert as a LeRobotDataset a policy trains on.

``loongforge collect ROOT --env reach-v3 --episodes 50 --seed 0`` plays the expert on seeds
``seed, seed + 1, ...`` until ``episodes`` of them succeeded and writes those with our LeRobot writer:
``observation.state`` (the environment's state, float32), ``action`` (float32, clipped to [-1, 1]), the task
text and, with ``--cameras``, one video per camera, at the environment's control rate. Environments with a scripted
expert: Meta-World (its own scripted policies: 39 state values, 4 actions, 80 fps) and LIBERO's pick-and-place
tasks (``--env libero:libero_object/0``: :mod:`~loongforge_embodied.sim.libero_expert`; 14 state values, 7
actions, 20 fps).

Episode end: an episode stops ``tail`` steps after the first step that reports success (so a policy also sees the
hold at the goal: the expert keeps acting for those steps), or after ``max_steps`` steps. An expert episode that
never succeeds within ``max_steps`` is not written; it is counted and its seed listed in ``meta/collect.json``,
next to the seeds that were written (evaluate on seeds outside them).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from loongforge.errors import LoongForgeError
from loongforge.progress import job_progress

from loongforge_embodied.commands import add_lerobot_version
from loongforge_embodied.data.lerobot_writer import LEROBOT_04, EpisodeData, VideoOptions, write_lerobot_dataset
from loongforge_embodied.sim.environment import SimEnvironment, SimEnvironmentError, make_env

#: Written next to LeRobot's metadata: how the set was made.
REPORT_PATH = "meta/collect.json"


class CollectError(LoongForgeError, RuntimeError):
    """A collection that cannot be written: the output already holds a dataset, or too few expert runs succeeded."""


@dataclass
class CollectReport:
    """What a collection did: the seeds written, the seeds whose expert failed, episode lengths, frames."""

    env: str
    seeds: list[int] = field(default_factory=list)
    failed_seeds: list[int] = field(default_factory=list)
    success_steps: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    max_steps: int = 0
    tail: int = 0
    seconds: float = 0.0

    @property
    def expert_success_rate(self) -> float:
        return len(self.seeds) / max(1, len(self.seeds) + len(self.failed_seeds))


def expert_episode(env: SimEnvironment, seed: int, *, max_steps: int, tail: int) -> tuple[EpisodeData | None, int]:
    """Seed ``seed``'s expert episode, cut ``tail`` steps after its first success; ``(None, -1)`` if it never
    succeeds within ``max_steps``. Returns the episode and the step (0-based) whose action reached success."""
    if not hasattr(env, "scripted_expert"):
        raise SimEnvironmentError(f"{env.name} has no scripted expert to collect with (Meta-World tasks and LIBERO's "
                                  "pick-and-place tasks have one)")
    observation = env.reset(seed)
    act = env.scripted_expert()
    states, actions, frames = [], [], {cam: [] for cam in env.cameras}
    success_step = -1
    for t in range(min(max_steps, env.max_steps)):
        action = act(observation)
        states.append(observation.state.astype(np.float32))
        actions.append(action)
        for cam, image in observation.images.items():
            frames[cam].append(image)
        observation, success = env.step(action)
        if success and success_step < 0:
            success_step = t
        if success_step >= 0 and t >= success_step + tail:
            break
    if success_step < 0:
        return None, -1
    episode = EpisodeData(task=env.task,
                          features={"observation.state": np.stack(states), "action": np.stack(actions)},
                          cameras={f"observation.images.{cam}": np.stack(images) for cam, images in frames.items()})
    return episode, success_step


def collect(root: str | Path, env_name: str, *, episodes: int, seed: int = 0, max_steps: int = 200, tail: int = 10,
            version: str = "v3.0", cameras: Sequence[str] = (), image_size: int = 64,
            max_attempts: int | None = None, lerobot: str = LEROBOT_04) -> CollectReport:
    """Write ``episodes`` successful expert episodes of ``env_name`` under ``root``; returns what happened.

    Tries at most ``max_attempts`` seeds (default ``2 * episodes + 10``) and fails when too few succeeded. Shows
    progress per written episode (:mod:`loongforge.progress`) and a line per skipped seed."""
    root = Path(root)
    if (root / "meta" / "info.json").exists():
        raise CollectError(f"{root} already holds a LeRobotDataset; choose a new directory or delete it")
    env = make_env(env_name, cameras=cameras, image_size=image_size)
    report = CollectReport(env=env_name, max_steps=max_steps, tail=tail)
    attempts = max_attempts if max_attempts is not None else 2 * episodes + 10
    written: list[EpisodeData] = []
    start = time.perf_counter()
    with job_progress(f"collecting {env_name} expert episodes", total=episodes, unit="episode") as progress:
        for s in range(seed, seed + attempts):
            if len(written) == episodes:
                break
            episode, success_step = expert_episode(env, s, max_steps=max_steps, tail=tail)
            if episode is None:
                report.failed_seeds.append(s)
                progress.message(f"seed {s}: expert did not succeed in {max_steps} steps, skipped "
                                 f"({len(report.failed_seeds)} so far)")
                continue
            written.append(episode)
            report.seeds.append(s)
            report.success_steps.append(success_step)
            report.lengths.append(episode.length)
            progress.advance(note=f"seed {s}: success at step {success_step}, {episode.length} frames")
    env.close()
    if len(written) < episodes:
        raise CollectError(f"only {len(written)} of {attempts} expert episodes of {env_name} succeeded within "
                           f"{max_steps} steps (wanted {episodes}); raise --max-steps or lower --episodes")
    write_lerobot_dataset(root, written, fps=env.fps, version=version, video=VideoOptions(),
                          robot_type=env.robot_type, lerobot=lerobot)
    report.seconds = time.perf_counter() - start
    (root / REPORT_PATH).write_text(json.dumps({**asdict(report), "task": env.task, "fps": env.fps,
                                                "expert_success_rate": report.expert_success_rate}, indent=1))
    return report


def configure(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``loongforge collect``."""
    parser.add_argument("root", help="output directory (must not hold a dataset yet)")
    parser.add_argument("--env", default="reach-v3",
                        help="environment with a scripted expert: a Meta-World v3 task (default reach-v3) or "
                             "libero:libero_object/<task>")
    parser.add_argument("--episodes", type=int, default=50, help="successful episodes to write")
    parser.add_argument("--seed", type=int, default=0, help="first seed; later episodes take the next seeds")
    parser.add_argument("--max-steps", type=int, default=200, help="steps before an expert episode counts as failed")
    parser.add_argument("--tail", type=int, default=10, help="steps recorded after the first success")
    parser.add_argument("--version", default="v3.0", choices=("v2.1", "v3.0"), help="LeRobot format version")
    parser.add_argument("--cameras", nargs="*", default=[],
                        help="cameras to record as H.264 video (needs MUJOCO_GL=egl or osmesa), e.g. corner")
    parser.add_argument("--image-size", type=int, default=64, help="camera image side in pixels (default 64)")
    add_lerobot_version(parser)


def run(args: argparse.Namespace) -> int:
    """``loongforge collect``: collect, then print one summary line."""
    report = collect(args.root, args.env, episodes=args.episodes, seed=args.seed, max_steps=args.max_steps,
                     tail=args.tail, version=args.version, cameras=args.cameras, image_size=args.image_size,
                     lerobot=args.lerobot_version)
    print(f"wrote {len(report.seeds)} {args.env} episodes ({sum(report.lengths)} frames, seeds "
          f"{report.seeds[0]}..{report.seeds[-1]}) to {args.root} in {report.seconds:.1f} s; expert success "
          f"{report.expert_success_rate:.0%} ({len(report.failed_seeds)} failed seeds skipped)")
    return 0


if __name__ == "__main__":  # the old front-end: say where it went rather than exit 0 having done nothing
    raise SystemExit("python -m loongforge_embodied.sim.collect is now `loongforge collect ...`")
