"""Qwen3-Next in Hugging Face format: the ``config.json`` reader registered under ``Qwen3NextForCausalLM`` (and the
Qwen3.5 text models, the same architecture under other names) and the tensor adapter, both ways.

Tensor names are transformers' (``model.layers.<i>.linear_attn.*`` / ``self_attn.*``); every conversion is a
reshape, concatenation or slice, so ``from_hf`` and ``to_hf`` are exact inverses (a round trip is bitwise). Where
megatron fuses what transformers keeps apart:

* gated attention: transformers' ``q_proj`` holds each head's query then its gate (``[q_h; gate_h]`` per head);
  megatron's ``linear_qkv`` holds per query group the group's queries, their gates, its key and its value;
* Gated DeltaNet: ``in_proj`` holds per key head ``[q, k, v, z, b, a]`` -- Qwen3-Next's ``in_proj_qkvz`` and
  ``in_proj_ba`` are already grouped that way, Qwen3.5's ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` /
  ``in_proj_a`` are not -- and ``conv1d`` holds per key head ``[q, k, v]`` channels where transformers stores all
  queries, then all keys, then all values (see :mod:`loongforge.models.qwen3_next.mixer` for why);
* MLPs: ``linear_fc1`` is ``[gate; up]``; experts are one module each on disk (``mlp.experts.<e>.gate_proj``...,
  what ``save_pretrained`` writes) or fused in memory (``mlp.experts.gate_up_proj`` / ``down_proj``), both read;
  the shared expert is ``mlp.shared_experts`` with its gate ``gate_weight`` (transformers' ``shared_expert_gate``).

Multi-token-prediction weights (``mtp.*``, which transformers does not load either) are ignored.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loongforge.errors import ConfigError, InteropError
from loongforge.models.hf_format import DTYPE_NAMES
from loongforge.models.qwen3_next.flavors import FAMILY, LAYER_KINDS, Qwen3NextFlavor


@dataclass(frozen=True)
class HFLayout:
    """One architecture of the family in Hugging Face format: its names, how its DeltaNet input projections are
    stored, whether its layers are MoE, and its transformers config class's defaults."""

    architecture: str
    model_type: str
    #: ``qkvz_ba``: Qwen3-Next's two grouped projections; ``qkv_z_b_a``: Qwen3.5's four flat ones.
    deltanet_inputs: str
    #: ``None``: ``num_experts`` decides (0: dense); ``True`` every layer MoE; ``False`` every layer dense.
    moe: bool | None
    defaults: dict[str, Any] = field(default_factory=dict, hash=False)
    #: MoE keys the config class has (Qwen3.5-MoE's router always renormalises and has no sparse step).
    moe_switches: tuple[str, ...] = ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")


_COMMON = dict(hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, head_dim=256,
               linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
               linear_num_value_heads=32, partial_rotary_factor=0.25, rope_theta=10000.0)
#: The defaults of transformers' ``Qwen3NextConfig`` / ``Qwen3_5TextConfig`` / ``Qwen3_5MoeTextConfig``.
LAYOUTS: dict[str, HFLayout] = {layout.architecture: layout for layout in (
    HFLayout("Qwen3NextForCausalLM", "qwen3_next", "qkvz_ba", None, dict(
        _COMMON, vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=32768, decoder_sparse_step=1,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts_per_tok=10, num_experts=512,
        norm_topk_prob=True, router_aux_loss_coef=0.001, mlp_only_layers=[])),
    HFLayout("Qwen3_5ForCausalLM", "qwen3_5_text", "qkv_z_b_a", False, dict(
        _COMMON, vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=32768), moe_switches=()),
    HFLayout("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", "qkv_z_b_a", True, dict(
        _COMMON, vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
        num_key_value_heads=2, max_position_embeddings=32768, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, num_experts_per_tok=8, num_experts=256, router_aux_loss_coef=0.001),
        moe_switches=()),
)}
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


# -- config.json -> flavor -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Qwen3NextHFReader:
    """The :class:`~loongforge.models.family.HFReader` of one architecture of :data:`LAYOUTS`."""

    architecture: str

    def read_config(self, raw: dict[str, Any], path: Path) -> Qwen3NextFlavor:
        """The flavor ``raw`` describes; a switch the family cannot express is refused naming ``path`` and the key."""
        layout = LAYOUTS[self.architecture]
        given = {k: v for k, v in raw.items() if v is not None}
        values = {**layout.defaults, **given}
        for key in _REQUIRED:
            if not isinstance(raw.get(key), int):
                raise InteropError(f"{path}: key {key!r} is missing or not an integer")
        refused = [(key, values.get(key), needed) for key, needed in (
            ("hidden_act", "silu"), ("attention_bias", False), ("use_sliding_window", False))
            if values.get(key, needed) != needed]
        if refused:
            key, value, needed = refused[0]
            raise InteropError(f"{path}: {key}={value!r} is not supported for {layout.architecture} "
                               f"(needs {needed!r})")
        fields = _flavor_fields(values, layout, path)
        return Qwen3NextFlavor(family=FAMILY, hf_architecture=layout.architecture, **fields)


def _rope(values: dict[str, Any], path: Path) -> tuple[float, float]:
    """``(rope_theta, partial rotary factor)`` from transformers 5's ``rope_parameters`` or the older keys."""
    params = dict(values.get("rope_parameters") or {})
    scaling = dict(values.get("rope_scaling") or {})
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in ("default", "mrope"):
        raise InteropError(f"{path}: rope type {rope_type!r} is not supported (only default RoPE)")
    # Qwen3.5's mrope_section: a text model's positions are the same in every M-RoPE section, which is plain RoPE.
    theta = params.get("rope_theta", values.get("rope_theta"))
    partial = params.get("partial_rotary_factor", values.get("partial_rotary_factor"))
    return float(theta), float(partial)


def _flavor_fields(values: dict[str, Any], layout: HFLayout, path: Path) -> dict[str, Any]:
    theta, partial = _rope(values, path)
    layers = values["num_hidden_layers"]
    types = values.get("layer_types")
    if types is None:
        interval = values.get("full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if len(types) != layers or not set(types) <= set(LAYER_KINDS):
        raise InteropError(f"{path}: layer_types must name {layers} layers, each one of {', '.join(LAYER_KINDS)}")
    heads = values["num_attention_heads"]
    fields: dict[str, Any] = dict(
        num_layers=layers, hidden_size=values["hidden_size"],
        ffn_hidden_size=values.get("intermediate_size") or values.get("moe_intermediate_size"),
        num_attention_heads=heads, num_query_groups=values.get("num_key_value_heads") or heads,
        head_dim=values["head_dim"], vocab_size=values["vocab_size"],
        max_position_embeddings=values["max_position_embeddings"], rope_theta=theta, rotary_percent=partial,
        norm_eps=float(values["rms_norm_eps"]), qk_layernorm=True, norm_zero_centered=True,
        tie_word_embeddings=bool(values["tie_word_embeddings"]), layer_types=tuple(types),
        full_attention_interval=values.get("full_attention_interval", 4),
        **{name: values[name] for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                           "linear_value_head_dim", "linear_conv_kernel_dim")},
    )
    experts = values.get("num_experts") or 0
    if layout.moe is False or (layout.moe is None and experts == 0):
        return fields
    shared = values.get("shared_expert_intermediate_size") or 0
    if shared <= 0:
        raise InteropError(f"{path}: shared_expert_intermediate_size={shared!r} is not supported (needs > 0)")
    fields.update(num_experts=experts, moe_router_topk=values["num_experts_per_tok"],
                  moe_ffn_hidden_size=values["moe_intermediate_size"], moe_shared_expert_intermediate_size=shared,
                  moe_aux_loss_coeff=float(values.get("router_aux_loss_coef") or 0.0),
                  moe_norm_topk_prob=values.get("norm_topk_prob", True) is not False,
                  decoder_sparse_step=values.get("decoder_sparse_step", 1),
                  mlp_only_layers=tuple(values.get("mlp_only_layers") or ()))
    return fields


def register_hf_architectures(registry: Any) -> None:
    """Register a reader for each architecture of :data:`LAYOUTS`, its ``model_type`` as an alias."""
    for architecture, layout in LAYOUTS.items():
        registry.register(architecture, Qwen3NextHFReader(architecture), aliases=(layout.model_type,),
                          description="Qwen3-Next hybrid decoder (Gated DeltaNet + gated attention)")


# -- flavor -> config.json, tensors both ways -----------------------------------------------------------------


@dataclass(frozen=True)
class Qwen3NextHFAdapter:
    """The :class:`~loongforge.models.family.HFAdapter` of one Qwen3-Next flavor (TP=PP=1 full state dicts)."""

    flavor: Qwen3NextFlavor

    @property
    def layout(self) -> HFLayout:
        """The flavor's architecture in :data:`LAYOUTS`, its switches checked against what that format holds."""
        flavor = self.flavor
        layout = LAYOUTS.get(flavor.hf_architecture)
        if layout is None:
            raise ConfigError(f"{flavor.family}: hf_architecture {flavor.hf_architecture!r} has no Hugging Face "
                              f"layout; known: {', '.join(LAYOUTS)}")
        dense_layers = [i for i in range(flavor.num_layers) if not flavor.is_moe_layer(i)]
        problems = [
            (not flavor.attention_output_gate, "attention_output_gate"), (not flavor.qk_layernorm, "qk_layernorm"),
            (not flavor.norm_zero_centered, "norm_zero_centered"), (flavor.rope_scaling is not None, "rope_scaling"),
            (flavor.position_embedding != "rope", "position_embedding"), (flavor.activation != "silu", "activation"),
            (not flavor.gated_linear_unit, "gated_linear_unit"),
            (flavor.add_bias_linear or flavor.add_qkv_bias, "add_bias_linear"),
            (flavor.is_moe and not (flavor.moe_shared_expert_intermediate_size and flavor.moe_shared_expert_gate),
             "moe_shared_expert_gate"),
            (layout.moe is True and bool(dense_layers), "mlp_only_layers"),
            (layout.moe is False and flavor.is_moe, "num_experts"),
            (flavor.is_moe and "norm_topk_prob" not in layout.moe_switches and not flavor.moe_norm_topk_prob,
             "moe_norm_topk_prob"),
        ]
        for wrong, name in problems:
            if wrong:
                raise ConfigError(f"{flavor.family}: {name}={getattr(flavor, name)!r} has no place in "
                                  f"{layout.architecture}'s Hugging Face format")
        return layout

    def config_json(self, dtype: str, base: dict[str, Any] | None = None) -> dict[str, Any]:
        """The ``config.json`` mapping in ``dtype``, keeping ``base``'s keys this model does not own."""
        flavor, layout = self.flavor, self.layout
        out = dict(base or {})
        for key in ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "dtype", "torch_dtype",
                    "transformers_version", "full_attention_interval"):
            out.pop(key, None)
        out.update(
            architectures=[layout.architecture], model_type=layout.model_type, hidden_size=flavor.hidden_size,
            num_hidden_layers=flavor.num_layers, num_attention_heads=flavor.num_attention_heads,
            num_key_value_heads=flavor.num_query_groups, head_dim=flavor.kv_channels, vocab_size=flavor.vocab_size,
            max_position_embeddings=flavor.max_position_embeddings, rms_norm_eps=flavor.norm_eps,
            tie_word_embeddings=flavor.tie_word_embeddings, hidden_act="silu", attention_bias=False,
            layer_types=list(flavor.layer_kinds), linear_conv_kernel_dim=flavor.linear_conv_kernel_dim,
            linear_key_head_dim=flavor.linear_key_head_dim, linear_value_head_dim=flavor.linear_value_head_dim,
            linear_num_key_heads=flavor.linear_num_key_heads, linear_num_value_heads=flavor.linear_num_value_heads,
        )
        if layout.moe is not True:
            out["intermediate_size"] = flavor.ffn_hidden_size
        if flavor.is_moe:
            out.update(num_experts=flavor.num_experts, num_experts_per_tok=flavor.moe_router_topk,
                       moe_intermediate_size=flavor.moe_ffn_hidden_size,
                       shared_expert_intermediate_size=flavor.moe_shared_expert_intermediate_size,
                       router_aux_loss_coef=flavor.moe_aux_loss_coeff)
            switches = dict(norm_topk_prob=flavor.moe_norm_topk_prob, decoder_sparse_step=flavor.decoder_sparse_step,
                            mlp_only_layers=list(flavor.mlp_only_layers))
            out.update({key: switches[key] for key in layout.moe_switches})
        elif layout.moe is None:
            out["num_experts"] = 0
        rope = {"rope_theta": flavor.rope_theta, "partial_rotary_factor": flavor.rotary_percent}
        if base is not None and "rope_parameters" in base:  # transformers >= 5 style
            kept = {k: v for k, v in base["rope_parameters"].items() if k.startswith("mrope")}
            out["rope_parameters"] = {"rope_type": "default", **kept, **rope}
        else:
            out.update(rope)
        out["dtype" if base is not None and "dtype" in base else "torch_dtype"] = DTYPE_NAMES[dtype]
        return out

    def to_hf(self, state: dict[str, Any]) -> dict[str, Any]:
        """Hugging Face tensors (experts one module each, as ``save_pretrained`` writes them) from a full megatron
        state dict; padded vocabulary rows dropped, every tensor a fresh contiguous copy."""
        rules, out = self._rules(), {}
        for rule in rules:
            out.update(zip(rule.hf, rule.split(state[rule.megatron]), strict=True))
        for hf, mg in self._moe_layers():
            for e in range(self.flavor.num_experts or 0):
                expert = f"{mg}mlp.experts.local_experts.{e}."
                gate, up = state[expert + "linear_fc1.weight"].chunk(2, dim=0)
                out[f"{hf}mlp.experts.{e}.gate_proj.weight"] = gate
                out[f"{hf}mlp.experts.{e}.up_proj.weight"] = up
                out[f"{hf}mlp.experts.{e}.down_proj.weight"] = state[expert + "linear_fc2.weight"]
        return {name: tensor.detach().clone(memory_format=_contiguous()) for name, tensor in out.items()}

    def from_hf(self, tensors: dict[str, Any], *, padded_vocab_size: int | None = None) -> dict[str, Any]:
        """The full megatron state dict from Hugging Face tensors (experts per module or fused), vocabulary rows
        padded to ``padded_vocab_size`` (default: as a TP=1 model holds them)."""
        from loongforge.models.decoder_model import padded_vocab_size as tp1_padded

        rows = padded_vocab_size or tp1_padded(self.flavor.vocab_size)
        out = {rule.megatron: rule.fuse([tensors[name] for name in rule.hf], rows) for rule in self._rules()}
        for hf, mg in self._moe_layers():
            for e, (fc1, fc2) in enumerate(zip(*_experts(tensors, hf, self.flavor.num_experts or 0), strict=True)):
                out[f"{mg}mlp.experts.local_experts.{e}.linear_fc1.weight"] = fc1
                out[f"{mg}mlp.experts.local_experts.{e}.linear_fc2.weight"] = fc2
        return out

    def tensor_shapes(self, stored: Collection[str]) -> dict[str, tuple[int, ...] | None]:
        """Every tensor a checkpoint of this model holds by name and shape: experts one module each unless the files
        fuse them; a tied ``lm_head.weight`` and multi-token-prediction weights (``mtp.*``) ignored."""
        import torch

        shapes: dict[str, tuple[int, ...] | None] = {}
        for rule in self._rules():
            parts = rule.split(torch.empty(rule.shape, device="meta"))
            shapes.update({name: tuple(part.shape) for name, part in zip(rule.hf, parts, strict=True)})
        fused = any(name.endswith(".mlp.experts.gate_up_proj") for name in stored)
        flavor = self.flavor
        h, e, m = flavor.hidden_size, flavor.num_experts or 0, flavor.moe_ffn_hidden_size or 0
        for hf, _ in self._moe_layers():
            if fused:
                shapes.update({hf + "mlp.experts.gate_up_proj": (e, 2 * m, h), hf + "mlp.experts.down_proj": (e, h, m)})
                continue
            for expert in range(e):
                base = f"{hf}mlp.experts.{expert}."
                shapes.update({base + "gate_proj.weight": (m, h), base + "up_proj.weight": (m, h),
                               base + "down_proj.weight": (h, m)})
        if flavor.tie_word_embeddings:
            shapes.setdefault("lm_head.weight", None)
        shapes.update({name: None for name in stored if name.startswith("mtp.")})
        return shapes

    # -- the tensor rules ---------------------------------------------------------------------------------------

    def _moe_layers(self) -> list[tuple[str, str]]:
        return [(f"model.layers.{i}.", f"decoder.layers.{i}.") for i in range(self.flavor.num_layers)
                if self.flavor.is_moe_layer(i)]

    def _rules(self) -> list[_Rule]:
        """Every tensor but the routed experts, embedding first."""
        flavor, layout = self.flavor, self.layout
        h, d, vocab = flavor.hidden_size, flavor.kv_channels, flavor.vocab_size
        heads, groups = flavor.num_attention_heads, flavor.num_query_groups
        nk, nv = flavor.linear_num_key_heads, flavor.linear_num_value_heads
        dk, dv, kernel = flavor.linear_key_head_dim, flavor.linear_value_head_dim, flavor.linear_conv_kernel_dim
        ratio = nv // nk
        dims = _Dims(heads=heads, groups=groups, head_dim=d, k_heads=nk, d_k=dk, ratio=ratio, d_v=dv)
        rules = [_Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), (vocab, h), "vocab", dims)]
        for i, kind in enumerate(flavor.layer_kinds):
            hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
            rules.append(_Rule(mg + "input_layernorm.weight", (hf + "input_layernorm.weight",), (h,)))
            if kind == "full_attention":
                att, sa = hf + "self_attn.", mg + "self_attention."
                rules += [
                    _Rule(sa + "linear_qkv.weight", (att + "q_proj.weight", att + "k_proj.weight",
                                                    att + "v_proj.weight"),
                          ((2 * heads + 2 * groups) * d, h), "gated_qkv", dims),
                    _Rule(sa + "q_layernorm.weight", (att + "q_norm.weight",), (d,)),
                    _Rule(sa + "k_layernorm.weight", (att + "k_norm.weight",), (d,)),
                    _Rule(sa + "linear_proj.weight", (att + "o_proj.weight",), (h, heads * d)),
                ]
            else:
                lin, sa = hf + "linear_attn.", mg + "self_attention."
                inputs = (("in_proj_qkvz", "in_proj_ba") if layout.deltanet_inputs == "qkvz_ba"
                          else ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
                rules += [
                    _Rule(sa + "in_proj.weight", tuple(f"{lin}{name}.weight" for name in inputs),
                          (nk * (2 * dk + 2 * ratio * dv + 2 * ratio), h), layout.deltanet_inputs, dims),
                    _Rule(sa + "conv1d.weight", (lin + "conv1d.weight",), (2 * nk * dk + nv * dv, 1, kernel), "conv",
                          dims),
                    _Rule(sa + "A_log", (lin + "A_log",), (nv,)),
                    _Rule(sa + "dt_bias", (lin + "dt_bias",), (nv,)),
                    _Rule(sa + "out_norm.weight", (lin + "norm.weight",), (dv,)),
                    _Rule(sa + "out_proj.weight", (lin + "out_proj.weight",), (h, nv * dv)),
                ]
            rules.append(_Rule(mg + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",), (h,)))
            rules += self._mlp_rules(i, hf, mg)
        rules.append(_Rule("decoder.final_layernorm.weight", ("model.norm.weight",), (h,)))
        if not flavor.tie_word_embeddings:
            rules.append(_Rule("output_layer.weight", ("lm_head.weight",), (vocab, h), "vocab", dims))
        return rules

    def _mlp_rules(self, index: int, hf: str, mg: str) -> list[_Rule]:
        flavor, h = self.flavor, self.flavor.hidden_size

        def swiglu(megatron: str, hf_mlp: str, width: int) -> list[_Rule]:
            return [_Rule(megatron + "linear_fc1.weight", (hf_mlp + "gate_proj.weight", hf_mlp + "up_proj.weight"),
                          (2 * width, h), "gate_up"),
                    _Rule(megatron + "linear_fc2.weight", (hf_mlp + "down_proj.weight",), (h, width))]

        if not flavor.is_moe_layer(index):
            return swiglu(mg + "mlp.", hf + "mlp.", flavor.ffn_hidden_size)
        shared = flavor.moe_shared_expert_intermediate_size or 0
        return [_Rule(mg + "mlp.router.weight", (hf + "mlp.gate.weight",), (flavor.num_experts or 0, h)),
                *swiglu(mg + "mlp.shared_experts.", hf + "mlp.shared_expert.", shared),
                _Rule(mg + "mlp.shared_experts.gate_weight", (hf + "mlp.shared_expert_gate.weight",), (1, h))]


def _contiguous() -> Any:
    import torch

    return torch.contiguous_format


@dataclass(frozen=True)
class _Dims:
    heads: int
    groups: int
    head_dim: int
    k_heads: int
    d_k: int
    ratio: int
    d_v: int


@dataclass(frozen=True)
class _Rule:
    """One megatron tensor and the Hugging Face tensors it is made of; ``kind`` says how (module docstring):
    ``same``, ``vocab`` (rows padded), ``gate_up``, ``gated_qkv``, ``qkvz_ba`` / ``qkv_z_b_a`` (DeltaNet inputs),
    ``conv`` (DeltaNet convolution channels). ``shape`` is megatron's, with the unpadded vocabulary."""

    megatron: str
    hf: tuple[str, ...]
    shape: tuple[int, ...]
    kind: str = "same"
    dims: _Dims | None = None

    def fuse(self, parts: list[Any], rows: int) -> Any:
        """Hugging Face tensors -> the megatron tensor (``rows``: the padded vocabulary)."""
        import torch

        dims = self.dims
        if self.kind == "vocab":
            weight = parts[0]
            return weight if weight.shape[0] == rows else torch.cat(
                [weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])
        if self.kind == "gate_up":
            return torch.cat(parts, dim=0)
        if self.kind == "same":
            return parts[0]
        assert dims is not None
        if self.kind == "gated_qkv":
            q_proj, k_proj, v_proj = parts
            hidden, per_group = q_proj.shape[-1], dims.heads // dims.groups * dims.head_dim
            q_gate = q_proj.reshape(dims.heads, 2, dims.head_dim, hidden)
            query = q_gate[:, 0].reshape(dims.groups, per_group, hidden)
            gate = q_gate[:, 1].reshape(dims.groups, per_group, hidden)
            key = k_proj.reshape(dims.groups, dims.head_dim, hidden)
            value = v_proj.reshape(dims.groups, dims.head_dim, hidden)
            return torch.cat([query, gate, key, value], dim=1).reshape(-1, hidden)
        grouped = [part.reshape(dims.k_heads, -1, *part.shape[1:]) for part in self._flat_to_groups(parts)]
        return torch.cat(grouped, dim=1).reshape(-1, *parts[0].shape[1:])

    def split(self, tensor: Any) -> list[Any]:
        """The exact inverse of :meth:`fuse`."""
        import torch

        dims = self.dims
        if self.kind == "vocab":
            return [tensor[: self.shape[0]]]
        if self.kind == "gate_up":
            return list(tensor.chunk(2, dim=0))
        if self.kind == "same":
            return [tensor]
        assert dims is not None
        if self.kind == "gated_qkv":
            hidden, per_group = tensor.shape[-1], dims.heads // dims.groups * dims.head_dim
            query, gate, key, value = tensor.reshape(dims.groups, -1, hidden).split(
                [per_group, per_group, dims.head_dim, dims.head_dim], dim=1)
            q_gate = torch.stack([query.reshape(dims.heads, dims.head_dim, hidden),
                                  gate.reshape(dims.heads, dims.head_dim, hidden)], dim=1)
            return [q_gate.reshape(-1, hidden), key.reshape(-1, hidden), value.reshape(-1, hidden)]
        rest = tensor.shape[1:]
        grouped = tensor.reshape(dims.k_heads, -1, *rest).split(self._group_sizes(), dim=1)
        return self._groups_to_flat([part.reshape(-1, *rest) for part in grouped])

    # The DeltaNet tensors: per key head [q, k, v, z, b, a] (in_proj) or [q, k, v] (conv1d) in megatron.

    def _group_sizes(self) -> list[int]:
        d = self.dims
        assert d is not None
        sizes = {"qkvz_ba": [2 * d.d_k + 2 * d.ratio * d.d_v, 2 * d.ratio],
                 "qkv_z_b_a": [d.d_k, d.d_k, d.ratio * d.d_v, d.ratio * d.d_v, d.ratio, d.ratio],
                 "conv": [d.d_k, d.d_k, d.ratio * d.d_v]}
        return sizes[self.kind]

    def _flat_sizes(self) -> list[int]:
        """How transformers' tensors split into per-key-head-groupable parts (all queries, then all keys ...)."""
        d = self.dims
        assert d is not None
        k, v = d.k_heads * d.d_k, d.k_heads * d.ratio * d.d_v
        return [k, k, v] if self.kind in ("conv", "qkv_z_b_a") else []

    def _flat_to_groups(self, parts: list[Any]) -> list[Any]:
        """Transformers' tensors as a list of parts each ``[k_heads * size, ...]`` in megatron's group order."""
        sizes = self._flat_sizes()
        if not sizes:  # qkvz_ba: already grouped by key head
            return parts
        return [*parts[0].split(sizes, dim=0), *parts[1:]]

    def _groups_to_flat(self, parts: list[Any]) -> list[Any]:
        """The inverse of :meth:`_flat_to_groups`."""
        import torch

        if not self._flat_sizes():
            return parts
        return [torch.cat(parts[:3], dim=0), *parts[3:]]


def _experts(tensors: dict[str, Any], hf: str, experts: int) -> tuple[list[Any], list[Any]]:
    """``(linear_fc1 per expert [gate; up], linear_fc2 per expert)`` of HF layer prefix ``hf``, fused or not."""
    import torch

    if hf + "mlp.experts.gate_up_proj" in tensors:  # transformers >= 5, in memory
        return list(tensors[hf + "mlp.experts.gate_up_proj"].unbind(0)), list(tensors[hf + "mlp.experts.down_proj"]
                                                                               .unbind(0))
    fc1 = [torch.cat([tensors[f"{hf}mlp.experts.{e}.gate_proj.weight"], tensors[f"{hf}mlp.experts.{e}.up_proj.weight"]])
           for e in range(experts)]
    return fc1, [tensors[f"{hf}mlp.experts.{e}.down_proj.weight"] for e in range(experts)]
