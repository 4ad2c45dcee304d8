"""The CPU backend's megatron ``BackendSpecProvider``: megatron's local modules with a fused attention and norm.

Linear layers and MoE experts are megatron's own local (pure torch) modules; the core attention is
:class:`~loongforge.devices.sdpa_attention.SDPAttention` (torch SDPA instead of the unfused baddbmm/softmax
path) and the norm is :class:`~loongforge.devices.norm.SPNorm` (``F.rms_norm``, sequence-parallel aware).
"""

from __future__ import annotations

from megatron.core.models.backends import LocalSpecProvider

from loongforge.devices.norm import SPNorm
from loongforge.devices.sdpa_attention import SDPAttention


class CPUSpecProvider(LocalSpecProvider):
    """``LocalSpecProvider`` with SDPA core attention and the SP-aware fused norm."""

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        """SPNorm for every norm; it reads RMSNorm vs LayerNorm from the TransformerConfig."""
        return SPNorm

    def core_attention(self) -> type:
        """Torch SDPA attention."""
        return SDPAttention
