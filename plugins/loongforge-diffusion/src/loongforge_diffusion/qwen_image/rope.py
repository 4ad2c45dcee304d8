"""Qwen-Image's multimodal rotary embedding (MSRoPE): one position per axis for image and text tokens alike.

Each attention head is split into frame, row and column channels (``axes_dims``, e.g. 16/56/56); each axis rotates
its channel pairs (interleaved: ``x[2i], x[2i+1]``) by ``position * theta ** (-2i / axis_width)``, frequencies
computed over the axis's own width.

Image tokens: the frame position is the image's index within the sample (a sample may hold several images, e.g. a
reference image for editing); row and column positions are *centred* -- a side of ``n`` tokens gets positions
``-(n - n // 2) .. n // 2 - 1`` -- so resolutions share their central frequencies. Text tokens come after the
images: token ``j`` sits at ``start + j`` on all three axes, with ``start = max(h // 2, w // 2)`` over the images,
just past the largest centred position; padded text tokens keep their positions (the mask hides them).

Angles are float32 products of the position and float32 inverse frequencies, exactly as in the reference, so the
tables agree bitwise. As in the Wan RoPE, the complex tables are computed per shape and cached, never stored as
buffers, so ``model.to(bfloat16)`` cannot drop their imaginary parts.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

Shape = tuple[int, int, int]


def _angles(positions: torch.Tensor, axes_dims: Sequence[int], theta: float) -> list[torch.Tensor]:
    """Per axis, ``(len(positions), width // 2)`` float32 angles."""
    out = []
    for width in axes_dims:
        inv_freq = 1.0 / torch.pow(theta, torch.arange(0, width, 2, dtype=torch.float32) / width)
        out.append(torch.outer(positions.float(), inv_freq))
    return out


def centred(length: int) -> torch.Tensor:
    """Positions of a side of ``length`` tokens, centred on zero (the extra token of an odd side goes negative)."""
    return torch.arange(length) - (length - length // 2)


def _image_table(index: int, shape: Shape, axes_dims: tuple[int, int, int], theta: float) -> torch.Tensor:
    frames, rows, cols = shape
    frame = _angles(torch.arange(index, index + frames), axes_dims[:1], theta)[0]
    row = _angles(centred(rows), axes_dims[1:2], theta)[0]
    col = _angles(centred(cols), axes_dims[2:], theta)[0]
    angles = torch.cat(
        [
            frame[:, None, None, :].expand(frames, rows, cols, -1),
            row[None, :, None, :].expand(frames, rows, cols, -1),
            col[None, None, :, :].expand(frames, rows, cols, -1),
        ],
        dim=-1,
    ).reshape(frames * rows * cols, -1)
    return torch.polar(torch.ones_like(angles), angles)


def text_start(shapes: Sequence[Shape]) -> int:
    """First text position: one past the largest centred row/column position of the sample's images."""
    return max(max(rows // 2, cols // 2) for _, rows, cols in shapes)


@functools.lru_cache(maxsize=32)
def rope_tables(shapes: tuple[Shape, ...], text_len: int, axes_dims: tuple[int, int, int], theta: float,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Complex64 tables ``(image_tokens, head_dim // 2)`` and ``(text_len, head_dim // 2)`` for one sample layout.

    ``shapes`` lists the ``(frames, rows, cols)`` token grid of each image of a sample, in token order.
    """
    image = torch.cat([_image_table(i, shape, axes_dims, theta) for i, shape in enumerate(shapes)])
    start = text_start(shapes)
    text_angles = torch.cat(_angles(torch.arange(start, start + text_len), axes_dims, theta), dim=-1)
    text = torch.polar(torch.ones_like(text_angles), text_angles)
    return image.to(device), text.to(device)
