"""Context-parallel attention without Transformer Engine: Ulysses all-to-all over heads.

Why Ulysses and not ring attention: megatron's CP attention lives in Transformer Engine, so the local backend
needs its own. An all-to-all that trades "my slice of the sequence, all heads" for "the whole sequence, my
slice of the heads" lets each rank run ordinary (fused, causal) SDPA on complete sequences, so the result is
exact, the attention kernel is unchanged, and the code is two collectives. Ring attention keeps the heads
whole but needs an online-softmax merge of partial results and its own backward. The cost of Ulysses:
attention heads and K/V groups must divide by cp (per tensor-parallel rank).

Sequence layout: like megatron (``get_batch_on_this_cp_rank``, ``get_pos_emb_on_this_cp_rank``) each rank
``i`` holds chunks ``i`` and ``2*cp-1-i`` of ``2*cp`` equal chunks (which balances causal work for ring
attention; here it only has to be undone). After the gather the chunks are reordered into the natural
sequence order so that plain causal masking applies, and restored before the inverse all-to-all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def all_to_all_blocks(x: torch.Tensor, group: Any,
                      arrange: Callable[[torch.Tensor], torch.Tensor] = lambda received: received) -> torch.Tensor:
    """Equal-split all-to-all along dim 0 (block ``r`` goes to rank ``r``; block ``r`` of the result came from it),
    returned through ``arrange`` (the caller's permute/reshape of the received blocks).

    Not differentiable by itself; the Ulysses exchanges here and in plugins wrap it in autograd Functions.

    Why gloo gets buffers of its own, released here: its worker thread drops its reference to a finished collective
    (and to the tensors it was given) a moment after ``wait()`` returns, racing the caller. A tensor the caller let
    go of right after the exchange (its input, the received blocks that ``arrange`` copied out) was then freed by
    whichever side let go last, so a step's peak memory moved by ~20% from run to run. Handing gloo a copy of the
    input and releasing the storage of what this function made once the collective is done frees everything at the
    same point every run (FSDP2 frees its unsharded parameters the same way). An accelerator's stream-ordered
    allocator has no such race, so there the input goes as it is."""
    on_cpu = x.device.type == "cpu"
    blocks = x.clone(memory_format=torch.contiguous_format) if on_cpu else x.contiguous()
    received = torch.empty_like(blocks)
    dist.all_to_all_single(received, blocks, group=group)
    result = arrange(received)
    if on_cpu:
        blocks.untyped_storage().resize_(0)
        if result.untyped_storage().data_ptr() != received.untyped_storage().data_ptr():
            received.untyped_storage().resize_(0)
    return result


def _seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``[s, b, h, d]`` (local sequence, all heads) -> ``[cp*s, b, h/cp, d]`` (rank-ordered sequence, my heads)."""
    cp = dist.get_world_size(group)
    s, b, h, d = x.shape
    blocks = x.reshape(s, b, cp, h // cp, d).permute(2, 0, 1, 3, 4)
    return all_to_all_blocks(blocks, group).reshape(cp * s, b, h // cp, d)


def _heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The inverse of :func:`_seq_to_heads`: ``[cp*s, b, h/cp, d]`` -> ``[s, b, h, d]``."""
    cp = dist.get_world_size(group)
    total, b, h, d = x.shape
    s = total // cp
    return all_to_all_blocks(x.reshape(cp, s, b, h, d), group,
                             lambda received: received.permute(1, 2, 0, 3, 4).reshape(s, b, cp * h, d))


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _heads_to_seq(grad, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _seq_to_heads(grad, ctx.group), None


def seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Differentiable ``[s, b, h, d]`` -> ``[cp*s, b, h/cp, d]``, the sequence in rank order (hybrid ring
    attention gathers this way inside its sub-groups: :mod:`loongforge.devices.ring_attention`)."""
    return _SeqToHeads.apply(x, group)


def heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Differentiable inverse of :func:`seq_to_heads`."""
    return _HeadsToSeq.apply(x, group)


def natural_order(total: int, cp: int, device: torch.device | None = None) -> torch.Tensor:
    """Indices that put a rank-ordered gathered sequence (rank ``r``: chunks ``r``, ``2cp-1-r``) in natural order."""
    chunk = total // (2 * cp)
    slot = [2 * k if k < cp else 2 * (2 * cp - 1 - k) + 1 for k in range(2 * cp)]
    within = torch.arange(chunk, device=device)
    return torch.cat([slot[k] * chunk + within for k in range(2 * cp)])


def gather_sequence(tensors: tuple[torch.Tensor, ...], group: Any,
                    order: torch.Tensor | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Whole sequences in natural order for this rank's heads, and the index that undoes the reordering.

    ``order`` puts the rank-ordered gathered rows in natural order (default: one sequence in ``2*cp`` zig-zag
    chunks; packed rows pass their own, :meth:`~loongforge.parallel.sequence_pieces.SequencePieces.natural_order`).
    """
    cp = dist.get_world_size(group)
    gathered = [seq_to_heads(t, group) for t in tensors]
    if order is None:
        order = natural_order(gathered[0].shape[0], cp, gathered[0].device)
    order = order.to(gathered[0].device)
    return [t.index_select(0, order) for t in gathered], torch.argsort(order)


def scatter_sequence(x: torch.Tensor, restore: torch.Tensor, group: Any) -> torch.Tensor:
    """``[S, b, h/cp, d]`` in natural order -> this rank's ``[S/cp, b, h, d]`` chunks (inverse of the gather)."""
    return heads_to_seq(x.index_select(0, restore), group)
