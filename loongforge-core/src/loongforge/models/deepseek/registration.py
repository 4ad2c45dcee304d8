"""Registering the DeepSeek family: its flavors and its Hugging Face readers (torch-free, so ``loongforge list``
stays instant). Called from core's own hooks (:mod:`loongforge.builtin`), as a plugin's ``plugin.py`` would."""

from __future__ import annotations

from typing import Any

from loongforge.models.deepseek.flavor import DeepSeekFlavor
from loongforge.models.deepseek.flavors import FLAVORS, HF_IDS, V2, V3, V32
from loongforge.models.listing import size_label


def describe(flavor: DeepSeekFlavor) -> str:
    """One line for listings: size (total and active per token), layers, MLA, experts and routing."""
    from loongforge.models.deepseek.counts import deepseek_num_params

    total = deepseek_num_params(flavor, include_mtp=False)
    active = deepseek_num_params(flavor, include_mtp=False, active=True)
    parts = [f"{flavor.family} decoder", f"{size_label(total)} params ({size_label(active)} active)",
             f"{flavor.num_layers} layers", f"d{flavor.hidden_size}", f"MLA {flavor.num_attention_heads} heads"]
    if flavor.num_experts is not None:
        routing = f"{flavor.moe_score_function} top-{flavor.moe_router_topk}"
        if flavor.moe_router_num_groups:
            routing += f" in {flavor.moe_router_group_topk}/{flavor.moe_router_num_groups} groups"
        parts.append(f"{flavor.first_k_dense} dense + {flavor.num_experts} experts ({routing})")
    if flavor.moe_expert_bias and flavor.is_moe:
        parts.append("aux-free bias")
    if flavor.yarn_factor:
        parts.append(f"YaRN x{flavor.yarn_factor:g}")
    if flavor.is_dsa:
        parts.append(f"sparse attention (top-{flavor.index_topk} keys)")
    if flavor.mtp_num_layers:
        parts.append(f"MTP {flavor.mtp_num_layers} (+{size_label(deepseek_num_params(flavor) - total)})")
    return ", ".join(parts)


def register_deepseek_models(registry: Any) -> None:
    """Each DeepSeek flavor under its name, its Hugging Face ids as aliases."""
    for name, flavor in FLAVORS.items():
        registry.register(name, flavor, aliases=HF_IDS.get(name, ()), description=describe(flavor))


def register_deepseek_hf_architectures(registry: Any) -> None:
    """The DeepSeek readers under ``DeepseekV3ForCausalLM`` (alias ``deepseek_v3``; Kimi-K2's ``kimi_k2``) and
    ``DeepseekV2ForCausalLM`` (alias ``deepseek_v2``)."""
    from loongforge.models.deepseek.hf import DeepSeekHFReader

    registry.register(V3, DeepSeekHFReader(V3), aliases=("deepseek_v3", "kimi_k2"),
                      description="DeepSeek-V3 / Kimi-K2 / Moonlight (MLA, sigmoid MoE, MTP)")
    registry.register(V2, DeepSeekHFReader(V2), aliases=("deepseek_v2",),
                      description="DeepSeek-V2 (MLA, softmax MoE)")
    registry.register(V32, DeepSeekHFReader(V32), aliases=("deepseek_v32",),
                      description="DeepSeek-V3.2 (MLA with DeepSeek sparse attention, sigmoid MoE)")
