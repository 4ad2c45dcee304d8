"""Token layout of a Qwen vision batch: 2D positions, attention segments and Qwen2.5-VL's window order.

A batch is the processor's output: patches of all images flattened into one sequence (``pixel_values``,
``sum(t * h * w)`` rows) plus ``grid_thw``. Inside one frame the processor already orders patches block-major
over ``merge x merge`` blocks, so every ``merge ** 2`` consecutive rows form one LLM token. Everything here is
integer bookkeeping derived from ``grid_thw`` alone, computed once per forward and shared by all blocks.

Qwen2.5-VL's windowed blocks attend inside windows of ``window_size`` pixels, a square of ``k`` merged tokens
(partial at the right/bottom edges). Rather than permuting hidden states inside the model, the whole batch is
put into window order before the patch embedding (which acts per patch, so it commutes with the permutation):
windows then are contiguous segments, full-attention blocks still see each frame as one contiguous segment,
and the merged output is put back into image order with the inverse permutation at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from loongforge.errors import LoongForgeError


@dataclass(frozen=True)
class Segments:
    """Contiguous, independent attention segments, laid out for one batched SDPA call.

    ``index[s, j]`` is the row of the ``j``-th token of segment ``s`` (0 where ``j`` is past its end) and
    ``valid`` marks the real entries: gathering by ``index`` pads segments to one length, ``valid`` masks the
    padded keys, and ``out[valid]`` returns the rows in sequence order because segments are contiguous.
    """

    cu_seqlens: torch.Tensor
    index: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def from_lengths(cls, lengths: torch.Tensor) -> Segments:
        cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
        offsets = torch.arange(int(lengths.max()), device=lengths.device)
        valid = offsets < lengths[:, None]
        index = torch.where(valid, cu_seqlens[:-1, None] + offsets, 0)
        return cls(cu_seqlens, index, valid)


@dataclass(frozen=True)
class VisionLayout:
    """What the encoder needs besides the patches, in the order the encoder processes tokens.

    ``order`` permutes input rows into processing order (``None``: processing order is the input order);
    ``merged_restore`` puts the merged output rows back into input order.
    """

    positions: torch.Tensor
    frames: Segments
    windows: Segments | None
    order: torch.Tensor | None
    merged_restore: torch.Tensor | None


def check_grid(grid_thw: torch.Tensor, num_patches: int, merge: int) -> list[tuple[int, int, int]]:
    """``grid_thw`` as Python triples, refused with the image index if it cannot describe ``num_patches`` rows."""
    if grid_thw.ndim != 2 or grid_thw.shape[1] != 3:
        raise LoongForgeError(f"grid_thw must have shape (num_images, 3), got {tuple(grid_thw.shape)}")
    grids = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
    for image, (t, h, w) in enumerate(grids):
        if min(t, h, w) <= 0 or h % merge or w % merge:
            raise LoongForgeError(f"grid_thw[{image}] = {(t, h, w)}: t, h, w must be positive and h, w multiples "
                                  f"of spatial_merge_size {merge}")
    total = sum(t * h * w for t, h, w in grids)
    if total != num_patches:
        raise LoongForgeError(f"grid_thw describes {total} patches but pixel_values has {num_patches} rows")
    return grids


def _positions(t: int, h: int, w: int, merge: int, device: torch.device) -> torch.Tensor:
    """(row, column) of every patch of one image, block-major over merge blocks, repeated for each frame."""
    rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    blocks = (h // merge, merge, w // merge, merge)
    pos = torch.stack([rows.reshape(blocks).transpose(1, 2).flatten(), cols.reshape(blocks).transpose(1, 2).flatten()],
                      dim=-1)
    return pos.repeat(t, 1)


def _window_order(t: int, rows: int, cols: int, side: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged tokens of one image in window order, and the window lengths (frame-major, then windows row-major).

    A stable sort by window id keeps row-major order inside each window.
    """
    r = torch.arange(rows, device=device)[:, None] // side
    c = torch.arange(cols, device=device)[None, :] // side
    per_row = -(-cols // side)
    per_frame = -(-rows // side) * per_row
    window = (r * per_row + c).flatten()
    window = (torch.arange(t, device=device)[:, None] * per_frame + window).flatten()
    return torch.argsort(window, stable=True), torch.bincount(window, minlength=t * per_frame)


def vision_layout(grid_thw: torch.Tensor, num_patches: int, *, merge: int, window_tokens: int | None) -> VisionLayout:
    """The layout of a batch; ``window_tokens`` is the window side in merged tokens (``None``: no windows)."""
    grids = check_grid(grid_thw, num_patches, merge)
    device = grid_thw.device
    positions = torch.cat([_positions(t, h, w, merge, device) for t, h, w in grids])
    frames = Segments.from_lengths(torch.tensor([h * w for t, h, w in grids for _ in range(t)], device=device))
    if window_tokens is None:
        return VisionLayout(positions, frames, None, None, None)

    merged_orders, window_lengths, offset = [], [], 0
    for t, h, w in grids:
        order, lengths = _window_order(t, h // merge, w // merge, window_tokens, device)
        merged_orders.append(order + offset)
        window_lengths.append(lengths * merge ** 2)
        offset += order.numel()
    merged_order = torch.cat(merged_orders)
    unit = torch.arange(merge ** 2, device=device)
    order = (merged_order[:, None] * merge ** 2 + unit).flatten()
    return VisionLayout(positions[order], frames, Segments.from_lengths(torch.cat(window_lengths)), order,
                        torch.argsort(merged_order))
