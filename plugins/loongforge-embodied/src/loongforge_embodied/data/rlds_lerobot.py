"""RLDS episodes as a LeRobotDataset v3.0: ``loongforge convert rlds-to-lerobot SOURCE OUT``.

Each RLDS episode becomes one LeRobot episode through :func:`lerobot_episode` (``observation.state``, ``action``,
``next.reward`` when the key map names a reward, the cameras under the map's LeRobot keys, the first step's
instruction as the task) and the set is written by the same writer ``loongforge collect`` uses
(:func:`~loongforge_embodied.data.lerobot_writer.write_lerobot_dataset`), so LeRobot's reader and ours open it. RLDS
records no frame rate, hence ``--fps``. Episodes are held in memory while written (the writer's design): fine for
the small sets and slices this is meant for, not for a whole OXE dataset at once.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

from loongforge.errors import ConfigError

from loongforge_embodied.commands import add_lerobot_version
from loongforge_embodied.data.lerobot_format import V30
from loongforge_embodied.data.lerobot_writer import LEROBOT_04, EpisodeData, VideoOptions, write_lerobot_dataset
from loongforge_embodied.data.rlds import RLDSDataset, RLDSEpisode
from loongforge_embodied.data.rlds_keys import KEY_MAPS, RLDSKeyMap, key_map

#: The conversion's default camera storage: PNG cells in the parquet, lossless (the RLDS frames exactly).
DEFAULT_CODEC = "png"


def lerobot_episode(episode: RLDSEpisode) -> EpisodeData:
    """One RLDS episode as the LeRobot writer's episode."""
    features = {"observation.state": episode.state, "action": episode.action}
    if episode.reward is not None:
        features["next.reward"] = episode.reward
    return EpisodeData(task=episode.instruction, features=features, cameras=dict(episode.cameras))


def write_lerobot(out: str | Path, episodes: Iterable[RLDSEpisode], *, fps: int, codec: str = DEFAULT_CODEC,
                  lerobot: str = LEROBOT_04) -> Path:
    """Write ``episodes`` as a LeRobotDataset v3.0 under ``out`` (as LeRobot release ``lerobot`` writes one); a
    :class:`ConfigError` when there are none or their features differ (a LeRobot set has one width per feature and
    one size per camera)."""
    converted = [lerobot_episode(episode) for episode in episodes]
    if not converted:
        raise ConfigError(f"{out}: no RLDS episodes to convert")
    first = converted[0]
    for index, episode in enumerate(converted[1:], start=1):
        shapes = {k: v.shape[1:] for k, v in (*episode.features.items(), *episode.cameras.items())}
        expected = {k: v.shape[1:] for k, v in (*first.features.items(), *first.cameras.items())}
        if shapes != expected:
            raise ConfigError(f"{out}: episode {index} has features {shapes}, episode 0 has {expected}; a LeRobot "
                              "dataset needs the same widths and camera sizes in every episode")
    return write_lerobot_dataset(out, converted, fps=fps, version=V30, video=VideoOptions(codec=codec),
                                 lerobot=lerobot)


def configure(parser: argparse.ArgumentParser) -> None:
    """The options of ``loongforge convert rlds-to-lerobot SOURCE OUT``."""
    parser.add_argument("--keys", default="default",
                        help=f"the key map: a shipped one ({', '.join(KEY_MAPS)}) or a YAML file with cameras, state, "
                             "action, instruction, reward (default: %(default)s)")
    parser.add_argument("--split", default="train", help="the TFDS split to convert (default: %(default)s)")
    parser.add_argument("--fps", type=int, default=10, help="frame rate to record (RLDS stores none; default 10)")
    parser.add_argument("--codec", default=DEFAULT_CODEC, choices=("png", "h264", "av1"),
                        help="cameras as lossless PNG cells in the parquet (default) or H.264 / AV1 mp4 videos")
    add_lerobot_version(parser)


def keys_option(value: str) -> RLDSKeyMap:
    """``--keys``: a shipped map's name, or a YAML file holding a key map."""
    from loongforge.config.loader import read_yaml_mapping
    from loongforge.config.sections import build_section

    if value in KEY_MAPS or not value.endswith((".yaml", ".yml")):
        return key_map(value)
    return build_section(RLDSKeyMap, read_yaml_mapping(Path(value)), value)


def run(args: argparse.Namespace) -> int:
    """Convert, then print one line with what was written."""
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty; choose a new directory")
    dataset = RLDSDataset(args.source, keys_option(args.keys), split=args.split)
    episodes = list(dataset)
    write_lerobot(out, episodes, fps=args.fps, codec=args.codec, lerobot=args.lerobot_version)
    frames = sum(episode.length for episode in episodes)
    print(f"converted {len(episodes)} episodes ({frames} frames) of RLDS '{dataset.name}' to LeRobot v3.0 at {out}")
    return 0

