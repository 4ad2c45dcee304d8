"""InternVL's dynamic tiling: an image -> square tiles of the tower's size, plus a thumbnail, with Pillow and numpy.

A high-resolution image does not fit a 448px tower, and squashing it into one square loses detail and distorts its
aspect. InternVL instead picks a grid of ``cols x rows`` tiles (``min_tiles <= cols * rows <= max_tiles``) whose
aspect ratio ``cols / rows`` is closest to the image's, resizes the image to exactly that many tiles and cuts it
row-major; when that gives more than one tile, the whole image resized to one tile (the thumbnail) follows, so the
model also sees the global layout. Ties in aspect go to the larger grid, but only while the image's area exceeds
half the grid's pixels (no upscaling a small image into many tiles). The arrangements are visited in order of tile
count (then columns, then rows), which is what decides among equal ties. Resampling is Pillow's bicubic on the
8-bit image, then rescale and per-channel normalisation (:func:`~loongforge_vlm.data.processor.normalized_pixels`).

Each tile becomes ``(S/p / merge)**2`` LLM tokens; an image's grid is ``(tiles, S/p, S/p)``, so the dataset's
``num_tokens(grid)`` covers all of its tiles, and its pixels are ``[tiles, 3, S, S]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from loongforge_vlm.data.processor import NORMALIZATIONS, PatchGridRows, normalized_pixels


def tile_grid(width: int, height: int, tile: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """``(cols, rows)`` of the tiling of a ``width x height`` image (see the module docstring)."""
    if min(width, height) < 1:
        raise ValueError(f"image has no pixels ({width}x{height})")
    arrangements = sorted(((cols, rows) for cols in range(1, max_tiles + 1) for rows in range(1, max_tiles + 1)
                           if min_tiles <= cols * rows <= max_tiles), key=lambda grid: grid[0] * grid[1])
    aspect, area = width / height, width * height
    best, best_gap = (1, 1), float("inf")
    for cols, rows in arrangements:
        gap = abs(aspect - cols / rows)
        if gap < best_gap or (gap == best_gap and area > 0.5 * tile * tile * cols * rows):
            best, best_gap = (cols, rows), gap
    return best


@dataclass(frozen=True)
class TilingProcessor(PatchGridRows):
    """Images for InternViT: ``[tiles, 3, S, S]`` per image, no videos. ``merge_size`` is the projector's (pixel
    shuffle); ``max_tiles=1`` is one resized square per image."""

    tile_size: int
    patch_size: int
    merge_size: int = 1
    min_tiles: int = 1
    max_tiles: int = 12
    thumbnail: bool = True
    normalization: str = "internvl"

    supports_video = False

    def __post_init__(self) -> None:
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"unknown normalization {self.normalization!r}; known: {', '.join(NORMALIZATIONS)}")
        side = self.tile_size // self.patch_size
        if side < 1 or self.tile_size % self.patch_size or side % self.merge_size:
            raise ValueError(f"{self.tile_size}px tiles in {self.patch_size}px patches do not form a grid that "
                             f"merge_size {self.merge_size} divides")
        if not 1 <= self.min_tiles <= self.max_tiles:
            raise ValueError(f"need 1 <= min_tiles <= max_tiles, got {self.min_tiles}, {self.max_tiles}")

    @classmethod
    def for_encoder(cls, flavor: Any, **overrides: Any) -> TilingProcessor:
        """The processor of an InternViT flavor (its tile size and tiling settings)."""
        settings = {"tile_size": flavor.image_size, "patch_size": flavor.patch_size, "min_tiles": flavor.min_tiles,
                    "max_tiles": flavor.max_tiles, "thumbnail": flavor.thumbnail}
        return cls(**{**settings, **overrides})

    @property
    def pixel_shape(self) -> tuple[int, ...]:
        return (3, self.tile_size, self.tile_size)

    def tiles(self, width: int, height: int) -> tuple[int, int, bool]:
        """``(cols, rows, thumbnail)`` of a ``width x height`` image."""
        if self.max_tiles == 1:
            return 1, 1, False
        cols, rows = tile_grid(width, height, self.tile_size, self.min_tiles, self.max_tiles)
        return cols, rows, self.thumbnail and cols * rows > 1

    def grid(self, width: int, height: int, frames: int = 1) -> tuple[int, int, int]:
        """``(tiles, S/p, S/p)`` of one image (no pixels needed)."""
        if frames != 1:
            raise ValueError(f"a tiled {self.tile_size}px tower takes images, not {frames}-frame videos")
        cols, rows, thumbnail = self.tiles(width, height)
        side = self.tile_size // self.patch_size
        return cols * rows + thumbnail, side, side

    def num_tokens(self, grid_thw: Sequence[int]) -> int:
        t, h, w = grid_thw
        return t * h * w // self.merge_size ** 2

    def image(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """The tiles (row-major, thumbnail last) ``[tiles, 3, S, S]`` float32 and the grid of one image."""
        cols, rows, thumbnail = self.tiles(*image.size)
        size = self.tile_size
        whole = normalized_pixels(image, cols * size, rows * size, self.normalization)
        tiles = whole.reshape(rows, size, cols, size, 3).transpose(0, 2, 4, 1, 3).reshape(rows * cols, 3, size, size)
        if thumbnail:
            small = normalized_pixels(image, size, size, self.normalization).transpose(2, 0, 1)
            tiles = np.concatenate([tiles, small[None]])
        return np.ascontiguousarray(tiles), self.grid(*image.size)

    def video(self, frames: Sequence[Image.Image]) -> tuple[np.ndarray, tuple[int, int, int]]:
        raise ValueError(f"a tiled {self.tile_size}px tower takes images, not videos")
