"""LLaVA-OneVision's AnyRes tiling for a SigLIP tower: an image -> its base tile and a grid of tiles, with Pillow and
numpy.

The geometry (which resolution, how many tiles, how many LLM tokens) is :mod:`loongforge_vlm.encoders.anyres`'s; this
module makes the pixels. The image is resized (Pillow's bicubic on the 8-bit image) into the chosen resolution
keeping its aspect, centred on black padding and cut into ``image_size`` tiles row-major; the whole image squashed to
one tile goes first. Rescale and per-channel normalisation are
:func:`~loongforge_vlm.data.processor.normalized_pixels`'s, and the padding gets the value black normalises to.

An image's pixels are ``[1 + rows * cols, 3, S, S]``. Its grid is ``(tiles, height, width)`` with the image's own
size in pixels, not a patch grid: the model needs that size to cut the padding off the tiles' features again (as
transformers passes ``image_sizes``), and the token count follows from it (``num_tokens``).

An image of a multi-image sample is not tiled (:meth:`for_sample`): it is centred on a square of the normalisation's
mean colour (in 8-bit, as transformers pads before resizing) and squashed to one tile, ``[1, 3, S, S]`` with grid
``(1, height, width)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from PIL import Image

from loongforge_vlm.data.processor import NORMALIZATIONS, normalized_pixels, to_rgb
from loongforge_vlm.encoders.anyres import AnyResLayout, best_resolution, fitted_size


@dataclass(frozen=True)
class AnyResProcessor:
    """Images for a SigLIP tower with AnyRes tiling; no videos. Build it with :meth:`for_encoder`; ``tiled`` is
    false for the images of a multi-image sample (:meth:`for_sample`)."""

    layout: AnyResLayout
    normalization: str = "siglip"
    tiled: bool = True

    supports_video = False

    def __post_init__(self) -> None:
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"unknown normalization {self.normalization!r}; known: {', '.join(NORMALIZATIONS)}")

    @classmethod
    def for_encoder(cls, flavor: Any, merge_size: int = 1, **overrides: Any) -> AnyResProcessor:
        """The processor of a SigLIP flavor with AnyRes on, before a projector merging ``merge_size`` patches."""
        if flavor.grid_size % merge_size:
            side = flavor.grid_size
            raise ValueError(f"{flavor.image_size}px tiles in {flavor.patch_size}px patches give a {side}x{side} grid, "
                             f"which merge_size {merge_size} does not divide")
        return cls(flavor.anyres_layout(merge_size), **overrides)

    def for_sample(self, images: int) -> AnyResProcessor:
        """The processor of a sample holding ``images`` images: LLaVA-OneVision tiles an image only when it is
        alone."""
        return replace(self, tiled=images <= 1)

    @property
    def pixel_shape(self) -> tuple[int, ...]:
        return (3, self.layout.tile, self.layout.tile)

    def grid(self, width: int, height: int, frames: int = 1) -> tuple[int, int, int]:
        """``(tiles, height, width)`` of one image (no pixels needed)."""
        if frames != 1:
            raise ValueError(f"an AnyRes {self.layout.tile}px tower takes images, not {frames}-frame videos")
        return self.layout.num_tiles(height, width, self.tiled), height, width

    def num_tokens(self, grid_thw: Sequence[int]) -> int:
        tiles, height, width = grid_thw
        return self.layout.num_tokens(height, width, self.layout.is_tiled(tiles))

    def encoder_grid(self, grid_thw: Sequence[int]) -> tuple[int, int, int]:
        """``(tiles, patches, patches)`` the tower encodes for an image of grid row ``(tiles, height, width)``."""
        tiles, height, width = grid_thw
        return self.layout.encoder_grid(height, width, self.layout.is_tiled(tiles))

    def image(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """The base tile and the grid's tiles (row-major) ``[tiles, 3, S, S]`` float32, and the grid; untiled, the
        padded square as one tile."""
        width, height = image.size
        size = self.layout.tile
        if not self.tiled:
            return self._square(image), self.grid(width, height)
        target_h, target_w = best_resolution(height, width, self.layout.pinpoints)
        fit_h, fit_w = fitted_size(height, width, (target_h, target_w))
        black = normalized_pixels(Image.new("RGB", (1, 1)), 1, 1, self.normalization)[0, 0]
        canvas = np.broadcast_to(black, (target_h, target_w, 3)).copy()
        top, left = (target_h - fit_h) // 2, (target_w - fit_w) // 2
        canvas[top:top + fit_h, left:left + fit_w] = normalized_pixels(image, fit_w, fit_h, self.normalization)
        rows, cols = target_h // size, target_w // size
        tiles = canvas.reshape(rows, size, cols, size, 3).transpose(0, 2, 4, 1, 3).reshape(rows * cols, 3, size, size)
        base = normalized_pixels(image, size, size, self.normalization).transpose(2, 0, 1)
        return np.ascontiguousarray(np.concatenate([base[None], tiles])), self.grid(width, height)

    def _square(self, image: Image.Image) -> np.ndarray:
        """``[1, 3, S, S]``: the image centred on a square of the mean colour, resized to one tile."""
        width, height = image.size
        mean = NORMALIZATIONS[self.normalization][0]
        square = Image.new("RGB", (max(width, height),) * 2, tuple(int(channel * 255) for channel in mean))
        square.paste(to_rgb(image), ((square.width - width) // 2, (square.height - height) // 2))
        size = self.layout.tile
        return np.ascontiguousarray(normalized_pixels(square, size, size, self.normalization).transpose(2, 0, 1)[None])

    def video(self, frames: Sequence[Image.Image]) -> tuple[np.ndarray, tuple[int, int, int]]:
        raise ValueError(f"an AnyRes {self.layout.tile}px tower takes images, not videos")
