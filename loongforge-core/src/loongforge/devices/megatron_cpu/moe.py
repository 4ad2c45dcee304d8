"""Megatron's MoE router without Transformer Engine."""

from __future__ import annotations


def patch_router_gemm() -> None:
    """Define ``moe_utils.te_general_gemm`` as ``None`` when Transformer Engine is absent.

    CUDA behaviour: ``moe_utils`` imports ``te_general_gemm`` from Transformer Engine inside a ``try`` and, when
    the import fails, leaves the name undefined. ``router_gating_linear`` then tests
    ``te_general_gemm is not None`` and raises ``NameError`` on any machine without TE (every CPU machine).
    ``None`` is the value that check expects for "use the torch matmul path".
    """
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
