"""The Qwen2-VL / Qwen2.5-VL vision towers match transformers' (fp32 outputs and gradients), images of two sizes."""

from __future__ import annotations

import pytest
import torch
from loongforge.errors import LoongForgeError
from loongforge_vlm.encoders.qwen_vit import QwenViT
from loongforge_vlm.encoders.qwen_vit_adapter import from_hf, to_hf
from qwen_vit_reference import QWEN2, QWEN25, TWO_IMAGES, batch, max_abs, reference_model, rel_l2
from transformers.vision_utils import get_vision_window_index

#: A 2-frame video beside an image: windows are frame-major, and attention never crosses frames.
VIDEO_AND_IMAGE = ((2, 4, 6), (1, 6, 8))


def _run_both(flavor, grids):
    """Outputs and gradients (inputs, parameters in transformers' names) of both models on one batch."""
    reference = reference_model(flavor)
    ours = QwenViT(flavor)
    ours.load_state_dict(from_hf(reference.state_dict(), flavor))
    pixels, grid_thw = batch(flavor, grids)
    theirs_in, ours_in = pixels.clone().requires_grad_(), pixels.clone().requires_grad_()
    theirs_out = reference(theirs_in, grid_thw).pooler_output
    ours_out = ours(ours_in, grid_thw)
    weights = torch.randn(theirs_out.shape, generator=torch.Generator().manual_seed(2))
    (theirs_out * weights).sum().backward()
    (ours_out * weights).sum().backward()
    ours_grads = to_hf({name: p.grad for name, p in ours.named_parameters()}, flavor)
    theirs_grads = {name: p.grad for name, p in reference.named_parameters()}
    return (theirs_out, ours_out), (theirs_in.grad, ours_in.grad), (theirs_grads, ours_grads)


@pytest.mark.parametrize(("flavor", "grids"), [(QWEN2, TWO_IMAGES), (QWEN25, TWO_IMAGES), (QWEN25, VIDEO_AND_IMAGE)],
                         ids=["qwen2-vl", "qwen2.5-vl", "qwen2.5-vl-video"])
def test_outputs_and_gradients_match_transformers(flavor, grids):
    (theirs, ours), (theirs_dx, ours_dx), (theirs_grads, ours_grads) = _run_both(flavor, grids)
    merged = sum(t * h * w for t, h, w in grids) // flavor.merge_unit
    assert ours.shape == (merged, flavor.out_dim)
    assert theirs.abs().mean() > 0.1  # O(1) outputs, so the tolerances below are meaningful
    assert max_abs(ours, theirs) < 1e-4 and rel_l2(ours, theirs) < 1e-5
    assert max_abs(ours_dx, theirs_dx) < 1e-4 and rel_l2(ours_dx, theirs_dx) < 1e-5
    assert sorted(ours_grads) == sorted(theirs_grads)
    for name, grad in theirs_grads.items():
        assert grad.abs().max() > 0, name
        assert max_abs(ours_grads[name], grad) < 1e-4, name
        assert rel_l2(ours_grads[name], grad) < 1e-5, name


@pytest.mark.parametrize("grids", [TWO_IMAGES, VIDEO_AND_IMAGE])
def test_window_layout_is_transformers_window_index(grids):
    flavor = QWEN25
    _, grid_thw = batch(flavor, grids)
    layout = QwenViT(flavor).layout(grid_thw, int(grid_thw.prod(-1).sum()))
    window_index, cu_window_seqlens = get_vision_window_index(
        grid_thw, spatial_merge_size=flavor.spatial_merge_size, window_size=flavor.window_size,
        patch_size=flavor.patch_size)
    assert torch.equal(layout.merged_restore, torch.argsort(window_index))
    assert torch.equal(layout.windows.cu_seqlens, cu_window_seqlens.long())
    # The 6x8-patch image alone spans four windows (two of them partial): windows really split images.
    assert layout.windows.cu_seqlens.numel() - 1 > len(grids) + 2
    assert torch.equal(layout.frames.cu_seqlens, torch.tensor([0, 24, 48, 96] if grids == VIDEO_AND_IMAGE
                                                              else [0, 48, 64]))


def test_window_attention_changes_the_output():
    """The windowed blocks are not silently full attention (else parity above would prove less)."""
    reference = reference_model(QWEN25)
    windowed, full = QwenViT(QWEN25), QwenViT(QWEN25.with_overrides(full_attention_blocks=range(4)))
    state = from_hf(reference.state_dict(), QWEN25)
    windowed.load_state_dict(state)
    full.load_state_dict(state)
    pixels, grid_thw = batch(QWEN25)
    with torch.no_grad():
        assert rel_l2(windowed(pixels, grid_thw), full(pixels, grid_thw)) > 1e-2


def test_images_do_not_attend_to_each_other():
    model = QwenViT(QWEN2)
    pixels, grid_thw = batch(QWEN2)
    first = int(grid_thw[0].prod())
    with torch.no_grad():
        together = model(pixels, grid_thw)
        alone = model(pixels[:first], grid_thw[:1])
    assert max_abs(together[: first // QWEN2.merge_unit], alone) < 1e-6


def test_bad_inputs_are_refused_with_the_reason():
    model = QwenViT(QWEN2)
    pixels, grid_thw = batch(QWEN2)
    with pytest.raises(LoongForgeError, match=r"grid_thw describes 64 patches but pixel_values has 63 rows"):
        model(pixels[:63], grid_thw)
    with pytest.raises(LoongForgeError, match=r"grid_thw\[1\] = \(1, 4, 3\).*multiples of spatial_merge_size 2"):
        model(pixels[:60], torch.tensor([[1, 6, 8], [1, 4, 3]]))
    with pytest.raises(LoongForgeError, match=r"pixel_values must have shape \(patches, 96\)"):
        model(pixels[:, :95], grid_thw)
