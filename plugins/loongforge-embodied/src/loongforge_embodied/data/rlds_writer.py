"""Write episodes as a TFDS-format RLDS dataset, so demos and the conversion can be tried without downloads.

Lays out what TFDS writes for an RLDS builder: ``dataset_info.json`` (name, version, per split its shards'
episode counts), ``features.json`` (the step features as a TFDS ``FeaturesDict`` with a ``Dataset`` of steps) and
``<name>-<split>.tfrecord-NNNNN-of-NNNNN`` shards, one ``tf.train.Example`` per episode with every step feature
flattened over the steps. ``loongforge make-data synthetic-rlds ROOT`` writes :func:`synthetic_rlds_episodes` this
way, in the ``default`` key map's layout.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from loongforge.errors import LoongForgeError

from loongforge_embodied.data.images import encode_png
from loongforge_embodied.data.rlds import DATASET_INFO, FEATURES, IS_FIRST, IS_LAST, IS_TERMINAL, SHARD_NAME
from loongforge_embodied.data.rlds_keys import KEY_MAPS
from loongforge_embodied.data.synthetic import TINY_LENGTHS, synthetic_episodes
from loongforge_embodied.data.tf_example import serialize_example
from loongforge_embodied.data.tfrecord import write_records

#: One episode as TFDS flattens it: ``steps/...`` key -> (T, ...) numbers or T encoded byte strings.
StepFeatures = dict[str, np.ndarray | list[bytes]]


def write_rlds_dataset(root: str | Path, episodes: Sequence[StepFeatures], *, name: str, split: str = "train",
                       shards: int = 1, version: str = "1.0.0") -> Path:
    """Write ``episodes`` (each with ``steps/is_first`` and the rest of its step features) under ``root``, spread
    over ``shards`` shards in order; returns ``root``."""
    root = Path(root)
    groups = [group.tolist() for group in np.array_split(np.arange(len(episodes)), shards)]
    for index, group in enumerate(groups):
        path = root / SHARD_NAME.format(name=name, split=split, index=index, count=shards)
        write_records(path, (serialize_example(episodes[e]) for e in group))
    info = {"name": name, "version": version, "fileFormat": "tfrecord", "moduleName": "loongforge_embodied",
            "splits": [{"name": split, "filepathTemplate": "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}",
                        "shardLengths": [str(len(group)) for group in groups]}]}
    (root / DATASET_INFO).write_text(json.dumps(info, indent=2))
    (root / FEATURES).write_text(json.dumps(_features_dict(episodes[0]), indent=2))
    return root


def _features_dict(episode: StepFeatures) -> dict:
    """``features.json`` as TFDS writes it: the step features, nested by their ``/``-separated names."""
    steps: dict = {}
    for key, values in episode.items():
        *parents, leaf = key.removeprefix("steps/").split("/")
        node = steps
        for parent in parents:
            node = node.setdefault(parent, {"pythonClassName": "tensorflow_datasets.core.features.features_dict."
                                                                "FeaturesDict", "featuresDict": {"features": {}}})
            node = node["featuresDict"]["features"]
        node[leaf] = _feature(values)
    return {"pythonClassName": "tensorflow_datasets.core.features.features_dict.FeaturesDict",
            "featuresDict": {"features": {"steps": {
                "pythonClassName": "tensorflow_datasets.core.features.dataset_feature.Dataset",
                "sequence": {"feature": {
                    "pythonClassName": "tensorflow_datasets.core.features.features_dict.FeaturesDict",
                    "featuresDict": {"features": steps}}, "length": "-1"}}}}}


def _feature(values: np.ndarray | list[bytes]) -> dict:
    if isinstance(values, list):
        if values and values[0].startswith(b"\x89PNG"):
            return {"pythonClassName": "tensorflow_datasets.core.features.image_feature.Image",
                    "image": {"shape": {"dimensions": ["-1", "-1", "3"]}, "dtype": "uint8", "encodingFormat": "png"}}
        return {"pythonClassName": "tensorflow_datasets.core.features.text_feature.Text", "text": {}}
    array = np.asarray(values)
    dtype = {"b": "bool", "i": "int64", "u": "int64"}.get(array.dtype.kind, "float32")
    return {"pythonClassName": "tensorflow_datasets.core.features.tensor_feature.Tensor",
            "tensor": {"shape": {"dimensions": [str(d) for d in array.shape[1:]]}, "dtype": dtype,
                       "encoding": "none"}}


def synthetic_rlds_episodes(lengths: Sequence[int] = TINY_LENGTHS, *, seed: int = 0) -> list[StepFeatures]:
    """The reader's synthetic episodes (:func:`~loongforge_embodied.data.synthetic.synthetic_episodes`: random-walk
    states and actions, moving-square frames, two alternating tasks) in the ``default`` key map's layout, frames as
    PNG, a reward of 1 on the last step."""
    keys = KEY_MAPS["default"]
    camera_key = next(iter(keys.cameras.values()))
    episodes = []
    for episode in synthetic_episodes(lengths, seed=seed):
        steps = episode.length
        last = np.arange(steps) == steps - 1
        episodes.append({
            IS_FIRST: np.arange(steps) == 0, IS_LAST: last, IS_TERMINAL: last,
            keys.state[0]: episode.features["observation.state"], keys.action[0]: episode.features["action"],
            keys.instruction: [episode.task.encode()] * steps, keys.reward: last.astype(np.float32),
            camera_key: [encode_png(frame) for frame in next(iter(episode.cameras.values()))],
        })
    return episodes


def configure(parser: argparse.ArgumentParser) -> None:
    """The options of ``loongforge make-data synthetic-rlds``."""
    parser.add_argument("root", help="output directory: the TFDS dataset version directory (must not hold one yet)")
    parser.add_argument("--lengths", type=int, nargs="+", metavar="STEPS", default=list(TINY_LENGTHS),
                        help="steps of each episode, one episode per length (default: %(default)s)")
    parser.add_argument("--shards", type=int, default=2, help="TFRecord shards to spread the episodes over")
    parser.add_argument("--name", default="synthetic_rlds", help="the TFDS dataset name (in the shard file names)")


def run(args: argparse.Namespace) -> int:
    """``loongforge make-data synthetic-rlds ROOT``: write the set and print one line."""
    if (Path(args.root) / DATASET_INFO).exists():
        raise LoongForgeError(f"{args.root} already holds a TFDS dataset; choose a new directory or delete it")
    if min(args.lengths) < 1 or not 1 <= args.shards <= len(args.lengths):
        raise LoongForgeError(f"--lengths must be >= 1 and --shards between 1 and the {len(args.lengths)} episodes")
    root = write_rlds_dataset(args.root, synthetic_rlds_episodes(args.lengths), name=args.name, shards=args.shards)
    print(f"wrote {len(args.lengths)} RLDS episodes ({sum(args.lengths)} steps, {args.shards} shards) to {root}")
    return 0
