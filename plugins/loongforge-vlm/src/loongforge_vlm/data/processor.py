"""Images and videos -> the pixels a vision tower reads, with Pillow and numpy only.

Why our own: the references (transformers' image processors) are a test-only dependency, and the Qwen video
processor needs torchvision. Two processors share one interface (:class:`ImageProcessor`), so the dataset
does not care which tower it feeds: :class:`VisionProcessor` for Qwen2-VL / Qwen2.5-VL ViTs (dynamic
resolution, flat patch rows) and :class:`FixedSizeProcessor` for towers with a fixed input size such as
SigLIP (``(images, C, H, W)``). :func:`processor_for` picks the one that matches an encoder flavor.

The Qwen steps:

1. *smart resize*: both sides become multiples of ``patch_size * merge_size`` (so the merger's 2x2 blocks
   tile the image), the pixel count is kept within ``[min_pixels, max_pixels]``, the aspect ratio nearly kept;
   resampling is Pillow's bicubic on the 8-bit image;
2. rescale to [0, 1] and normalise per channel (CLIP mean/std for Qwen, 0.5/0.5 for SigLIP towers);
3. patchify: frames are grouped ``temporal_patch_size`` at a time (an image is one frame; a video whose frame
   count is not a multiple repeats its last frame), and rows are ordered frame-group major, then merge-block
   major (``h/merge``, ``w/merge``), then inside the ``merge x merge`` block, so every ``merge ** 2``
   consecutive rows form one LLM token. A row is ``(channel, temporal, patch_row, patch_col)`` flattened.

The result of one image or video is ``(patches [t*h*w, C*tp*p*p] float32, (t, h, w))`` where ``t, h, w`` count
patches; the LLM sees ``t*h*w / merge**2`` tokens for it. A fixed-size tower's image is resized to its square
input (bicubic), rescaled and normalised the same way, ``[1, C, S, S]`` with grid ``(1, S/p, S/p)``; its tokens
are ``(S/p / merge)**2`` where ``merge`` is the projector's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from PIL import Image

#: Per-channel (mean, std) of the towers' pre-training: Qwen2-VL / Qwen2.5-VL use CLIP's, SigLIP and Qwen3-VL 0.5.
NORMALIZATIONS: dict[str, tuple[tuple[float, float, float], tuple[float, float, float]]] = {
    "clip": ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
    "siglip": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
    "internvl": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),  # ImageNet statistics
}
MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The ``(height, width)`` Qwen resizes to: multiples of ``factor``, area within the bounds, aspect kept.

    Each side is first rounded to the nearest multiple; if the area is then too large (small) both sides are
    scaled by the same factor and floored (ceiled) to multiples, so the bound holds after rounding; a side
    never drops below ``factor``, so a very elongated image can exceed ``max_pixels`` (as in Qwen's processors).
    """
    if min(height, width) < 1:
        raise ValueError(f"image has no pixels ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"aspect ratio of a {width}x{height} image exceeds {MAX_ASPECT_RATIO}")
    new_h, new_w = round(height / factor) * factor, round(width / factor) * factor
    if new_h * new_w > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        new_h = max(factor, math.floor(height / shrink / factor) * factor)
        new_w = max(factor, math.floor(width / shrink / factor) * factor)
    elif new_h * new_w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        new_h = math.ceil(height * grow / factor) * factor
        new_w = math.ceil(width * grow / factor) * factor
    return new_h, new_w


class ImageProcessor(Protocol):
    """What the dataset needs from a processor. ``pixel_shape`` is the trailing shape of its pixel arrays (the
    leading axis concatenates images); ``grid`` and ``num_tokens`` size a sample without touching pixels;
    ``for_sample`` gives the processor for the images of a sample holding that many (AnyRes tiles lone images only)."""

    pixel_shape: tuple[int, ...]
    supports_video: bool

    def for_sample(self, images: int) -> ImageProcessor: ...

    def grid(self, width: int, height: int, frames: int = 1) -> tuple[int, int, int]: ...

    def num_tokens(self, grid_thw: Sequence[int]) -> int: ...

    def encoder_grid(self, grid_thw: Sequence[int]) -> tuple[int, int, int]: ...

    def image(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]: ...

    def video(self, frames: Sequence[Image.Image]) -> tuple[np.ndarray, tuple[int, int, int]]: ...


class PatchGridRows:
    """For a processor whose grid rows already count the tower's patches and that treats an image the same whatever
    else its sample holds: every one but AnyRes's, whose rows hold the image's size in pixels."""

    def for_sample(self, images: int) -> PatchGridRows:
        """Itself: the sample's other images change nothing."""
        return self

    def encoder_grid(self, grid_thw: Sequence[int]) -> tuple[int, int, int]:
        """``(blocks, h, w)``: the tower attends within each of ``blocks`` blocks (frame groups, tiles) of ``h x w``
        patches -- what one image or video with this grid row costs it."""
        blocks, h, w = (int(n) for n in grid_thw)
        return blocks, h, w


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB pixels of any Pillow image; transparency is composited onto white (as the Qwen processors do)."""
    if "A" in image.getbands() or "transparency" in image.info:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def normalized_pixels(image: Image.Image, width: int, height: int, normalization: str) -> np.ndarray:
    """The image as RGB, resized (bicubic, on 8-bit pixels) to ``width x height``, in [0, 1], normalised per
    channel: ``[H, W, C]`` float32."""
    rgb = to_rgb(image)
    if rgb.size != (width, height):
        rgb = rgb.resize((width, height), resample=Image.Resampling.BICUBIC)
    mean, std = NORMALIZATIONS[normalization]
    scaled = (np.asarray(rgb, dtype=np.float64) / 255.0).astype(np.float32)
    return (scaled - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)


@dataclass(frozen=True)
class VisionProcessor(PatchGridRows):
    """Settings of one vision tower's input; defaults are Qwen2-VL's image processor.

    ``normalization`` names an entry of :data:`NORMALIZATIONS`. ``frame_sampling`` is the rule videos are sampled
    with and ``timestamped_videos`` whether the text carries each temporal patch's time (Qwen3-VL: ``qwen3``,
    true; see :mod:`loongforge_vlm.data.video`). Build one that matches an encoder flavor with :meth:`for_encoder`.
    """

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    normalization: str = "clip"
    frame_sampling: str = "qwen2"
    timestamped_videos: bool = False

    def __post_init__(self) -> None:
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"unknown normalization {self.normalization!r}; known: {', '.join(NORMALIZATIONS)}")
        if min(self.patch_size, self.temporal_patch_size, self.merge_size) < 1:
            raise ValueError("patch_size, temporal_patch_size and merge_size must be positive")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"need 0 < min_pixels <= max_pixels, got {self.min_pixels}, {self.max_pixels}")

    @classmethod
    def for_encoder(cls, flavor, **overrides) -> VisionProcessor:
        """The processor for a Qwen ViT flavor (``patch_size``, ``temporal_patch_size``, ``spatial_merge_size``)."""
        settings = {"patch_size": flavor.patch_size, "temporal_patch_size": flavor.temporal_patch_size,
                    "merge_size": flavor.spatial_merge_size, "timestamped_videos": flavor.timestamped_videos,
                    "frame_sampling": "qwen3" if flavor.timestamped_videos else "qwen2",
                    "normalization": flavor.pixel_normalization}
        return cls(**{**settings, **overrides})

    @property
    def factor(self) -> int:
        """Pixel side of one LLM token."""
        return self.patch_size * self.merge_size

    supports_video = True

    @property
    def patch_dim(self) -> int:
        """Width of one patch row (3 channels)."""
        return 3 * self.temporal_patch_size * self.patch_size ** 2

    @property
    def pixel_shape(self) -> tuple[int, ...]:
        return (self.patch_dim,)

    def grid(self, width: int, height: int, frames: int = 1) -> tuple[int, int, int]:
        """``(t, h, w)`` in patches for ``frames`` frames of ``width x height`` pixels (no pixels needed)."""
        new_h, new_w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return -(-frames // self.temporal_patch_size), new_h // self.patch_size, new_w // self.patch_size

    def num_tokens(self, grid_thw: Sequence[int]) -> int:
        """LLM tokens of one image or video with patch grid ``(t, h, w)``."""
        t, h, w = grid_thw
        return t * h * w // self.merge_size ** 2

    def image(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Patch rows and grid of one image."""
        return self.video([image])

    def video(self, frames: Sequence[Image.Image]) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Patch rows and grid of a video given as frames (all resized to the first frame's target size)."""
        if not frames:
            raise ValueError("a video needs at least one frame")
        width, height = frames[0].size
        new_h, new_w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        pixels = np.stack([normalized_pixels(frame, new_w, new_h, self.normalization) for frame in frames])
        return self._patchify(pixels)  # from [T, H, W, C]

    def _patchify(self, pixels: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """``[T, H, W, C]`` -> rows in the ViT's order (see the module docstring) and the grid."""
        tp, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
        pad = -len(pixels) % tp
        if pad:
            pixels = np.concatenate([pixels, np.repeat(pixels[-1:], pad, axis=0)])
        frames, height, width, channels = pixels.shape
        t, h, w = frames // tp, height // p, width // p
        blocks = pixels.reshape(t, tp, h // m, m, p, w // m, m, p, channels)
        # -> t, h/m, w/m, m (row in block), m (col in block), channel, temporal, patch row, patch col
        rows = blocks.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
        return np.ascontiguousarray(rows.reshape(t * h * w, channels * tp * p * p)), (t, h, w)


@dataclass(frozen=True)
class FixedSizeProcessor(PatchGridRows):
    """Images for a tower with one square input size (SigLIP): ``[1, 3, S, S]`` per image, no videos.

    ``merge_size`` is the projector's merge (``merge x merge`` patches per LLM token); the grid must divide.
    """

    image_size: int
    patch_size: int
    merge_size: int = 1
    normalization: str = "siglip"

    supports_video = False

    def __post_init__(self) -> None:
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"unknown normalization {self.normalization!r}; known: {', '.join(NORMALIZATIONS)}")
        side = self.image_size // self.patch_size
        if min(self.patch_size, self.merge_size) < 1 or side < 1 or side % self.merge_size:
            raise ValueError(f"{self.image_size}px images in {self.patch_size}px patches give a {side}x{side} grid, "
                             f"which merge_size {self.merge_size} does not divide")

    @property
    def pixel_shape(self) -> tuple[int, ...]:
        return (3, self.image_size, self.image_size)

    def grid(self, width: int, height: int, frames: int = 1) -> tuple[int, int, int]:
        if frames != 1:
            raise ValueError(f"a {self.image_size}px fixed-size tower takes images, not {frames}-frame videos")
        side = self.image_size // self.patch_size
        return 1, side, side

    def num_tokens(self, grid_thw: Sequence[int]) -> int:
        t, h, w = grid_thw
        return t * h * w // self.merge_size ** 2

    def image(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        pixels = normalized_pixels(image, self.image_size, self.image_size, self.normalization)
        return np.ascontiguousarray(pixels.transpose(2, 0, 1)[None]), self.grid(*image.size)

    def video(self, frames: Sequence[Image.Image]) -> tuple[np.ndarray, tuple[int, int, int]]:
        raise ValueError(f"a {self.image_size}px fixed-size tower takes images, not videos")


def processor_for(encoder: Any, *, merge_size: int | None = None, **overrides: Any) -> ImageProcessor:
    """The processor that feeds an encoder flavor: a Qwen ViT flavor (it has ``spatial_merge_size``) or a
    fixed-size one (``image_size``; pass the projector's ``merge_size``), tiled when it has ``max_tiles``
    (InternViT) or AnyRes on (a SigLIP tower). ``overrides`` go to the processor."""
    if hasattr(encoder, "spatial_merge_size"):
        return VisionProcessor.for_encoder(encoder, **overrides)
    if hasattr(encoder, "max_tiles"):  # InternViT: dynamic tiling (loongforge_vlm.data.tiling)
        from loongforge_vlm.data.tiling import TilingProcessor

        return TilingProcessor.for_encoder(encoder, merge_size=merge_size or 1, **overrides)
    if getattr(encoder, "anyres", False):  # SigLIP with LLaVA-OneVision's tiling (loongforge_vlm.data.anyres)
        from loongforge_vlm.data.anyres import AnyResProcessor

        return AnyResProcessor.for_encoder(encoder, merge_size=merge_size or 1, **overrides)
    if hasattr(encoder, "image_size"):
        return FixedSizeProcessor(image_size=encoder.image_size, patch_size=encoder.patch_size,
                                  merge_size=merge_size or 1, **overrides)
    raise ValueError(f"no image processor for encoder flavor {type(encoder).__name__}")
