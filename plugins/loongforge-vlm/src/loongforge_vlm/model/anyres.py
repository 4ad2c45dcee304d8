"""AnyRes feature packing: each image's projected tile features -> the LLM tokens LLaVA-OneVision gives it.

The tower and projector see tiles; the LLM sees images. An AnyRes image arrives as its base tile and a ``rows x
cols`` grid of tiles (:mod:`loongforge_vlm.data.anyres`); its tokens are the base tile's features, then the grid's
features stitched into one map, with the padding cut off, shrunk to the token budget when too large, and read row
by row with the learned newline token after each row. An image of a multi-image sample arrives as one tile, untiled,
and gets its features and one newline. Every size comes from
:class:`~loongforge_vlm.encoders.anyres.AnyResLayout`, which also counts the placeholders the data writes, so the two
sides cannot disagree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loongforge_vlm.encoders.anyres import AnyResLayout


def pack_image(tiles: torch.Tensor, height: int, width: int, layout: AnyResLayout,
               newline: torch.Tensor) -> torch.Tensor:
    """``(1 + rows*cols, side*side, D)`` features of one ``height x width`` image (``(1, side*side, D)`` untiled) ->
    its ``(tokens, D)``."""
    if not layout.is_tiled(tiles.shape[0]):
        return torch.cat([tiles[0], newline.to(tiles.dtype)[None]])
    rows, cols = layout.tile_grid(height, width)
    side, dim = layout.side, tiles.shape[-1]
    if tiles.shape[0] != 1 + rows * cols or tiles.shape[1] != side * side:
        raise ValueError(f"anyres: a {width}x{height} image needs {1 + rows * cols} tiles of {side * side} features, "
                         f"got {tiles.shape[0]} of {tiles.shape[1]}")
    grid = tiles[1:].reshape(rows, cols, side, side, dim).permute(4, 0, 2, 1, 3).reshape(dim, rows * side, cols * side)
    top, kept_rows, left, kept_cols = layout.unpadded_window(height, width)
    grid = grid[:, top:top + kept_rows, left:left + kept_cols]
    size = layout.shrunk_size(kept_rows, kept_cols)
    if size != (kept_rows, kept_cols):
        grid = F.interpolate(grid[None], size=size, mode="bilinear")[0]
    ends = newline.to(grid.dtype)[:, None, None].expand(dim, size[0], 1)
    return torch.cat([tiles[0], torch.cat([grid, ends], dim=-1).flatten(1).T])


def pack_images(tile_features: list[torch.Tensor], grid_thw: torch.Tensor | None, layout: AnyResLayout,
                newline: torch.Tensor) -> list[torch.Tensor]:
    """One ``(side*side, D)`` tensor per tile, in order -> one packed tensor per image; ``grid_thw`` rows are the
    processor's ``(tiles, height, width)``."""
    if grid_thw is None:
        raise ValueError("anyres: the model needs image_grid_thw (tiles, height, width per image) with the pixels")
    packed, start = [], 0
    for tiles, height, width in grid_thw.tolist():
        packed.append(pack_image(torch.stack(tile_features[start:start + tiles]), height, width, layout, newline))
        start += tiles
    if start != len(tile_features):
        raise ValueError(f"anyres: image_grid_thw counts {start} tiles, pixel_values hold {len(tile_features)}")
    return packed
