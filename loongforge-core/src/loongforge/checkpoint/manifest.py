"""The manifest that makes a checkpoint verifiable: every file with its size, its sha256 and the sha256 of each block.

It is written last, so a checkpoint without one is incomplete by definition; on load the listed files are checked,
so a truncated or bit-flipped file fails with one line naming the checkpoint and the file instead of a pickling
error (or, worse, silently different weights).

Who hashes: the rank that wrote a file hashes it (in its background thread when the save is asynchronous, see
:mod:`loongforge.checkpoint.writer`), so the ranks share the reading instead of rank 0 reading the whole checkpoint
(sha256 runs at ~250 MiB/s: a terabyte alone would take over an hour). Rank 0 merges the ranks' entries with
:func:`write_manifest`, which refuses a merge that leaves a file of the directory out or names one that is not there.

How a load verifies (``checkpoint.verify``):

* ``full`` -- every file's size and sha256: every byte is read.
* ``sampled`` -- every file's size, and the sha256 of :data:`SAMPLED_BLOCKS` of its :data:`BLOCK_SIZE` blocks: the
  first, the last and ones drawn with a seed made from the file's name (the same blocks at every load, so a damaged
  block that is not drawn stays unnoticed). Files of one block, and files listed by manifests written before block
  hashes existed, are hashed whole.
* ``none`` -- sizes only (a truncated or missing file is still caught; corruption inside a file is not).

Format (``format`` 1, unchanged; older manifests lack ``block_size`` and ``blocks`` and still verify)::

    {"format": 1, "step": N, "block_size": 4194304,
     "files": {"model_optim/__0_0.distcp": {"size": ..., "sha256": "...", "blocks": ["...", ...]}, ...}}

``blocks`` is there for files longer than one block; whole-file digests and block digests come from the same read.

Hashing a large checkpoint takes minutes (a 140 GB one about ten at that rate), so callers outside a training run
-- a conversion writing its manifest, a command or a resume verifying every byte -- ask for a progress display
(:mod:`loongforge.progress`, on standard error) counted in :data:`BLOCK_SIZE` blocks with the file being read as
its note. Only checkpoints of at least :data:`LARGE_CHECKPOINT_BYTES` show it: a small one hashes in seconds, and a
line per tiny save would bury what matters. Saves during training stay quiet (the run has its own display, and a
background save hashes in a thread).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from loongforge.errors import LoongForgeError
from loongforge.progress import job_progress

MANIFEST = "manifest.json"
_FORMAT = 1
#: Bytes per hashed block: small enough that a sampled load reads little of a file, large enough that the block list
#: of a terabyte checkpoint stays a few megabytes of JSON.
BLOCK_SIZE = 4 << 20
#: Blocks of a file that ``checkpoint.verify: sampled`` hashes (all of them for shorter files).
SAMPLED_BLOCKS = 4
#: Values of ``checkpoint.verify``.
VERIFY_MODES = ("full", "sampled", "none")
#: Checkpoints whose files add up to at least this many bytes (1 GiB: about four seconds of sha256) show the
#: progress of hashing them all when the caller asks for it; smaller ones are hashed quietly.
LARGE_CHECKPOINT_BYTES = 1 << 30


class CheckpointCorruptError(LoongForgeError):
    """A checkpoint's files do not match its manifest (or it has none)."""


class ManifestIncompleteError(LoongForgeError):
    """The entries merged for a manifest do not name exactly the files of the checkpoint being saved."""


def _no_report() -> None:
    """The ``on_block`` of a hashing nobody watches."""


def file_entry(path: Path, block_size: int = BLOCK_SIZE, on_block: Callable[[], None] = _no_report) -> dict[str, Any]:
    """``{"size", "sha256"}`` of the file at ``path``, plus ``"blocks"`` (each block's sha256) when it has several
    blocks; one pass over the file, calling ``on_block()`` after each block."""
    whole = hashlib.sha256()
    blocks = []
    size = 0
    with open(path, "rb") as handle:
        while block := handle.read(block_size):
            whole.update(block)
            blocks.append(hashlib.sha256(block).hexdigest())
            size += len(block)
            on_block()
    entry: dict[str, Any] = {"size": size, "sha256": whole.hexdigest()}
    if len(blocks) > 1:
        entry["blocks"] = blocks
    return entry


@contextmanager
def _reading(description: str | None, sizes: Mapping[str, int]) -> Iterator[Callable[[str], Callable]]:
    """Yield ``reader(name) -> on_block`` for hashing the files ``sizes`` lists: a progress display per block when
    ``description`` is given and they add up to :data:`LARGE_CHECKPOINT_BYTES`, else callbacks that do nothing."""
    if description is None or sum(sizes.values()) < LARGE_CHECKPOINT_BYTES:
        yield lambda name: _no_report
        return
    blocks = sum(-(-size // BLOCK_SIZE) for size in sizes.values())
    with job_progress(description, total=blocks, unit="block", stderr=True) as progress:
        yield lambda name: lambda: progress.advance(note=name)


def hash_files(root: str | os.PathLike, names: Iterable[str], *,
               progress: str | None = None) -> dict[str, dict[str, Any]]:
    """:func:`file_entry` of each of ``names`` (paths relative to ``root``); ``progress`` (a description) shows
    the hashing of a large checkpoint (see the module docstring)."""
    root = Path(root)
    names = list(names)
    with _reading(progress, {name: (root / name).stat().st_size for name in names}) as reader:
        return {name: file_entry(root / name, on_block=reader(name)) for name in names}


def list_files(root: str | os.PathLike) -> list[str]:
    """Every file under ``root`` but the manifest, as sorted ``/``-separated paths relative to ``root``."""
    root = Path(root)
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(root: str | os.PathLike, *, step: int, entries: Mapping[str, dict] | None = None) -> Path:
    """Write ``root/manifest.json`` (fsynced) listing every file under ``root``; call after all else is written.

    ``entries`` are the ranks' hashes of the files they wrote (:func:`hash_files`); they must name exactly the files
    under ``root`` (:class:`ManifestIncompleteError` otherwise: a file no rank hashed would go unverified). Without
    ``entries`` this process hashes every file itself.
    """
    root = Path(root)
    present = list_files(root)
    if entries is None:
        entries = hash_files(root, present)
    unlisted = sorted(set(present) - set(entries))
    absent = sorted(set(entries) - set(present))
    if unlisted or absent:
        raise ManifestIncompleteError(
            f"checkpoint {root}: the ranks' file hashes do not match the directory (hashed by no rank: "
            f"{', '.join(unlisted) or 'none'}; hashed but missing: {', '.join(absent) or 'none'})"
        )
    path = root / MANIFEST
    manifest = {"format": _FORMAT, "step": step, "block_size": BLOCK_SIZE, "files": dict(sorted(entries.items()))}
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    return path


def sampled_blocks(name: str, count: int) -> list[int]:
    """The blocks of a file ``name`` with ``count`` blocks that ``sampled`` verification hashes, in order: the first,
    the last, and the rest of :data:`SAMPLED_BLOCKS` drawn from the others with a seed made from ``name`` (string
    seeds hash the same in every process)."""
    if count <= SAMPLED_BLOCKS:
        return list(range(count))
    inner = random.Random(f"{name}:{count}").sample(range(1, count - 1), SAMPLED_BLOCKS - 2)
    return sorted({0, count - 1, *inner})


def _block_sha256(path: Path, index: int, block_size: int) -> str:
    with open(path, "rb") as handle:
        handle.seek(index * block_size)
        return hashlib.sha256(handle.read(block_size)).hexdigest()


def _check_file(root: Path, name: str, expected: dict, block_size: int | None, mode: str,
                on_block: Callable[[], None]) -> None:
    """Raise :class:`CheckpointCorruptError` if file ``name`` does not match ``expected`` as ``mode`` checks;
    ``on_block`` is called per block a whole-file hash reads."""
    file = root / name
    if not file.is_file():
        raise CheckpointCorruptError(f"checkpoint {root}: file {name} is missing")
    size = file.stat().st_size
    if size != expected["size"]:
        raise CheckpointCorruptError(
            f"checkpoint {root}: file {name} has {size} bytes, manifest says {expected['size']}"
        )
    if mode == "none":
        return
    blocks = expected.get("blocks") if mode == "sampled" and block_size else None
    if blocks is None:  # full, a one-block file, or a manifest from before block hashes
        if file_entry(file, on_block=on_block)["sha256"] != expected["sha256"]:
            raise CheckpointCorruptError(f"checkpoint {root}: file {name} does not match its sha256 in {MANIFEST}")
        return
    if len(blocks) != -(-size // block_size):
        raise CheckpointCorruptError(f"checkpoint {root}: {MANIFEST} is unreadable (block list of {name})")
    for index in sampled_blocks(name, len(blocks)):
        if _block_sha256(file, index, block_size) != blocks[index]:
            raise CheckpointCorruptError(
                f"checkpoint {root}: file {name} block {index} does not match its sha256 in {MANIFEST}"
            )


def verify_manifest(root: str | os.PathLike, mode: str = "full", *, progress: bool = False) -> dict:
    """Check every file the manifest lists as ``mode`` (one of :data:`VERIFY_MODES`) says; return the manifest or
    raise :class:`CheckpointCorruptError`. ``progress`` shows a ``full`` verification of a large checkpoint (the
    other modes read a few blocks per file at most)."""
    if mode not in VERIFY_MODES:
        raise ValueError(f"verification mode {mode!r} is not one of {VERIFY_MODES}")
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        raise CheckpointCorruptError(f"checkpoint {root}: no {MANIFEST} (incomplete save)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files = manifest["files"]
        block_size = manifest.get("block_size")
        shown = f"verifying {root}" if progress and mode == "full" else None
        with _reading(shown, {name: int(expected["size"]) for name, expected in files.items()}) as reader:
            for name, expected in files.items():
                _check_file(root, name, expected, block_size, mode, reader(name))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointCorruptError(f"checkpoint {root}: {MANIFEST} is unreadable") from None
    return manifest
