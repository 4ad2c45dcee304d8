"""Where checkpoints live on disk and how one becomes visible atomically.

A save writes into ``.tmp-step-N``; only after every file (manifest last) is fsynced is the directory
renamed to ``step-N`` and the ``latest`` pointer replaced. A process killed at any moment therefore leaves
either the previous checkpoints untouched or a ``.tmp-*`` directory that no load ever looks at.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from loongforge.checkpoint.manifest import MANIFEST, CheckpointCorruptError, verify_manifest
from loongforge.errors import LoongForgeError


class CheckpointNotFoundError(LoongForgeError):
    """A path that is neither a checkpoint nor a checkpoint root with a ``latest`` pointer."""


LATEST = "latest"
#: The resolved run config and the run metadata inside every checkpoint (task and megatron checkpoints alike).
CONFIG_YAML = "config.yaml"
METADATA_JSON = "metadata.json"
_TMP_PREFIX = ".tmp-"
_STEP_RE = re.compile(r"^step-(\d{7,})$")


def step_dir_name(step: int) -> str:
    """``step-0000006``: zero-padded so names sort like steps."""
    return f"step-{step:07d}"


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Complete-looking checkpoint directories under ``root``, newest step first (``.tmp-*`` never included)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_RE.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (and ``root`` itself) so a rename cannot outrun the data."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


class CheckpointDir:
    """One checkpoint root: begin a save, commit it, prune old ones, and pick one to resume from."""

    def __init__(self, root: str | os.PathLike, keep_last: int = 2) -> None:
        self.root = Path(root)
        self.keep_last = keep_last

    def tmp_path(self, step: int) -> Path:
        """Where the save of ``step`` is written before it becomes visible."""
        return self.root / f"{_TMP_PREFIX}{step_dir_name(step)}"

    def begin(self, step: int) -> Path:
        """A fresh, empty temporary directory for the save of ``step`` (stale ``.tmp-*`` leftovers are removed)."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(f"{_TMP_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = self.tmp_path(step)
        tmp.mkdir()
        return tmp

    def commit(self, tmp: Path, step: int) -> Path:
        """Make a fully written ``tmp`` visible as ``step-N``, point ``latest`` at it, prune old checkpoints."""
        fsync_tree(tmp)
        final = self.root / step_dir_name(step)
        if final.exists():  # re-saving a step after resuming from an older checkpoint
            old = self.root / f"{_TMP_PREFIX}replaced-{final.name}"
            os.rename(final, old)
            shutil.rmtree(old)
        os.rename(tmp, final)
        pointer_tmp = self.root / f"{_TMP_PREFIX}{LATEST}"
        with open(pointer_tmp, "w", encoding="utf-8") as handle:
            handle.write(final.name + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(pointer_tmp, self.root / LATEST)
        _fsync_path(self.root)
        self.prune()
        return final

    def prune(self) -> list[Path]:
        """Delete all but the newest ``keep_last`` checkpoints (0 keeps everything); return what was removed."""
        if self.keep_last <= 0:
            return []
        removed = list_checkpoints(self.root)[self.keep_last :]
        for path in removed:
            shutil.rmtree(path, ignore_errors=True)
        return removed

    def latest(self) -> Path | None:
        """The checkpoint the ``latest`` pointer names, if the pointer and the directory exist."""
        pointer = self.root / LATEST
        if not pointer.is_file():
            return None
        path = self.root / pointer.read_text(encoding="utf-8").strip()
        return path if _STEP_RE.match(path.name) and path.is_dir() else None

    def find_valid(self) -> tuple[Path | None, list[str]]:
        """The newest checkpoint whose manifest verifies, plus one warning per newer checkpoint that failed."""
        warnings = []
        for path in list_checkpoints(self.root):
            try:
                verify_manifest(path)
            except CheckpointCorruptError as exc:
                warnings.append(f"{exc}; falling back to an older checkpoint")
                continue
            return path, warnings
        return None, warnings


def find_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` itself if it is a checkpoint, else the one a checkpoint root's ``latest`` names; verified.

    Here, torch-free, so that commands acting on a checkpoint (a policy server, ``loongforge sample``) do not
    import megatron just to find it.
    """
    path = Path(path).expanduser()
    if not (path / MANIFEST).is_file():
        latest = CheckpointDir(path).latest()
        if latest is None:
            raise CheckpointNotFoundError(
                f"{path}: not a LoongForge checkpoint (no {MANIFEST}) nor a checkpoint root with a 'latest' pointer"
            )
        path = latest
    verify_manifest(path)
    return path
