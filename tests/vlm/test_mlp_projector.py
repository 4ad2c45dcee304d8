"""The LLaVA-style MLP projector: shapes, the exact patch grouping of the merge, and gradients."""

from __future__ import annotations

import pytest
import torch
from loongforge_vlm.projectors.mlp import MlpProjector, merge_patches


def test_plain_projector_is_linear_gelu_linear():
    torch.manual_seed(0)
    proj = MlpProjector(8, 12, hidden_dim=10)
    x = torch.randn(2, 5, 8)
    expected = proj.fc2(torch.nn.functional.gelu(proj.fc1(x)))
    out = proj(x)
    assert out.shape == (2, 5, 12) and torch.equal(out, expected)
    assert proj.fc1.out_features == 10 and MlpProjector(8, 12).fc1.out_features == 12  # LLaVA: hidden = out


def test_merge_concatenates_each_block_of_neighbours_row_major():
    rows, cols, merge = 4, 6, 2
    # Token features are its own (row, col), so the merged token says exactly which patches it holds.
    coords = torch.tensor([[r, c] for r in range(rows) for c in range(cols)], dtype=torch.float32)[None]
    merged = merge_patches(coords, (rows, cols), merge)
    assert merged.shape == (1, (rows // merge) * (cols // merge), merge * merge * 2)
    for index, token in enumerate(merged[0]):
        block_row, block_col = divmod(index, cols // merge)
        expected = [[block_row * merge + dr, block_col * merge + dc] for dr in range(merge) for dc in range(merge)]
        assert token.reshape(-1, 2).tolist() == expected


def test_merging_projector_shapes_square_inferred_and_non_square_given():
    torch.manual_seed(0)
    proj = MlpProjector(4, 6, merge=2)
    assert proj.fc1.in_features == 16
    assert proj(torch.randn(3, 16, 4)).shape == (3, 4, 6)
    assert proj(torch.randn(3, 24, 4), grid=(4, 6)).shape == (3, 6, 6)
    assert proj.output_grid((4, 6)) == (2, 3)
    with pytest.raises(ValueError, match="not a square grid; pass grid="):
        proj(torch.randn(1, 24, 4))
    with pytest.raises(ValueError, match="not divisible by merge=2"):
        proj(torch.randn(1, 15, 4), grid=(3, 5))
    with pytest.raises(ValueError, match="grid 4x4 has 16 patches, the tokens have 12"):
        proj(torch.randn(1, 12, 4), grid=(4, 4))
    with pytest.raises(ValueError, match="sizes must be positive"):
        MlpProjector(4, 6, merge=0)


def test_gradients_are_correct_in_float64():
    torch.manual_seed(0)
    proj = MlpProjector(3, 5, hidden_dim=4, merge=2).double()
    x = torch.randn(2, 8, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: proj(t, grid=(2, 4)), (x,))
    proj(x, grid=(2, 4)).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in proj.parameters())
    assert x.grad.abs().min() > 0  # every patch reaches the output through its merged token
