"""The CUDA backend's local layers (``device_options.layers: local``, or no Transformer Engine installed).

Megatron's local modules, except the core attention, which is core's
:class:`~loongforge.devices.sdpa_attention.SDPAttention`: torch's ``scaled_dot_product_attention`` picks the flash or
memory-efficient kernel on the GPU where megatron's ``DotProductAttention`` materialises the score matrix, and it
takes what megatron's module refuses -- Multi-Latent Attention's query/key and value heads of different widths
(``k_channels``/``v_channels``), Gemma-2's soft-capping and sliding window, Ulysses context parallelism. With
flash-attn usable (the backend's ``supports("flash_attn")``), packed rows go through its varlen kernel
(:class:`~loongforge_cuda.flash_varlen.FlashVarlenAttention`).
"""

from __future__ import annotations

from loongforge.devices.sdpa_attention import SDPAttention
from megatron.core.models.backends import LocalSpecProvider

from loongforge_cuda.flash_varlen import FlashVarlenAttention


class LocalSDPASpecProvider(LocalSpecProvider):
    """``LocalSpecProvider`` with torch SDPA as the core attention; ``flash_varlen``: packed rows through flash-attn."""

    def __init__(self, flash_varlen: bool = False) -> None:
        super().__init__()
        self.flash_varlen = flash_varlen

    def core_attention(self) -> type:
        """Core's SDPA attention (flash / memory-efficient kernels on the GPU), with flash-attn's varlen kernel for
        packed rows when ``flash_varlen``."""
        return FlashVarlenAttention if self.flash_varlen else SDPAttention
