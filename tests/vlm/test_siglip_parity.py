"""Our SigLIP vision encoder against transformers' ``SiglipVisionModel``, both built tiny from one config.

Random weights with a wide spread (LayerNorm scales far from 1, large biases and position rows) so a
wrong norm, activation, scale or interpolation cannot hide. Outputs, input-pixel gradients and every
parameter gradient must agree in fp32 to max abs <= 1e-4 and rel-L2 <= 1e-5, at the trained resolution, at
one that is not a patch multiple (18px: the conv drops the remainder, like so400m's 384px with 14px patches),
and at another grid with ``interpolate_pos_encoding=True``.
"""

from __future__ import annotations

import pytest
import torch
from loongforge_vlm.encoders.siglip import SIGLIP_FLAVORS, SiglipVisionEncoder, from_hf_state_dict, to_hf_state_dict
from transformers import SiglipVisionConfig, SiglipVisionModel

#: Head dim 16, 4x4 trained grid at 18px (two pixel rows/columns not seen), two blocks.
FLAVOR = SIGLIP_FLAVORS["siglip-tiny"].with_overrides(dim=32, ffn_dim=48, num_heads=2, patch_size=4, image_size=18)


def rel_l2(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).norm() / ref.norm()).item()


def max_abs(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return (ours - ref).abs().max().item()


def _spread_(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter: matrices ~ N(0, 1.5/sqrt(fan_in)) (position rows N(0, 1)), vectors ~ N(0, 0.5),
    norm scales ~ 1 + N(0, 0.5)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if param.dim() > 1:
                fan_in = param[0].numel()
                param.copy_(noise * (1.0 if "position" in name else 1.5 / fan_in ** 0.5))
            elif "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.5 * noise)
            else:
                param.copy_(0.5 * noise)


@pytest.fixture(scope="module")
def pair() -> tuple[SiglipVisionModel, SiglipVisionEncoder]:
    ref = SiglipVisionModel(SiglipVisionConfig(**FLAVOR.to_hf_config(), attn_implementation="eager"))
    _spread_(ref, seed=0)
    ours = SiglipVisionEncoder(FLAVOR)
    ours.load_state_dict(from_hf_state_dict(ref.state_dict(), FLAVOR), strict=True)
    return ref.eval(), ours.eval()


def _run(model, pixels: torch.Tensor, probe: torch.Tensor, call) -> tuple[torch.Tensor, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    pixels = pixels.clone().requires_grad_(True)
    out = call(model, pixels)
    (out * probe).sum().backward()
    return out.detach(), pixels.grad


@pytest.mark.parametrize(("height", "width", "interpolate"), [(18, 18, False), (16, 16, False), (28, 20, True)])
def test_outputs_and_gradients_match_transformers(pair, height, width, interpolate):
    ref, ours = pair
    gen = torch.Generator().manual_seed(height * 100 + width)
    pixels = torch.randn(2, 3, height, width, generator=gen)
    probe = torch.randn(2, (height // 4) * (width // 4), FLAVOR.dim, generator=gen)
    probe /= probe.numel() ** 0.5  # the loss <out, probe> then has unit variance, like a training loss

    ref_out, ref_dx = _run(ref, pixels, probe,
                           lambda m, x: m(x, interpolate_pos_encoding=interpolate).last_hidden_state)
    our_out, our_dx = _run(ours, pixels, probe, lambda m, x: m(x, interpolate_pos_encoding=interpolate))

    assert our_out.shape == ref_out.shape == (2, (height // 4) * (width // 4), FLAVOR.dim)
    assert ref_out.std() > 0.5  # the spread reached the output: differences are not hidden by tiny values
    assert max_abs(our_out, ref_out) <= 1e-4 and rel_l2(our_out, ref_out) <= 1e-5
    assert max_abs(our_dx, ref_dx) <= 1e-4 and rel_l2(our_dx, ref_dx) <= 1e-5

    our_grads = to_hf_state_dict({n: p.grad for n, p in ours.named_parameters()}, FLAVOR)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    assert set(our_grads) == set(ref_grads)
    for name, ref_grad in ref_grads.items():
        if name.endswith("k_proj.bias"):
            # Softmax ignores a shift shared by all keys, so this gradient is exactly zero: both sides hold only
            # rounding noise, where a relative error means nothing.
            assert max(our_grads[name].abs().max(), ref_grad.abs().max()) <= 1e-5, name
            continue
        assert max_abs(our_grads[name], ref_grad) <= 1e-4, name
        assert rel_l2(our_grads[name], ref_grad) <= 1e-5, name


def test_other_grid_without_interpolation_is_an_error_that_says_what_to_pass(pair):
    _, ours = pair
    with pytest.raises(ValueError, match="interpolate_pos_encoding=True"):
        ours(torch.zeros(1, 3, 28, 20))


def test_image_smaller_than_a_patch_and_wrong_channels_are_errors(pair):
    _, ours = pair
    with pytest.raises(ValueError, match="smaller than one 4x4 patch"):
        ours(torch.zeros(1, 3, 3, 16))
    with pytest.raises(ValueError, match=r"\(batch, 3, height, width\)"):
        ours(torch.zeros(1, 1, 16, 16))
