"""SwiGLU in two kernels each way, for megatron's fused-activation entry point (``bias_swiglu_impl``) on CPU.

megatron's MLP with ``bias_activation_fusion`` hands the whole ``linear_fc1`` output ``[gate, up]`` to
``bias_swiglu_impl``; on GPU that is its ``torch.compile``-fused kernel. On CPU compiling it would import and run
Inductor in every eager run (~70 MiB and seconds before the first step), and megatron's unfused ``glu`` is worse
than either: ``silu(gate) * (up + 0.0)`` copies ``up`` for its zero offset, keeps three ``[.., ffn]`` tensors for
backward, and backward ends in a ``cat`` of the two halves' gradients (the ``chunk``'s backward) -- ~2.5% of the
tiny Llama benchmark's step.

:class:`SwiGLUHalves` keeps only the ``linear_fc1`` output for backward (a tensor nothing else holds: ``linear_fc2``
saves the activation's output) and writes both halves of the input gradient in place into one buffer, so the ``cat``
and the offset copy are gone. Every value is computed by the same kernels as autograd's unfused path (``silu``,
``mul``, ``silu_backward``), so forward and gradients are bitwise those of megatron's unfused MLP.

Tracing under ``torch.compile`` uses the plain formula (Inductor fuses it); FP8 input storage and CPU offloading of
the input go to megatron's own function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from loongforge.devices.megatron_cpu.wrapping import replace_once

#: megatron's modules that look ``bias_swiglu_impl`` up in their globals (the dense MLP and the shared experts).
SWIGLU_CALLERS = ("megatron.core.transformer.mlp", "megatron.core.transformer.moe.shared_experts")

_silu_backward_into = torch.ops.aten.silu_backward.grad_input


class SwiGLUHalves(torch.autograd.Function):
    """``y = silu(a) * b`` for ``x = [a, b]`` (halves of the last dimension).

    Backward, with ``g`` the output gradient: ``db = g * silu(a)`` and ``da = silu'(a) * (g * b)``, each written
    into its half of one input-gradient buffer. ``silu(a)`` is recomputed rather than saved: one pass over half
    of ``x`` instead of keeping an extra ``[.., ffn]`` tensor per layer until backward.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        ctx.save_for_backward(x)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        gate, up = x.chunk(2, dim=-1)
        grad_x = torch.empty_like(x)
        grad_gate, grad_up = grad_x.chunk(2, dim=-1)
        torch.mul(grad, F.silu(gate), out=grad_up)
        _silu_backward_into(grad * up, gate, grad_input=grad_gate)
        return grad_x


def eager_bias_swiglu(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """megatron's ``bias_swiglu_impl`` signature, computed by :class:`SwiGLUHalves` where it applies."""

    def bias_swiglu_impl(x: torch.Tensor, bias: torch.Tensor | None, fp8_input_store: bool = False,
                         cpu_offload_input: bool = False) -> torch.Tensor:
        if fp8_input_store or cpu_offload_input:
            return original(x, bias, fp8_input_store, cpu_offload_input)
        if bias is not None:
            x = x + bias
        if torch.compiler.is_compiling():
            gate, up = x.chunk(2, dim=-1)
            return F.silu(gate) * up
        return SwiGLUHalves.apply(x)

    return bias_swiglu_impl


def patch_swiglu_kernel() -> None:
    """Install :func:`eager_bias_swiglu` where megatron's MLPs look ``bias_swiglu_impl`` up (once)."""
    for name in SWIGLU_CALLERS:
        replace_once(name, "bias_swiglu_impl", eager_bias_swiglu)
