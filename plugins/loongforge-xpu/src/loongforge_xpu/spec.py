"""The Kunlun backend's megatron ``BackendSpecProvider``: megatron's local modules, which Kunlun's ``xpu_plugin``
patches with fused XPU kernels, and a core attention that also builds Multi-Latent Attention.

Megatron's ``DotProductAttention`` (the local core attention the plugin accelerates) takes one head width for
queries, keys and values; MLA asks its core attention for query/key heads wider than its value heads
(``k_channels``/``v_channels``) and megatron's local module refuses those keywords. :func:`core_attention` keeps
``DotProductAttention`` for every attention that does not ask, and gives MLA core's
:class:`~loongforge.devices.sdpa_attention.SDPAttention` (torch's ``scaled_dot_product_attention``, which the
Kunlun torch build provides).
"""

from __future__ import annotations

from typing import Any

from loongforge.devices.sdpa_attention import SDPAttention
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.dot_product_attention import DotProductAttention


class MLAAwareCoreAttention:
    """What megatron builds as the core attention: ``DotProductAttention``, or ``SDPAttention`` when the attention
    states its own query/key and value head widths (MLA). A factory with a class's calling convention, because
    megatron's ``build_module`` instantiates the type a spec names."""

    def __new__(cls, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kwargs: Any) -> Any:
        if k_channels is None and v_channels is None:
            return DotProductAttention(*args, **kwargs)
        return SDPAttention(*args, k_channels=k_channels, v_channels=v_channels, **kwargs)


class XPUSpecProvider(LocalSpecProvider):
    """``LocalSpecProvider`` whose core attention also builds MLA (:class:`MLAAwareCoreAttention`)."""

    def core_attention(self) -> type:
        return MLAAwareCoreAttention
