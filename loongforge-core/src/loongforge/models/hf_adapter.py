"""Hugging Face Llama/Qwen2/Qwen3 weights <-> megatron ``GPTModel`` state dict (TP=1, PP=1 names and shapes).

Megatron fuses projections that Hugging Face keeps separate:

* ``linear_qkv`` holds Q, K and V interleaved *per query group*: for each of the ``g`` groups, that group's
  ``heads/g`` query heads, then its key head, then its value head (so a TP shard is a contiguous slice);
* ``linear_fc1`` holds ``[gate; up]`` of the SwiGLU MLP (megatron applies ``silu(first half) * second half``).

The mapping is what the parity tests use to prove the megatron model computes the same function as
transformers; checkpoint conversion builds on it. The two directions are exact inverses (only reshapes,
concatenations and slices), so a round trip is bitwise. Other tensor/pipeline layouts are reached from these
full tensors by :mod:`loongforge.interop.sharding`, never by a second name map.
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


def split_qkv(fused: torch.Tensor, flavor: DecoderFlavor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: HF ``(q, k, v)`` weights (or biases) from megatron's ``linear_qkv``."""
    groups, d = flavor.num_query_groups, flavor.kv_channels
    heads_per_group = flavor.num_attention_heads // groups
    rest = fused.shape[1:]
    per_group = fused.reshape(groups, (heads_per_group + 2) * d, *rest)
    q, k, v = per_group.split([heads_per_group * d, d, d], dim=1)
    return (q.reshape(groups * heads_per_group * d, *rest), k.reshape(groups * d, *rest),
            v.reshape(groups * d, *rest))


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


def megatron_to_hf(megatron_state_dict: dict[str, torch.Tensor], flavor: DecoderFlavor) -> dict[str, torch.Tensor]:
    """A ``*ForCausalLM`` state dict (as ``save_pretrained`` writes it) from a full megatron state dict.

    Padded vocabulary rows are dropped; a tied model has no ``lm_head.weight`` (Hugging Face re-ties it on
    load). Every tensor is a fresh contiguous copy, so the result can be written with safetensors.
    """
    sd = megatron_state_dict
    vocab = flavor.vocab_size
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"][:vocab]}
    for i in range(flavor.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = hf + "self_attn."
        out[hf + "input_layernorm.weight"] = sd[mg + "input_layernorm.weight"]
        q, k, v = split_qkv(sd[mg + "self_attention.linear_qkv.weight"], flavor)
        out.update({attn + "q_proj.weight": q, attn + "k_proj.weight": k, attn + "v_proj.weight": v})
        if flavor.add_qkv_bias:
            q, k, v = split_qkv(sd[mg + "self_attention.linear_qkv.bias"], flavor)
            out.update({attn + "q_proj.bias": q, attn + "k_proj.bias": k, attn + "v_proj.bias": v})
        if flavor.qk_layernorm:
            out[attn + "q_norm.weight"] = sd[mg + "self_attention.q_layernorm.weight"]
            out[attn + "k_norm.weight"] = sd[mg + "self_attention.k_layernorm.weight"]
        out[attn + "o_proj.weight"] = sd[mg + "self_attention.linear_proj.weight"]
        out[hf + "post_attention_layernorm.weight"] = sd[mg + "pre_mlp_layernorm.weight"]
        gate, up = sd[mg + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out.update({hf + "mlp.gate_proj.weight": gate, hf + "mlp.up_proj.weight": up})
        out[hf + "mlp.down_proj.weight"] = sd[mg + "mlp.linear_fc2.weight"]
    out["model.norm.weight"] = sd["decoder.final_layernorm.weight"]
    if not flavor.tie_word_embeddings:
        out["lm_head.weight"] = sd["output_layer.weight"][:vocab]
    return {name: tensor.detach().clone(memory_format=torch.contiguous_format) for name, tensor in out.items()}


def hf_tensor_shapes(flavor: DecoderFlavor) -> dict[str, tuple[int, ...]]:
    """Every tensor a ``*ForCausalLM`` checkpoint of ``flavor`` holds, with its shape (as saved: tied models
    have no ``lm_head.weight``). Used to refuse a checkpoint before any weight is read."""
    h, f, d, vocab = flavor.hidden_size, flavor.ffn_hidden_size, flavor.kv_channels, flavor.vocab_size
    q, kv = flavor.num_attention_heads * d, flavor.num_query_groups * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    for i in range(flavor.num_layers):
        hf = f"model.layers.{i}."
        attn = hf + "self_attn."
        shapes.update({
            hf + "input_layernorm.weight": (h,), hf + "post_attention_layernorm.weight": (h,),
            attn + "q_proj.weight": (q, h), attn + "k_proj.weight": (kv, h), attn + "v_proj.weight": (kv, h),
            attn + "o_proj.weight": (h, q),
            hf + "mlp.gate_proj.weight": (f, h), hf + "mlp.up_proj.weight": (f, h), hf + "mlp.down_proj.weight": (h, f),
        })
        if flavor.add_qkv_bias:
            shapes.update({attn + "q_proj.bias": (q,), attn + "k_proj.bias": (kv,), attn + "v_proj.bias": (kv,)})
        if flavor.qk_layernorm:
            shapes.update({attn + "q_norm.weight": (d,), attn + "k_norm.weight": (d,)})
    if not flavor.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, h)
    return shapes


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
