"""The manifest that makes a checkpoint verifiable: every file with its size and sha256.

It is written last, so a checkpoint without one is incomplete by definition; on load every listed file is
checked, so a truncated or bit-flipped file fails with one line naming the checkpoint and the file instead
of a pickling error (or, worse, silently different weights).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from loongforge.errors import LoongForgeError

MANIFEST = "manifest.json"
_FORMAT = 1
_CHUNK = 1 << 20


class CheckpointCorruptError(LoongForgeError):
    """A checkpoint's files do not match its manifest (or it has none)."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(root: str | os.PathLike, *, step: int) -> Path:
    """Hash every file under ``root`` into ``root/manifest.json`` (fsynced). Call after all else is written."""
    root = Path(root)
    files = {p.relative_to(root).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in _files(root)}
    path = root / MANIFEST
    with open(path, "w", encoding="utf-8") as handle:
        json.dump({"format": _FORMAT, "step": step, "files": files}, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    return path


def verify_manifest(root: str | os.PathLike) -> dict:
    """Check every file the manifest lists; return the manifest or raise :class:`CheckpointCorruptError`."""
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        raise CheckpointCorruptError(f"checkpoint {root}: no {MANIFEST} (incomplete save)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        files = manifest["files"]
    except (ValueError, KeyError, TypeError):
        raise CheckpointCorruptError(f"checkpoint {root}: {MANIFEST} is unreadable") from None
    for name, expected in files.items():
        file = root / name
        if not file.is_file():
            raise CheckpointCorruptError(f"checkpoint {root}: file {name} is missing")
        if file.stat().st_size != expected["size"]:
            raise CheckpointCorruptError(
                f"checkpoint {root}: file {name} has {file.stat().st_size} bytes, manifest says {expected['size']}"
            )
        if _sha256(file) != expected["sha256"]:
            raise CheckpointCorruptError(f"checkpoint {root}: file {name} does not match its sha256 in {MANIFEST}")
    return manifest
