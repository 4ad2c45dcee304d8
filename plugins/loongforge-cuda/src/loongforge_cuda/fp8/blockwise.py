"""FP8 (e4m3) quantisation with tensorwise, rowwise and blockwise scales, and the GEMMs they feed, on any device.

This is the numerical reference for the GPU path: Transformer Engine's ``Float8BlockScaling`` recipe (the
DeepSeek-V3 scheme) scales activations per 1x128 tile along the reduction dimension K and weights per 128x128
tile, so one outlier only coarsens the 128 values that share its scale instead of the whole tensor.
``torch._scaled_mm`` does not take such scales on CPU, so the blockwise GEMM is emulated here: values are cast
to ``torch.float8_e4m3fn`` and back, and the product is accumulated in fp32 one K-block at a time, each block
multiplied by its own pair of scales, as the GPU kernels do.

Conventions: a GEMM is ``x @ w.T`` with activations ``x`` of shape [M, K] and weights ``w`` of shape [N, K]
(``torch.nn.Linear`` layout). A scale multiplies the FP8 value back to the real one (``real = q * scale``).
K (and N for weights) need not be multiples of the block: the last block is ragged and has its own scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: Largest finite ``float8_e4m3fn`` value; a scale maps a block's amax onto it.
E4M3_MAX = 448.0
#: Tile edge of the blockwise recipe (1x128 activations, 128x128 weights).
BLOCK = 128


@dataclass(frozen=True)
class Quantized:
    """FP8 values and the fp32 scales that turn them back into real numbers.

    ``block`` is the tile shape one scale covers: ``(rows, cols)`` with ``0`` meaning "the whole dimension",
    so tensorwise is ``(0, 0)``, rowwise ``(1, 0)``, 1x128 activations ``(1, 128)``, weights ``(128, 128)``.
    """

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        """The fp32 tensor this quantisation represents."""
        return self.data.float() * expand_scale(self.scale, self.block, self.data.shape)


def scales_from_amax(amax: torch.Tensor, *, pow2: bool = False) -> torch.Tensor:
    """``amax / 448`` in fp32; an all-zero block gets scale 1 (not 0, which would divide by zero).

    ``pow2`` rounds each scale up to a power of two, as Transformer Engine's blockwise recipe does by default,
    so that scaling is exact in binary (only the e4m3 rounding remains).
    """
    amax = amax.float()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return scale


def _tile_amax(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Max |x| per ``rows x cols`` tile (0 = the whole dimension); ragged edge tiles are padded with zeros,
    which never raise an amax."""
    m, k = x.shape
    rows, cols = rows or m, cols or k
    grid_m, grid_k = math.ceil(m / rows), math.ceil(k / cols)
    padded = torch.zeros(grid_m * rows, grid_k * cols, dtype=torch.float32, device=x.device)
    padded[:m, :k] = x.float().abs()
    return padded.view(grid_m, rows, grid_k, cols).amax(dim=(1, 3))


def expand_scale(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size | tuple[int, int]) -> torch.Tensor:
    """Repeat one scale per tile to one per element of a tensor of ``shape`` (cropping ragged edges)."""
    m, k = shape
    rows, cols = block[0] or m, block[1] or k
    return scale.repeat_interleave(rows, dim=0)[:m].repeat_interleave(cols, dim=1)[:, :k]


def quantize(x: torch.Tensor, block: tuple[int, int], *, pow2: bool = False) -> Quantized:
    """Quantise a 2-D tensor to e4m3 with one scale per ``block`` tile (see :class:`Quantized`).

    Values are clamped to +-448 before the cast: rounding in ``x / scale`` can land a hair above the
    largest finite value, and an out-of-range cast is not guaranteed to saturate on every device.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize expects a 2-D tensor, got shape {tuple(x.shape)}")
    scale = scales_from_amax(_tile_amax(x, *block), pow2=pow2)
    scaled = x.float() / expand_scale(scale, block, x.shape)
    data = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return Quantized(data, scale, block)


def quantize_tensorwise(x: torch.Tensor) -> Quantized:
    """One scale for the whole tensor (shape [1, 1])."""
    return quantize(x, (0, 0))


def quantize_rowwise(x: torch.Tensor) -> Quantized:
    """One scale per row (shape [rows, 1]): per token for activations, per output feature for weights."""
    return quantize(x, (1, 0))


def quantize_activation_blockwise(x: torch.Tensor, *, pow2: bool = False) -> Quantized:
    """Activations [M, K]: one scale per row per 128 columns, scales [M, ceil(K/128)]."""
    return quantize(x, (1, BLOCK), pow2=pow2)


def quantize_weight_blockwise(w: torch.Tensor, *, pow2: bool = False) -> Quantized:
    """Weights [N, K]: one scale per 128x128 tile, scales [ceil(N/128), ceil(K/128)]."""
    return quantize(w, (BLOCK, BLOCK), pow2=pow2)


def blockwise_matmul(a: Quantized, b: Quantized) -> torch.Tensor:
    """``a @ b.T`` in fp32 for blockwise operands, accumulated one 128-wide K-block at a time.

    Each K-block's partial product uses that block's activation scales (per row) and weight scales (per
    128 output columns), which is how the FP8 GEMM kernels promote partial sums into fp32.
    """
    if a.block != (1, BLOCK) or b.block != (BLOCK, BLOCK):
        raise ValueError(f"blockwise_matmul needs 1x{BLOCK} activations and {BLOCK}x{BLOCK} weights, "
                         f"got {a.block} and {b.block}")
    m, k = a.data.shape
    n, k_b = b.data.shape
    if k != k_b:
        raise ValueError(f"inner dimensions differ: activations [{m}, {k}], weights [{n}, {k_b}]")
    # Weight scales repeated to one per output column: [N, ceil(K/128)].
    b_scale = b.scale.repeat_interleave(BLOCK, dim=0)[:n]
    out = torch.zeros(m, n, dtype=torch.float32, device=a.data.device)
    for j, start in enumerate(range(0, k, BLOCK)):
        stop = min(start + BLOCK, k)
        qa = a.data[:, start:stop].float() * a.scale[:, j : j + 1]
        qb = b.data[:, start:stop].float() * b_scale[:, j : j + 1]
        out += qa @ qb.T
    return out


def emulated_matmul(a: Quantized, b: Quantized) -> torch.Tensor:
    """``a @ b.T`` in fp32 for any pair of quantised operands: the blockwise GEMM where the scales are
    blockwise, else dequantise-then-multiply (exact for tensorwise and rowwise, whose scales factor out)."""
    if a.block == (1, BLOCK) and b.block == (BLOCK, BLOCK):
        return blockwise_matmul(a, b)
    return a.dequantize() @ b.dequantize().T


def scaled_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``a @ b.T`` through ``torch._scaled_mm`` for tensorwise or rowwise operands.

    ``_scaled_mm`` wants the second operand column-major ([K, N] with stride (1, K)), which is exactly the
    transpose view of a row-major [N, K] weight; rowwise scales go in as ``scale_a`` [M, 1] and
    ``scale_b`` [1, N]. It rejects blockwise scales, hence :func:`blockwise_matmul`.
    """
    if a.block != b.block or a.block not in ((0, 0), (1, 0)):
        raise ValueError(f"torch._scaled_mm takes tensorwise or rowwise scales on both operands, got "
                         f"{a.block} and {b.block}; use blockwise_matmul for blockwise scales")
    if a.block == (0, 0):
        scale_a, scale_b = a.scale.reshape(()), b.scale.reshape(())
    else:
        scale_a, scale_b = a.scale.contiguous(), b.scale.T.contiguous()
    return torch._scaled_mm(a.data, b.data.T, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approx - exact|| / ||exact||`` (Frobenius) in fp32; 0 when both are zero."""
    exact = exact.float()
    norm = exact.norm().item()
    diff = (approx.float() - exact).norm().item()
    return diff / norm if norm else diff
