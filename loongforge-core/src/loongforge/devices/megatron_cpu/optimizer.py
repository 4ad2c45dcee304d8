"""Megatron's optimizer wrappers on CPU tensors.

Megatron dispatches on ``tensor.type()`` strings (``'torch.cuda.FloatTensor'``, ``'torch.cuda.BFloat16Tensor'``)
to decide which parameters get fp32 main copies, and asserts on them when clipping. CPU tensors report
``'torch.FloatTensor'``, so the wrappers raise ``TypeError`` or fail the assertion although the logic is
device-neutral.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

#: CPU tensor type names and the CUDA names megatron compares against.
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


@contextlib.contextmanager
def cuda_type_names() -> Iterator[None]:
    """While active, ``tensor.type()`` (no arguments) names CPU float tensors by their CUDA type names.

    Scoped to an optimizer constructor: megatron's dtype dispatch there runs once per parameter, so the
    temporary override costs nothing during training and is gone before any other code runs.
    """
    original = torch.Tensor.type

    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if args or kwargs:
            return result
        return _CUDA_TYPE_NAMES.get(result, result)

    torch.Tensor.type = type_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]


def _construct_with_cuda_type_names(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        with cuda_type_names():
            init(self, *args, **kwargs)

    __init__._loongforge_cpu = True  # type: ignore[attr-defined]
    return __init__


def patch_optimizer_type_checks() -> None:
    """Let ``Float16OptimizerWithFloat16Params`` and ``DistributedOptimizer`` accept CPU parameters.

    CUDA behaviour: their constructors sort parameters into fp16/bf16 (given fp32 main copies) and fp32 by
    comparing ``param.type()`` with CUDA type names, raising ``TypeError`` for anything else. On CPU every
    parameter is "anything else". The patch wraps both constructors so that the comparison sees CUDA names
    for CPU tensors (see :func:`cuda_type_names`); nothing else in them depends on the device.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    for cls in (Float16OptimizerWithFloat16Params, DistributedOptimizer):
        if not getattr(cls.__init__, "_loongforge_cpu", False):
            cls.__init__ = _construct_with_cuda_type_names(cls.__init__)


def clip_grad_by_total_norm_fp32(
    parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    """CPU version of megatron's ``clip_grad_by_total_norm_fp32`` (same signature and semantics).

    Scales every gradient in place by ``max_norm / (total_norm + 1e-6)`` when that is below 1, using one
    ``torch._foreach_mul_`` instead of megatron's multi-tensor-apply kernel.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = []
    for param in parameters:
        grad = getattr(param, attr, None)
        if grad is not None:
            if grad.dtype not in (torch.float32, torch.bfloat16):
                raise TypeError(f"gradient clipping expects fp32/bf16 main grads, got {grad.dtype}")
            grads.append(grad.to_local().detach() if hasattr(grad, "to_local") else grad.detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def patch_clip_grads() -> None:
    """Replace ``clip_grad_by_total_norm_fp32`` where megatron's optimizers look it up.

    CUDA behaviour: the function asserts ``param.grad.type() == 'torch.cuda.FloatTensor'`` and allocates its
    overflow buffer with ``device='cuda'``; both fail on CPU. ``MegatronOptimizer.clip_grad_norm`` calls the name
    imported into ``megatron.core.optimizer.optimizer``, so that binding (and the defining module's) is
    replaced with :func:`clip_grad_by_total_norm_fp32`.
    """
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as moptimizer

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    moptimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
