"""megatron's ``torch_dist`` checkpoint format written by this process, now or from a host copy in a thread.

megatron's own writer (``FileSystemWriterAsync``) forks worker processes and starts a ``spawn`` multiprocessing
manager, which breaks scripts without a ``__main__`` guard and costs seconds per save. Here torch's
``dcp.save`` is cut into the three parts that :mod:`loongforge.checkpoint.writer` schedules:

* **plan** (:class:`_DcpSave` construction; collective): torch's local and global planning, exactly as
  ``dcp.save`` does it; with ``stage`` every item the plan writes is then copied into host memory
  (:class:`_HostCopy`), so training may change the live tensors while the copy is written;
* **write** (:meth:`_DcpSave.write`; any thread, no collectives): torch's own ``FileSystemWriter.write_data``
  writes this rank's one file (``__<rank>_0.distcp``) and fsyncs it;
* **finish** (:meth:`_DcpSave.finish`; collective): the write results are gathered and the coordinator writes
  ``.metadata``, as ``dcp.save`` finishes.

A save may report its progress per tensor written (``progress=`` a description, see :mod:`loongforge.progress`):
the writer asks its source for each item's data just before writing it, so a source that counts those requests
(:class:`_Reported`) counts the tensors on disk; it shows on standard error, beside a conversion's other
progress. Conversions use it; training saves do not, since a training run already has its own display and a
background save writes from a thread.

Both modes run the same torch code on the same bytes -- a host copy holds what the live tensors held -- so a
background save writes exactly the files a synchronous one does. The writer records no random save id and no
absolute path in ``.metadata`` (:class:`_ReproducibleWriter`), so two saves of the same state are byte-identical
wherever they are written; neither was ever read back. megatron's :class:`AsyncRequest` carries the parts to
``dist_checkpointing.save(..., async_sharded_save=True)``, which adds its own ``metadata.json`` to the finish.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem
from torch.distributed.checkpoint.utils import _DistWrapper

from loongforge.progress import JobProgress, job_progress


class _ReproducibleWriter(dcp.FileSystemWriter):
    """torch's file writer (one file per rank, fsynced), without the random save id and the absolute directory
    path it would pickle into ``.metadata`` -- the only bytes that differed between two saves of one state."""

    def storage_meta(self) -> None:
        return None


class _HostCopy:
    """Stands in for the planner when the files are written: every item's data, copied into host memory when this
    is made (tensors cloned -- ``Tensor.cpu()`` would alias a CPU tensor -- and byte blobs copied)."""

    def __init__(self, planner: SavePlanner, items: list[WriteItem]) -> None:
        self._data = {item.index: _host_copy(planner.resolve_data(item)) for item in items}

    def resolve_data(self, item: WriteItem) -> Any:
        return self._data[item.index]


class _Reported:
    """Hands the writer each item's data from ``source`` (the planner or a :class:`_HostCopy`), advancing
    ``progress`` with the item's tensor name: the writer resolves an item right before writing it."""

    def __init__(self, source: Any, progress: JobProgress) -> None:
        self._source = source
        self._progress = progress

    def resolve_data(self, item: WriteItem) -> Any:
        data = self._source.resolve_data(item)
        self._progress.advance(note=item.index.fqn)
        return data


def _host_copy(data: Any) -> Any:
    if isinstance(data, io.BytesIO):
        return io.BytesIO(data.getvalue())
    # ``copy=True`` keeps a dense tensor's strides and compacts a view's storage, as torch's writer would.
    return data.detach().to("cpu", copy=True)


class _DcpSave:
    """One rank's part of a ``torch.distributed.checkpoint`` save of ``state_dict`` into ``directory``, planned when
    made (collective); :meth:`write` then :meth:`finish` complete it."""

    def __init__(self, state_dict: dict[str, Any], directory: str | Path, planner: SavePlanner, *,
                 stage: bool, progress: str | None = None) -> None:
        # One writer thread, so one file per rank; no copy-ahead loader, so no device work in a background write.
        self._writer = _ReproducibleWriter(directory, thread_count=1, sync_files=True, per_thread_copy_ahead=0)
        self._dist = _DistWrapper(None, dist.is_initialized(), 0)
        self._metadata = None
        self._results: list[Any] | None = None
        self._progress = progress

        def local_step() -> Any:
            planner.set_up_planner(state_dict, storage_meta=self._writer.storage_meta(),
                                   is_coordinator=self._dist.is_coordinator)
            self._writer.set_up_storage_writer(self._dist.is_coordinator, rank=self._dist.rank, use_collectives=True)
            return self._writer.prepare_local_plan(planner.create_local_plan())

        def global_step(plans: list[Any]) -> list[Any]:
            plans, self._metadata = planner.create_global_plan(plans)
            return self._writer.prepare_global_plan(plans)

        self._plan = planner.finish_plan(self._dist.reduce_scatter("plan", local_step, global_step))
        self._source: Any = _HostCopy(planner, self._plan.items) if stage else planner

    @property
    def data_file(self) -> str:
        """The file this rank writes (relative to the directory): torch names it after the plan's storage prefix."""
        return f"{self._plan.storage_data.prefix}0{DEFAULT_SUFFIX}"

    def write(self) -> None:
        """Write and fsync this rank's file (no collectives: safe in a background thread)."""
        if self._progress is None:
            self._results = self._writer.write_data(self._plan, self._source).value()
        else:
            with job_progress(self._progress, total=len(self._plan.items), unit="tensor", stderr=True) as progress:
                self._results = self._writer.write_data(self._plan, _Reported(self._source, progress)).value()
        self._source = None  # the host copy is written: free it

    def finish(self) -> None:
        """Gather every rank's write results; the coordinator writes ``.metadata``. Collective."""
        self._dist.all_reduce("write", lambda: self._results,
                              lambda results: self._writer.finish(metadata=self._metadata, results=results))


class InProcessTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
    """megatron's ``torch_dist`` format written by this process (no fork, no spawn).

    ``save`` (inherited) runs :meth:`async_save`'s request at once; with ``stage`` the request writes a host copy
    made when it was created, so it may run in a background thread while training goes on.
    """

    def __init__(self, backend: str = "torch_dist", version: int = 1, *, stage: bool = False,
                 progress: str | None = None) -> None:
        super().__init__(backend, version, thread_count=1)
        self.stage = stage
        #: Description of a per-tensor progress display of the write (``None``: quiet).
        self.progress = progress
        #: The last request's :class:`_DcpSave` (:attr:`_DcpSave.data_file` names what it writes).
        self.last_save: _DcpSave | None = None

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: Path | str) -> AsyncRequest:
        state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
        planner = MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False)
        self.last_save = _DcpSave(mcore_to_pyt_state_dict(state, False), checkpoint_dir, planner, stage=self.stage,
                                  progress=self.progress)
        return AsyncRequest(self.last_save.write, (), [self.last_save.finish])

