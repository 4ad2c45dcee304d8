"""The CPU reference of FP8 e4m3 quantisation and GEMMs (tensorwise, rowwise, 1x128 / 128x128 blockwise)."""

from __future__ import annotations

import pytest
import torch
from loongforge_cuda.fp8 import blockwise as bw


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_scale_shapes_with_ragged_last_block():
    x = torch.randn(5, 300, generator=_gen())  # K = 2 * 128 + 44
    w = torch.randn(200, 300, generator=_gen(1))  # N = 128 + 72
    assert bw.quantize_activation_blockwise(x).scale.shape == (5, 3)
    assert bw.quantize_weight_blockwise(w).scale.shape == (2, 3)
    assert bw.quantize_rowwise(x).scale.shape == (5, 1)
    assert bw.quantize_tensorwise(x).scale.shape == (1, 1)
    q = bw.quantize_weight_blockwise(w)
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == (200, 300)


def test_each_tile_maps_its_amax_onto_e4m3_max():
    x = torch.randn(3, 300, generator=_gen())
    q = bw.quantize_activation_blockwise(x)
    # The ragged last tile (columns 256..299) has its own amax.
    assert q.scale[1, 2].item() == pytest.approx(x[1, 256:].abs().max().item() / 448.0, rel=1e-6)
    assert q.data.float().abs().amax().item() == 448.0
    w = torch.randn(130, 130, generator=_gen(2))
    qw = bw.quantize_weight_blockwise(w)
    assert qw.scale[1, 1].item() == pytest.approx(w[128:, 128:].abs().max().item() / 448.0, rel=1e-6)


def test_zero_amax_gets_scale_one_and_round_trips_to_zero():
    x = torch.randn(4, 256, generator=_gen())
    x[:, :128] = 0.0  # first tile of every row is all zeros
    q = bw.quantize_activation_blockwise(x)
    assert torch.equal(q.scale[:, 0], torch.ones(4))
    deq = q.dequantize()
    assert torch.isfinite(deq).all() and torch.equal(deq[:, :128], torch.zeros(4, 128))
    zero = bw.quantize_weight_blockwise(torch.zeros(128, 256))
    out = bw.blockwise_matmul(q, zero)
    assert torch.isfinite(out).all() and torch.equal(out, torch.zeros(4, 128))


def test_pow2_scales_are_powers_of_two_and_cover_the_amax():
    x = torch.randn(4, 256, generator=_gen()) * 3.7
    q = bw.quantize_activation_blockwise(x, pow2=True)
    exponents = torch.log2(q.scale)
    assert torch.equal(exponents, exponents.round())
    assert (q.scale * 448.0 >= x.abs().view(4, 2, 128).amax(-1)).all()


#: A few activations five orders of magnitude above the rest (LLM activations have such outliers).
OUTLIERS = ((3, 7), (17, 200), (40, 300), (41, 511))


def _outlier_operands() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(64, 512, generator=_gen())
    for i, (row, col) in enumerate(OUTLIERS):
        x[row, col] = 1.0e5 * (-1) ** i
    w = torch.randn(256, 512, generator=_gen(1)) * 0.05
    return x, w


def _mean_row_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """Every token's output counts alike (a Frobenius norm would be dominated by the outlier rows)."""
    return ((approx - exact).norm(dim=1) / exact.norm(dim=1)).mean().item()


def test_blockwise_error_is_below_tensorwise_on_outliers():
    x, w = _outlier_operands()
    normal = torch.ones_like(x, dtype=torch.bool)
    for row, col in OUTLIERS:
        normal[row, col] = False
    schemes = {
        "tensorwise": (bw.quantize_tensorwise(x), bw.quantize_tensorwise(w)),
        "rowwise": (bw.quantize_rowwise(x), bw.quantize_rowwise(w)),
        "blockwise": (bw.quantize_activation_blockwise(x), bw.quantize_weight_blockwise(w)),
    }
    # Error on the ordinary values: one shared scale pushes them into e4m3's subnormals.
    q_err = {k: bw.relative_error(a.dequantize()[normal], x[normal]) for k, (a, _) in schemes.items()}
    # Measured: tensorwise 0.125, rowwise 0.040 (the outlier rows), blockwise 0.030.
    assert q_err["tensorwise"] > 0.1
    assert q_err["blockwise"] < 0.035
    assert q_err["blockwise"] < q_err["rowwise"] < q_err["tensorwise"]
    exact = x @ w.T
    gemm_err = {k: _mean_row_error(bw.emulated_matmul(a, b), exact) for k, (a, b) in schemes.items()}
    # Measured: tensorwise 0.122, blockwise 0.037 (e4m3's own rounding).
    assert gemm_err["tensorwise"] > 0.1
    assert gemm_err["blockwise"] < 0.045
    assert gemm_err["blockwise"] < gemm_err["tensorwise"] / 2.5


def test_blockwise_matmul_is_the_dequantised_product():
    x = torch.randn(8, 300, generator=_gen())
    w = torch.randn(200, 300, generator=_gen(1))
    a, b = bw.quantize_activation_blockwise(x), bw.quantize_weight_blockwise(w)
    reference = a.dequantize() @ b.dequantize().T
    torch.testing.assert_close(bw.blockwise_matmul(a, b), reference, rtol=1e-5, atol=1e-4)
    assert bw.relative_error(bw.blockwise_matmul(a, b), x @ w.T) < 0.05


@pytest.mark.parametrize("quantize", [bw.quantize_tensorwise, bw.quantize_rowwise], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_torch_scaled_mm_matches_the_emulation(quantize, out_dtype):
    x = torch.randn(32, 256, generator=_gen())
    w = torch.randn(64, 256, generator=_gen(1))
    a, b = quantize(x), quantize(w)
    emulated = bw.emulated_matmul(a, b)
    assert bw.relative_error(bw.scaled_mm(a, b, out_dtype=out_dtype), emulated) < 1e-2


def test_scaled_mm_refuses_blockwise_scales():
    x = torch.randn(4, 128, generator=_gen())
    with pytest.raises(ValueError, match="use blockwise_matmul"):
        bw.scaled_mm(bw.quantize_activation_blockwise(x), bw.quantize_weight_blockwise(x))


def test_blockwise_matmul_checks_its_operands():
    x = torch.randn(4, 256, generator=_gen())
    w = torch.randn(8, 128, generator=_gen(1))
    with pytest.raises(ValueError, match="inner dimensions differ"):
        bw.blockwise_matmul(bw.quantize_activation_blockwise(x), bw.quantize_weight_blockwise(w))
    with pytest.raises(ValueError, match="needs 1x128 activations"):
        bw.blockwise_matmul(bw.quantize_rowwise(x), bw.quantize_weight_blockwise(w))
