"""megatron's local linear layers on oneDNN's fp32 GEMM where that is the faster library on this CPU.

torch sends every fp32 ``mm`` on x86 to MKL. On AMD processors MKL does not take its best code paths, and oneDNN
(which torch ships too, behind ``torch.ops.mkldnn._linear_pointwise``, the kernel Inductor's CPU linear fusions
use) runs the tiny Llama benchmark's layer shapes 20-28% faster there for the forward product and ~18% for the
input gradient; the weight gradient (a long reduction over tokens, read transposed) is no faster, so it stays
``mm``. The layers' GEMMs are ~60% of a CPU training step, so this is the largest single speed lever on such hosts.

Which library serves a run (:func:`linear_kernel`): ``LOONGFORGE_CPU_GEMM=auto`` (default) takes oneDNN on x86
processors other than Intel's and torch's ``mm`` on Intel's (MKL's home ground) and off x86; ``onednn`` or ``aten``
force a choice. The rule reads the processor's vendor rather than timing both at start-up: a timing near a tie could
pick differently in the next process, and a resumed run must compute as the first one did. ``loongforge doctor``
shows the choice.

:func:`patch_linear_gemm` replaces ``linear_with_grad_accumulation_and_async_allreduce`` where megatron's
``ColumnParallelLinear``/``RowParallelLinear`` look it up, with one that hands the cases it covers -- fp32, no
sequence parallelism, no fused gradient accumulation, no deferred embedding weight gradient -- to the
differentiable operator :func:`onednn_linear_op` (to :class:`OneDNNLinear` where the input gradient is all-reduced
over the tensor-parallel group) and everything else to megatron's function. Results differ from ``mm``'s by float
rounding (a different summation order), like any other GEMM library.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from loongforge.devices.megatron_cpu.gemm_choice import GEMM_VARIABLE, automatic_kernel, cpu_vendor, requested_kernel
from loongforge.devices.megatron_cpu.wrapping import replace_once

#: megatron's module whose ``linear_with_grad_accumulation_and_async_allreduce`` is replaced.
LAYERS = "megatron.core.tensor_parallel.layers"

_ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` by oneDNN, for any leading dimensions of ``x`` (strided ``weight`` allowed).

    The kernel returns a view for a 3-D input; an autograd Function must not return a view of its own temporary
    (an in-place op downstream would bypass its backward), so the product is taken in 2-D and reshaped with
    ``_unsafe_view``, which makes no view.
    """
    out = _ONEDNN_LINEAR(x.reshape(-1, x.shape[-1]), weight, bias, "none", [], "")
    return torch.ops.aten._unsafe_view(out, (*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("loongforge::onednn_linear", mutates_args=())
def onednn_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`_onednn` as an operator of its own, so that ``torch.compile`` keeps it as one opaque call in the graph
    (Inductor has no lowering for the raw oneDNN kernel with plain weights)."""
    return _onednn(x, weight, bias)


@onednn_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


#: ``(x, weight) -> x @ weight.T`` by oneDNN, or None without the kernel (the matmul-peak probe times it too).
onednn_product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = (
    None if _ONEDNN_LINEAR is None else lambda x, weight: _onednn(x, weight, None))


def _weight_and_bias_grads(grad: torch.Tensor, x: torch.Tensor, use_bias: bool,
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight gradient by ``mm`` (oneDNN is no faster for this long reduction over tokens) and the bias's."""
    grad_2d = grad.reshape(-1, grad.shape[-1])
    grad_weight = grad_2d.t().mm(x.reshape(-1, x.shape[-1]))
    return grad_weight, grad_2d.sum(0) if use_bias else None


def _save_for_backward(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.use_bias = bias is not None


def _input_grad(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    """``grad @ W`` by oneDNN, from what :func:`_save_for_backward` kept."""
    return onednn_linear_op(grad, ctx.saved_tensors[1].t(), None)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    return _input_grad(ctx, grad), *_weight_and_bias_grads(grad, ctx.saved_tensors[0], ctx.use_bias)


# Differentiable as a registered operator rather than an autograd Function: ``torch.compile`` traces an autograd
# Function as a higher-order op that AOTAutograd's cache refuses, so layers built on it would be re-traced in
# every process; an operator's registered backward is cacheable.
onednn_linear_op.register_autograd(_backward, setup_context=_save_for_backward)


class OneDNNLinear(torch.autograd.Function):
    """:func:`onednn_linear_op` whose input gradient is summed over ``tp_group`` (a column-parallel layer at tensor
    parallelism > 1, ``allreduce_dgrad``), as megatron's function does: the all-reduce runs while the weight
    gradient is computed. The weight gradient lands in ``weight.grad`` for megatron's DDP hook to add into its
    buffer, as with megatron's function when gradient accumulation fusion is off.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                tp_group: Any) -> torch.Tensor:
        _save_for_backward(ctx, (x, weight, bias), None)
        ctx.tp_group = tp_group
        return onednn_linear_op(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad_x = _input_grad(ctx, grad)
        handle = torch.distributed.all_reduce(grad_x, group=ctx.tp_group, async_op=True)
        grad_weight, grad_bias = _weight_and_bias_grads(grad, ctx.saved_tensors[0], ctx.use_bias)
        handle.wait()
        return grad_x, grad_weight, grad_bias, None


@functools.cache
def linear_kernel() -> str:
    """``"onednn"`` or ``"aten"``: the GEMM library this process's linear layers use (see the module docstring)."""
    choice = requested_kernel()
    if _ONEDNN_LINEAR is None:
        if choice == "onednn":
            raise ValueError(f"{GEMM_VARIABLE}=onednn: this torch build has no oneDNN linear kernel")
        return "aten"
    return automatic_kernel(cpu_vendor()) if choice == "auto" else choice


@torch.compiler.assume_constant_result
def _uses_onednn() -> bool:
    """:func:`linear_kernel` is oneDNN (a constant of the process, also to ``torch.compile``'s tracer)."""
    return linear_kernel() == "onednn"


def onednn_linear(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """megatron's ``linear_with_grad_accumulation_and_async_allreduce`` on oneDNN where it applies:
    :func:`onednn_linear_op`, or :class:`OneDNNLinear` where the input gradient is all-reduced."""

    def linear_with_grad_accumulation_and_async_allreduce(
        input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gradient_accumulation_fusion: bool,
        allreduce_dgrad: bool, sequence_parallel: bool, grad_output_buffer: list | None = None,
        wgrad_deferral_limit: int | None = 0, async_grad_allreduce: bool | None = None, tp_group: Any = None,
    ) -> torch.Tensor:
        covered = (not sequence_parallel and not gradient_accumulation_fusion and grad_output_buffer is None
                   and input.dtype == torch.float32 and weight.dtype == torch.float32
                   and not (allreduce_dgrad and torch.compiler.is_compiling()) and _uses_onednn())
        if not covered:
            return original(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                            grad_output_buffer, wgrad_deferral_limit, async_grad_allreduce, tp_group)
        if not allreduce_dgrad:
            return onednn_linear_op(input, weight, bias)
        if tp_group is None:
            from megatron.core.parallel_state import get_tensor_model_parallel_group

            tp_group = get_tensor_model_parallel_group()
        return OneDNNLinear.apply(input, weight, bias, tp_group)

    # megatron's function reads and sets its warn-once flag through the module's name, which is now this one.
    linear_with_grad_accumulation_and_async_allreduce.warned = getattr(original, "warned", False)  # type: ignore[attr-defined]
    return linear_with_grad_accumulation_and_async_allreduce


def patch_linear_gemm() -> None:
    """Install :func:`onednn_linear` where megatron's parallel linear layers look their function up (once)."""
    replace_once(LAYERS, "linear_with_grad_accumulation_and_async_allreduce", onednn_linear)
