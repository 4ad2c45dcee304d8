"""AnyRes (LLaVA-NeXT / LLaVA-OneVision): the geometry a tiled SigLIP image has, in pure Python.

Why one module for both sides: the data pipeline must write exactly as many image placeholders as the model packs
features, and both follow from the same few integers -- the image's size, the tower's tile size, the allowed
resolutions ("grid pinpoints") and the token budget. Keeping that arithmetic here, torch- and numpy-free, lets the
processor (:mod:`loongforge_vlm.data.anyres`) count tokens without pixels and the model
(:mod:`loongforge_vlm.model.anyres`) lay features out without re-deriving any of it.

The layout of one ``height x width`` image:

1. *best resolution*: among the pinpoints ``(H, W)`` (multiples of the tile size), the one that keeps the most of
   the image's pixels when it is scaled down (never counting more than it has) to fit, ties going to the one that
   wastes the fewest pixels; the first such pinpoint in the list wins.
2. the image is resized into it keeping its aspect (the fitting side exact, the other side rounded up), centred,
   padded, and cut into ``rows x cols`` tiles; the whole image squashed to one tile comes first (the base).
3. each tile gives ``side x side`` LLM tokens. The tiles' features form one ``rows*side x cols*side`` map, whose
   padding is cut off again (*unpadding*, by the image's aspect, as the reference computes it, which may keep one
   padded row or column), and which is bilinearly shrunk when it holds more than 1.1 times ``max_tiles`` tiles'
   worth of tokens (the ``anyres_max_N`` budget).
4. the LLM sees the base tile's ``side * side`` tokens, then the map row by row, each row followed by one learned
   newline token.

Only an image alone in its sample is tiled. An image of a multi-image sample is padded to a square and squashed to one
tile, which gives ``side * side`` tokens and one newline (LLaVA-OneVision tiles single images only). A tiled image has
at least two tiles (the base and a grid), so a grid row of one tile marks an untiled image
(:meth:`AnyResLayout.is_tiled`) and the model needs no other hint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Feature maps up to this factor over the token budget are kept as they are (the reference's threshold).
SHRINK_THRESHOLD = 1.1

Pinpoints = tuple[tuple[int, int], ...]


def grid_pinpoints(max_grid: int, tile: int) -> Pinpoints:
    """Every ``rows x cols`` arrangement of ``tile``-pixel tiles with both sides up to ``max_grid``, as ``(height,
    width)`` pixels, rows major (LLaVA-OneVision's pinpoints are ``grid_pinpoints(6, 384)``)."""
    return tuple((rows * tile, cols * tile) for rows in range(1, max_grid + 1) for cols in range(1, max_grid + 1))


def best_resolution(height: int, width: int, pinpoints: Pinpoints) -> tuple[int, int]:
    """The pinpoint an image is resized into (step 1 of the module docstring)."""
    if min(height, width) < 1:
        raise ValueError(f"image has no pixels ({width}x{height})")
    best, most_kept, least_wasted = pinpoints[0], 0, math.inf
    for target_h, target_w in pinpoints:
        scale = min(target_w / width, target_h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = target_h * target_w - kept
        if kept > most_kept or (kept == most_kept and wasted < least_wasted):
            best, most_kept, least_wasted = (target_h, target_w), kept, wasted
    return best


def fitted_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """``(height, width)`` of the image resized into ``target`` keeping its aspect: the side that limits the scale
    fills the target, the other is rounded up (and capped)."""
    target_h, target_w = target
    if target_w / width < target_h / height:
        return min(math.ceil(height * target_w / width), target_h), target_w
    return target_h, min(math.ceil(width * target_h / height), target_w)


@dataclass(frozen=True)
class AnyResLayout:
    """The AnyRes geometry of one tower: ``tile`` pixels per tile side, ``patches`` per tile side, ``side`` LLM tokens
    per tile side (the patches divided by the projector's merge), the allowed ``pinpoints`` and the ``max_tiles``
    budget."""

    tile: int
    patches: int
    side: int
    pinpoints: Pinpoints
    max_tiles: int

    def tile_grid(self, height: int, width: int) -> tuple[int, int]:
        """``(rows, cols)`` of high-resolution tiles (the base tile not counted)."""
        target_h, target_w = best_resolution(height, width, self.pinpoints)
        return target_h // self.tile, target_w // self.tile

    @staticmethod
    def is_tiled(tiles: int) -> bool:
        """Whether an image of ``tiles`` tiles was tiled, rather than squashed to one (see the module docstring)."""
        return tiles > 1

    def num_tiles(self, height: int, width: int, tiled: bool = True) -> int:
        """Tiles the tower encodes for the image: the base and the grid, or the one square tile when not ``tiled``."""
        if not tiled:
            return 1
        rows, cols = self.tile_grid(height, width)
        return 1 + rows * cols

    def encoder_grid(self, height: int, width: int, tiled: bool = True) -> tuple[int, int, int]:
        """``(tiles, patches, patches)``: what the tower encodes for the image, each tile attending alone."""
        return self.num_tiles(height, width, tiled), self.patches, self.patches

    def unpadded_window(self, height: int, width: int) -> tuple[int, int, int, int]:
        """``(top, rows, left, cols)`` of the tiles' feature map that unpadding keeps (step 3)."""
        tiles_h, tiles_w = self.tile_grid(height, width)
        map_h, map_w = tiles_h * self.side, tiles_w * self.side
        if width / height > map_w / map_h:  # wider than the map: rows were padded
            kept = int(round(height * map_w / width, 7))
            cut = (map_h - kept) // 2
            return cut, map_h - 2 * cut, 0, map_w
        kept = int(round(width * map_h / height, 7))
        cut = (map_w - kept) // 2
        return 0, map_h, cut, map_w - 2 * cut

    def shrunk_size(self, rows: int, cols: int) -> tuple[int, int]:
        """The size a ``rows x cols`` unpadded map is bilinearly resized to (itself when within the budget)."""
        ratio = math.sqrt(rows * cols / (self.max_tiles * self.side ** 2))
        if ratio <= SHRINK_THRESHOLD:
            return rows, cols
        return int(rows // ratio), int(cols // ratio)

    def packed_grid(self, height: int, width: int) -> tuple[int, int]:
        """``(rows, cols)`` of the high-resolution features the LLM sees (before the newline tokens)."""
        _, rows, _, cols = self.unpadded_window(height, width)
        return self.shrunk_size(rows, cols)

    def num_tokens(self, height: int, width: int, tiled: bool = True) -> int:
        """LLM tokens of the image: the base tile, then each feature row and its newline (step 4); an untiled image's
        one tile is a single row."""
        if not tiled:
            return self.side ** 2 + 1
        rows, cols = self.packed_grid(height, width)
        return self.side ** 2 + rows * (cols + 1)
