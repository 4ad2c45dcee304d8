"""How every rank's share of a save becomes one committed checkpoint, now or in the background.

A save has three parts, split where the kind of work changes:

1. **Snapshot** (the engine, main thread, collective): plan the files, write the small ones, and -- for a
   background save -- copy what the large ones hold into host memory, since training goes on changing the live
   tensors in place. It ends with :meth:`CheckpointWriter.submit` of this rank's :class:`RankShare`.
2. **Write** (:class:`_Job`; a background thread with ``checkpoint.async_save``): this rank writes its large files
   from the snapshot (fsynced) and hashes every file it wrote (:func:`~loongforge.checkpoint.manifest.hash_files`),
   so the ranks hash in parallel instead of rank 0 reading the whole checkpoint.
3. **Commit** (:meth:`CheckpointWriter.complete`; main thread, collective): the share's collective ``finalize``
   (torch DCP's ``.metadata``), then rank 0 merges the ranks' hashes into ``manifest.json`` (which must name
   exactly the directory's files) and :meth:`~loongforge.checkpoint.layout.CheckpointDir.commit` renames
   ``.tmp-step-N`` to ``step-N``, points ``latest`` at it and prunes.

A synchronous save runs the three in a row. A background save returns after the snapshot; the loop asks at each
step boundary whether every rank has finished writing (one all-reduce of two numbers while a save is pending) and
commits then; the next save and the end of training wait for it. The background thread issues no collectives --
gloo (or NCCL) collectives from a second thread would interleave with the training step's -- so the ranks agree on
"done" in the main thread, at the same step on every rank.

A process killed before the commit leaves only ``.tmp-step-N``, which no load looks at and the next save removes; a
write that fails (a full disk) fails the commit on every rank with one line naming the rank and the error, and the
previous checkpoints stay as they were.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loongforge.checkpoint.layout import CheckpointDir, list_checkpoints, step_dir_name, warn
from loongforge.checkpoint.manifest import MANIFEST, hash_files, list_files, write_manifest
from loongforge.errors import LoongForgeError


class CheckpointWriteError(LoongForgeError):
    """A rank could not write its part of a checkpoint; the checkpoint was not made visible."""


@dataclass
class RankShare:
    """This rank's part of one save, prepared by the snapshot.

    ``files`` (relative to the temporary directory) are those this rank wrote or ``write`` writes; this rank hashes
    them (rank 0 also every file no rank names, e.g. those lifecycle hooks wrote). ``write`` writes the large files
    from the snapshot and must not touch the live training state nor issue collectives (it may run in a background
    thread). ``finalize`` runs on every rank in the main thread once every rank's ``write`` is done (it may use
    collectives); only rank 0's may create files (DCP's and megatron's metadata), which rank 0 then hashes.
    """

    files: list[str]
    write: Callable[[], None] | None = None
    finalize: Callable[[], None] | None = None


@dataclass
class _Job:
    """Write and hash one rank's share; ``error`` holds what went wrong (read after the thread ended)."""

    tmp: Path
    share: RankShare
    files: list[str]
    entries: dict[str, dict] = field(default_factory=dict)
    error: BaseException | None = None

    def run(self) -> None:
        try:
            if self.share.write is not None:
                self.share.write()
                self.share.write = None  # lets go of the snapshot as soon as it is on disk
            self.entries = hash_files(self.tmp, self.files)
        except BaseException as exc:  # reported by every rank at the commit, in the main thread
            self.error = exc


@dataclass
class _Pending:
    """The save between :meth:`CheckpointWriter.begin` and its commit (``job`` once submitted)."""

    directory: CheckpointDir
    step: int
    tmp: Path
    job: _Job | None = None
    thread: threading.Thread | None = None


#: ``errno`` values of a write that found no room: the device is full, or the user's quota is.
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
#: How the libraries word those errors when they do not pass the ``OSError`` on (safetensors' Rust writer).
_NO_ROOM_TEXT = ("no space left on device", "disk quota exceeded", "os error 28", "os error 122")
#: torch's own message when a write through a file *path* fell short (the disk filled): "unexpected pos 704 vs 598".
_SHORT_WRITE_TEXT = ("unexpected pos", "file write failed", "pytorchstreamwriter failed")
#: Below this many free bytes a short write is taken for a full disk when the checkpoint's size is not known.
_NEARLY_FULL = 64 << 20


def save_torch(value: Any, path: Path) -> None:
    """``torch.save(value)`` into the file ``path`` through a Python file object: a full disk is then the
    ``OSError`` (ENOSPC) it is, not torch's "unexpected pos 704 vs 598" from its own C++ writer."""
    with open(path, "wb") as handle:
        torch.save(value, handle)


def _format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable


def checkpoint_bytes(path: Path) -> int | None:
    """The bytes of checkpoint ``path`` as its manifest lists them (``None`` when it cannot be read)."""
    try:
        files = json.loads((path / MANIFEST).read_text(encoding="utf-8"))["files"]
        return sum(int(entry["size"]) for entry in files.values()) + (path / MANIFEST).stat().st_size
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def expected_save_bytes(directory: CheckpointDir) -> tuple[int, str] | None:
    """How many bytes the next save of this run will write, and from where that is known: the size of the newest
    checkpoint in ``directory`` (``None`` before the first)."""
    for path in list_checkpoints(directory.root):
        size = checkpoint_bytes(path)
        if size is not None:
            return size, path.name
    return None


def _free_bytes(root: Path) -> int | None:
    try:
        return shutil.disk_usage(root).free
    except OSError:
        return None


def _room_hint(directory: CheckpointDir) -> str:
    keep = directory.keep_last
    if keep <= 0:
        return "checkpoint.keep_last is 0, so every checkpoint stays: delete old ones or give the run more space"
    lower = ", or lower keep_last" if keep > 1 else ""
    return (f"checkpoint.keep_last {keep} keeps {keep} checkpoint(s) and deletes the oldest only after the new one is "
            f"complete, so the disk must hold {keep + 1} at once: free space or move checkpoint.dir{lower}")


def write_failure(exc: BaseException, directory: CheckpointDir, step: int) -> str | None:
    """One line for ``exc`` when it is a write of checkpoint ``step`` that found no room (a full disk, a quota), with
    the bytes the save needs and those that were free for it; ``None`` for any other error."""
    text = str(exc).lower()
    no_room = (isinstance(exc, OSError) and exc.errno in _NO_ROOM) or any(t in text for t in _NO_ROOM_TEXT)
    free = _free_bytes(directory.root if directory.root.exists() else directory.root.parent)
    expected = expected_save_bytes(directory)
    if not no_room and any(t in text for t in _SHORT_WRITE_TEXT):  # torch's writer hides the errno: look at the disk
        no_room = free is not None and free < max(_NEARLY_FULL, expected[0] if expected else 0)
    if not no_room:
        return None
    tmp = directory.tmp_path(step)
    written = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file()) if tmp.is_dir() else 0
    if expected is not None:
        needed = f"needs about {_format_bytes(expected[0])} (the size of {expected[1]})"
    else:
        needed = f"needs more than the {_format_bytes(written)} it had written"
    where = getattr(exc, "filename", None)
    what = f" writing {where}" if where else ""
    room = f", and {_format_bytes(free + written)} was free for it in {directory.root}" if free is not None else ""
    return f"no space left on device{what}: the checkpoint {needed}{room}; {_room_hint(directory)}"


@contextlib.contextmanager
def named_write_errors(directory: CheckpointDir, step: int) -> Iterator[None]:
    """Turn a full disk met while saving checkpoint ``step`` (on this rank, in the main thread) into one
    :class:`CheckpointWriteError` line with the bytes needed (:func:`write_failure`), removing the partial save so
    that the space it took is free again; other errors pass unchanged."""
    try:
        yield
    except CheckpointWriteError:
        raise
    except Exception as exc:
        problem = write_failure(exc, directory, step)
        if problem is None:
            raise
        shutil.rmtree(directory.tmp_path(step), ignore_errors=True)
        raise CheckpointWriteError(f"checkpoint step {step} was not saved ({problem}); the previous checkpoints in "
                                   f"{directory.root} are unchanged") from None


def warn_if_no_room(directory: CheckpointDir, step: int) -> None:
    """A warning line before the save of ``step`` when the disk has less room than the last checkpoint took."""
    expected = expected_save_bytes(directory)
    free = _free_bytes(directory.root)
    if expected is not None and free is not None and free < expected[0]:
        warn(f"checkpoint step {step}: {_format_bytes(free)} free in {directory.root}, but {expected[1]} took "
             f"{_format_bytes(expected[0])}: the save will probably fail for lack of space; {_room_hint(directory)}")


def write_blobs(directory: Path, blobs: Mapping[str, bytes | memoryview]) -> None:
    """Write each ``name: bytes`` of ``blobs`` under ``directory``, fsynced: the large files of a background save
    whose snapshot is serialised bytes."""
    for name, data in blobs.items():
        with open(directory / name, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class CheckpointWriter:
    """Saves of one run, written now (``background=False``) or in a background thread; at most one pending.

    Every rank holds one and makes the same calls in the same order: :meth:`begin`, then the engine's snapshot,
    then :meth:`submit`; :meth:`complete` at step boundaries and at the end.
    """

    def __init__(self, *, background: bool) -> None:
        self.background = background
        self._pending: _Pending | None = None
        self._group: Any = None

    @property
    def pending(self) -> bool:
        """Whether a save was submitted and is not committed yet."""
        return self._pending is not None and self._pending.job is not None

    def begin(self, directory: CheckpointDir, step: int) -> Path:
        """The empty temporary directory to save ``step`` into (a pending save is committed first). Collective."""
        if self.pending:
            self.complete(wait=True)
        rank, _ = _world()
        tmp = directory.tmp_path(step)
        if rank == 0:
            directory.begin(step)
            warn_if_no_room(directory, step)
        self._barrier()
        self._pending = _Pending(directory, step, tmp)
        return tmp

    def submit(self, share: RankShare) -> Path | None:
        """Write (now or in the background) and hash this rank's ``share`` of the begun save; return the committed
        ``step-N`` directory, or ``None`` while it is written in the background. Collective."""
        pending = self._pending
        if pending is None or pending.job is not None:
            raise RuntimeError("CheckpointWriter.submit without a begun save")
        claimed = self._gather(list(share.files))
        files = list(share.files)
        if claimed is not None:  # rank 0: also every file that no rank claims (written by hooks)
            named = {name for names in claimed for name in names}
            files += [name for name in list_files(pending.tmp) if name not in named]
        pending.job = _Job(pending.tmp, share, files)
        if not self.background:
            pending.job.run()
            return self._commit()
        pending.thread = threading.Thread(target=pending.job.run, name=f"loongforge-save-{pending.step}",
                                          daemon=True)
        pending.thread.start()
        return None

    def complete(self, *, wait: bool) -> Path | None:
        """Commit the pending background save if every rank has written its share (``wait``: once they have);
        return its ``step-N`` directory, or ``None`` when nothing was committed. Collective whenever a save is
        pending (which it is on every rank alike)."""
        if not self.pending:
            return None
        thread = self._pending.thread
        if wait:
            if thread is not None:
                thread.join()
        elif not self._all_done(thread is None or not thread.is_alive()):
            return None
        return self._commit()

    # -- the commit ---------------------------------------------------------------------------------------------

    def _commit(self) -> Path:
        pending, self._pending = self._pending, None
        job, tmp = pending.job, pending.tmp
        rank, _ = _world()
        errors = self._all_gather(None if job.error is None else self._described(job.error, pending))
        self._refuse(pending, "; ".join(f"rank {r}: {error}" for r, error in enumerate(errors) if error))
        before = set(list_files(tmp)) if rank == 0 else set()
        if job.share.finalize is not None:
            job.share.finalize()
        gathered = self._gather(job.entries)
        outcome = None
        if gathered is not None:  # rank 0; a failure here must reach every rank, which would wait for it forever
            try:
                merged = {name: entry for part in gathered for name, entry in part.items()}
                merged.update(hash_files(tmp, sorted(set(list_files(tmp)) - before)))  # the finalisation's files
                write_manifest(tmp, step=pending.step, entries=merged)
                pending.directory.commit(tmp, pending.step)
            except Exception as exc:  # noqa: BLE001 -- reported on every rank below
                outcome = str(exc) if isinstance(exc, LoongForgeError) else self._described(exc, pending)
        self._refuse(pending, self._broadcast(outcome))
        return pending.directory.root / step_dir_name(pending.step)

    @staticmethod
    def _described(exc: BaseException, pending: _Pending) -> str:
        """One line for a rank's failure: a full disk as such (with the bytes needed), else the error itself."""
        return write_failure(exc, pending.directory, pending.step) or f"{type(exc).__name__}: {exc}"

    def _refuse(self, pending: _Pending, problem: str | None) -> None:
        """Raise on every rank (they all get the same ``problem``): the checkpoint stays a ``.tmp-*`` directory --
        except after a full disk, when rank 0 removes it so that the space it took is free again."""
        if problem:
            if "no space left on device" in problem and _world()[0] == 0:
                shutil.rmtree(pending.tmp, ignore_errors=True)
            raise CheckpointWriteError(f"checkpoint step {pending.step} was not saved ({problem}); the previous "
                                       f"checkpoints in {pending.directory.root} are unchanged")

    # -- coordination (main thread only) --------------------------------------------------------------------------

    def _coordination_group(self) -> Any:
        """A gloo group for the writer's own small collectives (the default group itself when it is gloo), so that
        they need no device tensors whatever the training backend."""
        if self._group is None:
            self._group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        return self._group

    def _barrier(self) -> None:
        if _world()[1] > 1:
            dist.barrier(group=self._coordination_group())

    def _all_done(self, done: bool) -> bool:
        if _world()[1] == 1:
            return done
        flag = torch.tensor([0 if done else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._coordination_group())
        return int(flag.item()) == 0

    def _all_gather(self, value: Any) -> list[Any]:
        _, world = _world()
        if world == 1:
            return [value]
        values: list[Any] = [None] * world
        dist.all_gather_object(values, value, group=self._coordination_group())
        return values

    def _broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if _world()[1] == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._coordination_group())
        return box[0]

    def _gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` on rank 0 (``None`` elsewhere)."""
        rank, world = _world()
        if world == 1:
            return [value]
        values: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(value, values, dst=0, group=self._coordination_group())
        return values
