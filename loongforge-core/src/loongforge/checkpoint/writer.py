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

import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loongforge.checkpoint.layout import CheckpointDir, step_dir_name
from loongforge.checkpoint.manifest import hash_files, list_files, write_manifest
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
        errors = self._all_gather(None if job.error is None else f"{type(job.error).__name__}: {job.error}")
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
                outcome = str(exc) if isinstance(exc, LoongForgeError) else f"{type(exc).__name__}: {exc}"
        self._refuse(pending, self._broadcast(outcome))
        return pending.directory.root / step_dir_name(pending.step)

    def _refuse(self, pending: _Pending, problem: str | None) -> None:
        """Raise on every rank (they all get the same ``problem``): the checkpoint stays a ``.tmp-*`` directory."""
        if problem:
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
