"""Hugging Face Llama/Qwen2/Qwen3/Mixtral/Qwen3-MoE weights <-> megatron ``GPTModel`` state dict (TP=1, PP=1).

Megatron fuses projections that Hugging Face keeps separate:

* ``linear_qkv`` holds Q, K and V interleaved *per query group*: for each of the ``g`` groups, that group's
  ``heads/g`` query heads, then its key head, then its value head (so a TP shard is a contiguous slice);
* ``linear_fc1`` holds ``[gate; up]`` of the SwiGLU MLP (megatron applies ``silu(first half) * second half``);
* MoE layers: the router is ``mlp.router.weight`` (HF ``mlp.gate.weight``) and expert ``e`` is
  ``mlp.experts.local_experts.<e>.linear_fc1/linear_fc2`` -- the *global* expert index, as megatron's
  ``SequentialMLP`` names experts at ep=1 and in dist-checkpoints at any ep. Transformers 5 keeps all experts
  of a layer in two 3-D tensors (``experts.gate_up_proj`` ``[E, 2I, H]``, already gate-then-up, and
  ``experts.down_proj`` ``[E, H, I]``); older checkpoints have one module per expert (Mixtral
  ``block_sparse_moe.experts.<e>.w1/w3/w2``, Qwen3-MoE ``mlp.experts.<e>.gate_proj/up_proj/down_proj``) --
  and that per-expert layout is still what transformers 5 writes to disk. Both are read; checkpoint writers
  ask for the per-expert layout (``per_expert=True``), in-memory comparisons for the fused one.

The mapping is what the parity tests use to prove the megatron model computes the same function as
transformers; checkpoint conversion builds on it. The two directions are exact inverses (only reshapes,
concatenations and slices), so a round trip is bitwise. Other tensor/pipeline layouts are reached from these
full tensors by :mod:`loongforge.interop.sharding`, never by a second name map.
"""

from __future__ import annotations

from typing import Any

import torch

from loongforge.errors import ConfigError
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


def _hf_experts(sd: dict[str, torch.Tensor], hf: str, flavor: DecoderFlavor) -> tuple[torch.Tensor, ...]:
    """``(router [E, H], gate_up [E, 2I, H], down [E, H, I])`` of HF layer prefix ``hf`` in any known layout."""
    if flavor.moe_shared_expert_intermediate_size:
        raise ConfigError(f"{flavor.family}: no Hugging Face mapping for shared experts")
    if hf + "mlp.experts.gate_up_proj" in sd:  # transformers >= 5, in memory
        return sd[hf + "mlp.gate.weight"], sd[hf + "mlp.experts.gate_up_proj"], sd[hf + "mlp.experts.down_proj"]
    gate_up, down = [], []
    for e in range(flavor.num_experts or 0):  # one module per expert, as checkpoints store them
        gate, up, down_name = _expert_names(flavor, hf, e)
        gate_up.append(torch.cat([sd[gate], sd[up]]))
        down.append(sd[down_name])
    return sd[_router_name(flavor, hf, per_expert=True)], torch.stack(gate_up), torch.stack(down)


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
        if flavor.is_moe:
            router, gate_up, down = _hf_experts(sd, hf, flavor)
            out[mg + "mlp.router.weight"] = router
            for e in range(flavor.num_experts or 0):
                out[f"{mg}mlp.experts.local_experts.{e}.linear_fc1.weight"] = gate_up[e]
                out[f"{mg}mlp.experts.local_experts.{e}.linear_fc2.weight"] = down[e]
        else:
            out[mg + "mlp.linear_fc1.weight"] = torch.cat(
                [sd[hf + "mlp.gate_proj.weight"], sd[hf + "mlp.up_proj.weight"]], dim=0
            )
            out[mg + "mlp.linear_fc2.weight"] = sd[hf + "mlp.down_proj.weight"]
    out["decoder.final_layernorm.weight"] = sd["norm.weight"]
    if not flavor.tie_word_embeddings:
        out["output_layer.weight"] = _pad_rows(sd["lm_head.weight"], vocab_rows)
    return out


def _expert_names(flavor: DecoderFlavor, layer: str, expert: int) -> tuple[str, str, str]:
    """(gate, up, down) names of one expert in the per-expert checkpoint layout of ``flavor``'s family."""
    if flavor.family == "mixtral":
        moe = f"{layer}block_sparse_moe.experts.{expert}."
        return moe + "w1.weight", moe + "w3.weight", moe + "w2.weight"
    mlp = f"{layer}mlp.experts.{expert}."
    return mlp + "gate_proj.weight", mlp + "up_proj.weight", mlp + "down_proj.weight"


def _router_name(flavor: DecoderFlavor, layer: str, per_expert: bool) -> str:
    """The router: Mixtral checkpoints keep it under ``block_sparse_moe``, transformers 5 modules under ``mlp``."""
    mixtral_on_disk = per_expert and flavor.family == "mixtral"
    return f"{layer}block_sparse_moe.gate.weight" if mixtral_on_disk else f"{layer}mlp.gate.weight"


def _experts_out(layer: str, router: torch.Tensor, gate_up: list[torch.Tensor], down: list[torch.Tensor],
                 flavor: DecoderFlavor, per_expert: bool) -> dict[str, torch.Tensor]:
    """One MoE layer's HF tensors, fused (``experts.gate_up_proj``/``down_proj``) or one module per expert."""
    out = {_router_name(flavor, layer, per_expert): router}
    if not per_expert:
        out[layer + "mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        out[layer + "mlp.experts.down_proj"] = torch.stack(down)
        return out
    for e, (fc1, fc2) in enumerate(zip(gate_up, down, strict=True)):
        gate_name, up_name, down_name = _expert_names(flavor, layer, e)
        gate, up = fc1.chunk(2, dim=0)
        out.update({gate_name: gate, up_name: up, down_name: fc2})
    return out


def megatron_to_hf(
    megatron_state_dict: dict[str, torch.Tensor], flavor: DecoderFlavor, *, per_expert: bool = False
) -> dict[str, torch.Tensor]:
    """A ``*ForCausalLM`` state dict from a full megatron state dict: as the module holds it (MoE experts fused,
    ``per_expert=False``) or as ``save_pretrained`` writes it to disk (``per_expert=True``).

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
        if flavor.is_moe:
            experts = range(flavor.num_experts or 0)
            gate_up = [sd[f"{mg}mlp.experts.local_experts.{e}.linear_fc1.weight"] for e in experts]
            down = [sd[f"{mg}mlp.experts.local_experts.{e}.linear_fc2.weight"] for e in experts]
            out.update(_experts_out(hf, sd[mg + "mlp.router.weight"], gate_up, down, flavor, per_expert))
        else:
            gate, up = sd[mg + "mlp.linear_fc1.weight"].chunk(2, dim=0)
            out.update({hf + "mlp.gate_proj.weight": gate, hf + "mlp.up_proj.weight": up})
            out[hf + "mlp.down_proj.weight"] = sd[mg + "mlp.linear_fc2.weight"]
    out["model.norm.weight"] = sd["decoder.final_layernorm.weight"]
    if not flavor.tie_word_embeddings:
        out["lm_head.weight"] = sd["output_layer.weight"][:vocab]
    return {name: tensor.detach().clone(memory_format=torch.contiguous_format) for name, tensor in out.items()}


def hf_tensor_shapes(flavor: DecoderFlavor, *, per_expert: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor a ``*ForCausalLM`` checkpoint of ``flavor`` holds, with its shape (as saved: tied models
    have no ``lm_head.weight``; MoE experts fused or, with ``per_expert``, one module each). Used to refuse a
    checkpoint before any weight is read."""
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
        })
        if flavor.num_experts is not None:
            e, m = flavor.num_experts, flavor.moe_ffn_hidden_size or 0
            shapes[_router_name(flavor, hf, per_expert)] = (e, h)
            if per_expert:
                for expert in range(e):
                    gate, up, down = _expert_names(flavor, hf, expert)
                    shapes.update({gate: (m, h), up: (m, h), down: (h, m)})
            else:
                shapes.update({hf + "mlp.experts.gate_up_proj": (e, 2 * m, h), hf + "mlp.experts.down_proj": (e, h, m)})
        else:
            shapes.update({hf + "mlp.gate_proj.weight": (f, h), hf + "mlp.up_proj.weight": (f, h),
                           hf + "mlp.down_proj.weight": (h, f)})
        if flavor.add_qkv_bias:
            shapes.update({attn + "q_proj.bias": (q,), attn + "k_proj.bias": (kv,), attn + "v_proj.bias": (kv,)})
        if flavor.qk_layernorm:
            shapes.update({attn + "q_norm.weight": (d,), attn + "k_norm.weight": (d,)})
    if not flavor.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, h)
    return shapes


def flavor_from_hf_config(config: object, *, family: str) -> DecoderFlavor:
    """A :class:`DecoderFlavor` from a transformers ``LlamaConfig``/``Qwen2Config``/``Qwen3Config``/``MixtralConfig``/
    ``Qwen3MoeConfig`` (``family`` ``qwen3-moe`` has Qwen3's QK-norm), or the ``text_config`` of a Qwen2-VL /
    Qwen2.5-VL model (``family`` ``qwen2``: its ``mrope_section`` becomes the flavor's)."""

    def get(name: str) -> Any:
        return getattr(config, name, None)

    rope_parameters = get("rope_parameters")
    if isinstance(rope_parameters, dict):  # transformers >= 5 keeps theta and scaling together
        rope_theta = rope_parameters.get("rope_theta", 10000.0)
        rope_scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    else:
        rope_theta = get("rope_theta") or 10000.0
        rope_scaling = dict(get("rope_scaling") or {})
    # Qwen2-VL's text config: M-RoPE sections, with rope type "default" (transformers 5) or "mrope" (older files).
    mrope_section = rope_scaling.pop("mrope_section", None)
    if rope_scaling.get("rope_type", rope_scaling.get("type", "default")) in ("default", "mrope"):
        rope_scaling = None
    heads = get("num_attention_heads")
    head_dim = get("head_dim")
    experts = get("num_local_experts") or get("num_experts")  # Mixtral / Qwen3-MoE names
    moe: dict[str, Any] = {}
    if experts:
        moe = dict(num_experts=experts, moe_router_topk=get("num_experts_per_tok"),
                   moe_ffn_hidden_size=get("moe_intermediate_size") or get("intermediate_size"),
                   moe_aux_loss_coeff=float(get("router_aux_loss_coef") or 0.0),
                   moe_norm_topk_prob=get("norm_topk_prob") is not False)
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
        qk_layernorm=family in ("qwen3", "qwen3-moe"),
        add_qkv_bias=family == "qwen2",
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        head_dim=head_dim if head_dim and head_dim != get("hidden_size") // heads else None,
        hf_architecture=(get("architectures") or [type(config).__name__.replace("Config", "ForCausalLM")])[0],
        mrope_section=None if mrope_section is None else tuple(mrope_section),
        **moe,
    )
