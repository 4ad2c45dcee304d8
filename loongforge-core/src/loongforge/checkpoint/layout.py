"""Where checkpoints live on disk and how one becomes visible atomically.

A save writes into ``.tmp-step-N``; only after every file (manifest last) is fsynced is the directory
renamed to ``step-N`` and the ``latest`` pointer replaced. A process killed at any moment therefore leaves
either the previous checkpoints untouched or a ``.tmp-*`` directory that no load ever looks at.

A checkpoint that fails verification when the resume scan or the pruner looks at it is *quarantined*: renamed in
place to ``step-N.corrupt`` (a rename within the root is atomic and cannot fail for lack of space, the step stays
readable in ``ls``, and the name no longer matches ``step-N`` so nothing lists, counts, loads or prunes it). It is
never deleted: the user decides whether it is evidence or rubbish.

How thoroughly a checkpoint is verified before it is loaded or counted is the root's ``verify`` mode
(``checkpoint.verify``: ``full``, ``sampled`` or ``none``; see :mod:`loongforge.checkpoint.manifest`). Commands that
load a checkpoint given by path (``generate``, ``convert``, ``sample`` ...) verify in full.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Callable
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
QUARANTINE_SUFFIX = ".corrupt"
_QUARANTINED_RE = re.compile(r"^step-(\d{7,})\.corrupt(-\d+)?$")


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


def warn(message: str) -> None:
    """A warning line on stderr (every rank that has one prints it)."""
    print(f"[loongforge] warning: {message}", file=sys.stderr, flush=True)


class CheckpointDir:
    """One checkpoint root: begin a save, commit it, prune old ones, and pick one to resume from.

    ``warn`` receives one line per checkpoint quarantined by the pruner (the resume scan returns its lines).
    """

    def __init__(self, root: str | os.PathLike, keep_last: int = 2,
                 warn: Callable[[str], None] = warn, verify: str = "full") -> None:
        self.root = Path(root)
        self.keep_last = keep_last
        self.warn = warn
        #: How checkpoints are verified before they are loaded or counted (``checkpoint.verify``).
        self.verify = verify
        #: Names of checkpoints this process verified or wrote itself: the pruner does not hash them again.
        self._verified: set[str] = set()

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
        self._point_latest(final)
        self._verified.add(final.name)  # its manifest was just hashed from these very files
        self.prune(current=final)
        return final

    def prune(self, current: Path | None = None) -> list[Path]:
        """Delete all but the newest ``keep_last`` *verified* checkpoints (0 keeps everything); return what was
        removed.

        ``current`` (the checkpoint just committed) is never a candidate: it is verified and counted first, so
        ``keep_last=1`` keeps just it even beside a newer step from an earlier run. The others are
        walked newest step first; each one that would be kept is verified unless this process already verified or
        wrote it (so a steady run hashes nothing here), and one that fails is quarantined with a warning instead of
        being counted -- a corrupt newest checkpoint can no longer push the good ones out. Checkpoints beyond
        ``keep_last`` are deleted without hashing: they go either way.
        """
        if self.keep_last <= 0:
            return []
        kept = 0 if current is None else 1
        removed = []
        for path in list_checkpoints(self.root):
            if current is not None and path.name == current.name:
                continue
            if kept >= self.keep_last:
                self._delete(path)
                removed.append(path)
            elif self._verifies(path, on_fail=self.warn, cached=True):
                kept += 1
        return removed

    def _delete(self, path: Path) -> None:
        """Remove checkpoint ``path`` so that no kill can leave it half deleted under its ``step-N`` name: it is
        renamed out of those names first (atomic), and a kill during the deletion leaves a ``.tmp-*`` directory,
        which the next :meth:`begin` sweeps, instead of a visible checkpoint with files missing."""
        doomed = self.root / f"{_TMP_PREFIX}deleting-{path.name}"
        os.rename(path, doomed)
        _fsync_path(self.root)
        shutil.rmtree(doomed, ignore_errors=True)

    def _verifies(self, path: Path, on_fail: Callable[[str], None], *, cached: bool, progress: bool = False) -> bool:
        """Whether ``path`` verifies (``cached``: trust this process's earlier verdict; ``progress``: show it, when
        large); a failure quarantines it and reports one line."""
        if cached and path.name in self._verified:
            return True
        try:
            verify_manifest(path, mode=self.verify, progress=progress)
        except CheckpointCorruptError as exc:
            on_fail(f"{exc}; quarantined as {self.quarantine(path).name}, not counted or loaded")
            return False
        self._verified.add(path.name)
        return True

    def quarantine(self, path: Path) -> Path:
        """Rename ``path`` to ``step-N.corrupt`` (``.corrupt-2``, ... if taken); if ``latest`` named it, point
        ``latest`` at the newest remaining checkpoint (or remove it), so the pointer never names a bad one."""
        target = path.with_name(path.name + QUARANTINE_SUFFIX)
        index = 1
        while target.exists():
            index += 1
            target = path.with_name(f"{path.name}{QUARANTINE_SUFFIX}-{index}")
        pointed = self.latest() == path
        os.rename(path, target)
        self._verified.discard(path.name)
        if pointed:
            remaining = list_checkpoints(self.root)
            self._point_latest(remaining[0] if remaining else None)
        return target

    def _point_latest(self, final: Path | None) -> None:
        """Replace the ``latest`` pointer atomically (``None`` removes it)."""
        pointer = self.root / LATEST
        if final is None:
            pointer.unlink(missing_ok=True)
        else:
            pointer_tmp = self.root / f"{_TMP_PREFIX}{LATEST}"
            with open(pointer_tmp, "w", encoding="utf-8") as handle:
                handle.write(final.name + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(pointer_tmp, pointer)
        _fsync_path(self.root)

    def latest(self) -> Path | None:
        """The checkpoint the ``latest`` pointer names, if the pointer and the directory exist."""
        pointer = self.root / LATEST
        if not pointer.is_file():
            return None
        try:
            name = pointer.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):  # a damaged pointer names nothing (the scan does not need it)
            return None
        path = self.root / name
        return path if _STEP_RE.match(name) and path.is_dir() else None  # a bare name: never outside the root

    def find_valid(self) -> tuple[Path | None, list[str]]:
        """The newest checkpoint whose manifest verifies, plus one line per newer checkpoint that failed (each
        of which is quarantined, so neither a later scan nor the pruner counts it again); the lines say which older
        checkpoint is used instead, when there is one."""
        rejected: list[str] = []
        for path in list_checkpoints(self.root):
            if self._verifies(path, on_fail=rejected.append, cached=False, progress=True):  # about to be loaded
                fallback = [f"{line}; falling back to the older {path.name}" for line in rejected]
                return path, fallback + unchecked_content(path, self.verify)
        return None, rejected

    def quarantined(self) -> list[Path]:
        """The checkpoints quarantined here so far (``step-N.corrupt``, ``step-N.corrupt-2``, ...), newest step
        first: what a resume that finds no valid checkpoint must not silently train over."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p.name, p) for p in self.root.iterdir()
                 if p.is_dir() and (m := _QUARANTINED_RE.match(p.name))]
        return [p for _, _, p in sorted(found, reverse=True)]


def unchecked_content(path: Path, mode: str) -> list[str]:
    """The warning for a checkpoint about to be loaded after verification ``mode`` (none unless ``none``)."""
    if mode != "none":
        return []
    return [f"checkpoint.verify is none: only the sizes of {path}'s files were checked, so corruption inside a "
            "file goes unnoticed"]


def locate_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` itself if it holds a manifest, else the step a checkpoint root's ``latest`` names; nothing is
    verified. For looking at a checkpoint's ``config.yaml`` before deciding what to do with it (the claims of
    ``loongforge convert`` / ``eval`` handlers): the handler that claims it verifies it once, with
    :func:`find_checkpoint`, instead of every handler hashing it again."""
    path = Path(path).expanduser()
    if (path / MANIFEST).is_file():
        return path
    latest = CheckpointDir(path).latest()
    if latest is None:
        raise CheckpointNotFoundError(
            f"{path}: not a LoongForge checkpoint (no {MANIFEST}) nor a checkpoint root with a 'latest' pointer"
        )
    return latest


def find_checkpoint(path: str | os.PathLike, verify: str = "full") -> Path:
    """``path`` itself if it is a checkpoint, else the one a checkpoint root's ``latest`` names; verified as
    ``verify`` says (``none`` prints a warning).

    Here, torch-free, so that commands acting on a checkpoint (a policy server, ``loongforge sample``) do not
    import megatron just to find it. Commands run outside training, so a large checkpoint's verification shows its
    progress (:data:`~loongforge.checkpoint.manifest.LARGE_CHECKPOINT_BYTES`).
    """
    path = locate_checkpoint(path)
    verify_manifest(path, mode=verify, progress=True)
    for line in unchecked_content(path, verify):
        warn(line)
    return path
