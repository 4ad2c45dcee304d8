"""Qwen3-Next sizes: :class:`Qwen3NextFlavor` (core's decoder flavor plus the hybrid layer pattern, the Gated
DeltaNet dimensions and the gates) and the registered table. Torch-free, so listing models stays instant.

A Qwen3-Next decoder is core's pre-norm decoder with three departures, each a field here:

* **layer pattern** -- ``layer_types`` names each layer ``linear_attention`` (a Gated DeltaNet token mixer,
  :mod:`loongforge.models.qwen3_next.mixer`) or ``full_attention``; ``None`` means transformers' default, every
  ``full_attention_interval``-th layer full. The ``linear_*`` fields size the DeltaNet: key heads (queries and keys),
  value heads (a multiple of the key heads; each key head serves ``value / key`` consecutive value heads), their
  head dimensions and the causal convolution's kernel.
* **gated full attention** -- ``attention_output_gate``: the query projection is twice as wide and its second half,
  through a sigmoid, gates each head's output (megatron's ``attention_output_gate``); RoPE rotates the first
  ``rotary_percent`` of each head (0.25); queries and keys are RMS-normalised per head.
* **MoE with a gated shared expert** -- core's MoE fields, plus ``moe_shared_expert_gate`` (the shared expert's
  output scaled by ``sigmoid(x . w)``, megatron's ``moe_shared_expert_gate``); layer ``i`` is MoE unless
  ``i in mlp_only_layers`` or ``(i + 1) % decoder_sparse_step`` (transformers' rule), the others a dense MLP of
  ``ffn_hidden_size``. ``num_experts=None`` makes every layer dense.

Every RMSNorm but the DeltaNet's gated output norm stores ``gamma - 1`` (``norm_zero_centered``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loongforge.errors import ConfigError
from loongforge.models.flavor import DecoderFlavor
from loongforge.models.listing import size_label

#: ``Qwen3NextFlavor.layer_types`` values (transformers' names).
LAYER_KINDS: tuple[str, ...] = ("linear_attention", "full_attention")
FAMILY = "qwen3-next"
ARCHITECTURE = "Qwen3NextForCausalLM"


@dataclass(frozen=True)
class Qwen3NextFlavor(DecoderFlavor):
    """A Qwen3-Next decoder (see the module docstring for the fields beyond :class:`DecoderFlavor`)."""

    layer_types: tuple[str, ...] | None = None
    full_attention_interval: int = 4
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    attention_output_gate: bool = True
    moe_shared_expert_gate: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("layer_types", "mlp_only_layers"):  # YAML and JSON give lists; keep the flavor hashable
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        super().__post_init__()
        where = f"{self.family} flavor"
        for name in ("full_attention_interval", "linear_num_key_heads", "linear_num_value_heads",
                     "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "decoder_sparse_step"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{where}: {name} must be positive, got {getattr(self, name)}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"{where}: linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                              f"linear_num_key_heads ({self.linear_num_key_heads})")
        if self.layer_types is not None:
            unknown = sorted(set(self.layer_types) - set(LAYER_KINDS))
            if unknown or len(self.layer_types) != self.num_layers:
                raise ConfigError(f"{where}: layer_types must name {self.num_layers} layers, each one of "
                                  f"{', '.join(LAYER_KINDS)}; got {list(self.layer_types)}")
            if self.layer_types == _interval_pattern(self.num_layers, self.full_attention_interval):
                object.__setattr__(self, "layer_types", None)  # one spelling per model: the interval's pattern
        if any(not 0 <= i < self.num_layers for i in self.mlp_only_layers):
            raise ConfigError(f"{where}: mlp_only_layers {list(self.mlp_only_layers)} names layers outside "
                              f"0..{self.num_layers - 1}")
        if self.residual != "sequential" or self.post_norms or self.normalization != "RMSNorm":
            raise ConfigError(f"{where}: Qwen3-Next layers are sequential pre-norm RMSNorm layers")

    # -- the layer pattern ------------------------------------------------------------------------------------

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Each layer's token mixer (``layer_types``, or every ``full_attention_interval``-th layer full)."""
        if self.layer_types is not None:
            return self.layer_types
        return _interval_pattern(self.num_layers, self.full_attention_interval)

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` (from 0) has the mixture of experts rather than the dense MLP."""
        return (self.num_experts is not None and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    @property
    def context_parallel_blocker(self) -> str | None:
        if "linear_attention" in self.layer_kinds:
            return "Gated DeltaNet linear attention"
        return super().context_parallel_blocker

    # -- the model-family contract ----------------------------------------------------------------------------

    @property
    def lora_linears(self) -> tuple[str, ...]:
        """Core's (the gated attention's and the MLPs') and the Gated DeltaNet's input and output projections."""
        return (*super().lora_linears, "in_proj", "out_proj")

    def decoder_spec(self) -> Any:
        """This family's layers (:func:`loongforge.models.qwen3_next.layers.decoder_spec`) in core's decoder chunk
        (embedding, output layer, RoPE, init)."""
        from loongforge.models.qwen3_next.layers import decoder_spec

        return decoder_spec(self)

    def hf_adapter(self) -> Any:
        from loongforge.models.qwen3_next.hf import Qwen3NextHFAdapter

        return Qwen3NextHFAdapter(self)

    # -- the planner's slots ------------------------------------------------------------------------------------

    def num_params(self, *, include_embeddings: bool = True, active: bool = False) -> int:
        """Parameters as the Hugging Face checkpoint holds them
        (:func:`~loongforge.models.qwen3_next.counts.qwen3_next_num_params`); ``active``: those one token uses."""
        from loongforge.models.qwen3_next.counts import qwen3_next_num_params

        return qwen3_next_num_params(self, include_embeddings=include_embeddings, active=active)

    def decoder_terms(self, kernels: str = "te") -> Any:
        """Gated-attention and Gated DeltaNet layers, dense and MoE MLPs by part
        (:func:`~loongforge.models.qwen3_next.counts.qwen3_next_decoder_terms`)."""
        from loongforge.models.qwen3_next.counts import qwen3_next_decoder_terms

        return qwen3_next_decoder_terms(self, kernels)

    def check_layout(self, layout: Any) -> list[Any]:
        """Core's decoder checks, plus the DeltaNet's: tp must divide its key heads (a rank holds whole key heads
        with the value heads that read them)."""
        from loongforge.models.sizing import LayoutProblem

        problems = list(super().check_layout(layout))
        if "linear_attention" in self.layer_kinds and self.linear_num_key_heads % layout.tp:
            problems.append(LayoutProblem(f"tp={layout.tp} must divide the model's Gated DeltaNet key heads "
                                          f"({self.linear_num_key_heads})", "tp does not divide DeltaNet key heads"))
        return problems


def _interval_pattern(layers: int, interval: int) -> tuple[str, ...]:
    """Transformers' default ``layer_types``: every ``interval``-th layer full attention, the others linear."""
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers))


def _qwen3_next(**kw: Any) -> Qwen3NextFlavor:
    base: dict[str, Any] = dict(family=FAMILY, hf_architecture=ARCHITECTURE, vocab_size=151936,
                                max_position_embeddings=262144, rope_theta=10000000.0, norm_eps=1e-6,
                                qk_layernorm=True, norm_zero_centered=True, head_dim=256, rotary_percent=0.25,
                                moe_aux_loss_coeff=0.001)
    return Qwen3NextFlavor(**{**base, **kw})


FLAVORS: dict[str, Qwen3NextFlavor] = {
    # https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json: hidden_size 2048,
    # intermediate_size 5120, num_hidden_layers 48, full_attention_interval 4, num_attention_heads 16,
    # num_key_value_heads 2, head_dim 256, partial_rotary_factor 0.25, rope_theta 10000000, linear_num_key_heads 16,
    # linear_num_value_heads 32, linear_key_head_dim / linear_value_head_dim 128, linear_conv_kernel_dim 4,
    # num_experts 512, num_experts_per_tok 10, moe_intermediate_size 512, shared_expert_intermediate_size 512,
    # norm_topk_prob true, decoder_sparse_step 1, mlp_only_layers [], router_aux_loss_coef 0.001, rms_norm_eps 1e-6,
    # max_position_embeddings 262144, vocab_size 151936, tie_word_embeddings false.
    "qwen3-next-80b-a3b": _qwen3_next(
        num_layers=48, hidden_size=2048, ffn_hidden_size=5120, num_attention_heads=16, num_query_groups=2,
        num_experts=512, moe_router_topk=10, moe_ffn_hidden_size=512, moe_shared_expert_intermediate_size=512),
    # CPU-sized: both layer kinds (3 linear + 1 full), GVA (2 key / 4 value heads), MoE with the gated shared
    # expert in every layer but the first (a dense MLP there, through mlp_only_layers).
    "qwen3-next-tiny": _qwen3_next(
        num_layers=4, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2, head_dim=32,
        vocab_size=384, max_position_embeddings=4096, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=64,
        moe_shared_expert_intermediate_size=64, mlp_only_layers=(0,)),
}

#: Hugging Face repository ids accepted as aliases.
HF_IDS: dict[str, tuple[str, ...]] = {
    "qwen3-next-80b-a3b": ("Qwen/Qwen3-Next-80B-A3B-Instruct", "Qwen/Qwen3-Next-80B-A3B-Thinking"),
}


def describe(flavor: Qwen3NextFlavor) -> str:
    """One line for ``loongforge list models``."""
    total, active = flavor.num_params(), flavor.num_params(active=True, include_embeddings=False)
    kinds = flavor.layer_kinds
    parts = [f"{flavor.family} hybrid decoder", f"{size_label(total)} params", f"{flavor.num_layers} layers "
             f"({kinds.count('linear_attention')} Gated DeltaNet, {kinds.count('full_attention')} gated attention)",
             f"d{flavor.hidden_size}", f"{flavor.num_attention_heads}/{flavor.num_query_groups} heads"]
    if flavor.num_experts is not None:
        parts.append(f"{flavor.num_experts} experts (top-{flavor.moe_router_topk}, "
                     f"{size_label(active)} active non-embedding)")
    return ", ".join(parts)
