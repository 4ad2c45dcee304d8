"""Megatron ``core_attention`` module backed by ``torch.nn.functional.scaled_dot_product_attention``.

Megatron's local ``DotProductAttention`` materialises the ``[b*np, sq, sk]`` score matrix with ``baddbmm``,
masks and softmaxes it in separate kernels and repeats K/V for GQA. On CPU, torch's SDPA runs a fused
flash-style kernel instead; plain PyTorch training loops (our benchmark baseline) use it, so a megatron model
must too to be competitive. The constructor takes every keyword megatron-core's attention modules (0.15 and
0.16) pass to their core attention -- ``DotProductAttention``'s and ``TEDotProductAttention``'s, which adds
``k_channels``/``v_channels`` (multi-latent attention) and ``num_splits`` -- and ``forward`` matches theirs, so
the module drops into ``SelfAttentionSubmodules.core_attention`` and ``MLASelfAttentionSubmodules.core_attention``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

from loongforge.devices import chunk_attention, ring_attention, ulysses
from loongforge.errors import ConfigError
from loongforge.parallel.packed_rows import PackedRows
from loongforge.parallel.sequence_chunks import SequenceChunk
from loongforge.parallel.sequence_pieces import SequencePieces

#: ``enable_gqa`` appeared in torch 2.5; older torch gets K/V repeated explicitly.
_SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)

#: Megatron's ``cp_comm_type`` -> how this module exchanges a context-parallel sequence. TE's ``all_gather``
#: keeps the heads whole, as the ring does, so a layout valid for it is valid for the ring. None: Ulysses.
_CP_MODES = {None: "ulysses", "a2a": "ulysses", "p2p": "ring", "all_gather": "ring", "a2a+p2p": "hybrid"}


class SDPAttention(MegatronModule):
    """Causal/padded multi-head attention with grouped K/V, via torch SDPA.

    Inputs are megatron's ``[sq, b, heads, head_dim]`` query/key/value (key/value carry the query groups of
    this tensor-parallel rank); the output is ``[sq, b, heads * v_head_dim]``. Query and key heads have
    ``k_channels`` channels and value heads ``v_channels`` (both default to ``config.kv_channels``; multi-latent
    attention passes ``qk_head_dim + qk_pos_emb_head_dim`` and ``v_head_dim``, which differ), and the default
    softmax scale is ``1 / sqrt(k_channels)``. Supported: causal and
    ``no_mask`` attention, explicit boolean masks (megatron convention: ``True`` = masked out), attention
    dropout (forked on the model-parallel RNG like megatron), GQA. An explicit mask replaces the causal flag (as
    in megatron's softmax), so it must carry causality itself. Packed rows come as ``packed_seq_params``
    :class:`~loongforge.parallel.packed_rows.PackedRows` (their sequence boundaries, ``cu_seqlens``): each sequence
    is attended causally on its own (varlen; :meth:`_attend_varlen`), with no ``s * s`` mask. Context parallelism
    (``context_parallel_size > 1``) goes through an
    all-to-all over heads (:mod:`loongforge.devices.ulysses`), ring attention (:mod:`loongforge.devices.ring_attention`)
    or both (Ulysses inside megatron's hierarchical cp sub-groups, a ring across them), as megatron's
    ``cp_comm_type`` says (``a2a`` or None, ``p2p`` or ``all_gather``, ``a2a+p2p``); causal and unmasked attention
    only, and no attention dropout around a ring. Packed rows under context parallelism come as
    ``packed_seq_params`` :class:`~loongforge.parallel.sequence_pieces.SequencePieces` (every sequence split on
    its own, or dealt whole to one rank): each token attends causally within its own sequence (varlen again). A
    chunk of a sequence (``parallel.seq_chunks``) comes as
    :class:`~loongforge.parallel.sequence_chunks.SequenceChunk` and attends over its own and the earlier chunks'
    K/V (:mod:`loongforge.devices.chunk_attention`). Sliding-window attention
    follows megatron's ``window_size``/``window_attn_skip_freq`` (a band mask on the layers they select) and
    ``softcap`` ``c`` replaces the scaled scores ``s`` by ``c * tanh(s / c)`` before masking (Gemma-2; SDPA has no
    hook for it, so those layers compute the scores explicitly). ``num_splits`` (TE's flash-decoding split
    count) chooses how an exact result is computed, not what it is, so it is accepted and ignored. Not supported
    (raise at construction or call): non-vanilla softmax, recording the max attention logit (``qk_clip``,
    ``log_max_attention_logit``), DeepSeek sparse attention (``experimental_attention_variant='dsa'``), megatron's
    THD packed sequences (other ``packed_seq_params``), attention bias, explicit masks, sliding windows or soft-capping
    with context parallelism.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        num_splits: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__(config=config)
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise NotImplementedError(f"SDPAttention supports only vanilla softmax, not {config.softmax_type}")
        if getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit", False):
            raise ConfigError("SDPAttention does not record the max attention logit that megatron's qk_clip / "
                              "log_max_attention_logit need (Transformer Engine's attention does)")
        if getattr(config, "experimental_attention_variant", None) == "dsa":
            raise ConfigError("SDPAttention does not implement DeepSeek sparse attention "
                              "(experimental_attention_variant='dsa')")
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"SDPAttention: num_splits must be a positive count, got {num_splits}")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        tp_size = pg_collection.tp.size()
        #: The context-parallel group when the sequence is split over > 1 ranks, else None.
        self.cp_group = pg_collection.cp if config.context_parallel_size > 1 else None
        if cp_comm_type not in _CP_MODES:
            raise ValueError(f"SDPAttention: unknown cp_comm_type {cp_comm_type!r}; known: a2a, p2p, all_gather, "
                             "a2a+p2p")
        #: ``ulysses``, ``ring`` or ``hybrid`` (with context parallelism).
        self.cp_mode = _CP_MODES[cp_comm_type]
        #: The Ulysses sub-group and the ring group of hybrid context parallelism (megatron's ``hcp``).
        self.hybrid_groups = getattr(pg_collection, "hcp", None) if self.cp_mode == "hybrid" else None
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.num_heads = divide(config.num_attention_heads, tp_size)
        self.num_groups = divide(config.num_query_groups, tp_size)
        #: Channels of a query/key head and of a value head (multi-latent attention: they differ).
        self.k_channels = k_channels if k_channels is not None else config.kv_channels
        self.v_channels = v_channels if v_channels is not None else config.kv_channels
        # Megatron's apply_query_key_layer_scaling divides the scores by layer_number and multiplies them back
        # inside the fp32 softmax; mathematically the scale is unchanged, so SDPA gets the plain scale.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.k_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        #: Tokens before the query this layer attends to (None: all), as megatron's ``window_size[0]``.
        self.window = (config.window_size[0] if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number) else None)
        if self.window is not None and config.window_size[1] != 0:
            raise ConfigError(f"SDPAttention supports causal windows (right size 0), not {config.window_size}")
        self.softcap = softcap
        if (self.window is not None or softcap is not None) and self.cp_group is not None:
            raise ConfigError("SDPAttention does not support sliding windows or soft-capping with context "
                              "parallelism (parallel.cp > 1); use cp=1")
        if self.cp_group is not None:
            self._check_context_parallel(config, tp_size)

    def _check_context_parallel(self, config: TransformerConfig, tp_size: int) -> None:
        """What each exchange needs: Ulysses splits the K/V groups over cp, hybrid over its sub-groups (which
        megatron's parallel state must hold); the ring computes attention itself, without dropout."""
        if self.cp_mode == "ulysses":
            divide(config.num_query_groups, tp_size * self.cp_group.size())
            return
        if self.dropout_p > 0.0:
            raise ConfigError(f"SDPAttention: attention dropout ({self.dropout_p}) is not supported with "
                              f"parallel.cp_mode {self.cp_mode}; use cp_mode ulysses or attention dropout 0")
        if self.cp_mode == "hybrid":
            if not self.hybrid_groups or len(self.hybrid_groups) != 2:
                raise ConfigError("SDPAttention: cp_comm_type a2a+p2p needs megatron's hierarchical context-parallel "
                                  "groups (two levels: Ulysses sub-groups, ring); initialise the parallel state "
                                  "through MegatronStrategy.initialize with parallel.cp_mode hybrid")
            divide(config.num_query_groups, tp_size * self.hybrid_groups[0].size())

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """Attend ``query`` over ``key``/``value``; returns ``[sq, b, heads * v_channels]``."""
        if packed_seq_params is not None and not isinstance(packed_seq_params,
                                                            (PackedRows, SequencePieces, SequenceChunk)):
            raise NotImplementedError("SDPAttention does not support megatron's THD packed sequences")
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention does not support attention bias")
        if query.shape[-1] != self.k_channels or key.shape[-1] != self.k_channels or value.shape[-1] != self.v_channels:
            raise ValueError(f"SDPAttention was built for query/key heads of {self.k_channels} and value heads of "
                             f"{self.v_channels} channels, got query {tuple(query.shape)}, key {tuple(key.shape)}, "
                             f"value {tuple(value.shape)}")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if isinstance(packed_seq_params, SequenceChunk):  # parallel.seq_chunks: over the earlier chunks' K/V too
            out = self._attend_chunk(query, key, value, attention_mask, mask_type, packed_seq_params)
        elif isinstance(packed_seq_params, PackedRows):
            if self.cp_group is not None:
                raise NotImplementedError("SDPAttention: packed rows under context parallelism come as SequencePieces")
            self._check_packed(attention_mask, mask_type)
            out = self._attend_varlen(query, key, value, packed_seq_params)
        elif packed_seq_params is not None:
            out = self._attend_pieces(query, key, value, attention_mask, mask_type, packed_seq_params)
        elif self.cp_group is None:
            out = self._attend(query, key, value, attention_mask, mask_type)
        else:
            if attention_mask is not None:
                raise NotImplementedError("SDPAttention with context parallelism supports causal masks only")
            out = self._attend_context_parallel(query, key, value, mask_type)
        # [sq, b, n, dv] -> [sq, b, n * dv]
        return out.reshape(out.shape[0], out.shape[1], self.num_heads * self.v_channels)

    def _attend_pieces(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, mask_type: AttnMaskType,
                       pieces: SequencePieces) -> torch.Tensor:
        """Causal attention within each sequence of a packed row laid out by ``pieces``; ``[sq, 1, n, dv]``."""
        self._check_packed(attention_mask, mask_type)
        if not pieces.split:  # every sequence whole on this rank: local attention, no exchange
            rank = 0 if self.cp_group is None else self.cp_group.rank()
            return self._attend_varlen(query, key, value, PackedRows.from_segments(pieces.segments(rank)[None]))
        if self.cp_group is None:
            raise ValueError("SDPAttention: split packed sequences need context parallelism (cp > 1)")
        if self.cp_mode == "ulysses":
            order, segments = pieces.natural_order()
            (query, key, value), restore = ulysses.gather_sequence((query, key, value), self.cp_group, order)
            out = self._attend_varlen(query, key, value, PackedRows.from_segments(segments[None]))
            return ulysses.scatter_sequence(out, restore, self.cp_group)
        a2a_group, ring_group = self.hybrid_groups or (None, self.cp_group)
        return ring_attention.context_parallel_attention(
            query, key, value, ring_group, a2a_group, causal=True, scale=self.softmax_scale, pieces=pieces.pieces)

    @staticmethod
    def _check_packed(attention_mask: torch.Tensor | None, mask_type: AttnMaskType) -> None:
        """Packed sequences are attended causally, each on its own; an explicit mask would say something else."""
        if attention_mask is not None or mask_type != AttnMaskType.causal:
            raise NotImplementedError("SDPAttention: packed sequences (packed_seq_params) take causal attention "
                                      f"without an explicit mask, got {mask_type}")

    def _attend_varlen(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       layout: PackedRows) -> torch.Tensor:
        """Causal attention within each sequence of ``layout`` over ``[s, b, heads, d]`` rows; ``[s, b, n, dv]``.

        The tokens are reordered once so that the sequences of one length sit together, each such group is viewed
        as a batch ``[length, count, heads, d]`` and attended with the causal flag (:meth:`_attend`, so windows,
        soft-capping, dropout and GQA behave as for whole rows), and the outputs are put back in row order: one
        gather and one scatter per tensor, however many sequences (a gather per group would make backward add up
        a zero-filled full-size gradient per group). No ``s * s`` tensor is made; a device with a varlen kernel
        overrides this method (the CUDA plugin's flash-attention)."""
        s, b = query.shape[:2]
        order = layout.order.to(query.device)
        grouped = [x.transpose(0, 1).reshape(b * s, *x.shape[2:]).index_select(0, order) for x in (query, key, value)]
        sizes = [length * count for length, count in layout.groups]
        outs = []
        for (length, count), *parts in zip(layout.groups, *(x.split(sizes) for x in grouped), strict=True):
            batched = [part.view(count, length, *part.shape[1:]).transpose(0, 1) for part in parts]
            out = self._attend(*batched, None, AttnMaskType.causal)  # [length, count, n, dv]
            outs.append(out.transpose(0, 1).reshape(length * count, *out.shape[2:]))
        out = torch.cat(outs).index_select(0, layout.restore.to(query.device))
        return out.reshape(b, s, *out.shape[1:]).transpose(0, 1)

    def _attend_chunk(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, mask_type: AttnMaskType,
                      chunk: SequenceChunk) -> torch.Tensor:
        """Causal attention of one chunk of a sequence over its own and the earlier chunks' K/V; ``[sq, b, n, dv]``."""
        if attention_mask is not None or mask_type != AttnMaskType.causal or self.cp_group is not None:
            raise NotImplementedError("SDPAttention: parallel.seq_chunks takes causal attention without an explicit "
                                      f"mask or context parallelism, got {mask_type}")
        if self.window is not None or self.softcap is not None or (self.dropout_p and self.training):
            raise NotImplementedError("SDPAttention: parallel.seq_chunks does not support sliding windows, "
                                      "soft-capping or attention dropout")
        return chunk_attention.chunk_attention(query, key, value, self, chunk, self.softmax_scale)

    def _attend_context_parallel(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask_type: AttnMaskType
    ) -> torch.Tensor:
        """Attention over the sequence of the whole cp group; ``[sq, b, n, dv]`` for this rank's chunks."""
        if self.cp_mode == "ulysses":
            (query, key, value), restore = ulysses.gather_sequence((query, key, value), self.cp_group)
            return ulysses.scatter_sequence(self._attend(query, key, value, None, mask_type), restore, self.cp_group)
        if mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise NotImplementedError(f"SDPAttention with cp_mode {self.cp_mode} supports causal and unmasked "
                                      f"attention, not {mask_type}")
        a2a_group, ring_group = self.hybrid_groups or (None, self.cp_group)
        return ring_attention.context_parallel_attention(
            query, key, value, ring_group, a2a_group, causal=mask_type == AttnMaskType.causal,
            scale=self.softmax_scale)

    def _attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
        mask_type: AttnMaskType,
    ) -> torch.Tensor:
        """SDPA over ``[s, b, heads, d]`` inputs (any head counts; value heads have their own d); ``[sq, b, n, dv]``."""
        sq, sk = query.shape[0], key.shape[0]
        # [s, b, n, d] -> [b, n, s, d]
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        mask, is_causal = self._sdpa_mask(attention_mask, mask_type, sq, sk, query.device)
        if self.window is not None or self.softcap is not None:
            mask, is_causal = self._banded(mask, is_causal, sq, sk, query.device), False
        if self.softcap is not None:
            return self._softcapped(q, k, v, mask).permute(2, 0, 1, 3)
        kwargs: dict[str, Any] = {}
        if query.shape[2] != key.shape[2]:
            if _SDPA_HAS_GQA:
                kwargs["enable_gqa"] = True
            else:
                k = k.repeat_interleave(query.shape[2] // key.shape[2], dim=1)
                v = v.repeat_interleave(query.shape[2] // key.shape[2], dim=1)
        dropout_p = self.dropout_p if self.training else 0.0
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                    scale=self.softmax_scale, **kwargs,
                )
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                scale=self.softmax_scale, **kwargs,
            )
        # [b, n, sq, d] -> [sq, b, n, d]
        return out.permute(2, 0, 1, 3)

    def _banded(self, mask: torch.Tensor | None, is_causal: bool, sq: int, sk: int,
                device: torch.device) -> torch.Tensor | None:
        """``mask`` (``True`` = attend) made explicit and cut to this layer's window."""
        if mask is None and is_causal:
            mask = torch.ones(sq, sk, dtype=torch.bool, device=device).tril(diagonal=sk - sq)
        if self.window is None:
            return mask
        query_pos = torch.arange(sk - sq, sk, device=device).unsqueeze(1)
        band = query_pos - torch.arange(sk, device=device).unsqueeze(0) <= self.window
        return band if mask is None else mask & band

    def _softcapped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None) -> torch.Tensor:
        """Attention with soft-capped scores over ``[b, n, s, d]`` inputs (K/V groups repeated); ``[b, n, sq, d]``."""
        if q.shape[1] != k.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        dropout_p = self.dropout_p if self.training else 0.0
        if dropout_p > 0.0:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = F.dropout(probs, p=dropout_p)
        return torch.matmul(probs, v)

    @staticmethod
    def _sdpa_mask(
        attention_mask: torch.Tensor | None, mask_type: AttnMaskType, sq: int, sk: int, device: torch.device
    ) -> tuple[torch.Tensor | None, bool]:
        """Translate megatron's mask (``True`` = masked out) into SDPA's (``True`` = attend) and causal flag."""
        if attention_mask is not None:
            return ~attention_mask, False
        if mask_type == AttnMaskType.no_mask or sq == 1:
            return None, False
        if mask_type != AttnMaskType.causal:
            raise NotImplementedError(f"SDPAttention needs an explicit mask for {mask_type}")
        if sq == sk:
            return None, True
        # Decoding with a cache: queries are the last sq positions, aligned to the bottom right.
        keep = torch.ones(sq, sk, dtype=torch.bool, device=device).tril(diagonal=sk - sq)
        return keep, False
