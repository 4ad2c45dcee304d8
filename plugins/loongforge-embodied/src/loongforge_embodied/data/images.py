"""Camera frames stored inside the parquet files (LeRobot feature dtype ``image``) instead of in mp4 videos.

LeRobot writes such a column the way Hugging Face ``datasets.Image`` does: a struct of encoded file ``bytes``
(PNG by default) and an optional ``path``. Some converted datasets (LIBERO, for instance) ship cameras this
way; decoding is lossless and needs no seeking, so these columns are read directly with Pillow.
"""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
from PIL import Image

#: Arrow type of an image cell, as ``datasets.Image`` stores it.
IMAGE_TYPE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def encode_png(frame: np.ndarray) -> bytes:
    """(H, W, 3) uint8 RGB -> PNG bytes."""
    buffer = io.BytesIO()
    Image.fromarray(frame, mode="RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def image_column(frames: np.ndarray) -> pa.Array:
    """(T, H, W, 3) uint8 frames -> an arrow column of PNG cells."""
    return pa.array([{"bytes": encode_png(frame), "path": None} for frame in frames], type=IMAGE_TYPE)


def decode_image(cell: dict) -> np.ndarray:
    """An image cell (``{"bytes": ..., "path": ...}``) -> (H, W, 3) uint8 RGB."""
    if cell.get("bytes") is None:
        raise ValueError(f"image cell has no embedded bytes (path {cell.get('path')!r}); embed the images")
    with Image.open(io.BytesIO(cell["bytes"])) as image:
        return np.asarray(image.convert("RGB"))
