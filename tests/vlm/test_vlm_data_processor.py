"""Image processors: the Qwen one against transformers' PIL Qwen2-VL image processor plus the video layout by
hand; the fixed-size (SigLIP) one against transformers' PIL SigLIP processor; picking one for an encoder.

transformers 5 ships two image processors for Qwen2-VL; the reference here is the PIL/numpy one
(``Qwen2VLImageProcessorPil``), which imports without torchvision. Its video processor needs torchvision (not
installed), so videos are checked against the layout written out by hand: element ``[row, col]`` of the patch
rows is pixel ``(frame, y, x, channel)`` of the normalised, resized frames, with the last frame repeated.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from loongforge_vlm.data.processor import (
    NORMALIZATIONS,
    FixedSizeProcessor,
    VisionProcessor,
    processor_for,
    smart_resize,
)
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as reference_resize

BOUNDS = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 16}


def _random_image(height: int, width: int, mode: str, seed: int) -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode)


@pytest.mark.parametrize("normalization", ["clip", "siglip"])
def test_images_match_transformers(normalization):
    # different sizes and aspect ratios: one kept near its size, one with alpha shrunk to max_pixels, one grey image
    # upscaled to min_pixels
    images = [_random_image(61, 90, "RGB", 0), _random_image(300, 47, "RGBA", 1), _random_image(20, 25, "L", 2)]
    mean, std = NORMALIZATIONS[normalization]
    reference = Qwen2VLImageProcessorPil(**BOUNDS, image_mean=list(mean), image_std=list(std))
    expected = reference(images, return_tensors="np")
    ours = VisionProcessor(**BOUNDS, normalization=normalization)
    results = [ours.image(image) for image in images]
    pixel_values = np.concatenate([rows for rows, _ in results])
    assert [list(grid) for _, grid in results] == expected["image_grid_thw"].tolist()
    assert [grid for _, grid in results] == [(1, 4, 6), (1, 20, 2), (1, 4, 6)]
    assert pixel_values.shape == expected["pixel_values"].shape == (24 + 40 + 24, 3 * 2 * 14 * 14)
    assert pixel_values.dtype == np.float32
    assert np.abs(pixel_values - expected["pixel_values"]).max() <= 1e-5


def test_smart_resize_matches_transformers_and_holds_its_bounds():
    rng = np.random.default_rng(0)
    for height, width in itertools.chain([(1, 199), (28, 28), (5000, 30)], rng.integers(1, 3000, (300, 2))):
        height, width = int(height), int(width)
        if max(height, width) / min(height, width) > 200:
            continue
        got = smart_resize(height, width, 28, **BOUNDS)
        assert got == reference_resize(height, width, 28, **BOUNDS), (height, width)
        assert got[0] % 28 == got[1] % 28 == 0
        if max(height, width) / min(height, width) < 4:  # extreme ratios keep a side >= 28 and may exceed the bound
            assert BOUNDS["min_pixels"] <= got[0] * got[1] <= BOUNDS["max_pixels"], (height, width)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2500, 28, **BOUNDS)


def test_grid_and_token_count_without_pixels():
    ours = VisionProcessor(**BOUNDS)
    assert ours.grid(90, 61) == (1, 4, 6) and ours.num_tokens((1, 4, 6)) == 6
    assert ours.grid(90, 61, frames=5) == (3, 4, 6) and ours.num_tokens((3, 4, 6)) == 18
    assert ours.patch_dim == 1176 and ours.factor == 28


def test_video_layout_by_hand():
    """Rows are (frame group, merge block row, block col, row in block, col in block); columns are
    (channel, frame in group, patch row, patch col); 3 frames become 2 groups, the last frame repeated."""
    ours = VisionProcessor(patch_size=2, temporal_patch_size=2, merge_size=2, min_pixels=16, max_pixels=4096)
    frames = [_random_image(12, 8, "RGB", seed) for seed in range(3)]
    rows, grid = ours.video(frames)
    assert grid == (2, 6, 4) and rows.shape == (2 * 6 * 4, 3 * 2 * 2 * 2)
    mean, std = (np.asarray(v, dtype=np.float32) for v in NORMALIZATIONS["clip"])
    pixels = [(np.asarray(f, dtype=np.float32) / 255 - mean) / std for f in frames]  # no resize: 12x8 fits
    p, m, (t, h, w) = 2, 2, grid
    row = 0
    for ti, bh, bw, mh, mw in itertools.product(range(t), range(h // m), range(w // m), range(m), range(m)):
        col = 0
        for c, tpi, py, px in itertools.product(range(3), range(2), range(p), range(p)):
            frame = min(ti * 2 + tpi, len(frames) - 1)
            y, x = (bh * m + mh) * p + py, (bw * m + mw) * p + px
            assert rows[row, col] == pytest.approx(pixels[frame][y, x, c], abs=1e-6)
            col += 1
        row += 1


def test_an_image_is_a_one_frame_video_and_resizing_uses_the_first_frame():
    ours = VisionProcessor(**BOUNDS)
    image = _random_image(61, 90, "RGB", 0)
    image_rows, image_grid = ours.image(image)
    video_rows, video_grid = ours.video([image, image])
    assert image_grid == video_grid == (1, 4, 6)
    assert np.array_equal(image_rows, video_rows)
    # the temporal halves of every row hold the same frame
    halves = image_rows.reshape(len(image_rows), 3, 2, -1)
    assert np.array_equal(halves[:, :, 0], halves[:, :, 1])


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="unknown normalization 'imagenet'"):
        VisionProcessor(normalization="imagenet")
    with pytest.raises(ValueError, match="min_pixels <= max_pixels"):
        VisionProcessor(min_pixels=100, max_pixels=10)
    with pytest.raises(ValueError, match="at least one frame"):
        VisionProcessor().video([])


def test_fixed_size_images_match_transformers_siglip():
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    images = [_random_image(61, 90, "RGB", 0), _random_image(20, 25, "RGBA", 1)]
    expected = SiglipImageProcessorPil(size={"height": 32, "width": 32})(images, return_tensors="np")["pixel_values"]
    ours = FixedSizeProcessor(image_size=32, patch_size=4, merge_size=2)
    results = [ours.image(image) for image in images]
    pixels = np.concatenate([rows for rows, _ in results])
    assert pixels.shape == expected.shape == (2, 3, 32, 32) and ours.pixel_shape == (3, 32, 32)
    assert np.abs(pixels - expected).max() <= 1e-5
    assert [grid for _, grid in results] == [(1, 8, 8)] * 2 and ours.num_tokens((1, 8, 8)) == 16
    assert not ours.supports_video
    with pytest.raises(ValueError, match="not videos"):
        ours.video(images)
    with pytest.raises(ValueError, match="merge_size 3 does not divide"):
        FixedSizeProcessor(image_size=32, patch_size=4, merge_size=3)


def test_processor_for_encoder_flavors():
    from loongforge_vlm.encoders.qwen_vit_flavors import FLAVORS
    from loongforge_vlm.encoders.siglip_flavors import SIGLIP_FLAVORS

    qwen = processor_for(FLAVORS["qwen2-vl-2b-vit"])
    assert qwen == VisionProcessor() and qwen.pixel_shape == (FLAVORS["qwen2-vl-2b-vit"].patch_dim,)
    tiny = processor_for(FLAVORS["qwen2.5-vl-vit-tiny"], max_pixels=64 * 64)
    assert (tiny.patch_size, tiny.merge_size, tiny.max_pixels) == (4, 2, 64 * 64)
    assert processor_for(SIGLIP_FLAVORS["siglip-tiny"], merge_size=2) == FixedSizeProcessor(32, 4, 2)
    with pytest.raises(ValueError, match="no image processor for encoder flavor int"):
        processor_for(3)


@pytest.mark.parametrize(("encoder", "reference"), [
    ("qwen2-vl-vit-tiny", "OPENAI_CLIP"), ("qwen2.5-vl-vit-tiny", "OPENAI_CLIP"),
    ("qwen3-vl-vit-tiny", "IMAGENET_STANDARD")])
def test_each_qwen_tower_normalises_with_its_release_statistics(encoder, reference):
    """Qwen2-VL / Qwen2.5-VL ship CLIP's mean and std, Qwen3-VL 0.5 and 0.5 (the defaults of transformers'
    Qwen3-VL video processor, and the published preprocessor_config.json): the values are transformers' constants."""
    from loongforge_vlm.encoders.qwen_vit_flavors import FLAVORS as QWEN_VIT_FLAVORS
    from transformers.image_utils import (
        IMAGENET_STANDARD_MEAN,
        IMAGENET_STANDARD_STD,
        OPENAI_CLIP_MEAN,
        OPENAI_CLIP_STD,
    )

    expected = {"OPENAI_CLIP": (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD),
                "IMAGENET_STANDARD": (IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD)}[reference]
    processor = VisionProcessor.for_encoder(QWEN_VIT_FLAVORS[encoder])
    mean, std = NORMALIZATIONS[processor.normalization]
    np.testing.assert_allclose(mean, expected[0], rtol=0, atol=1e-7)
    np.testing.assert_allclose(std, expected[1], rtol=0, atol=1e-7)
