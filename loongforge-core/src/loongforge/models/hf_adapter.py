"""Hugging Face ``*ForCausalLM`` weights <-> megatron ``GPTModel`` state dict (TP=1, PP=1), for every decoder family.

Where a family's tensors live is a row of :mod:`loongforge.models.hf_layouts`; here each row becomes a list of
rules, one per megatron tensor, which both directions and the expected-shape table are derived from.
Megatron fuses projections that Hugging Face keeps separate:

* ``linear_qkv`` holds Q, K and V interleaved *per query group*: for each of the ``g`` groups, that group's
  ``heads/g`` query heads, then its key head, then its value head (so a TP shard is a contiguous slice);
* ``linear_fc1`` holds ``[gate; up]`` of a gated MLP (megatron applies ``act(first half) * second half``);
* GPT-2 stores ``[q; k; v]`` in one ``Conv1D`` whose weights are ``[in, out]``; GPT-NeoX stores ``[q, k, v]``
  per head, which already is megatron's layout (each head is its own group);
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

from dataclasses import dataclass
from typing import Any

import torch

from loongforge.errors import ConfigError
from loongforge.models.flavor import DecoderFlavor
from loongforge.models.hf_layouts import (
    FAMILIES,
    HF_ACTIVATIONS,
    HFNames,
    config_key,
    hf_family,
    hf_names,
    with_base_prefix,
)


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


@dataclass(frozen=True)
class _Rule:
    """One megatron tensor and the Hugging Face tensor(s) it is made of.

    ``kind`` says how: ``same`` (one tensor, equal), ``qkv`` (``q``, ``k``, ``v`` interleaved per group),
    ``stacked_qkv`` (one ``[q; k; v]`` tensor, interleaved the same way), ``gate_up`` (``[gate; up]``), ``vocab``
    (rows padded to megatron's vocabulary). ``transposed``: the HF tensors are stored ``[in, out]``.
    """

    megatron: str
    hf: tuple[str, ...]
    shape: tuple[int, ...]  # megatron's, with the unpadded vocabulary
    kind: str = "same"
    transposed: bool = False


def _fuse(rule: _Rule, parts: list[torch.Tensor], flavor: DecoderFlavor, rows: int) -> torch.Tensor:
    """HF tensors -> the megatron tensor of ``rule`` (reshapes, concatenations and padding only)."""
    if rule.transposed:
        parts = [part.t() for part in parts]
    if rule.kind == "qkv":
        return fuse_qkv(*parts, flavor)
    if rule.kind == "stacked_qkv":
        return fuse_qkv(*parts[0].split(_qkv_sizes(flavor)), flavor)
    if rule.kind == "gate_up":
        return torch.cat(parts, dim=0)
    if rule.kind == "vocab":
        return _pad_rows(parts[0], rows)
    return parts[0]


def _split(rule: _Rule, tensor: torch.Tensor, flavor: DecoderFlavor) -> list[torch.Tensor]:
    """The exact inverse of :func:`_fuse`: the HF tensors of ``rule`` from the megatron tensor."""
    if rule.kind == "qkv":
        parts = list(split_qkv(tensor, flavor))
    elif rule.kind == "stacked_qkv":
        parts = [torch.cat(split_qkv(tensor, flavor))]
    elif rule.kind == "gate_up":
        parts = list(tensor.chunk(2, dim=0))
    elif rule.kind == "vocab":
        parts = [tensor[: flavor.vocab_size]]
    else:
        parts = [tensor]
    return [part.t() for part in parts] if rule.transposed else parts


def _qkv_sizes(flavor: DecoderFlavor) -> list[int]:
    d = flavor.kv_channels
    return [flavor.num_attention_heads * d, flavor.num_query_groups * d, flavor.num_query_groups * d]


def _check_names(flavor: DecoderFlavor, names: HFNames) -> None:
    """Refuse a flavor whose switches its family's HF layout cannot hold (a plugin flavor of a core family)."""
    problems = [
        (flavor.gated_linear_unit != (len(names.fc1) == 2), "gated_linear_unit"),
        ((flavor.position_embedding == "learned_absolute") != (names.position is not None), "position_embedding"),
        ((flavor.residual == "parallel_shared_norm") != (names.mlp_norm is None), "residual"),
        (flavor.post_norms != (names.post_attn_norm is not None), "post_norms"),
        (names.qkv_layout == "per_head" and flavor.num_query_groups != flavor.num_attention_heads,
         "num_query_groups"),
    ]
    for wrong, field_name in problems:
        if wrong:
            raise ConfigError(f"{flavor.family}: {field_name}={getattr(flavor, field_name)!r} has no place in the "
                              f"family's Hugging Face tensor layout")


def _rules(flavor: DecoderFlavor) -> list[_Rule]:
    """Every dense tensor of ``flavor`` (all but MoE experts and routers), embedding first."""
    names = hf_names(flavor.family)
    _check_names(flavor, names)
    h, f, d, vocab = flavor.hidden_size, flavor.ffn_hidden_size, flavor.kv_channels, flavor.vocab_size
    q = flavor.num_attention_heads * d
    bias, t = flavor.add_bias_linear, names.transposed
    rules = [_Rule("embedding.word_embeddings.weight", (names.embed + ".weight",), (vocab, h), "vocab")]
    if names.position is not None:
        rules.append(_Rule("embedding.position_embeddings.weight", (names.position + ".weight",),
                           (flavor.max_position_embeddings, h)))

    def norm(megatron: str, hf: str, size: int = h) -> list[_Rule]:
        params = ("weight", "bias") if flavor.normalization == "LayerNorm" else ("weight",)
        return [_Rule(f"{megatron}.{p}", (f"{hf}.{p}",), (size,)) for p in params]

    def linear(megatron: str, hf: tuple[str, ...], shape: tuple[int, int], kind: str, with_bias: bool) -> list[_Rule]:
        out = [_Rule(megatron + ".weight", tuple(n + ".weight" for n in hf), shape, kind, t)]
        if with_bias:
            out.append(_Rule(megatron + ".bias", tuple(n + ".bias" for n in hf), shape[:1], kind))
        return out

    qkv_kind = {"separate": "qkv", "stacked": "stacked_qkv", "per_head": "same"}[names.qkv_layout]
    fc1_rows = f * (2 if flavor.gated_linear_unit else 1)
    for i in range(flavor.num_layers):
        hf, mg = f"{names.layers}.{i}.", f"decoder.layers.{i}."
        rules += norm(mg + "input_layernorm", hf + names.input_norm)
        rules += linear(mg + "self_attention.linear_qkv", tuple(hf + n for n in names.qkv),
                        (sum(_qkv_sizes(flavor)), h), qkv_kind, flavor.add_qkv_bias or bias)
        if flavor.qk_layernorm:
            rules += norm(mg + "self_attention.q_layernorm", hf + names.q_norm, d)
            rules += norm(mg + "self_attention.k_layernorm", hf + names.k_norm, d)
        rules += linear(mg + "self_attention.linear_proj", (hf + names.proj,), (h, q), "same", bias)
        if names.mlp_norm is not None:
            rules += norm(mg + "pre_mlp_layernorm", hf + names.mlp_norm)
        if names.post_attn_norm is not None and names.post_mlp_norm is not None:
            rules += norm(mg + "self_attention.post_norm", hf + names.post_attn_norm)
            rules += norm(mg + "post_mlp_layernorm", hf + names.post_mlp_norm)
        if not flavor.is_moe:
            rules += linear(mg + "mlp.linear_fc1", tuple(hf + n for n in names.fc1), (fc1_rows, h),
                            "gate_up" if flavor.gated_linear_unit else "same", bias)
            rules += linear(mg + "mlp.linear_fc2", (hf + names.fc2,), (h, f), "same", bias)
    rules += norm("decoder.final_layernorm", names.final_norm)
    if not flavor.tie_word_embeddings:
        rules.append(_Rule("output_layer.weight", (names.lm_head + ".weight",), (vocab, h), "vocab"))
    if flavor.output_layer_bias:
        rules.append(_Rule("output_layer.bias", (names.lm_head + ".bias",), (vocab,), "vocab"))
    return rules


def _moe_layers(flavor: DecoderFlavor) -> list[tuple[str, str]]:
    """``(HF layer prefix, megatron layer prefix)`` of every MoE layer (none for a dense flavor)."""
    if not flavor.is_moe:
        return []
    layers = hf_names(flavor.family).layers
    return [(f"{layers}.{i}.", f"decoder.layers.{i}.") for i in range(flavor.num_layers)]


def hf_to_megatron(
    hf_state_dict: dict[str, torch.Tensor], flavor: DecoderFlavor, *, padded_vocab_size: int | None = None
) -> dict[str, torch.Tensor]:
    """Megatron ``GPTModel`` state dict (TP=1, PP=1) from a ``*ForCausalLM`` state dict of ``flavor``."""
    sd = hf_state_dict
    rows = padded_vocab_size or flavor.vocab_size
    stored = {**with_base_prefix(list(sd), flavor.family), **dict(hf_names(flavor.family).in_memory)}
    out = {
        rule.megatron: _fuse(rule, [sd[name] if name in sd else sd[stored[name]] for name in rule.hf], flavor, rows)
        for rule in _rules(flavor)
    }
    for hf, mg in _moe_layers(flavor):
        router, gate_up, down = _hf_experts(sd, hf, flavor)
        out[mg + "mlp.router.weight"] = router
        for e in range(flavor.num_experts or 0):
            out[f"{mg}mlp.experts.local_experts.{e}.linear_fc1.weight"] = gate_up[e]
            out[f"{mg}mlp.experts.local_experts.{e}.linear_fc2.weight"] = down[e]
    return out


def _expert_names(flavor: DecoderFlavor, layer: str, expert: int) -> tuple[str, str, str]:
    """(gate, up, down) names of one expert in the per-expert checkpoint layout of ``flavor``'s family."""
    if hf_family(flavor.family).moe_layout == "mixtral":
        moe = f"{layer}block_sparse_moe.experts.{expert}."
        return moe + "w1.weight", moe + "w3.weight", moe + "w2.weight"
    mlp = f"{layer}mlp.experts.{expert}."
    return mlp + "gate_proj.weight", mlp + "up_proj.weight", mlp + "down_proj.weight"


def _router_name(flavor: DecoderFlavor, layer: str, per_expert: bool) -> str:
    """The router: Mixtral checkpoints keep it under ``block_sparse_moe``, transformers 5 modules under ``mlp``."""
    mixtral_on_disk = per_expert and hf_family(flavor.family).moe_layout == "mixtral"
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
    ``per_expert=False``) or as ``save_pretrained`` writes it to disk (``per_expert=True``). Other names are
    always the checkpoint files' (GPT-NeoX's ``embed_out``, see ``HFNames.in_memory``).

    Padded vocabulary rows are dropped; a tied model has no ``lm_head.weight`` (Hugging Face re-ties it on
    load). Every tensor is a fresh contiguous copy, so the result can be written with safetensors.
    """
    sd = megatron_state_dict
    out: dict[str, torch.Tensor] = {}
    for rule in _rules(flavor):
        out.update(zip(rule.hf, _split(rule, sd[rule.megatron], flavor), strict=True))
    for hf, mg in _moe_layers(flavor):
        experts = range(flavor.num_experts or 0)
        gate_up = [sd[f"{mg}mlp.experts.local_experts.{e}.linear_fc1.weight"] for e in experts]
        down = [sd[f"{mg}mlp.experts.local_experts.{e}.linear_fc2.weight"] for e in experts]
        out.update(_experts_out(hf, sd[mg + "mlp.router.weight"], gate_up, down, flavor, per_expert))
    return {name: tensor.detach().clone(memory_format=torch.contiguous_format) for name, tensor in out.items()}


def hf_tensor_shapes(flavor: DecoderFlavor, *, per_expert: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor a ``*ForCausalLM`` checkpoint of ``flavor`` holds, with its shape (as saved: tied models
    have no ``lm_head.weight``; MoE experts fused or, with ``per_expert``, one module each). Used to refuse a
    checkpoint before any weight is read. The shapes come from splitting shape-only megatron tensors with the
    same rules the conversion uses, so they cannot disagree with it."""
    shapes: dict[str, tuple[int, ...]] = {}
    for rule in _rules(flavor):
        parts = _split(rule, torch.empty(rule.shape, device="meta"), flavor)
        shapes.update({name: tuple(part.shape) for name, part in zip(rule.hf, parts, strict=True)})
    h = flavor.hidden_size
    for hf, _ in _moe_layers(flavor):
        e, m = flavor.num_experts or 0, flavor.moe_ffn_hidden_size or 0
        shapes[_router_name(flavor, hf, per_expert)] = (e, h)
        if per_expert:
            for expert in range(e):
                gate, up, down = _expert_names(flavor, hf, expert)
                shapes.update({gate: (m, h), up: (m, h), down: (h, m)})
        else:
            shapes.update({hf + "mlp.experts.gate_up_proj": (e, 2 * m, h), hf + "mlp.experts.down_proj": (e, h, m)})
    return shapes


def flavor_from_hf_config(config: object, *, family: str) -> DecoderFlavor:
    """A :class:`DecoderFlavor` from a transformers config of ``family`` (``LlamaConfig``, ``Qwen2Config``,
    ``Qwen3Config``, ``MixtralConfig``, ``Qwen3MoeConfig``, ``GPT2Config``, ``GPTNeoXConfig``, ``PhiConfig``,
    ``GemmaConfig``) or an object with the same attributes (``config.json``'s keys), or the ``text_config`` of a
    Qwen2-VL / Qwen2.5-VL / Qwen3-VL model (its ``mrope_section`` and ``mrope_interleaved`` become the flavor's).

    The family's fixed switches come from its row (:class:`~loongforge.models.hf_layouts.HFFamily`); the rest are
    read from the config, and one this module cannot express is a one-line :class:`ConfigError` naming the key.
    """

    def get(name: str) -> Any:
        return getattr(config, config_key(family, name), None)

    rope_parameters = get("rope_parameters")
    if isinstance(rope_parameters, dict):  # transformers >= 5 keeps theta and scaling together
        rope_theta = rope_parameters.get("rope_theta", 10000.0)
        rope_scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    else:
        rope_theta = get("rope_theta") or get("rotary_emb_base") or 10000.0  # GPT-NeoX's older name
        rope_scaling = dict(get("rope_scaling") or {})
    rotary_percent = rope_scaling.pop("partial_rotary_factor", None) or get("partial_rotary_factor") \
        or get("rotary_pct") or 1.0
    # Qwen2-VL's text config: M-RoPE sections, with rope type "default" (transformers 5) or "mrope" (older files).
    mrope_section = rope_scaling.pop("mrope_section", None)
    mrope_interleaved = bool(rope_scaling.pop("mrope_interleaved", False))  # Qwen3-VL's frequency layout
    if rope_scaling.get("rope_type", rope_scaling.get("type", "default")) in ("default", "mrope"):
        rope_scaling = None
    heads = get("num_attention_heads")
    hidden = get("hidden_size")
    head_dim = get("head_dim")
    experts = get("num_local_experts") or get("num_experts")  # Mixtral / Qwen3-MoE names
    moe: dict[str, Any] = {}
    if experts:
        moe = dict(num_experts=experts, moe_router_topk=get("num_experts_per_tok"),
                   moe_ffn_hidden_size=get("moe_intermediate_size") or get("intermediate_size"),
                   moe_aux_loss_coeff=float(get("router_aux_loss_coef") or 0.0),
                   moe_norm_topk_prob=get("norm_topk_prob") is not False)
    row = hf_family(family)
    switches: dict[str, Any] = dict(row.switches)
    switches["activation"] = _activation(get("hidden_act") or "silu", config_key(family, "hidden_act"))
    if row.embedding_scaled:
        switches["embedding_multiplier"] = hidden**0.5
    if row.read_extra is not None:
        switches.update(row.read_extra(get))
    return DecoderFlavor(
        family=family,
        num_layers=get("num_hidden_layers"),
        hidden_size=hidden,
        ffn_hidden_size=get("intermediate_size") or 4 * hidden,  # GPT-2's n_inner: null means 4 * hidden
        num_attention_heads=heads,
        num_query_groups=get("num_key_value_heads") or heads,
        vocab_size=get("vocab_size"),
        max_position_embeddings=get("max_position_embeddings"),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        rotary_percent=float(rotary_percent),
        norm_eps=get("norm_eps"),
        qk_layernorm=row.qk_layernorm,
        add_qkv_bias=row.add_qkv_bias,
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        head_dim=head_dim if head_dim and head_dim != hidden // heads else None,
        hf_architecture=_architecture(get("architectures"), config, family),
        mrope_section=None if mrope_section is None else tuple(mrope_section),
        mrope_interleaved=mrope_interleaved,
        **moe,
        **switches,
    )


def _architecture(architectures: list[str] | None, config: object, family: str) -> str:
    """``architectures[0]``, else the family's class, else the config class's ``*ForCausalLM`` sibling."""
    if architectures:
        return architectures[0]
    if family in FAMILIES:
        return FAMILIES[family].architecture
    return type(config).__name__.replace("Config", "ForCausalLM")


def _activation(hf_name: str, key: str) -> str:
    """``DecoderFlavor.activation`` for a Hugging Face activation name (``key`` names it in messages)."""
    if hf_name not in HF_ACTIVATIONS:
        raise ConfigError(f"{key} {hf_name!r} is not supported; supported: {', '.join(HF_ACTIVATIONS)}")
    return HF_ACTIVATIONS[hf_name]
