"""Refuse a distributed checkpoint whose files would run code when megatron and torch read them -- before they do.

Why a check of our own: ``model_optim/`` is megatron ``dist_checkpointing`` in torch's DCP format, and reading it
unpickles. torch's ``FileSystemReader.read_metadata`` calls ``pickle.load`` on ``.metadata``; its load planner calls
``torch.load(weights_only=False)`` on every non-tensor (BYTE_IO) item, such as the layers' ``_extra_state`` that
megatron stores as ShardedObjects; megatron reads ``common.pt`` with ``torch.load``'s default, which the environment
variable ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` turns unsafe. A pickle may name any callable, so a crafted checkpoint
would run code the moment it is loaded, and the manifest cannot help: whoever crafts the files can recompute it.

So :func:`check_dist_checkpoint` reads those same bytes first, without running anything:

* every ``.metadata`` (and a rank's own ``__N.metadata``) goes through :class:`_MetadataUnpickler`, which hands out
  only the globals a DCP ``Metadata`` is built from (:func:`admitted_globals`) and refuses any other by name;
* every BYTE_IO item that metadata lists is read from its ``.distcp`` file and must load with
  ``torch.load(weights_only=True)``: torch's allow-list of plain data (tensors, containers, numbers, and the few
  dataclasses and enums megatron-core registers as safe);
* ``common.pt`` must load the same way, and ``metadata.json`` must name the ``torch_dist`` / ``torch`` format
  LoongForge writes, so that megatron picks no other reader.

A pickle that passes is safe for the unrestricted unpickler too, since that one calls exactly the globals admitted
here. Tensor data needs no check: torch reads it with ``weights_only=True`` itself. Only metadata and the small
BYTE_IO payloads are read (milliseconds), so every path that reads a dist checkpoint calls the check first:
:func:`loongforge.checkpoint.saver.load_checkpoint` (resume, rewind) and
:func:`loongforge.interop.mcore_checkpoint.load_model_weights` (``generate``, ``convert``, ``model.load``, plugins).
"""

from __future__ import annotations

import functools
import io
import json
import pickle
import re
from collections import defaultdict
from pathlib import Path, PosixPath
from typing import Any

import torch
import torch.serialization
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from loongforge.checkpoint.manifest import CheckpointCorruptError
from loongforge.errors import UntrustedCheckpointError

#: megatron's format record in a dist-checkpoint directory, and the backends it must name (the ones we write).
FORMAT_JSON = "metadata.json"
FORMAT = {"sharded_backend": "torch_dist", "common_backend": "torch"}
#: megatron's file of non-sharded state.
COMMON_PT = "common.pt"
#: torch DCP's global metadata file; ranks that saved without collectives write ``__<rank>.metadata`` instead.
METADATA_FILES = (".metadata", "__*.metadata")


@functools.cache
def admitted_globals() -> dict[tuple[str, str], Any]:
    """``(module, name) -> object`` of every global a DCP ``.metadata`` pickle may name (torch dtypes are admitted
    by :func:`_admitted` too). Found by saving real checkpoints -- tp/pp/dp layouts, the distributed optimizer,
    MoE in bf16, LoRA, a composed VLM, converted ones -- and listing what their pickles name; each is harmless to
    call with any arguments (it builds a value, imports nothing and touches nothing)."""
    md = dcp_metadata
    return {
        # The metadata itself: what the state dict holds (tensor or bytes), its shape and its chunks.
        ("torch.distributed.checkpoint.metadata", "Metadata"): md.Metadata,
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"): md.MetadataIndex,
        # torch's default writer (which wrote LoongForge's checkpoints before checkpoint/torch_dist.py) records a
        # StorageMeta with the directory it saved to as a PosixPath; both appear only in such checkpoints.
        ("torch.distributed.checkpoint.metadata", "StorageMeta"): md.StorageMeta,
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"): md.TensorStorageMetadata,
        ("torch.distributed.checkpoint.metadata", "TensorProperties"): md.TensorProperties,
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"): md.ChunkStorageMetadata,
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"): md.BytesStorageMetadata,
        # TensorProperties pickles its memory format as this Enum (torch.memory_format cannot be pickled).
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): md._MEM_FORMAT_ENCODING,
        # Where each item's bytes are: file name, offset, length.
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
        # Tensor sizes and chunk offsets.
        ("torch", "Size"): torch.Size,
        # How torch pickles a layout (``torch.strided``): a lookup of torch's layouts by name.
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        ("pathlib", "PosixPath"): PosixPath,
    }


@functools.cache
def _dtypes() -> dict[str, torch.dtype]:
    """torch's dtypes by attribute name (``bfloat16``), read from the module's namespace: a ``getattr`` could import
    a torch submodule lazily."""
    return {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}


def _admitted(module: str, name: str) -> Any:
    """The object ``(module, name)`` names if metadata may hold it (a torch dtype such as ``torch.bfloat16`` is
    pickled as that global), else ``None``."""
    found = admitted_globals().get((module, name))
    return _dtypes().get(name) if found is None and module == "torch" else found


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only :func:`_admitted` globals; any other is refused by name before it can
    be imported or called (the pickle module routes every global, extension codes included, through here)."""

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        found = _admitted(module, name)
        if found is None:
            raise UntrustedCheckpointError(
                f"{self.path}: names {module}.{name}, which is no part of distributed-checkpoint metadata; "
                "unpickling it would run code chosen by whoever wrote the checkpoint, so it was refused"
            )
        return found


def read_dcp_metadata(path: Path) -> Any:
    """The ``Metadata`` in DCP metadata file ``path``, read with :class:`_MetadataUnpickler`."""
    try:
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle, path).load()
    except UntrustedCheckpointError:
        raise
    except Exception as exc:  # a damaged pickle can fail in any way (bad opcode, truncation, bad arguments)
        raise CheckpointCorruptError(f"{path}: unreadable distributed-checkpoint metadata ({type(exc).__name__}: "
                                     f"{exc})") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointCorruptError(f"{path}: holds a {type(metadata).__name__}, not distributed-checkpoint metadata")
    return metadata


def _weights_only_reason(exc: pickle.UnpicklingError) -> str:
    """What torch's multi-paragraph ``weights_only`` refusal refused: the global it names, else its own reason."""
    text = str(exc)
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:
        return f"it names the global {found.group(1)}, which torch.load(weights_only=True) does not admit"
    found = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
    return found.group(1).strip() if found else text.strip().splitlines()[0]


def _check_plain_data(data: Any, where: str) -> None:
    """``data`` (a path or a file object) must load with ``torch.load(weights_only=True)``."""
    try:
        torch.load(data, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UntrustedCheckpointError(
            f"{where} is not plain data ({_weights_only_reason(exc)}); loading it would run code chosen by whoever "
            "wrote the checkpoint, so it was refused"
        ) from None
    except Exception as exc:  # not a torch.save file at all: truncated zip, garbage
        raise CheckpointCorruptError(f"{where}: unreadable ({type(exc).__name__}: {exc})") from None


def _storage_entries(metadata_file: Path, metadata: Any) -> list[tuple[str, Any]]:
    """``(item name, _StorageInfo)`` of every stored item, after checking the shapes the restricted unpickler cannot
    (it admits the right classes, not that they are put together as DCP puts them)."""
    storage, items = metadata.storage_data, metadata.state_dict_metadata
    if not isinstance(storage, dict) or not isinstance(items, dict):
        raise CheckpointCorruptError(f"{metadata_file}: malformed distributed-checkpoint metadata")
    entries = []
    for index, info in storage.items():
        well_formed = (isinstance(index, dcp_metadata.MetadataIndex) and isinstance(index.fqn, str)
                       and isinstance(info, dcp_filesystem._StorageInfo) and isinstance(info.relative_path, str)
                       and all(isinstance(n, int) and n >= 0 for n in (info.offset, info.length)))
        if not well_formed:
            raise CheckpointCorruptError(f"{metadata_file}: malformed storage entry {index!r}: {info!r}")
        entries.append((index.fqn, info))
    return entries


def _byte_items(directory: Path, metadata_file: Path, metadata: Any) -> dict[Path, list[tuple[str, int, int]]]:
    """``file -> [(item name, offset, length)]`` of the BYTE_IO items ``metadata`` lists, each inside ``directory``."""
    items: dict[Path, list[tuple[str, int, int]]] = defaultdict(list)
    root = directory.resolve()
    for fqn, info in _storage_entries(metadata_file, metadata):
        if not isinstance(metadata.state_dict_metadata.get(fqn), dcp_metadata.BytesStorageMetadata):
            continue  # tensors: torch reads them with weights_only=True
        if info.transform_descriptors:
            raise UntrustedCheckpointError(f"{metadata_file}: item '{fqn}' is stored through the transforms "
                                           f"{list(info.transform_descriptors)}, which LoongForge never writes")
        file = (directory / info.relative_path).resolve()
        if file.parent != root or not file.is_file():
            raise CheckpointCorruptError(f"{metadata_file}: item '{fqn}' is stored in {info.relative_path!r}, "
                                         f"which is no file of {directory}")
        items[file].append((fqn, info.offset, info.length))
    return items


def _check_format(directory: Path) -> None:
    path = directory / FORMAT_JSON
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointCorruptError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(recorded, dict) or any(recorded.get(key) != value for key, value in FORMAT.items()):
        raise UntrustedCheckpointError(f"{path}: names the format {recorded!r}, but LoongForge reads only the "
                                       f"{FORMAT['sharded_backend']} / {FORMAT['common_backend']} format it writes "
                                       "(another reader would unpickle files this check never saw), so it was refused")


def check_dist_checkpoint(directory: str | Path) -> None:
    """Raise :class:`UntrustedCheckpointError` (or :class:`CheckpointCorruptError`) unless reading the megatron
    dist-checkpoint ``directory`` can run no code (see the module docstring); reads nothing but metadata and the
    BYTE_IO payloads."""
    directory = Path(directory)
    _check_format(directory)
    metadata_files = sorted({file for pattern in METADATA_FILES for file in directory.glob(pattern)})
    if not metadata_files:
        raise CheckpointCorruptError(f"{directory}: no distributed-checkpoint metadata (.metadata)")
    for metadata_file in metadata_files:
        metadata = read_dcp_metadata(metadata_file)
        for file, items in _byte_items(directory, metadata_file, metadata).items():
            with open(file, "rb") as handle:
                for name, offset, length in items:
                    handle.seek(offset)
                    _check_plain_data(io.BytesIO(handle.read(length)),
                                      f"{file}: item '{name}' (bytes {offset}..{offset + length})")
    if (directory / COMMON_PT).is_file():
        _check_plain_data(directory / COMMON_PT, str(directory / COMMON_PT))
