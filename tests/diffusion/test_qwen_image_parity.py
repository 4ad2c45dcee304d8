"""Our Qwen-Image MMDiT matches diffusers' ``QwenImageTransformer2DModel`` built tiny from the same config.

Outputs, input gradients and every parameter gradient (mapped back to diffusers' names) must agree in fp32 to
rel-L2 < 1e-5 and max abs < 1e-4: for a square and a non-square image (the centred row/column positions differ),
two images in one sample (frame positions, the text start after the larger image), and text with padding -- at
the end of one prompt and in the middle of another, since the mask may take any pattern.
"""

from __future__ import annotations

import pytest
import torch
from loongforge_diffusion.qwen_image.diffusers_adapter import from_diffusers, name_map
from loongforge_diffusion.qwen_image.model import QwenImageModel
from qwen_image_reference import TINY, TINY_WIDE, reference_model
from wan_reference import max_abs, rel_l2

REL, ABS = 1e-5, 1e-4
BATCH, TEXT_LEN = 2, 7
MASK = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 0, 1, 1, 1, 1]])

LAYOUTS = {
    "square": [(1, 4, 4)],
    "non-square": [(1, 3, 5)],
    "two-images": [(1, 2, 3), (1, 5, 2)],
}


def _inputs(flavor, grids, generator: torch.Generator) -> dict:
    tokens = sum(f * h * w for f, h, w in grids)
    return {
        "hidden_states": torch.randn(BATCH, tokens, flavor.in_channels, generator=generator),
        "encoder_hidden_states": 3 * torch.randn(BATCH, TEXT_LEN, flavor.text_dim, generator=generator),
        "encoder_hidden_states_mask": MASK,
        "timestep": torch.tensor([0.013, 0.87]),
        "img_shapes": [list(grids)] * BATCH,
    }


def _run(model, inputs: dict, weights: torch.Tensor, *, ours: bool) -> tuple[torch.Tensor, dict]:
    leaves = {k: inputs[k].clone().requires_grad_(True) for k in ("hidden_states", "encoder_hidden_states")}
    kwargs = {**inputs, **leaves}
    out = model(**kwargs) if ours else model(**kwargs, return_dict=False)[0]
    (out * weights).sum().backward()
    return out.detach(), {k: v.grad for k, v in leaves.items()}


@pytest.mark.parametrize("flavor", [TINY, TINY_WIDE], ids=["tiny", "wide"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_forward_and_gradients_match_diffusers(flavor, layout):
    reference = reference_model(flavor, seed=0)
    ours = QwenImageModel(flavor)
    ours.load_state_dict(from_diffusers(reference.state_dict(), flavor))
    generator = torch.Generator().manual_seed(1)
    inputs = _inputs(flavor, LAYOUTS[layout], generator)
    weights = torch.randn(*inputs["hidden_states"].shape[:2], flavor.patch_out, generator=generator)

    out, input_grads = _run(ours, inputs, weights, ours=True)
    ref_out, ref_input_grads = _run(reference, inputs, weights, ours=False)

    assert out.shape == ref_out.shape and ref_out.norm() > 0
    assert rel_l2(out, ref_out) < REL and max_abs(out, ref_out) < ABS
    for name, grad in input_grads.items():
        assert rel_l2(grad, ref_input_grads[name]) < REL, name
        assert max_abs(grad, ref_input_grads[name]) < ABS, name
    # Padded text tokens are never attended to, so their states get no gradient, in either model.
    assert input_grads["encoder_hidden_states"][MASK == 0].abs().max() == 0

    # The last block's text stream only supplies keys and values: its queries, output projection and FFN feed
    # nothing, so their gradients are None (unused) or exactly zero (text queries) in both models.
    last_text = f"blocks.{flavor.num_layers - 1}.txt."
    names = name_map(flavor)
    ref_params = dict(reference.named_parameters())
    compared = set()
    for ours_name, param in ours.named_parameters():
        theirs = names[ours_name]
        if param.grad is None:
            assert ours_name.startswith(last_text) and all(ref_params[t].grad is None for t in theirs), ours_name
            continue
        for name, grad in zip(theirs, param.grad.chunk(len(theirs)), strict=True):
            ref_grad = ref_params[name].grad
            if ref_grad.norm() == 0:
                assert ours_name.startswith(last_text) and grad.norm() == 0, name
                continue
            assert rel_l2(grad, ref_grad) < REL and max_abs(grad, ref_grad) < ABS, name
            compared.add(name)
    assert len(compared) == len(ref_params) - 9  # last text stream: q (weight, bias, norm), out, ffn.fc1, ffn.fc2


def test_padding_changes_nothing_but_is_not_ignored():
    """Masked text tokens do not influence the image; unmasking them does (the mask is really applied)."""
    torch.manual_seed(0)
    model = QwenImageModel(TINY).eval()
    reference = reference_model(TINY)
    model.load_state_dict(from_diffusers(reference.state_dict(), TINY))
    generator = torch.Generator().manual_seed(2)
    inputs = _inputs(TINY, LAYOUTS["non-square"], generator)
    changed = inputs["encoder_hidden_states"].clone()
    changed[MASK == 0] = 100.0
    with torch.no_grad():
        base = model(**inputs)
        same = model(**{**inputs, "encoder_hidden_states": changed})
        unmasked = model(**{**inputs, "encoder_hidden_states": changed, "encoder_hidden_states_mask": None})
    assert torch.equal(base, same)
    assert max_abs(unmasked, base) > 1e-2
