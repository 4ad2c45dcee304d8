"""Timed BF16 and FP8 linear layers, on an NVIDIA GPU through Transformer Engine or emulated on any device.

:class:`TELinearTimer` measures what a training step pays: forward and backward of a ``te.pytorch.Linear``
(three GEMMs plus the casts and scale computations of the FP8 recipe), in or out of ``fp8_autocast``.
:class:`EmulatedLinearTimer` runs the same measurement loop where there is no FP8 hardware: FP8 is the
CPU reference of :mod:`.blockwise` (forward only), so its timings prove the tool and the policy file work
and say nothing about GPU speed -- the policy it writes is marked ``emulated`` and refused for training.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from loongforge_cuda.capability import FP8_RECIPES, choose_fp8_recipe, installed, te_recipe_classes
from loongforge_cuda.fp8 import blockwise

#: Recipes the emulation can reproduce (MXFP8's 1x32 power-of-two block scales are not emulated).
EMULATED_RECIPES = ("blockwise", "tensorwise")


def emulated_fp8_linear(x: torch.Tensor, w: torch.Tensor, recipe: str, *, pow2: bool = False) -> torch.Tensor:
    """``x @ w.T`` as the FP8 ``recipe`` computes it, in BF16 like the GPU layer's output, on ``x``'s device.

    ``blockwise`` quantises 1x128 / 128x128 tiles (``pow2`` rounds scales to powers of two, as TE's blockwise
    recipe does by default); ``tensorwise`` uses one current scale per operand.
    """
    if recipe == "blockwise":
        a = blockwise.quantize_activation_blockwise(x, pow2=pow2)
        b = blockwise.quantize_weight_blockwise(w, pow2=pow2)
        return blockwise.blockwise_matmul(a, b).bfloat16()
    if recipe == "tensorwise":
        a, b = blockwise.quantize_tensorwise(x), blockwise.quantize_tensorwise(w)
        return blockwise.emulated_matmul(a, b).bfloat16()
    raise ValueError(f"FP8 recipe '{recipe}' cannot be emulated; emulated: {', '.join(EMULATED_RECIPES)}")


def median_ms(step: Callable[[], object], *, repeat: int, warmup: int) -> float:
    """Median wall time of ``step`` in milliseconds on the CPU clock, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


class EmulatedLinearTimer:
    """``x @ w.T`` in BF16 vs the FP8 emulation (quantise both operands, scaled GEMM), forward only."""

    emulated = True

    def __init__(self, recipe: str = "blockwise", *, repeat: int = 5, warmup: int = 1, seed: int = 0) -> None:
        if recipe not in EMULATED_RECIPES:
            raise ValueError(f"FP8 recipe '{recipe}' cannot be emulated; emulated: {', '.join(EMULATED_RECIPES)}")
        self.recipe, self.repeat, self.warmup = recipe, repeat, warmup
        self.device = "cpu"
        self.generator = torch.Generator().manual_seed(seed)

    def operands(self, in_features: int, out_features: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """BF16 activations [tokens, in] and weights [out, in] scaled like an initialised layer's."""
        x = torch.randn(tokens, in_features, generator=self.generator).bfloat16()
        w = (torch.randn(out_features, in_features, generator=self.generator) * in_features**-0.5).bfloat16()
        return x, w

    def time_ms(self, in_features: int, out_features: int, tokens: int, *, fp8: bool) -> float:
        x, w = self.operands(in_features, out_features, tokens)
        if fp8:
            return median_ms(lambda: emulated_fp8_linear(x, w, self.recipe), repeat=self.repeat, warmup=self.warmup)
        return median_ms(lambda: torch.nn.functional.linear(x, w), repeat=self.repeat, warmup=self.warmup)


class TELinearTimer:
    """Forward + backward of a Transformer Engine ``Linear`` in BF16 vs in FP8 with ``recipe``, timed with
    CUDA events (median over ``repeat`` steps)."""

    emulated = False

    def __init__(self, recipe: str = "auto", *, repeat: int = 20, warmup: int = 5, seed: int = 0) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device visible; run with --device cpu for the emulation")
        if not installed("transformer_engine"):
            raise RuntimeError("FP8 on the GPU needs Transformer Engine: pip install 'loongforge-cuda[te]'")
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe as te_recipe

        capability = torch.cuda.get_device_capability()
        self.recipe = choose_fp8_recipe(recipe, capability, te_recipe_classes())
        self.fp8_recipe = getattr(te_recipe, FP8_RECIPES[self.recipe][1])()
        self.te, self.repeat, self.warmup = te, repeat, warmup
        self.device = torch.cuda.get_device_name()
        torch.manual_seed(seed)

    def layer(self, in_features: int, out_features: int) -> torch.nn.Module:
        return self.te.Linear(in_features, out_features, bias=False, params_dtype=torch.bfloat16, device="cuda")

    def forward(self, layer: torch.nn.Module, x: torch.Tensor, *, fp8: bool) -> torch.Tensor:
        with self.te.fp8_autocast(enabled=fp8, fp8_recipe=self.fp8_recipe):
            return layer(x)

    def time_ms(self, in_features: int, out_features: int, tokens: int, *, fp8: bool) -> float:
        layer = self.layer(in_features, out_features)
        x = torch.randn(tokens, in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(tokens, out_features, device="cuda", dtype=torch.bfloat16)

        def step() -> None:
            self.forward(layer, x, fp8=fp8).backward(grad)

        for _ in range(self.warmup):
            step()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.repeat)]
        for start, end in events:
            start.record()
            step()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)


def make_timer(device: str, recipe: str, *, repeat: int | None = None, warmup: int | None = None):
    """The timer for ``device`` (``auto``: the GPU when one is visible, else the CPU emulation)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise ValueError(f"--device must be auto, cuda or cpu, got '{device}'")
    cls = TELinearTimer if device == "cuda" else EmulatedLinearTimer
    if device == "cpu" and recipe == "auto":
        recipe = "blockwise"
    counts = {k: v for k, v in (("repeat", repeat), ("warmup", warmup)) if v is not None}
    return cls(recipe, **counts)
