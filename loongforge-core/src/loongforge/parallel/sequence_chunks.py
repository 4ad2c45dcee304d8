"""Chunked pipeline (``parallel.seq_chunks``, ChunkPipe-style): a long sequence cut into chunks that flow through
megatron's schedule as micro-batches, so that what a pipeline stage holds for backward is bounded by the chunk.

Why two passes: chunk ``i`` attends to the K/V of chunks ``< i``, so the gradient of those K/V comes from every
later chunk. Megatron's schedules run each micro-batch's backward in the order of the forwards (first in, first
out), so a chunk's backward would run before the later chunks have sent it their share. Instead, each step runs

1. a **recording pass**: megatron's forward-only schedule over every chunk in order, without gradients; each
   attention layer keeps its chunk's K/V (rotated by RoPE at the chunk's global positions) in the micro-batch's
   :class:`ChunkKV`;
2. a **replay pass**: megatron's forward-backward schedule over the chunks of each micro-batch *in reverse order*
   (the last chunk first). A chunk's forward is recomputed, attending to its own K/V and the recorded K/V of the
   earlier chunks; since backward runs first-in first-out, every later chunk's backward has already added its
   gradient for this chunk's K/V into the store when this chunk's backward runs, and the chunk's attention hands it
   on (:mod:`loongforge.devices.chunk_attention`). The chunk's K/V record is freed once its backward is done.

It is exact: each token's attention sees the same keys as in the whole sequence, RoPE and learned positions use the
global ``position_ids`` and the loss of a chunk is its token-loss sum over the token count of the *whole*
micro-batch (times the chunk count, which megatron's division by the micro-batch count takes back), so the step's
loss and gradients are those of the unchunked run. The price is one more forward per chunk (as full recompute) and
the K/V of every chunk per layer (``2 * query_groups * head_dim`` numbers per token and layer, far below the
activations). What a stage holds at its peak is one chunk's activations for each micro-batch the pipeline keeps in
flight, instead of whole sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from loongforge.parallel.context import SEQUENCE_KEYS


class ChunkKV:
    """One micro-batch's attention keys and values per layer and chunk (recorded without gradient), and the
    gradient that later chunks' backward sends to each chunk's K/V, summed until that chunk's backward takes it."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._kv: dict[Any, list[tuple[torch.Tensor, torch.Tensor] | None]] = {}
        self._grads: dict[Any, list[tuple[torch.Tensor, torch.Tensor] | None]] = {}

    def record(self, layer: Any, index: int, key: torch.Tensor, value: torch.Tensor) -> None:
        self._kv.setdefault(layer, [None] * self.count)[index] = (_own_storage(key), _own_storage(value))

    def earlier(self, layer: Any, index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The recorded K/V of chunks ``0 .. index-1`` of ``layer``, in order (a one-line error when the recording
        pass did not reach them)."""
        kept = self._kv.get(layer, [None] * self.count)[:index]
        if any(entry is None for entry in kept):
            raise RuntimeError(f"chunk {index}: the K/V of an earlier chunk was not recorded (the recording pass "
                               "must run every chunk before the replay)")
        return kept

    def add_grad(self, layer: Any, index: int, dkey: torch.Tensor, dvalue: torch.Tensor) -> None:
        grads = self._grads.setdefault(layer, [None] * self.count)
        held = grads[index]
        # a copy, not a view: a view would keep the sender's whole gradient tensor alive
        grads[index] = (dkey.clone(), dvalue.clone()) if held is None else (held[0] + dkey, held[1] + dvalue)

    def take_grad(self, layer: Any, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What the later chunks sent chunk ``index``'s K/V (None: nothing, the last chunk); forgets it and the
        chunk's record, which no chunk reads any more once its own backward runs."""
        grads = self._grads.get(layer)
        held = None if grads is None else grads[index]
        if grads is not None:
            grads[index] = None
        if layer in self._kv:
            self._kv[layer][index] = None
        return held


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached, copied when it is a view into a larger storage: megatron's values are a slice of the fused
    QKV projection's output, and a record holding the view would keep the whole projection (queries too) alive for
    the step."""
    tensor = tensor.detach()
    if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor


@dataclass
class SequenceChunk(PackedSeqParams):
    """Chunk ``index`` of ``count`` equal chunks of a micro-batch, carried to every attention call as megatron's
    ``packed_seq_params`` (qkv format ``sbhd``: megatron's THD paths stay off). ``recording``: the recording pass
    (keep this chunk's K/V); otherwise the replay, which backpropagates. ``target_tokens``: the loss-mask count of
    the whole micro-batch, which every chunk's loss divides by."""

    index: int = 0
    count: int = 1
    kv: ChunkKV = field(default_factory=lambda: ChunkKV(1))
    recording: bool = False
    target_tokens: int = 0
    length: int = 0

    def rotary_positions(self) -> torch.Tensor:
        """``[1, length]``: the positions RoPE rotates this chunk's tokens by, those of the whole row that megatron
        uses unchunked (``0 .. seq-1`` whatever ``position_ids`` say; learned positions read ``position_ids``)."""
        return torch.arange(self.index * self.length, (self.index + 1) * self.length)[None]


def chunk_passes(micro_batches: list[dict[str, Any]], count: int) -> tuple[list[dict], list[dict]]:
    """The recording pass's chunks (every micro-batch's chunks in order) and the replay's (each micro-batch's
    chunks last first), sharing one :class:`ChunkKV` per micro-batch."""
    recording, replay = [], []
    for batch in micro_batches:
        extra = sorted(key for key in set(batch) - set(SEQUENCE_KEYS) if batch[key] is not None)
        if extra:
            raise ValueError(f"parallel.seq_chunks cuts text rows only; this micro-batch also has {extra}")
        seq = batch["tokens"].shape[1]
        if seq % count:
            raise ValueError(f"parallel.seq_chunks ({count}) does not divide this micro-batch's {seq} tokens")
        store, length = ChunkKV(count), seq // count
        targets = int(batch["loss_mask"].sum())
        pieces = [{key: part for key, part in zip(SEQUENCE_KEYS, parts, strict=True)}
                  for parts in zip(*(batch[key].chunk(count, dim=1) for key in SEQUENCE_KEYS), strict=True)]
        for index, piece in enumerate(pieces):
            common = dict(qkv_format="sbhd", index=index, count=count, kv=store, target_tokens=targets,
                          length=length, max_seqlen_q=seq, max_seqlen_kv=seq)
            recording.append({**piece, "packed_seq_params": SequenceChunk(recording=True, **common)})
            pieces[index] = {**piece, "packed_seq_params": SequenceChunk(recording=False, **common)}
        replay += reversed(pieces)
    return recording, replay


def chunk_mean_loss(chunk: SequenceChunk, loss_mask: torch.Tensor,
                    per_token_loss: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """One chunk's share of its micro-batch's mean loss, scaled by the chunk count: megatron divides every
    micro-batch's loss by the number of micro-batches (chunks here), which this undoes, so the step's loss is the
    mean over micro-batches of each one's mean over all its target tokens, as unchunked. The reported copy is
    cloned (megatron divides the returned loss in place)."""
    mask = loss_mask.reshape(-1)
    loss = torch.sum(per_token_loss.float().reshape(-1) * mask) * chunk.count / max(chunk.target_tokens, 1)
    return loss, {"loss": loss.detach().clone()}


def discard_output(output: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The recording pass's loss function: its output is not needed (the replay computes the loss)."""
    return output, {}
