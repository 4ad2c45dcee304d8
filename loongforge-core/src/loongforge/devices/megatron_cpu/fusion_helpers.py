"""megatron's ``jit_fuser`` helpers as written on CPU, not compiled at their first call.

megatron decorates small elementwise helpers with ``jit_fuser`` (``torch.compile`` on current torch): the MoE
router's expert-bias add, the token dispatcher's preprocessing, the torch norm, attention's output gate.
:mod:`loongforge.megatron_import` already defers that compile to the first call; on CPU the compile itself is the
cost -- Inductor generating and building C++ for each helper at the first forward of every process: ~6.5 s of CPU
in a three-step ``qwen3-moe-tiny`` run (22.9 s with compiling, 16.3 s without), and every torchrun rank pays it --
while the fused kernels save microseconds per step on shapes this size. Compiled and eager helpers compute the
same values.

A model compiled as a whole (``training.compile``) still traces the helpers inside its own graph.
"""

from __future__ import annotations


def run_fusion_helpers_eagerly() -> None:
    """Make megatron's deferred ``jit_fuser`` helpers run as written (see the module docstring)."""
    from loongforge.megatron_import import compile_fusion_helpers

    compile_fusion_helpers(False)
