"""Where image-text records come from: a jsonl file with image files beside it, or WebDataset tar shards.

Both are *map-style*: they are indexed once (line offsets; tar member offsets, grouped into samples) and then
read by index, so a seeded permutation of indices fixes the data order and a step count resumes it. The tar
reader is the standard library's ``tarfile`` (no webdataset dependency); shards must be uncompressed ``.tar``
so that members are read by seeking. WebDataset conventions: a sample is the consecutive members sharing a
key (the member path up to the first dot of its file name), ``key.json`` holds the record, and the rest of
the name after that dot (``jpg``, ``0.png``) is how the record's ``images`` refer to a member; without an
``images`` list, a sample's images are its image members in name order.

A source has a ``name`` and answers five questions: ``where(i)``, ``raw(i) -> JSON value``,
``media(i, name) -> (where, bytes)``, ``default_images(i)`` and ``listing(i, name)`` (a directory's frame images,
for videos given as a directory; ``None`` when ``name`` is none); ``where`` strings (``data.jsonl line 17``,
``shards/00001.tar:abc.jpg``) are what warnings and errors print.
"""

from __future__ import annotations

import glob
import json
import re
import tarfile
from pathlib import Path
from typing import Any

from loongforge.data.errors import DataError

from loongforge_vlm.data.records import RecordError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
_BRACES = re.compile(r"\{([^{}]*)\}")


class MediaError(ValueError):
    """A media file that is missing or unreadable; ``where`` names it."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where, self.reason = where, reason


def expand_pattern(pattern: str) -> list[str]:
    """Shard paths of a pattern: brace sets ``{a,b}`` and zero-padded ranges ``{000..009}``, then glob (sorted)."""
    match = _BRACES.search(pattern)
    if match:
        body, head, tail = match.group(1), pattern[: match.start()], pattern[match.end():]
        if ".." in body:
            first, last = body.split("..", 1)
            if not (first.isdigit() and last.isdigit()):
                raise DataError(f"shard pattern {pattern!r}: a range needs digits, like {{000..009}}")
            width = len(first) if first.startswith("0") else 0
            choices = [str(n).zfill(width) for n in range(int(first), int(last) + 1)]
        else:
            choices = body.split(",")
        return [path for choice in choices for path in expand_pattern(head + choice + tail)]
    if glob.has_magic(pattern):
        return sorted(glob.glob(str(Path(pattern).expanduser())))
    return [pattern]


class JsonlSource:
    """Records of a jsonl file (one per non-blank line); media names are paths relative to the file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise DataError(f"image-text data file not found: {self.path}")
        self._offsets: list[int] = []
        self._lines: list[int] = []
        with self.path.open("rb") as f:
            offset = 0
            for number, line in enumerate(f, start=1):
                if line.strip():
                    self._offsets.append(offset)
                    self._lines.append(number)
                offset += len(line)

    def __len__(self) -> int:
        return len(self._offsets)

    @property
    def name(self) -> str:
        """What messages call the whole source."""
        return str(self.path)

    def where(self, index: int) -> str:
        return f"{self.path} line {self._lines[index]}"

    def raw(self, index: int) -> Any:
        with self.path.open("rb") as f:
            f.seek(self._offsets[index])
            line = f.readline()
        try:
            return json.loads(line)
        except ValueError as exc:  # also UnicodeDecodeError
            raise RecordError(f"not JSON ({exc})") from None

    def media(self, index: int, name: str) -> tuple[str, bytes]:
        path = self.path.parent / name
        try:
            return str(path), path.read_bytes()
        except OSError as exc:
            raise MediaError(str(path), f"cannot be read ({type(exc).__name__})") from None

    def default_images(self, index: int) -> list[str]:
        return []

    def listing(self, index: int, name: str) -> list[str] | None:
        folder = self.path.parent / name
        if not folder.is_dir():
            return None
        return [f"{name.rstrip('/')}/{p.name}" for p in sorted(folder.iterdir())
                if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS]


class WebDatasetSource:
    """Samples of WebDataset tar shards, in shard order and then member order."""

    def __init__(self, patterns: str | list[str]) -> None:
        patterns = [patterns] if isinstance(patterns, str) else list(patterns)
        self.shards = [path for pattern in patterns for path in expand_pattern(str(pattern))]
        if not self.shards:
            raise DataError(f"no WebDataset shards match {', '.join(map(str, patterns))}")
        # per sample: (shard index, key, {extension: (member name, data offset, size)})
        self._samples: list[tuple[int, str, dict[str, tuple[str, int, int]]]] = []
        for shard_index, shard in enumerate(self.shards):
            self._index_shard(shard_index, shard)

    def _index_shard(self, shard_index: int, shard: str) -> None:
        try:
            with tarfile.open(shard, mode="r:") as tar:
                members = [m for m in tar.getmembers() if m.isfile()]
        except (OSError, tarfile.TarError) as exc:
            raise DataError(f"{shard}: not a readable uncompressed tar ({type(exc).__name__}: {exc})") from None
        current: tuple[int, str, dict[str, tuple[str, int, int]]] | None = None
        for member in members:
            folder, _, filename = member.name.rpartition("/")
            stem, dot, extension = filename.partition(".")
            key = f"{folder}/{stem}" if folder else stem
            if not dot or not stem:
                continue  # not part of a sample (e.g. a README without extension, or a dot file)
            if current is None or current[1] != key:
                current = (shard_index, key, {})
                self._samples.append(current)
            current[2][extension] = (member.name, member.offset_data, member.size)

    def __len__(self) -> int:
        return len(self._samples)

    @property
    def name(self) -> str:
        """What messages call the whole source."""
        return self.shards[0] if len(self.shards) == 1 else f"{self.shards[0]} (+{len(self.shards) - 1} shards)"

    def _read(self, index: int, extension: str) -> tuple[str, bytes]:
        shard_index, key, members = self._samples[index]
        shard = self.shards[shard_index]
        if extension not in members:
            raise MediaError(f"{shard}:{key}.{extension}", "is not in the shard")
        name, offset, size = members[extension]
        with open(shard, "rb") as f:
            f.seek(offset)
            data = f.read(size)
        if len(data) != size:
            raise MediaError(f"{shard}:{name}", "is truncated")
        return f"{shard}:{name}", data

    def where(self, index: int) -> str:
        shard_index, key, _ = self._samples[index]
        return f"{self.shards[shard_index]}:{key}"

    def raw(self, index: int) -> Any:
        _, key, members = self._samples[index]
        if "json" not in members:
            raise RecordError(f"sample has no {key}.json (members: {', '.join(sorted(members))})")
        try:
            return json.loads(self._read(index, "json")[1])
        except (ValueError, MediaError) as exc:
            raise RecordError(f"{key}.json is not readable JSON ({exc})") from None

    def media(self, index: int, name: str) -> tuple[str, bytes]:
        _, key, _ = self._samples[index]
        prefix = key.rpartition("/")[2] + "."
        return self._read(index, name[len(prefix):] if name.startswith(prefix) else name)

    def listing(self, index: int, name: str) -> list[str] | None:
        return None  # a shard sample has no directories: give a video as a file or a frame list

    def default_images(self, index: int) -> list[str]:
        return sorted(ext for ext in self._samples[index][2] if f".{ext}".lower().endswith(IMAGE_EXTENSIONS))
