"""Broken device backends (MUTANTS, tests only): each is the CPU backend with one fault a real accelerator stack
has shipped -- a reduction that skips a rank, a matmul or softmax that accumulates in bf16, a fused kernel whose
backward is off, a dropped patch -- and that the loss alone does not reveal. ``loongforge certify`` must fail every
one of them, at the check that should see it (tests/certify/test_certify.py).

Each is selected by import path (``--device mutant_backends:SkippedReduction``; this directory on ``PYTHONPATH``),
the way an out-of-tree backend under development is.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from loongforge.devices.cpu import CPUBackend
from loongforge.devices.cpu_spec import CPUSpecProvider
from loongforge.devices.norm import SPNorm
from loongforge.devices.sdpa_attention import SDPAttention


class _Mutant(CPUBackend):
    """The CPU backend plus :meth:`break_it`, applied after the CPU patches."""

    name = "mutant"
    provider: type = CPUSpecProvider

    def apply_patches(self) -> None:
        super().apply_patches()
        self.break_it()

    def break_it(self) -> None:  # noqa: B027 -- mutants that break only the spec leave the patches alone
        pass

    def spec_provider(self) -> Any:
        return self.provider()


def _wrap(module: Any, attribute: str, make: Any) -> None:
    """``module.attribute = make(original)``, once per process (megatron looks these names up at call time)."""
    original = getattr(module, attribute)
    if not getattr(original, "mutated", False):
        replacement = make(original)
        # the original's own attributes too: megatron's linear reads and sets a warn-once flag on whatever function
        # its module name holds at call time, so a wrapper without it failed where the call reached megatron's code
        replacement.__dict__.update(original.__dict__)
        replacement.mutated = True
        setattr(module, attribute, replacement)


# -- collectives -----------------------------------------------------------------------------------------------------

class SkippedReduction(_Mutant):
    """Tensor-parallel all-reduce that leaves rank 1's partial sum out (rank 1 takes part with zeros, so nothing
    hangs: every rank silently gets rank 0's partial sum of a row-parallel output)."""

    name = "mutant-skipped-reduction"

    def break_it(self) -> None:
        from megatron.core.tensor_parallel import mappings

        def make(original: Any) -> Any:
            def _reduce(input_: torch.Tensor, group: Any) -> torch.Tensor:
                if group is not None and group.size() > 1 and torch.distributed.get_rank(group) == 1:
                    input_ = torch.zeros_like(input_)
                return original(input_, group)
            return _reduce

        _wrap(mappings, "_reduce", make)


class SummedNotAveraged(_Mutant):
    """Every float all-reduce over more than one rank scaled by the group size once more: data-parallel gradients
    (and logged losses) summed where they must be averaged."""

    name = "mutant-summed-not-averaged"

    def break_it(self) -> None:
        def make(original: Any) -> Any:
            def all_reduce(tensor: torch.Tensor, op: Any = torch.distributed.ReduceOp.SUM, group: Any = None,
                           async_op: bool = False) -> Any:
                work = original(tensor, op=op, group=group, async_op=async_op)
                size = torch.distributed.get_world_size(group)
                if size > 1 and tensor.is_floating_point() and op == torch.distributed.ReduceOp.SUM:
                    if work is not None:
                        work.wait()
                    tensor.mul_(size)
                return work
            return all_reduce

        _wrap(torch.distributed, "all_reduce", make)


# -- kernels ---------------------------------------------------------------------------------------------------------

class Bf16Linear(_Mutant):
    """Linear layers whose products are rounded to bf16 in an fp32 run (a GEMM accumulating in low precision)."""

    name = "mutant-bf16-linear"

    def break_it(self) -> None:
        from megatron.core.tensor_parallel import layers

        def make(original: Any) -> Any:
            def linear(*args: Any, **kwargs: Any) -> torch.Tensor:
                return _RoundForward.apply(original(*args, **kwargs))
            return linear

        _wrap(layers, "linear_with_grad_accumulation_and_async_allreduce", make)


class _RoundForward(torch.autograd.Function):
    """bf16 rounding in the forward pass, the gradient passed through (as a low-precision accumulator does)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _ScaledBackward(torch.autograd.Function):
    """Identity forward, gradient times ``scale`` (a fused kernel whose backward is off by a constant)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class _NormWithWrongBackward(SPNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(_ScaledBackward.apply(x, 0.9))


class _NormWithWrongEps(SPNorm):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.eps = 1e-2


class _Provider(CPUSpecProvider):
    """The CPU spec provider with one module class replaced (set per mutant)."""

    norm: type = SPNorm
    attention: type = SDPAttention

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        return self.norm

    def core_attention(self) -> type:
        return self.attention


class NormBackward(_Mutant):
    """A fused RMSNorm whose input gradient is 0.9 of the true one (the forward pass is exact)."""

    name = "mutant-norm-backward"

    class provider(_Provider):  # noqa: N801 -- a class attribute holding a class
        norm = _NormWithWrongBackward


class NormEpsilon(_Mutant):
    """RMSNorm with epsilon 1e-2 where the model says 1e-5."""

    name = "mutant-norm-epsilon"

    class provider(_Provider):  # noqa: N801
        norm = _NormWithWrongEps


class _NonCausalAttention(SDPAttention):
    def _sdpa_mask(self, attention_mask: Any, mask_type: Any, sq: int, sk: int, device: Any) -> tuple[Any, bool]:
        return None, False


class NonCausalAttention(_Mutant):
    """Attention that drops the causal mask (each token sees the future)."""

    name = "mutant-non-causal"

    class provider(_Provider):  # noqa: N801
        attention = _NonCausalAttention


class _MisscaledAttention(SDPAttention):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.softmax_scale = 1.0 / self.k_channels  # 1/d where it is 1/sqrt(d)


class MisscaledAttention(_Mutant):
    """Attention scores scaled by 1/d instead of 1/sqrt(d)."""

    name = "mutant-attention-scale"

    class provider(_Provider):  # noqa: N801
        attention = _MisscaledAttention


class _Bf16Attention(SDPAttention):
    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any) -> torch.Tensor:
        low = [t.to(torch.bfloat16) for t in (query, key, value)]
        return super()._attend(*low, *args).to(query.dtype)


class Bf16Attention(_Mutant):
    """Attention computed in bf16 inside an fp32 run (a softmax kernel without an fp32 path)."""

    name = "mutant-bf16-attention"

    class provider(_Provider):  # noqa: N801
        attention = _Bf16Attention


class SwiGLUBackward(_Mutant):
    """The fused SwiGLU with its gradient halved (forward exact): a wrong backward in the MLP only."""

    name = "mutant-swiglu-backward"

    def break_it(self) -> None:
        from megatron.core.fusions import fused_bias_swiglu

        def make(original: Any) -> Any:
            def bias_swiglu_impl(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
                return original(_ScaledBackward.apply(x, 0.5), *args, **kwargs)
            return bias_swiglu_impl

        _wrap(fused_bias_swiglu, "bias_swiglu_impl", make)
        from megatron.core.transformer import mlp

        if hasattr(mlp, "bias_swiglu_impl"):
            _wrap(mlp, "bias_swiglu_impl", make)


class FrozenEmbedding(_Mutant):
    """An embedding lookup whose backward drops the gradient (the word embeddings never train)."""

    name = "mutant-frozen-embedding"

    def break_it(self) -> None:
        def make(original: Any) -> Any:
            def embedding(input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
                return original(input, weight.detach(), *args, **kwargs)
            return embedding

        _wrap(F, "embedding", make)  # megatron's VocabParallelEmbedding calls F.embedding


class TorchRMSNormEpsilon(_Mutant):
    """``torch.nn.functional.rms_norm`` with epsilon 1e-2 whatever it is asked for: a kernel the task-engine models
    (the DiTs, the policies) call directly, outside megatron's layer specs."""

    name = "mutant-torch-rms-norm-epsilon"

    def break_it(self) -> None:
        def make(original: Any) -> Any:
            def rms_norm(input: torch.Tensor, normalized_shape: Any, weight: Any = None, eps: Any = None) -> Any:
                return original(input, normalized_shape, weight, 1e-2)
            return rms_norm

        _wrap(F, "rms_norm", make)


class DroppedClipPatch(_Mutant):
    """The CPU patches without the gradient-clipping one (megatron's clip then asserts CUDA tensors): what a vendor
    backend that forgets one of its patches does."""

    name = "mutant-dropped-patch"

    def apply_patches(self) -> None:
        from megatron.core.optimizer import clip_grads, optimizer

        megatrons = {module: module.clip_grad_by_total_norm_fp32 for module in (clip_grads, optimizer)}
        super().apply_patches()
        for module, function in megatrons.items():
            module.clip_grad_by_total_norm_fp32 = function

