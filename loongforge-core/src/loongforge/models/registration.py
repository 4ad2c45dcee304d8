"""Registering the built-in model flavors (torch-free, so ``loongforge list`` stays instant)."""

from __future__ import annotations

from typing import Any

from loongforge.models import gemma, gpt2, llama, moe, neox, phi, qwen
from loongforge.models.flavor import DecoderFlavor, flavor_num_params
from loongforge.models.listing import size_label

_TABLES = (llama, qwen, moe, gpt2, neox, phi, gemma)


def all_flavors() -> dict[str, DecoderFlavor]:
    """Every built-in flavor by canonical name."""
    return {name: flavor for table in _TABLES for name, flavor in table.FLAVORS.items()}


def describe(flavor: DecoderFlavor) -> str:
    """One line for listings: family, size and the switches that distinguish it."""
    count = flavor_num_params(flavor)
    size = size_label(count)
    extras = [s for s, on in (("qkv-bias", flavor.add_qkv_bias), ("qk-norm", flavor.qk_layernorm),
                             ("biases", flavor.add_bias_linear), ("LayerNorm", flavor.normalization == "LayerNorm"),
                             (flavor.residual.replace("_", "-") + " residual", flavor.residual != "sequential"),
                             (f"rotary {flavor.rotary_percent:g}", flavor.rotary_percent != 1.0),
                             ("learned positions", flavor.position_embedding == "learned_absolute"),
                             (f"{flavor.activation}{' gated' if flavor.gated_linear_unit else ''} MLP",
                              (flavor.activation, flavor.gated_linear_unit) != ("silu", True)),
                             ("(1 + w) RMSNorm", flavor.norm_zero_centered),
                             ("post-norms", flavor.post_norms),
                             (f"sliding window {flavor.sliding_window}", flavor.sliding_window is not None),
                             ("soft-capping", flavor.attn_logit_softcapping is not None
                              or flavor.final_logit_softcapping is not None),
                             ("tied", flavor.tie_word_embeddings)) if on]
    heads = f"{flavor.num_attention_heads}/{flavor.num_query_groups} heads"
    parts = [f"{flavor.family} decoder", f"{size} params", f"{flavor.num_layers} layers", f"d{flavor.hidden_size}"]
    parts.append(heads)
    if flavor.num_experts is not None:
        parts.append(f"{flavor.num_experts} experts (top-{flavor.moe_router_topk})")
    return ", ".join(parts + extras)


def register_builtin_models(registry: Any) -> None:
    """Register each flavor under its name, with its Hugging Face ids as aliases."""
    for table in _TABLES:
        for name, flavor in table.FLAVORS.items():
            registry.register(name, flavor, aliases=table.HF_IDS.get(name, ()), description=describe(flavor))
