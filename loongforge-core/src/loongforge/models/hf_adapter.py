"""Hugging Face Llama/Qwen2/Qwen3 weights -> megatron ``GPTModel`` state dict (TP=1, PP=1).

Megatron fuses projections that Hugging Face keeps separate:

* ``linear_qkv`` holds Q, K and V interleaved *per query group*: for each of the ``g`` groups, that group's
  ``heads/g`` query heads, then its key head, then its value head (so a TP shard is a contiguous slice);
* ``linear_fc1`` holds ``[gate; up]`` of the SwiGLU MLP (megatron applies ``silu(first half) * second half``).

The mapping is what the parity tests use to prove the megatron model computes the same function as
transformers; checkpoint conversion builds on it.
"""

from __future__ import annotations

from typing import Any

import torch

from loongforge.models.flavor import DecoderFlavor


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flavor: DecoderFlavor) -> torch.Tensor:
    """Interleave HF ``q_proj``/``k_proj``/``v_proj`` weights (or biases) into megatron's per-group layout."""
    groups, d = flavor.num_query_groups, flavor.kv_channels
    heads_per_group = flavor.num_attention_heads // groups
    rest = q.shape[1:]
    q = q.reshape(groups, heads_per_group * d, *rest)
    k = k.reshape(groups, d, *rest)
    v = v.reshape(groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(groups * (heads_per_group + 2) * d, *rest)


def _pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero rows appended up to megatron's padded vocabulary (padded ids never occur in data)."""
    if weight.shape[0] == rows:
        return weight
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])


def hf_to_megatron(
    hf_state_dict: dict[str, torch.Tensor], flavor: DecoderFlavor, *, padded_vocab_size: int | None = None
) -> dict[str, torch.Tensor]:
    """Megatron ``GPTModel`` state dict (TP=1, PP=1) from a ``*ForCausalLM`` state dict of ``flavor``."""
    sd = {k.removeprefix("model."): v for k, v in hf_state_dict.items()}
    vocab_rows = padded_vocab_size or flavor.vocab_size
    out = {"embedding.word_embeddings.weight": _pad_rows(sd["embed_tokens.weight"], vocab_rows)}
    for i in range(flavor.num_layers):
        hf, mg = f"layers.{i}.", f"decoder.layers.{i}."
        attn = hf + "self_attn."
        out[mg + "input_layernorm.weight"] = sd[hf + "input_layernorm.weight"]
        out[mg + "self_attention.linear_qkv.weight"] = fuse_qkv(
            sd[attn + "q_proj.weight"], sd[attn + "k_proj.weight"], sd[attn + "v_proj.weight"], flavor
        )
        if flavor.add_qkv_bias:
            out[mg + "self_attention.linear_qkv.bias"] = fuse_qkv(
                sd[attn + "q_proj.bias"], sd[attn + "k_proj.bias"], sd[attn + "v_proj.bias"], flavor
            )
        if flavor.qk_layernorm:
            out[mg + "self_attention.q_layernorm.weight"] = sd[attn + "q_norm.weight"]
            out[mg + "self_attention.k_layernorm.weight"] = sd[attn + "k_norm.weight"]
        out[mg + "self_attention.linear_proj.weight"] = sd[attn + "o_proj.weight"]
        out[mg + "pre_mlp_layernorm.weight"] = sd[hf + "post_attention_layernorm.weight"]
        out[mg + "mlp.linear_fc1.weight"] = torch.cat(
            [sd[hf + "mlp.gate_proj.weight"], sd[hf + "mlp.up_proj.weight"]], dim=0
        )
        out[mg + "mlp.linear_fc2.weight"] = sd[hf + "mlp.down_proj.weight"]
    out["decoder.final_layernorm.weight"] = sd["norm.weight"]
    if not flavor.tie_word_embeddings:
        out["output_layer.weight"] = _pad_rows(sd["lm_head.weight"], vocab_rows)
    return out


def flavor_from_hf_config(config: object, *, family: str) -> DecoderFlavor:
    """A :class:`DecoderFlavor` from a transformers ``LlamaConfig``/``Qwen2Config``/``Qwen3Config``."""

    def get(name: str) -> Any:
        return getattr(config, name, None)

    rope_parameters = get("rope_parameters")
    if isinstance(rope_parameters, dict):  # transformers >= 5 keeps theta and scaling together
        rope_theta = rope_parameters.get("rope_theta", 10000.0)
        default = rope_parameters.get("rope_type", "default") == "default"
        rope_scaling = None if default else {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    else:
        rope_theta = get("rope_theta") or 10000.0
        rope_scaling = get("rope_scaling") or None
    heads = get("num_attention_heads")
    head_dim = get("head_dim")
    return DecoderFlavor(
        family=family,
        num_layers=get("num_hidden_layers"),
        hidden_size=get("hidden_size"),
        ffn_hidden_size=get("intermediate_size"),
        num_attention_heads=heads,
        num_query_groups=get("num_key_value_heads") or heads,
        vocab_size=get("vocab_size"),
        max_position_embeddings=get("max_position_embeddings"),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        norm_eps=get("rms_norm_eps"),
        qk_layernorm=family == "qwen3",
        add_qkv_bias=family == "qwen2",
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        head_dim=head_dim if head_dim and head_dim != get("hidden_size") // heads else None,
        hf_architecture=(get("architectures") or [type(config).__name__.replace("Config", "ForCausalLM")])[0],
    )
