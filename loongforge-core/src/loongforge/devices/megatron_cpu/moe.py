"""Megatron's MoE router and alltoall token dispatcher on CPU (no Transformer Engine, gloo)."""

from __future__ import annotations

from typing import Any


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


def _splits_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """``moe_utils.maybe_move_tensor_to_cpu`` that also turns CPU split-size tensors into numpy arrays."""
    import torch

    if not torch.is_tensor(tensor):
        return tensor
    tensor = tensor.cpu()
    return tensor.numpy() if as_numpy else tensor


def patch_alltoall_splits() -> None:
    """Give the alltoall dispatcher host split sizes on CPU, as it gets them on CUDA.

    CUDA behaviour: ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` moves its split-size tensors to
    the host with ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which converts only CUDA tensors. On CPU
    they are already host tensors, so they stay tensors, and gloo's ``all_to_all_single`` (which wants int
    sequences) rejects them. The replacement converts host tensors the same way; it is bound where the
    dispatcher looks the name up. Its side stream is a no-op through the torch view (``CUDA_ASSUMING_MODULES``).
    """
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _splits_to_host
