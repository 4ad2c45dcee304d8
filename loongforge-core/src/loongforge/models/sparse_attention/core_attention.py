"""Megatron ``core_attention`` for DeepSeek sparse attention: lightning indexer + sparse attention + indexer loss.

Drops into ``MLASelfAttentionSubmodules.core_attention`` of megatron-core's ``MLASelfAttention`` built from an
``MLATransformerConfig`` with ``experimental_attention_variant='dsa'`` and ``dsa_indexer_n_heads``,
``dsa_indexer_head_dim``, ``dsa_indexer_topk`` (and ``dsa_indexer_loss_coeff`` to train the indexer). With that
variant megatron's MLA calls its core attention as::

    core_attention(query, key, value, attention_mask, packed_seq_params=..., attn_mask_type=..., x=hidden_states,
                   qr=q_compressed)

``query`` ``[sq, b, np, qk_head_dim + qk_pos_emb_head_dim]``, ``key`` likewise (per-head, expanded), ``value``
``[sq, b, np, v_head_dim]``, ``x`` the attention's input ``[sq, b, hidden]`` and ``qr`` the q-LoRA latent after
``q_layernorm`` ``[sq, b, q_lora_rank]`` (the hidden states when ``q_lora_rank`` is None). The constructor takes the
keywords MLA passes (``k_channels``, ``v_channels``, ``softmax_scale``, ``cp_comm_type``, ``pg_collection``).

The indexer's parameters live here, as ``core_attention.indexer.{wq_b,wk,k_norm,weights_proj}`` (transformers'
``self_attn.indexer.*``), and its RoPE tables come from a rotary embedding built like MLA's (``rope`` or ``yarn``),
applied half-split to the first ``qk_pos_emb_head_dim`` channels as transformers' ``DeepseekV32Indexer`` does.

Phases (:data:`DSA_PHASES`, attribute ``phase``, initially the ``phase`` argument -- a spec's ``params`` --, else
``config.dsa_phase`` if set, else ``'sparse'``):

- ``'dense_warmup'``: dense causal attention; in training the indexer's dense KL loss (Eq. 3) is attached to the
  output. Freeze everything else with :func:`freeze_all_but_indexers`.
- ``'sparse'``: top-k selection and sparse attention; in training the sparse KL loss (Eq. 4) is attached.

The loss (times ``dsa_indexer_loss_coeff``; none when it is 0 or unset) reaches the indexer only: ``x`` and ``qr``
are detached and the target is the detached attention distribution. ``last_indexer_loss`` keeps the latest value
(unscaled) for logging. When the sequence is no longer than ``top-k`` every query selects every earlier token, so
both phases compute dense causal attention (``torch.nn.functional.scaled_dot_product_attention``).

Not supported (raise): attention dropout, tensor/context parallelism, sequence packing (``packed_seq_params``),
masks other than causal, attention bias, key/value caches (``sq != skv``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge.errors import ConfigError
from loongforge.models.sparse_attention.indexer import LightningIndexer, select_topk
from loongforge.models.sparse_attention.losses import attach_indexer_loss, indexer_kl_loss
from loongforge.models.sparse_attention.sparse_attention import sparse_attention

#: The indexer's training phases, in order (DeepSeek-V3.2 report, Sec. 2.1).
DSA_PHASES = ("dense_warmup", "sparse")


def _rotary(config: TransformerConfig, cp_group: Any) -> torch.nn.Module:
    """A rotary embedding for the indexer built as megatron's MLA builds its own (same frequencies)."""
    from megatron.core.models.common.embeddings import RotaryEmbedding, YarnRotaryEmbedding

    if config.rope_type == "rope":
        return RotaryEmbedding(config.qk_pos_emb_head_dim, rotary_percent=config.rotary_percent,
                               rotary_base=config.rotary_base, cp_group=cp_group)
    if config.rope_type == "yarn":
        return YarnRotaryEmbedding(config.qk_pos_emb_head_dim, rotary_base=config.rotary_base,
                                   scaling_factor=config.rotary_scaling_factor,
                                   original_max_position_embeddings=config.original_max_position_embeddings,
                                   beta_fast=config.beta_fast, beta_slow=config.beta_slow, mscale=config.mscale,
                                   mscale_all_dim=config.mscale_all_dim, cp_group=cp_group)
    raise ConfigError(f"DSA supports rope_type 'rope' or 'yarn', not {config.rope_type!r}")


class DSACoreAttention(MegatronModule):
    """DeepSeek sparse attention as megatron's MLA core attention (see the module docstring)."""

    #: Generation recomputes the context each token: the indexer scores whole sequences (no key/value cache).
    supports_kv_cache = False

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, cp_comm_type: str | None = None,
                 pg_collection: Any = None, num_splits: int | None = None, phase: str | None = None) -> None:
        super().__init__(config=config)
        missing = [name for name in ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk")
                   if not getattr(config, name, None)]
        if missing:
            raise ConfigError(f"DSA core attention needs {', '.join(missing)} in the transformer config")
        if attn_mask_type != AttnMaskType.causal or attention_type != "self":
            raise ConfigError(f"DSA is causal self-attention, not {attn_mask_type} {attention_type}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ConfigError(f"DSA core attention has no attention dropout (got {dropout}); set attention_dropout 0")
        for name in ("tensor_model_parallel_size", "context_parallel_size"):
            if getattr(config, name, 1) > 1:
                raise ConfigError(f"DSA core attention does not support {name} > 1 yet")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(k_channels or config.kv_channels)
        self.indexer = LightningIndexer(config.hidden_size, config.q_lora_rank or config.hidden_size,
                                        config.dsa_indexer_n_heads, config.dsa_indexer_head_dim,
                                        config.qk_pos_emb_head_dim, config.dsa_indexer_topk)
        if config.perform_initialization:
            with torch.no_grad():
                for linear in (self.indexer.wq_b, self.indexer.wk, self.indexer.weights_proj):
                    config.init_method(linear.weight)
        self.rotary = _rotary(config, getattr(pg_collection, "cp", None))
        self.phase = phase or getattr(config, "dsa_phase", "sparse")
        if self.phase not in DSA_PHASES:
            raise ConfigError(f"dsa_phase {self.phase!r} is not one of {DSA_PHASES}")
        self.loss_coeff = float(config.dsa_indexer_loss_coeff or 0.0)
        self.last_indexer_loss: torch.Tensor | None = None

    def _rope(self, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        emb = self.rotary(seq)
        emb, mscale = emb if isinstance(emb, tuple) else (emb, 1.0)
        emb = emb.reshape(seq, -1).to(device)
        return emb.cos() * mscale, emb.sin() * mscale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, x: torch.Tensor | None = None, qr: torch.Tensor | None = None,
                attn_mask_type: AttnMaskType | None = None, attention_bias: torch.Tensor | None = None,
                packed_seq_params: Any = None) -> torch.Tensor:
        """``[sq, b, np * v_head_dim]`` from megatron's ``[s, b, heads, dim]`` query/key/value (see the module
        docstring for ``x`` and ``qr``)."""
        if x is None or qr is None:
            raise ValueError("DSA core attention needs x and qr: build MLA with experimental_attention_variant='dsa'")
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("DSA core attention supports neither attention_bias nor packed_seq_params")
        if attn_mask_type not in (None, AttnMaskType.causal):
            raise NotImplementedError(f"DSA core attention is causal only, not {attn_mask_type}")
        seq, batch, heads, _ = query.shape
        if key.shape[0] != seq:
            raise NotImplementedError("DSA core attention has no key/value cache (query and key lengths differ)")
        if attention_mask is not None:
            causal = torch.ones(seq, seq, dtype=torch.bool, device=attention_mask.device).triu(1)
            if attention_mask.dtype != torch.bool or not bool((attention_mask == causal).all()):
                raise NotImplementedError("DSA core attention supports only the causal mask")
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))  # [b, s, heads, dim]
        want_loss = self.training and torch.is_grad_enabled() and self.loss_coeff > 0
        dense = self.phase == "dense_warmup" or seq <= self.indexer.topk
        proj = None
        if want_loss or not dense:
            cos, sin = self._rope(seq, query.device)
            with torch.set_grad_enabled(want_loss):
                proj = self.indexer.project(x.detach().transpose(0, 1), qr.detach().transpose(0, 1), cos, sin)
        loss = None
        if dense:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, scale=self.softmax_scale).transpose(1, 2)
            if want_loss:
                loss = indexer_kl_loss(*proj, q, k, self.softmax_scale)
        else:
            indices = select_topk(proj.q.detach(), proj.k.detach(), proj.weights.detach(), self.indexer.topk)
            out, head_sum = sparse_attention(q, k, v, indices, self.softmax_scale, return_head_sum=True)
            if want_loss:
                loss = indexer_kl_loss(*proj, q, k, self.softmax_scale, indices, attention_head_sum=head_sum)
        if loss is not None:
            self.last_indexer_loss = loss.detach()
            out = attach_indexer_loss(out, loss * self.loss_coeff)
        return out.transpose(0, 1).reshape(seq, batch, -1)


def dsa_modules(model: torch.nn.Module) -> list[DSACoreAttention]:
    """Every :class:`DSACoreAttention` in ``model``."""
    return [module for module in model.modules() if isinstance(module, DSACoreAttention)]


def set_dsa_phase(model: torch.nn.Module, phase: str) -> int:
    """Put every DSA core attention of ``model`` in ``phase`` (:data:`DSA_PHASES`); returns how many."""
    if phase not in DSA_PHASES:
        raise ConfigError(f"DSA phase {phase!r} is not one of {DSA_PHASES}")
    modules = dsa_modules(model)
    for module in modules:
        module.phase = phase
    return len(modules)


def freeze_all_but_indexers(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The dense warm-up's freezing: ``requires_grad`` False on every parameter of ``model`` except the DSA
    indexers' (set True); returns the indexers' parameters (what the warm-up optimizer trains)."""
    indexer_params = {id(p): p for module in dsa_modules(model) for p in module.indexer.parameters()}
    for param in model.parameters():
        param.requires_grad_(id(param) in indexer_params)
    return list(indexer_params.values())
