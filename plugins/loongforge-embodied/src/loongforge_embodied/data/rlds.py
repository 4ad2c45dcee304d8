"""Episodes of a TFDS-format RLDS dataset (the Open X-Embodiment format) read without TensorFlow.

A TFDS dataset directory (``<name>/<version>/``) holds ``dataset_info.json`` (its ``name`` and, per split, the
number of episodes in each shard, ``shardLengths``), ``features.json`` and the shards
``<name>-<split>.tfrecord-00000-of-00004``. Each record is one ``tf.train.Example`` of one episode in which every
step feature is flattened over the steps: ``steps/action`` holds T*7 floats, ``steps/observation/image`` T encoded
JPEG/PNG frames, ``steps/is_first`` T int64s. :class:`RLDSDataset` reads the shards in order (records framed and
CRC-checked by :mod:`.tfrecord`, parsed by :mod:`.tf_example`), picks the features a :class:`~.rlds_keys.RLDSKeyMap`
names, and gives each episode as an :class:`RLDSEpisode` of arrays.

What is checked, each as one :class:`RLDSFormatError` line naming the file and the episode: a missing
``dataset_info.json`` or shard, a shard with fewer or more episodes than ``shardLengths`` says (a shard cut at a
record boundary has a valid framing), corrupt or truncated records (:class:`~.tfrecord.TFRecordError`), a key the map
names that an episode lacks, a feature whose length is not a whole number of values per step, steps whose
``is_first``/``is_last`` flags do not mark the first and last step, and frames that do not decode.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from loongforge.errors import LoongForgeError
from PIL import Image

from loongforge_embodied.data.rlds_keys import RLDSKeyMap
from loongforge_embodied.data.tf_example import parse_example
from loongforge_embodied.data.tfrecord import read_records

DATASET_INFO = "dataset_info.json"
FEATURES = "features.json"
#: TFDS's shard names: ``{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}``.
SHARD_NAME = "{name}-{split}.tfrecord-{index:05d}-of-{count:05d}"
#: Every RLDS step has these; ``is_first`` also gives the number of steps.
IS_FIRST, IS_LAST, IS_TERMINAL = "steps/is_first", "steps/is_last", "steps/is_terminal"


class RLDSFormatError(LoongForgeError, ValueError):
    """An RLDS dataset on disk that cannot be read as its key map says; the message names the file and episode."""


@dataclass
class RLDSEpisode:
    """One episode's steps as arrays: ``state`` (T, S) and ``action`` (T, A) float32, ``cameras`` camera key ->
    (T, H, W, 3) uint8 RGB, ``reward`` (T,) float32 or ``None``, the RLDS flags as (T,) bool."""

    instruction: str
    state: np.ndarray
    action: np.ndarray
    cameras: dict[str, np.ndarray] = field(default_factory=dict)
    reward: np.ndarray | None = None
    is_first: np.ndarray | None = None
    is_last: np.ndarray | None = None
    is_terminal: np.ndarray | None = None

    @property
    def length(self) -> int:
        return len(self.action)


class RLDSDataset:
    """The episodes of one split of a TFDS RLDS directory, read through ``keys``.

    :param root: the dataset version directory (holding ``dataset_info.json`` and the shards).
    :param keys: which features are the cameras, state, action, instruction and reward.
    :param split: the TFDS split (``train``, ``val`` ...).
    """

    def __init__(self, root: str | Path, keys: RLDSKeyMap, *, split: str = "train") -> None:
        self.root, self.keys, self.split = Path(root), keys, split
        info_path = self.root / DATASET_INFO
        try:
            info = json.loads(info_path.read_text(encoding="utf-8"))
            self.name = str(info["name"])
            splits = {entry["name"]: [int(n) for n in entry["shardLengths"]] for entry in info["splits"]}
        except OSError as err:
            raise RLDSFormatError(f"{info_path}: cannot read the TFDS dataset info ({err.strerror or err}); is "
                                  f"{self.root} a TFDS dataset version directory?") from None
        except (ValueError, KeyError, TypeError) as err:
            raise RLDSFormatError(f"{info_path}: not a TFDS dataset info (needs name and splits[].shardLengths): "
                                  f"{type(err).__name__} {err}") from None
        if split not in splits:
            raise RLDSFormatError(f"{info_path}: no split '{split}'; splits: {', '.join(splits)}")
        self.shard_lengths = splits[split]
        count = len(self.shard_lengths)
        self.shards = [self.root / SHARD_NAME.format(name=self.name, split=split, index=i, count=count)
                       for i in range(count)]
        missing = [shard.name for shard in self.shards if not shard.is_file()]
        if missing:
            raise RLDSFormatError(f"{self.root}: shard {missing[0]} is missing ({DATASET_INFO} lists {count} "
                                  f"shard(s) for split '{split}')")

    def __len__(self) -> int:
        """Episodes in the split (from ``shardLengths``; every shard is held to its count when read)."""
        return sum(self.shard_lengths)

    def __iter__(self) -> Iterator[RLDSEpisode]:
        index = 0
        for shard, expected in zip(self.shards, self.shard_lengths, strict=True):
            found = 0
            for record in read_records(shard):
                yield self._episode(record, shard, index)
                found, index = found + 1, index + 1
            if found != expected:
                raise RLDSFormatError(f"{shard}: holds {found} episode(s), {DATASET_INFO} says {expected} "
                                      "(truncated or replaced shard?)")

    def describe(self) -> str:
        """One line: name, split, episodes and shards."""
        return f"{self.root}: RLDS '{self.name}' split {self.split}, {len(self)} episodes in {len(self.shards)} shards"

    def _episode(self, record: bytes, shard: Path, index: int) -> RLDSEpisode:
        where = f"{shard}: episode {index}"
        try:
            example = parse_example(record)
        except ValueError as err:
            raise RLDSFormatError(f"{where}: {err}") from None
        missing = [key for key in (IS_FIRST, *self.keys.required()) if key not in example]
        if missing:
            known = ", ".join(sorted(k for k in example if k.startswith("steps/")))
            raise RLDSFormatError(f"{where}: key '{missing[0]}' named by the key map is missing; the episode has "
                                  f"{known}")
        steps = len(example[IS_FIRST])
        flags = {key: _values(example, key, steps, where).reshape(-1).astype(bool)
                 for key in (IS_FIRST, IS_LAST, IS_TERMINAL) if key in example}
        _check_order(flags, steps, where)
        instruction = ""
        if self.keys.instruction is not None:
            texts = example[self.keys.instruction]
            if not isinstance(texts, list) or len(texts) != steps:
                raise RLDSFormatError(f"{where}: '{self.keys.instruction}' is not one text per step ({steps} steps)")
            instruction = texts[0].decode("utf-8", errors="replace") if steps else ""
        return RLDSEpisode(
            instruction=instruction,
            state=self._vector(example, self.keys.state, steps, where),
            action=self._vector(example, self.keys.action, steps, where),
            cameras={camera: _frames(example[key], steps, f"{where} ({key})")
                     for camera, key in self.keys.cameras.items()},
            reward=(_values(example, self.keys.reward, steps, where).reshape(steps).astype(np.float32)
                    if self.keys.reward is not None else None),
            is_first=flags.get(IS_FIRST), is_last=flags.get(IS_LAST), is_terminal=flags.get(IS_TERMINAL),
        )

    @staticmethod
    def _vector(example: dict, keys: tuple[str, ...], steps: int, where: str) -> np.ndarray:
        """The features ``keys`` as (T, D) float32, concatenated along D in the map's order."""
        parts = [_values(example, key, steps, where).astype(np.float32) for key in keys]
        return np.concatenate(parts, axis=1) if parts else np.zeros((steps, 0), np.float32)


def _values(example: dict, key: str, steps: int, where: str) -> np.ndarray:
    """A numeric step feature as (T, D): its flat values split into ``steps`` equal rows."""
    values = example[key]
    if isinstance(values, list):
        raise RLDSFormatError(f"{where}: '{key}' holds bytes, the key map needs numbers there")
    if steps == 0 or len(values) % steps:
        raise RLDSFormatError(f"{where}: '{key}' has {len(values)} values for {steps} steps (not a whole number per "
                              "step)")
    return values.reshape(steps, -1)


def _check_order(flags: dict[str, np.ndarray], steps: int, where: str) -> None:
    """``is_first`` marks exactly the first step and ``is_last`` exactly the last: steps come in recorded order."""
    for key, position in ((IS_FIRST, 0), (IS_LAST, steps - 1)):
        if key in flags and not (flags[key][position] and flags[key].sum() == 1):
            raise RLDSFormatError(f"{where}: '{key}' is set at steps {np.flatnonzero(flags[key]).tolist()}, expected "
                                  f"only step {position}")


def _frames(encoded: object, steps: int, where: str) -> np.ndarray:
    """One camera's encoded frames -> (T, H, W, 3) uint8 RGB."""
    if not isinstance(encoded, list) or len(encoded) != steps:
        raise RLDSFormatError(f"{where}: not one encoded image per step ({steps} steps)")
    frames = []
    for step, data in enumerate(encoded):
        try:
            with Image.open(io.BytesIO(data)) as image:
                frames.append(np.asarray(image.convert("RGB")))
        except (OSError, ValueError) as err:
            raise RLDSFormatError(f"{where}: step {step}'s image does not decode: {err}") from None
    if len({frame.shape for frame in frames}) > 1:
        raise RLDSFormatError(f"{where}: frames of different sizes {sorted({f.shape for f in frames})}")
    return np.stack(frames)
