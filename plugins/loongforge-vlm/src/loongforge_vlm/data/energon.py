"""Megatron-Energon datasets as an image-text source: a WebDataset directory that ``energon prepare`` indexed
(``.nv-meta/dataset.yaml`` naming the sample type and its field map, ``split.yaml``, the tar indexes).

Energon's own code reads it: ``get_dataset_from_config`` builds the dataset's factory (its sample type, field
map or sample loader, split), energon's ``ShardInfosITarReader`` reads sample ``i`` of the split by its tar
index, and the factory's ``load_sample`` turns the raw parts into the typed sample. That random access, rather
than energon's ``get_train_dataset``/``get_loader`` stream, is what we use because the stream shuffles, shards
over ranks and workers and loops by itself: it would fight our seeded distributed sampler, which fixes the
order, splits it over data-parallel ranks and resumes by step count over any map-style source.

Media stay bytes (only ``json``/``txt`` parts are decoded), so images and videos go through the same decoding,
checks and error messages as every other source. Supported sample types, as conversations:

- ``VQASample``: user ``<image>`` + ``context``, assistant ``answers[0]``;
- ``CaptioningSample``: user ``<image>``, assistant ``caption``;
- ``VidQASample``: user ``<video>`` + ``context``, assistant ``answers[0]`` (the video a GIF, or a clip read
  with PyAV).

A ``context`` that already holds an ``<image>``/``<video>`` placeholder keeps it where it is.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

from loongforge.data.errors import DataError

from loongforge_vlm.data.records import RecordError
from loongforge_vlm.data.sources import MediaError

#: sample type name -> (media field, placeholder, question field or None, answer field).
SAMPLE_TYPES = {"VQASample": ("image", "<image>", "context", "answers"),
                "CaptioningSample": ("image", "<image>", None, "caption"),
                "VidQASample": ("video", "<video>", "context", "answers")}


class _KeepMedia:
    """An energon decoder that decodes text parts (json, txt, ...) and leaves images and videos as bytes."""

    def __init__(self) -> None:
        import webdataset.autodecode

        self._decode = webdataset.autodecode.Decoder([])

    def __call__(self, sample: dict) -> dict:
        return self._decode(sample)

    def config(self) -> dict[str, Any]:
        return {"decoder": "loongforge-vlm keep-media"}


def _close(reader: Any) -> None:
    """Close the tars and tar indexes energon's reader keeps open: left to interpreter shutdown, its storage
    client prints a traceback per file (its logger is already gone by then)."""
    reader.close()
    for entry in reader.cached_offset_reader.tar_index_reader_cache.values():
        entry.tar_index_reader.close()
    reader.cached_offset_reader.tar_index_reader_cache.clear()


class EnergonSource:
    """The ``split`` of an energon dataset directory, read by index (see the module docstring)."""

    def __init__(self, path: str | Path, split: str = "train") -> None:
        self.path = Path(path).expanduser()
        if not (self.path / ".nv-meta" / "dataset.yaml").is_file():
            raise DataError(f"{self.path}: not an energon dataset (no .nv-meta/dataset.yaml; write one with "
                            f"'energon prepare')")
        try:
            from megatron.energon import WorkerConfig
            from megatron.energon.dataset_config import get_dataset_from_config
            from megatron.energon.flavors.webdataset.itar_reader import ShardInfosITarReader
        except ImportError:
            raise DataError(f"{self.path}: reading energon datasets needs megatron-energon "
                            f"(pip install 'loongforge-vlm[energon]')") from None
        try:
            self._factory = get_dataset_from_config(
                self.path, split_part=split, training=False, decoder=_KeepMedia(),
                worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
        except Exception as exc:  # energon raises many types for a bad .nv-meta
            raise DataError(f"{self.path}: energon cannot open split '{split}' ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
        sample_type = getattr(self._factory, "__sample_type__", None)
        type_name = getattr(sample_type, "__name__", type(self._factory).__name__)
        if type_name not in SAMPLE_TYPES:
            raise DataError(f"{self.path}: energon sample type '{type_name}' is not supported (supported: "
                            f"{', '.join(SAMPLE_TYPES)})")
        self._fields = SAMPLE_TYPES[type_name]
        self._reader = ShardInfosITarReader(self._factory.path, self._factory.shards)
        weakref.finalize(self, _close, self._reader)
        self._cached: tuple[int, Any] | None = None

    def __len__(self) -> int:
        return len(self._reader)

    @property
    def name(self) -> str:
        """What messages call the whole source."""
        return str(self.path)

    def _sample(self, index: int) -> Any:
        """Energon's typed sample ``index`` (the last one is kept: a record and its media are read together)."""
        if self._cached is None or self._cached[0] != index:
            self._cached = (index, self._factory.load_sample(self._reader[index]))
        return self._cached[1]

    def where(self, index: int) -> str:
        sample = self._sample(index)
        return f"{self.path}:{sample.__key__}"

    def raw(self, index: int) -> Any:
        media_field, placeholder, question_field, answer_field = self._fields
        try:
            sample = self._sample(index)
        except Exception as exc:  # energon's field access and decoding errors
            raise RecordError(f"energon cannot load the sample ({type(exc).__name__}: {exc})") from None
        answer = getattr(sample, answer_field)
        if isinstance(answer, list):
            answer = answer[0] if answer else None
        if not isinstance(answer, str) or not answer:
            raise RecordError(f"has no {answer_field} (nothing to train on)")
        question = getattr(sample, question_field) if question_field else ""
        if not isinstance(question, str):
            raise RecordError(f"'{question_field}' is not text")
        prompt = question if placeholder in question else f"{placeholder}\n{question}" if question else placeholder
        key = "images" if media_field == "image" else "videos"
        return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}],
                key: [self._media_name(sample)]}

    def _media_name(self, sample: Any) -> str:
        """The media's name; a video's suffix says how it decodes (``.gif`` by Pillow, anything else by PyAV)."""
        media_field = self._fields[0]
        data = getattr(sample, media_field)
        return "video.gif" if media_field == "video" and bytes(data[:4]) == b"GIF8" else f"{media_field}.bin"

    def media(self, index: int, name: str) -> tuple[str, bytes]:
        sample = self._sample(index)
        where, data = f"{self.path}:{sample.__key__}.{name}", getattr(sample, self._fields[0])
        if not isinstance(data, (bytes, bytearray)):
            raise MediaError(where, f"energon gives a {type(data).__name__}, not the file's bytes")
        return where, bytes(data)

    def default_images(self, index: int) -> list[str]:
        return []

    def listing(self, index: int, name: str) -> list[str] | None:
        return None
