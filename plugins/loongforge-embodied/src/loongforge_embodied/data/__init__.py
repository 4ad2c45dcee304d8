"""Robot-learning data: LeRobotDataset v2.1/v3.0 reading and writing, RLDS reading, stats, normalisation, prefetch.

Importing this package is free (no numpy, pyarrow or PyAV): the names below load from their submodules on
first use, so plugin registration stays light. Modules:

- :mod:`~loongforge_embodied.data.lerobot_format`: the on-disk layout of both versions, ``LeRobotFormatError``
- :mod:`~loongforge_embodied.data.lerobot_dataset`: ``LeRobotDataset`` (frames, images, action chunks)
- :mod:`~loongforge_embodied.data.lerobot_checks`: the checks run when a dataset is opened
- :mod:`~loongforge_embodied.data.lerobot_writer`: ``write_lerobot_dataset`` from in-memory episodes
- :mod:`~loongforge_embodied.data.video`: PyAV encode/decode by timestamp, per-thread container cache
- :mod:`~loongforge_embodied.data.images`: cameras stored as PNG cells in the parquet (feature dtype ``image``)
- :mod:`~loongforge_embodied.data.stats` / :mod:`~loongforge_embodied.data.normalize`: stats and ``Normalizer``
- :mod:`~loongforge_embodied.data.prefetch`: ``BatchPrefetcher`` (seeded order, background threads)
- :mod:`~loongforge_embodied.data.synthetic`: tiny generated episodes/datasets for tests and demos
- :mod:`~loongforge_embodied.data.kind`: the ``lerobot`` dataset kind a config names
- :mod:`~loongforge_embodied.data.rlds`: ``RLDSDataset``, TFDS RLDS / Open X-Embodiment episodes without TensorFlow
  (:mod:`~loongforge_embodied.data.tfrecord` framing and CRCs, :mod:`~loongforge_embodied.data.tf_example` parsing,
  :mod:`~loongforge_embodied.data.rlds_keys` key maps, :mod:`~loongforge_embodied.data.rlds_lerobot` conversion,
  :mod:`~loongforge_embodied.data.rlds_mixture` weighted mixtures, :mod:`~loongforge_embodied.data.rlds_writer`)
"""

from __future__ import annotations

from loongforge.lazy import lazy_exports

_EXPORTS = {
    "LeRobotDataset": "lerobot_dataset",
    "LeRobotFormatError": "lerobot_format",
    "EpisodeData": "lerobot_writer",
    "VideoOptions": "lerobot_writer",
    "write_lerobot_dataset": "lerobot_writer",
    "compute_stats": "stats",
    "aggregate_stats": "stats",
    "Normalizer": "normalize",
    "synthetic_episodes": "synthetic",
    "write_synthetic_dataset": "synthetic",
    "RLDSDataset": "rlds",
    "RLDSKeyMap": "rlds_keys",
    "KEY_MAPS": "rlds_keys",
    "BatchPrefetcher": "prefetch",
    "collate": "prefetch",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)
