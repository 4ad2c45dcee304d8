"""An Open X-Embodiment-style mixture: several RLDS datasets, each read through its key map and drawn with a weight,
as the policy task's data (``task.data: mixture.yaml``).

The spec is a YAML file::

    datasets:
      - {path: bridge/1.0.0, keys: bridge, weight: 2.0}
      - {path: fractal/0.1.0, keys: fractal, weight: 1.0, split: train}
      - path: my_robot/1.0.0            # an inline key map
        keys: {cameras: {observation.images.image: steps/observation/rgb}, state: [steps/observation/joints],
               action: [steps/action], instruction: steps/language_instruction, reward: null}
    seed: 0      # which episodes are drawn
    fps: 10      # recorded in the LeRobot set

Relative paths are relative to the spec file. As in OXE's interleaved datasets, weights are shares of the training
*frames*: the mixture has as many frames as all datasets together, dataset ``i`` contributing about ``weight_i /
sum(weights)`` of them -- its episodes in a seeded random order, repeated when its share exceeds its size, whole
episodes only (so a share is met to within one episode). The mixed episodes are written once as a LeRobotDataset v3.0
(PNG frames, lossless) in a directory named by the spec's content, and the task reads that like any LeRobot set:
splits, stats, normalisation and action chunks stay one code path. The datasets must agree on state and action widths
and camera keys and sizes (what one LeRobot set can hold); use inline key maps to line them up.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from loongforge.config.loader import read_yaml_mapping
from loongforge.config.sections import build_section, ranged, section_to_dict
from loongforge.errors import ConfigError

from loongforge_embodied.data.lerobot_format import INFO_PATH
from loongforge_embodied.data.lerobot_writer import write_once
from loongforge_embodied.data.rlds import RLDSDataset, RLDSEpisode
from loongforge_embodied.data.rlds_keys import RLDSKeyMap, key_map
from loongforge_embodied.data.rlds_lerobot import write_lerobot

#: ``task.data`` names a mixture spec when it is a file with one of these suffixes (else a LeRobot set's root).
SPEC_SUFFIXES = (".yaml", ".yml")


@dataclass(frozen=True)
class MixtureDataset:
    """One dataset of the mixture: its TFDS version directory, key map (a shipped name or inline), weight, split."""

    path: str
    keys: str | RLDSKeyMap = "default"
    weight: float = ranged(1.0, low=0.0, low_open=True)
    split: str = "train"

    def key_map(self) -> RLDSKeyMap:
        return key_map(self.keys) if isinstance(self.keys, str) else self.keys


@dataclass(frozen=True)
class RLDSMixture:
    """A mixture spec file (see the module docstring)."""

    datasets: list[MixtureDataset] = field(default_factory=list)
    seed: int = ranged(0, low=0)
    fps: int = ranged(10, low=1)

    def __post_init__(self) -> None:
        if not self.datasets:
            raise ConfigError("'datasets' must list at least one RLDS dataset")


def is_mixture_spec(path: str | Path) -> bool:
    return Path(path).suffix in SPEC_SUFFIXES


def read_mixture(path: str | Path) -> RLDSMixture:
    """The spec at ``path`` (typed: unknown keys, wrong types and weights <= 0 fail naming the file and key), its
    dataset paths made absolute relative to the spec's directory."""
    path = Path(path).expanduser()
    mixture = build_section(RLDSMixture, read_yaml_mapping(path), str(path))
    datasets = [MixtureDataset(str((path.parent / d.path).expanduser()), d.keys, d.weight, d.split)
                for d in mixture.datasets]
    return RLDSMixture(datasets=datasets, seed=mixture.seed, fps=mixture.fps)


def frame_targets(sizes: list[int], weights: list[float]) -> list[float]:
    """Frames each dataset should contribute: the total of ``sizes`` shared out in proportion to ``weights``."""
    shares = np.asarray(weights, dtype=np.float64) / sum(weights)
    return (shares * sum(sizes)).tolist()


def draw_episodes(episodes: list[RLDSEpisode], target: float, rng: np.random.Generator) -> list[RLDSEpisode]:
    """Whole episodes in a seeded random order, cycling through them again as needed, while adding one brings the
    frames nearer to ``target`` (at least one episode)."""
    drawn, frames = [], 0
    while True:
        for index in rng.permutation(len(episodes)):
            episode = episodes[index]
            if drawn and frames + episode.length / 2 >= target:
                return drawn
            drawn.append(episode)
            frames += episode.length


def mixture_episodes(mixture: RLDSMixture) -> list[RLDSEpisode]:
    """The mixed episodes, dataset by dataset in spec order."""
    read = [list(RLDSDataset(d.path, d.key_map(), split=d.split)) for d in mixture.datasets]
    for dataset, episodes in zip(mixture.datasets, read, strict=True):
        if not episodes:
            raise ConfigError(f"{dataset.path}: split '{dataset.split}' has no episodes")
    targets = frame_targets([sum(e.length for e in eps) for eps in read], [d.weight for d in mixture.datasets])
    rng = np.random.default_rng(mixture.seed)
    return [episode for eps, target in zip(read, targets, strict=True) for episode in draw_episodes(eps, target, rng)]


def materialise(spec: str | Path, data_dir: str | Path) -> Path:
    """The mixture ``spec`` written as a LeRobotDataset v3.0 under ``data_dir`` (reused when already written: the
    directory is named by a hash of the resolved spec); returns its root."""
    mixture = read_mixture(spec)
    digest = hashlib.sha256(json.dumps(section_to_dict(mixture), sort_keys=True).encode()).hexdigest()[:12]
    root = Path(data_dir) / f"rlds-mixture-{Path(spec).stem}-{digest}"
    if (root / INFO_PATH).is_file():
        return root
    return write_once(root, lambda tmp: write_lerobot(tmp, mixture_episodes(mixture), fps=mixture.fps))
