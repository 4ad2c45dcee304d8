"""Packed rows through flash-attention's varlen kernel: core's attention with the CUDA route for ``cu_seqlens``.

Core's :class:`~loongforge.devices.sdpa_attention.SDPAttention` attends packed rows sequence by sequence, one SDPA
call per set of equal-length sequences (:mod:`loongforge.parallel.packed_rows`). On a GPU with flash-attn installed
one kernel does the whole micro-batch from the boundaries (``flash_attn_varlen_func``: tokens ``[total, heads, d]``,
``cu_seqlens`` int32), so the CUDA backend builds its local layers with this subclass when ``supports("flash_attn")``
(:meth:`~loongforge_cuda.backend.CUDABackend.spec_provider`). flash-attn computes in fp16/bf16 with one head width
for query, key and value; anything else (fp32, multi-latent attention's wider query/key heads, CPU tensors) keeps
core's path. Untested on hardware here (no GPU): the arguments follow flash-attn 2's public signature.
"""

from __future__ import annotations

import torch
from loongforge.devices.sdpa_attention import SDPAttention
from loongforge.parallel.packed_rows import PackedRows
from megatron.core import tensor_parallel

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


class FlashVarlenAttention(SDPAttention):
    """:class:`SDPAttention` whose packed rows (``PackedRows``) go through ``flash_attn_varlen_func`` where it can."""

    def _attend_varlen(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       layout: PackedRows) -> torch.Tensor:
        if query.device.type != "cuda" or query.dtype not in _FLASH_DTYPES or self.k_channels != self.v_channels:
            return super()._attend_varlen(query, key, value, layout)
        from flash_attn import flash_attn_varlen_func

        s, b = query.shape[:2]
        flat = [x.transpose(0, 1).reshape(b * s, *x.shape[2:]) for x in (query, key, value)]
        cu_seqlens = layout.cu_seqlens_q.to(device=query.device, dtype=torch.int32)
        dropout_p = self.dropout_p if self.training else 0.0
        with tensor_parallel.get_cuda_rng_tracker().fork():  # megatron's model-parallel RNG, as core's dropout
            out = flash_attn_varlen_func(
                *flat, cu_seqlens, cu_seqlens, layout.max_seqlen_q, layout.max_seqlen_kv, dropout_p=dropout_p,
                softmax_scale=self.softmax_scale, causal=True,
                window_size=(-1 if self.window is None else self.window, 0),
                softcap=0.0 if self.softcap is None else self.softcap)
        return out.reshape(b, s, *out.shape[1:]).transpose(0, 1)
