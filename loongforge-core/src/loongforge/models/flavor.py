"""``DecoderFlavor``: the hyperparameters that define one Llama-style decoder size.

Families (Llama, Qwen2, Qwen3, and their mixture-of-experts siblings Mixtral and Qwen3-MoE) differ only in a
few switches -- QKV bias, QK-norm, explicit head_dim, tied embeddings, RoPE scaling, experts in place of the
MLP -- so one flat, torch-free description serves all of them. Names in the registry
point at flavors; ``with_overrides`` lets a config shrink or tweak one (``num_layers=2`` for a smoke run)
without a new table entry.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from loongforge.errors import ConfigError

#: RoPE scaling types ``build_model`` implements (Hugging Face ``rope_type`` names).
ROPE_SCALING_TYPES: tuple[str, ...] = ("llama3", "linear")


@dataclass(frozen=True)
class DecoderFlavor:
    """A pre-norm decoder: RMSNorm, RoPE, SwiGLU MLP, grouped-query attention.

    ``rope_scaling`` is ``None`` or a Hugging Face style dict with ``rope_type`` ("llama3": ``factor``,
    ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``; "linear": ``factor``).
    ``head_dim`` is ``None`` when it is ``hidden_size // num_attention_heads``; Qwen3 sets it explicitly.

    Mixture of experts: ``num_experts`` is ``None`` for a dense model; otherwise every layer's MLP is
    ``num_experts`` SwiGLU experts of width ``moe_ffn_hidden_size``, of which a softmax router picks
    ``moe_router_topk`` per token. ``moe_norm_topk_prob`` renormalises the chosen probabilities to sum to one
    (Mixtral always; Qwen3-MoE's ``norm_topk_prob``); without it they stay the full-softmax values.
    ``moe_shared_expert_intermediate_size`` adds an always-on shared expert of that width (``None``: none).
    ``moe_aux_loss_coeff`` weights the load-balancing loss (HF ``router_aux_loss_coef``).

    ``mrope_section`` switches plain RoPE to multimodal RoPE (Qwen2-VL's M-RoPE): the ``head_dim / 2`` rotary
    frequencies are split into (temporal, height, width) sections of these sizes, each rotated by its own row
    of the ``(3, batch, seq)`` position ids. ``None`` is plain 1D RoPE.
    """

    family: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    norm_eps: float = 1e-5
    qk_layernorm: bool = False
    add_qkv_bias: bool = False
    tie_word_embeddings: bool = False
    head_dim: int | None = None
    hf_architecture: str = "LlamaForCausalLM"
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_aux_loss_coeff: float = 0.0
    moe_norm_topk_prob: bool = True
    mrope_section: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                     "vocab_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{self.family} flavor: {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(
                f"{self.family} flavor: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.num_query_groups})"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"{self.family} flavor: hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                f"({self.num_attention_heads}); set head_dim explicitly"
            )
        if self.num_experts is not None:
            if self.num_experts < 2 or not 1 <= self.moe_router_topk <= self.num_experts:
                raise ConfigError(
                    f"{self.family} flavor: need num_experts >= 2 and 1 <= moe_router_topk <= num_experts, got "
                    f"num_experts={self.num_experts}, moe_router_topk={self.moe_router_topk}"
                )
            if not self.moe_ffn_hidden_size or self.moe_ffn_hidden_size <= 0:
                raise ConfigError(f"{self.family} flavor: an MoE flavor needs a positive moe_ffn_hidden_size")
        if self.mrope_section is not None:  # YAML gives a list; keep the flavor hashable
            object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
        if self.mrope_section is not None and (
            len(self.mrope_section) != 3 or min(self.mrope_section) < 0
            or sum(self.mrope_section) != self.kv_channels // 2
        ):
            raise ConfigError(
                f"{self.family} flavor: mrope_section {self.mrope_section} must be three non-negative sizes summing "
                f"to head_dim / 2 = {self.kv_channels // 2}"
            )
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type not in ROPE_SCALING_TYPES:
                raise ConfigError(
                    f"{self.family} flavor: rope_scaling type {rope_type!r} is not supported; "
                    f"supported: {', '.join(ROPE_SCALING_TYPES)}"
                )

    @property
    def is_moe(self) -> bool:
        """Whether the MLP of each layer is a mixture of experts."""
        return self.num_experts is not None

    @property
    def kv_channels(self) -> int:
        """Per-head dimension (megatron's ``kv_channels``)."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    def with_overrides(self, **overrides: Any) -> DecoderFlavor:
        """A copy with some fields replaced; an unknown field name is a :class:`ConfigError`."""
        return replace_fields(self, overrides)


def replace_fields(flavor: Any, overrides: dict[str, Any], *, what: str = "flavor") -> Any:
    """A copy of the dataclass ``flavor`` with ``overrides`` (what every family's ``with_overrides`` does).

    An unknown field name is a :class:`ConfigError` listing the known ones; a list given for a tuple field (YAML
    has no tuples) becomes a tuple, so ``patch_size: [1, 2, 2]`` in a config means ``(1, 2, 2)``.
    """
    known = {f.name for f in dataclasses.fields(flavor)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"unknown {what} field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    values = {name: tuple(value) if isinstance(getattr(flavor, name), tuple) and isinstance(value, list) else value
              for name, value in overrides.items()}
    return dataclasses.replace(flavor, **values)


def flavor_num_params(flavor: DecoderFlavor, *, include_embeddings: bool = True) -> int:
    """Parameter count of ``flavor`` with the unpadded vocabulary, as published model sizes count it."""
    h, f, d = flavor.hidden_size, flavor.ffn_hidden_size, flavor.kv_channels
    q, kv = flavor.num_attention_heads * d, flavor.num_query_groups * d
    if flavor.num_experts is not None:  # experts (gate/up/down each), router, optional shared expert
        mlp = flavor.num_experts * (3 * h * flavor.moe_ffn_hidden_size + h)
        mlp += 3 * h * (flavor.moe_shared_expert_intermediate_size or 0)
    else:
        mlp = 3 * h * f  # gate/up/down
    layer = h * (q + 2 * kv) + q * h + mlp + 2 * h  # qkv, proj, mlp, two norms
    if flavor.add_qkv_bias:
        layer += q + 2 * kv
    if flavor.qk_layernorm:
        layer += 2 * d
    total = flavor.num_layers * layer + h  # + final norm
    if include_embeddings:
        total += flavor.vocab_size * h * (1 if flavor.tie_word_embeddings else 2)
    return total
