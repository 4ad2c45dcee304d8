"""DeepSeek-V2/V3 ``config.json`` <-> :class:`DeepSeekFlavor` (torch-free), and the family's :class:`HFAdapter`.

:class:`DeepSeekHFReader` is registered under ``DeepseekV3ForCausalLM`` (DeepSeek-V3, Kimi-K2, Moonlight) and
``DeepseekV2ForCausalLM`` (DeepSeek-V2-Lite). It refuses, naming the file and key, what megatron's layers would
compute differently from transformers' model:

* V3 sums each expert group's **two** best scores to rank groups; megatron sums the best ``topk / topk_group``, so
  group-limited routing needs ``num_experts_per_tok == 2 * topk_group`` (DeepSeek-V3: 8 = 2 * 4); V2's
  ``group_limited_greedy`` ranks groups by their best score, which needs ``num_experts_per_tok == topk_group``.
* megatron renormalises sigmoid top-k scores always (V3 ``norm_topk_prob: false`` is refused) and softmax scores
  never when it scores before choosing (V2 ``norm_topk_prob: true`` is refused: transformers ignores it);
* YaRN's attention factor must be megatron's ``mscale / mscale_all_dim`` form (no explicit ``attention_factor``,
  ``truncate`` on, ``mscale_all_dim`` only together with ``mscale``);
* one key/value head per query head, no attention or MLP biases, SiLU, every layer past the dense ones MoE.

``aux_loss_alpha`` is not read: transformers' models do not train with it, and the flavor balances experts with the
aux-loss-free bias (``moe_aux_loss_coeff`` 0; a run may set its own coefficient).

Keys a config omits get the defaults of the transformers config class, as transformers would read it. A
transformers-saved DeepSeek-V3 says ``num_nextn_predict_layers: 1`` but holds no MTP weights (its model class
drops them): the MTP depth is the number of blocks the directory's weight files hold, capped by the config.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loongforge.errors import InteropError
from loongforge.models.deepseek.flavor import DeepSeekFlavor
from loongforge.models.deepseek.flavors import V2, V3, V32
from loongforge.models.hf_format import DTYPE_NAMES

#: transformers' config defaults of the keys the reader uses, per architecture.
_DEFAULTS: dict[str, dict[str, Any]] = {
    V3: dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
             n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, n_group=8, topk_group=4,
             num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=4096,
             rms_norm_eps=1e-6, rope_interleave=True, num_nextn_predict_layers=1, moe_intermediate_size=2048),
    V32: dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
              n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, n_group=8, topk_group=4,
              num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=163840,
              rms_norm_eps=1e-6, moe_intermediate_size=2048, index_n_heads=64, index_head_dim=128,
              index_topk=2048),
    V2: dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
             n_shared_experts=2, n_routed_experts=64, routed_scaling_factor=1.0, n_group=None, topk_group=None,
             num_experts_per_tok=None, first_k_dense_replace=0, norm_topk_prob=False, max_position_embeddings=2048,
             rms_norm_eps=1e-6, topk_method="greedy", moe_intermediate_size=1407),
}
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_FAMILY = {V3: "deepseek-v3", V2: "deepseek-v2", V32: "deepseek-v32"}
_MODEL_TYPE = {V3: "deepseek_v3", V2: "deepseek_v2", V32: "deepseek_v32"}
#: The architectures that route by sigmoid scores with the expert bias (V3's router).
_SIGMOID = (V3, V32)


@dataclass(frozen=True)
class DeepSeekHFReader:
    """The :class:`~loongforge.models.family.HFReader` of ``architecture`` (``DeepseekV3ForCausalLM`` or
    ``DeepseekV2ForCausalLM``)."""

    architecture: str

    def read_config(self, raw: dict[str, Any], path: Path) -> DeepSeekFlavor:
        """The flavor ``raw`` describes; what the layers cannot express is refused naming ``path`` and the key."""
        arch = self.architecture
        values = {**_DEFAULTS[arch], **raw}

        def refuse(key: str, why: str) -> InteropError:
            return InteropError(f"{path}: {key}={values.get(key)!r} is not supported for {arch}: {why}")

        for key in _REQUIRED:
            if not isinstance(values.get(key), int):
                raise InteropError(f"{path}: key {key!r} is missing or not an integer")
        heads = values["num_attention_heads"]
        if values.get("hidden_act", "silu") != "silu":
            raise refuse("hidden_act", "only SiLU experts and MLPs")
        for key in ("attention_bias", "mlp_bias"):
            if values.get(key):
                raise refuse(key, "the layers have no biases")
        if values.get("num_key_value_heads") not in (None, heads):
            raise refuse("num_key_value_heads", f"multi-latent attention has one per query head ({heads})")
        if values.get("moe_layer_freq", 1) != 1:
            raise refuse("moe_layer_freq", "every layer after first_k_dense_replace is MoE")
        moe = _read_moe(arch, values, refuse)
        rope = _read_rope(values, refuse)
        mtp, sparse = 0, {}
        if arch == V32:  # always interleaved rotary channels and a query LoRA; no MTP layers in its model class
            if values.get("q_lora_rank") is None:
                raise refuse("q_lora_rank", "DeepSeek-V3.2 projects queries through the LoRA")
            sparse = dict(index_n_heads=values["index_n_heads"], index_head_dim=values["index_head_dim"],
                          index_topk=values["index_topk"])
        if arch == V3:
            mtp = int(values.get("num_nextn_predict_layers") or 0)
            stored = stored_layer_indices(path.parent)
            if stored is not None:  # what the files hold, not more (transformers drops the MTP weights)
                mtp = min(mtp, sum(1 for i in stored if i >= values["num_hidden_layers"]))
        return DeepSeekFlavor(
            family=_FAMILY[arch], hf_architecture=arch, position_embedding="none",
            num_layers=values["num_hidden_layers"], hidden_size=values["hidden_size"],
            ffn_hidden_size=values["intermediate_size"], num_attention_heads=heads, num_query_groups=heads,
            vocab_size=values["vocab_size"], max_position_embeddings=values["max_position_embeddings"],
            norm_eps=float(values["rms_norm_eps"]), tie_word_embeddings=bool(values.get("tie_word_embeddings")),
            q_lora_rank=values["q_lora_rank"], kv_lora_rank=values["kv_lora_rank"],
            qk_nope_head_dim=values["qk_nope_head_dim"], qk_rope_head_dim=values["qk_rope_head_dim"],
            v_head_dim=values["v_head_dim"], rope_interleave=bool(values.get("rope_interleave", True)) or arch == V32,
            mtp_num_layers=mtp, **rope, **moe, **sparse,
        )


def _read_moe(arch: str, values: dict[str, Any], refuse: Any) -> dict[str, Any]:
    """The flavor's expert fields from the router keys of ``arch``."""
    topk, groups, chosen = values["num_experts_per_tok"], values.get("n_group"), values.get("topk_group")
    if not isinstance(topk, int) or not isinstance(values.get("moe_intermediate_size"), int):
        raise refuse("num_experts_per_tok", "num_experts_per_tok and moe_intermediate_size must be integers")
    shared = values.get("n_shared_experts")
    if not isinstance(shared, int) or shared < 1:
        raise refuse("n_shared_experts", "at least one shared expert")
    grouped = groups is not None and groups > 1
    if arch in _SIGMOID:
        if values.get("scoring_func", "sigmoid") != "sigmoid":
            raise refuse("scoring_func", "DeepseekV3 routes by sigmoid scores")
        if values.get("topk_method", "noaux_tc") != "noaux_tc":
            raise refuse("topk_method", "DeepseekV3 routes with the expert bias (noaux_tc)")
        if not values.get("norm_topk_prob"):
            raise refuse("norm_topk_prob", "megatron renormalises the chosen sigmoid scores")
        if grouped and topk != 2 * chosen:
            raise refuse("topk_group", f"transformers ranks groups by their 2 best scores, megatron by the best "
                                       f"num_experts_per_tok / topk_group = {topk}/{chosen}; needs "
                                       f"num_experts_per_tok == 2 * topk_group")
        router = dict(moe_score_function="sigmoid", moe_expert_bias=True, moe_norm_topk_prob=True)
    else:
        if values.get("scoring_func", "softmax") != "softmax":
            raise refuse("scoring_func", "DeepseekV2 routes by softmax scores")
        method = values.get("topk_method")
        if method not in ("greedy", "group_limited_greedy"):
            raise refuse("topk_method", "greedy or group_limited_greedy")
        grouped = grouped and method == "group_limited_greedy"
        if grouped and topk != chosen:
            raise refuse("topk_group", "transformers ranks groups by their best score, megatron by the best "
                                       "num_experts_per_tok / topk_group; needs num_experts_per_tok == topk_group")
        if values.get("norm_topk_prob"):
            raise refuse("norm_topk_prob", "transformers' DeepseekV2 router never renormalises")
        router = dict(moe_score_function="softmax", moe_expert_bias=False, moe_norm_topk_prob=False)
    return dict(
        num_experts=values["n_routed_experts"], moe_router_topk=topk,
        moe_ffn_hidden_size=values["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=shared * values["moe_intermediate_size"],
        first_k_dense=values["first_k_dense_replace"] or 0,
        moe_router_num_groups=groups if grouped else None, moe_router_group_topk=chosen if grouped else None,
        moe_routed_scaling_factor=float(values["routed_scaling_factor"]),
        **router,
    )


def _read_rope(values: dict[str, Any], refuse: Any) -> dict[str, Any]:
    """``rope_theta`` and the YaRN fields, from transformers 5's ``rope_parameters`` or older ``rope_scaling``."""
    parameters = values.get("rope_parameters")
    if isinstance(parameters, dict):
        key, scaling = "rope_parameters", dict(parameters)
        theta = scaling.pop("rope_theta", values.get("rope_theta", 10000.0))
    else:
        key, scaling = "rope_scaling", dict(values.get("rope_scaling") or {})
        theta = values.get("rope_theta", 10000.0)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    out: dict[str, Any] = {"rope_theta": float(theta)}
    if kind == "default":
        return out
    if kind != "yarn":
        raise refuse(key, f"RoPE type {kind!r} (supported: default, yarn)")
    if scaling.get("attention_factor") is not None or scaling.get("truncate", True) is not True:
        raise refuse(key, "YaRN with an explicit attention_factor or truncate false")
    original = scaling.get("original_max_position_embeddings")
    if not isinstance(original, int):
        raise refuse(key, "YaRN needs original_max_position_embeddings")
    factor = scaling.get("factor") or values["max_position_embeddings"] / original
    mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if all_dim and not mscale:
        raise refuse(key, "mscale_all_dim without mscale (megatron divides the attention factor by it)")
    if not (mscale and all_dim):  # transformers then scales cos/sin by the plain YaRN factor
        mscale, all_dim = 1.0, 0.0
    return {**out, "yarn_factor": float(factor), "yarn_original_max_position_embeddings": original,
            "yarn_beta_fast": float(scaling.get("beta_fast") or 32.0),
            "yarn_beta_slow": float(scaling.get("beta_slow") or 1.0),
            "yarn_mscale": float(mscale), "yarn_mscale_all_dim": float(all_dim)}


def stored_layer_indices(directory: Path) -> set[int] | None:
    """Layer indices ``model.layers.<i>.`` the safetensors files of ``directory`` hold (read from the index or the
    file header, no weights), or ``None`` when there is no safetensors file to tell."""
    names: Collection[str]
    index, single = directory / "model.safetensors.index.json", directory / "model.safetensors"
    try:
        if index.is_file():
            names = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        elif single.is_file():
            with single.open("rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                names = json.loads(handle.read(length))
        else:
            return None
    except (OSError, ValueError, KeyError, struct.error):
        return None
    out = set()
    for name in names:
        if name.startswith("model.layers."):
            index_text = name[len("model.layers."):].split(".", 1)[0]
            if index_text.isdigit():
                out.add(int(index_text))
    return out


def hf_config_json(flavor: DeepSeekFlavor, dtype: str, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """``config.json`` of ``flavor`` in ``dtype``, keeping ``base``'s other keys (its model type too, e.g.
    ``kimi_k2``, when it names the same architecture) and its RoPE style (transformers >= 5's ``rope_parameters``
    or ``rope_theta`` + ``rope_scaling``)."""
    arch = flavor.hf_architecture
    if arch not in _DEFAULTS:
        raise InteropError(f"{flavor.family}: hf_architecture {arch!r} has no DeepSeek config.json; use {V3}, {V32} "
                           f"or {V2}")
    shared, width = flavor.moe_shared_expert_intermediate_size or 0, flavor.moe_ffn_hidden_size or 0
    if not flavor.is_moe or not width or shared % width or not shared:
        raise InteropError(f"{flavor.family}: {arch} needs experts with shared experts a whole number of expert "
                           f"widths, got moe_shared_expert_intermediate_size={shared}, moe_ffn_hidden_size={width}")
    source = dict(base or {})
    out = {k: v for k, v in source.items() if k not in ("rope_theta", "rope_scaling", "rope_parameters", "dtype",
                                                           "torch_dtype", "transformers_version")}
    same_arch = (source.get("architectures") or [None])[0] == arch
    grouped = flavor.moe_router_num_groups is not None
    out.update(
        architectures=[arch], model_type=source.get("model_type") if same_arch else _MODEL_TYPE[arch],
        vocab_size=flavor.vocab_size, hidden_size=flavor.hidden_size, intermediate_size=flavor.ffn_hidden_size,
        moe_intermediate_size=width, num_hidden_layers=flavor.num_layers,
        num_attention_heads=flavor.num_attention_heads, num_key_value_heads=flavor.num_attention_heads,
        n_shared_experts=shared // width, n_routed_experts=flavor.num_experts,
        routed_scaling_factor=flavor.moe_routed_scaling_factor, kv_lora_rank=flavor.kv_lora_rank,
        q_lora_rank=flavor.q_lora_rank, qk_rope_head_dim=flavor.qk_rope_head_dim, v_head_dim=flavor.v_head_dim,
        qk_nope_head_dim=flavor.qk_nope_head_dim, n_group=flavor.moe_router_num_groups if grouped else 1,
        topk_group=flavor.moe_router_group_topk if grouped else 1, num_experts_per_tok=flavor.moe_router_topk,
        first_k_dense_replace=flavor.first_k_dense, norm_topk_prob=flavor.moe_norm_topk_prob, moe_layer_freq=1,
        hidden_act="silu", max_position_embeddings=flavor.max_position_embeddings, rms_norm_eps=flavor.norm_eps,
        tie_word_embeddings=flavor.tie_word_embeddings, attention_bias=False,
    )
    if "scoring_func" in source:  # DeepSeek's own files name it; transformers' classes fix it per architecture
        out["scoring_func"] = flavor.moe_score_function
    if "qk_head_dim" in source or "head_dim" in source:  # transformers' derived keys
        out.update(qk_head_dim=flavor.qk_head_dim, head_dim=flavor.qk_rope_head_dim)
    if arch == V3:
        out.update(topk_method="noaux_tc", rope_interleave=flavor.rope_interleave,
                   num_nextn_predict_layers=flavor.mtp_num_layers)
    elif arch == V32:
        if not flavor.is_dsa or not flavor.rope_interleave or flavor.mtp_num_layers or flavor.q_lora_rank is None:
            raise InteropError(f"{flavor.family}: {V32} holds sparse attention, a query LoRA and interleaved rotary "
                               "channels, and no multi-token-prediction layers")
        out.update(index_n_heads=flavor.index_n_heads, index_head_dim=flavor.index_head_dim,
                   index_topk=flavor.index_topk)
    else:
        out["topk_method"] = "group_limited_greedy" if grouped else "greedy"
    out["dtype" if "dtype" in source else "torch_dtype"] = DTYPE_NAMES[dtype]
    scaling = None
    if flavor.yarn_factor is not None:
        scaling = {"rope_type": "yarn", "factor": flavor.yarn_factor,
                   "original_max_position_embeddings": flavor.yarn_original_max_position_embeddings,
                   "beta_fast": flavor.yarn_beta_fast, "beta_slow": flavor.yarn_beta_slow,
                   "mscale": flavor.yarn_mscale, "mscale_all_dim": flavor.yarn_mscale_all_dim}
    if "rope_parameters" in source:
        out["rope_parameters"] = {**(scaling or {"rope_type": "default"}), "rope_theta": flavor.rope_theta}
    else:
        out.update(rope_theta=flavor.rope_theta, rope_scaling=scaling)
    return out


@dataclass(frozen=True)
class DeepSeekHFAdapter:
    """The :class:`~loongforge.models.family.HFAdapter` of a DeepSeek flavor (full TP=PP=EP=1 state dicts)."""

    flavor: DeepSeekFlavor

    def config_json(self, dtype: str, base: dict[str, Any] | None = None) -> dict[str, Any]:
        return hf_config_json(self.flavor, dtype, base)

    def to_hf(self, state: dict[str, Any]) -> dict[str, Any]:
        """Tensors as DeepSeek's and transformers' checkpoints store them: one module per expert, each MTP block
        with its copies of the embedding and LM head."""
        from loongforge.models.deepseek.hf_layout import megatron_to_hf

        return megatron_to_hf(state, self.flavor, per_expert=True)

    def from_hf(self, tensors: dict[str, Any], *, padded_vocab_size: int | None = None) -> dict[str, Any]:
        from loongforge.models.decoder_model import padded_vocab_size as tp1_padded
        from loongforge.models.deepseek.hf_layout import hf_to_megatron

        return hf_to_megatron(tensors, self.flavor, rows=padded_vocab_size or tp1_padded(self.flavor.vocab_size))

    def tensor_shapes(self, stored: Collection[str]) -> dict[str, tuple[int, ...] | None]:
        """Every tensor by stored name: experts fused when the files fuse them; the MTP blocks' embedding/head copies
        and any layer past the model's MTP blocks (DeepSeek files a model built without them may hold) ignored."""
        from loongforge.models.deepseek.hf_layout import hf_shapes, mtp_copies

        flavor = self.flavor
        fused = any(name.endswith(".mlp.experts.gate_up_proj") for name in stored)
        shapes: dict[str, tuple[int, ...] | None] = dict(hf_shapes(flavor, per_expert=not fused))
        shapes.update({copy: None for copy, _ in mtp_copies(flavor)})
        last = flavor.num_layers + flavor.mtp_num_layers
        for name in stored:
            index = name[len("model.layers."):].split(".", 1)[0] if name.startswith("model.layers.") else ""
            if index.isdigit() and int(index) >= last:
                shapes.setdefault(name, None)
        if flavor.tie_word_embeddings:
            shapes.setdefault("lm_head.weight", None)
        return shapes
