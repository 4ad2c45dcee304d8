"""Full (TP=1, PP=1) megatron tensors <-> the shards a rank holds at any tensor/pipeline layout.

One mechanism for both directions: megatron's own ``sharded_state_dict``. For every local parameter it
states the global tensor it is part of and where (``global_offset``/``local_shape`` after the prepended
layer axis), including the awkward cases -- a SwiGLU ``linear_fc1`` shard is ``[gate slice; up slice]``,
which the ``ShardedTensorFactory`` splits into two placed pieces; a tied output layer on the last pipeline
stage is a replica of the embedding. So:

* :func:`load_full_state` cuts each rank's slices out of full tensors (loading HF weights at tp=2/pp=2 is
  ``hf_to_megatron`` then this);
* :func:`gather_full_state` sends every main-replica piece to rank 0 and places it (``save_hf`` at any
  layout is this then ``megatron_to_hf``).

Full tensors are keyed by the TP=1/PP=1 state-dict names (``decoder.layers.<global index>...``), the names
:mod:`loongforge.models.hf_adapter` speaks; a local name differs in its layer index on later pipeline stages,
which the layer's ``layer_number`` gives, and at expert parallelism in its expert index (``local_experts.0``
on the second EP rank is a later global expert), which the sharded tensor's expert offset gives.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, is_main_replica

from loongforge.checkpoint.saver import unwrap_model
from loongforge.errors import InteropError

_LAYERS = "decoder.layers."


_LOCAL_EXPERTS = "mlp.experts.local_experts."


def _full_name(local_name: str, layer_numbers: dict[str, int], piece: ShardedTensor) -> str:
    """The TP=1/PP=1/EP=1 name of a local parameter: global layer index, and for an MoE expert its global
    expert index, which megatron states as the piece's offset on the last prepended axis: ``(layer, expert)`` in a
    stack of identical layers, ``(expert,)`` alone where layers differ (dense first layers, hybrid layers), which
    megatron checkpoints layer by layer."""
    if not local_name.startswith(_LAYERS):
        return local_name
    index, rest = local_name[len(_LAYERS) :].split(".", 1)
    if rest.startswith(_LOCAL_EXPERTS):
        _, after = rest[len(_LOCAL_EXPERTS) :].split(".", 1)
        rest = f"{_LOCAL_EXPERTS}{piece.global_offset[piece.prepend_axis_num - 1]}.{after}"
    return f"{_LAYERS}{layer_numbers[index]}.{rest}"


def _pieces(chunk: Any) -> Iterator[tuple[str, str, ShardedTensor | ShardedTensorFactory, list[ShardedTensor]]]:
    """``(local name, full name, entry, placed pieces)`` for every tensor entry of ``chunk``'s sharded state."""
    model = unwrap_model(chunk)
    layer_numbers: dict[str, int] = {}  # read only where names are the decoder's own (a composed model's are nested)
    for local_name, entry in model.sharded_state_dict().items():
        if not layer_numbers and local_name.startswith(_LAYERS):
            layer_numbers = {str(i): layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
        if isinstance(entry, ShardedTensorFactory):
            built = entry.build()
            pieces = list(built) if isinstance(built, list) else [built]
        elif isinstance(entry, ShardedTensor):
            pieces = [entry]
        else:  # ShardedObject: module extra state, not weights
            continue
        yield local_name, _full_name(local_name, layer_numbers, pieces[0]), entry, pieces


def _region(piece: ShardedTensor) -> tuple[tuple[int, ...], tuple[slice, ...]]:
    """The global shape without prepended (layer) axes, and the slice of it this piece covers."""
    skip = piece.prepend_axis_num
    shape = tuple(piece.global_shape[skip:])
    region = tuple(slice(o, o + n) for o, n in zip(piece.global_offset[skip:], piece.local_shape, strict=True))
    return shape, region


def load_full_state(model_chunks: list[Any], full: dict[str, torch.Tensor]) -> int:
    """Load this rank's slices of ``full`` into ``model_chunks``; return how many tensors were loaded.

    A name missing from ``full`` falls back to the piece's sharded key, which is how a tied output layer on
    the last pipeline stage finds the embedding.
    """
    loaded = 0
    for chunk in model_chunks:
        local: dict[str, torch.Tensor] = {}
        for local_name, name, entry, pieces in _pieces(chunk):
            source_name = name if name in full else pieces[0].key
            if source_name not in full:
                raise InteropError(f"no weights for {name} (model parameter {local_name})")
            source = full[source_name]
            parts = []
            for piece in pieces:
                shape, region = _region(piece)
                if tuple(source.shape) != shape:
                    raise InteropError(f"tensor {name} has shape {list(source.shape)}, the model needs {list(shape)}")
                parts.append(source[region])
            local[local_name] = entry.merge_fn(parts) if isinstance(entry, ShardedTensorFactory) else parts[0]
        result = unwrap_model(chunk).load_state_dict(local, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            raise InteropError(f"model parameters not covered by the weights: {(missing or result.unexpected_keys)[0]}")
        loaded += len(local)
    return loaded


def gather_full_state(model_chunks: list[Any]) -> dict[str, torch.Tensor] | None:
    """Every rank's main-replica pieces assembled into full tensors on rank 0 (others get None).

    Collective: every rank of the default process group must call it. Rank 0 holds the whole model in
    memory, once.
    """
    pieces = []
    for chunk in model_chunks:
        for _, name, _, placed in _pieces(chunk):
            for piece in placed:
                if is_main_replica(piece.replica_id):
                    shape, region = _region(piece)
                    pieces.append((name, shape, region, piece.data.detach().clone()))
    if dist.is_initialized() and dist.get_world_size() > 1:
        everything: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(pieces, everything, dst=0)
        if everything is None:
            return None
        pieces = [p for rank_pieces in everything for p in rank_pieces]
    full: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}
    for name, shape, region, data in pieces:
        if name not in full:
            full[name] = torch.empty(shape, dtype=data.dtype)
            filled[name] = 0
        full[name][region] = data
        filled[name] += data.numel()
    for name, tensor in full.items():
        if filled[name] != tensor.numel():
            raise InteropError(f"gathered shards of {name} cover {filled[name]} of {tensor.numel()} elements")
    return full


def row_blocks(chunk: Any) -> dict[str, tuple[int, list[tuple[int, int]]]]:
    """``module -> (full rows, [(start, stop) of each local block, in local order])`` for every weight this rank
    holds a row slice of (a column-parallel linear; a SwiGLU ``linear_fc1`` has two blocks, gate and up): the
    columns of that module's output are split the same way, which is how ``loongforge diff`` reassembles them."""
    found = {}
    for local_name, _, _, pieces in _pieces(chunk):
        if not local_name.endswith(".weight"):
            continue
        regions = [_region(piece) for piece in pieces]
        blocks = [(region[0].start, region[0].stop) for _, region in regions]
        rows = regions[0][0][0]
        if sum(stop - start for start, stop in blocks) < rows:
            found[local_name.removesuffix(".weight")] = (rows, blocks)
    return found
