"""``DeepSeekFlavor``: the hyperparameters of one DeepSeek-V2/V3-architecture decoder (torch-free).

A DeepSeek decoder is core's pre-norm decoder (RMSNorm, SwiGLU, untied LM head) with three departures, each a
group of fields here that :mod:`loongforge.models.deepseek.layer_spec` turns into megatron-core modules:

* **Multi-Latent Attention** (MLA): queries through a LoRA-style bottleneck of rank ``q_lora_rank`` (``None``: one
  projection), keys and values through a shared latent of rank ``kv_lora_rank``; each head's query/key is
  ``qk_nope_head_dim`` channels without position plus ``qk_rope_head_dim`` rotated channels (one rotated key shared
  by all heads), values ``v_head_dim`` wide. MLA applies its own RoPE, with YaRN when ``yarn_factor`` is set
  (``yarn_*`` are DeepSeek's ``rope_scaling`` keys); ``position_embedding`` is therefore ``"none"`` (core's decoder
  builds no rotary table) and ``head_dim`` / ``num_query_groups`` are derived (``v_head_dim`` / one group per head).
* **DeepSeekMoE**: the first ``first_k_dense`` layers keep a dense MLP (``ffn_hidden_size``), the others route each
  token to ``moe_router_topk`` of ``num_experts`` narrow experts (``moe_ffn_hidden_size``) plus always-on shared
  experts (``moe_shared_expert_intermediate_size``, the shared experts' summed width). Scores are ``sigmoid``
  (V3) or ``softmax`` (V2) of the router logits; with ``moe_router_num_groups`` experts are split into groups and
  only the ``moe_router_group_topk`` best groups are eligible (node-limited routing); the chosen weights are
  multiplied by ``moe_routed_scaling_factor``. ``moe_expert_bias`` adds the auxiliary-loss-free balancing bias
  (V3's ``e_score_correction_bias``): it only shifts which experts are chosen, and after each optimizer step it
  moves by ``moe_bias_update_rate`` towards under-loaded experts. ``moe_aux_loss_coeff`` weights an optional
  load-balancing loss of type ``moe_aux_loss_type`` (V3's sequence-wise ``seq_aux_loss``).
* **Multi-token prediction** (MTP): ``mtp_num_layers`` extra blocks after the decoder, each predicting one token
  further ahead, their loss weighted by ``mtp_loss_scaling_factor`` (the mean over the blocks).

* **DeepSeek sparse attention** (DSA, DeepSeek-V3.2): with ``index_n_heads`` set, a lightning indexer of that many
  heads of ``index_head_dim`` channels scores every earlier token for each query and MLA attends to the
  ``index_topk`` best only (:mod:`loongforge.models.sparse_attention`). ``dsa_phase`` is the indexer's training
  phase: ``dense_warmup`` (dense attention; only the indexers train, on their KL loss weighted by
  ``dsa_indexer_loss_coeff``, the rest of the model frozen) or ``sparse`` (top-k attention; everything trains).

``rope_interleave`` says only how a Hugging Face checkpoint lays out its rotated channels (``True``: DeepSeek's
interleaved pairs, what megatron's MLA computes; ``False``: halves, reordered on conversion).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loongforge.errors import ConfigError
from loongforge.models.flavor import DecoderFlavor

#: The indexer's training phases, in order (what ``loongforge.models.sparse_attention.core_attention.DSA_PHASES``
#: implements; kept here so that the flavor stays torch-free).
DSA_PHASES: tuple[str, ...] = ("dense_warmup", "sparse")
#: Router score functions (megatron's ``moe_router_score_function``).
SCORE_FUNCTIONS: tuple[str, ...] = ("sigmoid", "softmax")
#: Load-balancing loss types a DeepSeek flavor may weight with ``moe_aux_loss_coeff`` (megatron's names).
AUX_LOSS_TYPES: tuple[str, ...] = ("seq_aux_loss", "aux_loss", "global_aux_loss")
#: Core decoder switches MLA layers do not implement: each must keep its Llama value.
_FIXED_SWITCHES: dict[str, Any] = dict(
    normalization="RMSNorm", norm_zero_centered=False, activation="silu", gated_linear_unit=True,
    add_bias_linear=False, add_qkv_bias=False, qk_layernorm=False, rotary_percent=1.0, residual="sequential",
    output_layer_bias=False, embedding_multiplier=None, post_norms=False, attn_logit_softcapping=None,
    final_logit_softcapping=None, sliding_window=None, sliding_window_full_every=None, query_pre_attn_scalar=None,
    mrope_section=None, rope_scaling=None,
)


@dataclass(frozen=True)
class DeepSeekFlavor(DecoderFlavor):
    """A DeepSeek-V2/V3-architecture decoder: MLA attention, DeepSeekMoE, optional multi-token prediction.

    The module docstring describes the fields. ``head_dim`` and ``num_query_groups`` are derived (``v_head_dim``,
    ``num_attention_heads``) whatever is passed; the core switches MLA does not implement (biases, QK-norm, other
    norms or activations, RoPE scaling through ``rope_scaling``, ...) must keep their defaults.
    """

    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True
    yarn_factor: float | None = None
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    first_k_dense: int = 0
    moe_score_function: str = "sigmoid"
    moe_expert_bias: bool = True
    moe_bias_update_rate: float = 1e-3
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_routed_scaling_factor: float = 1.0
    moe_aux_loss_type: str = "seq_aux_loss"
    mtp_num_layers: int = 0
    mtp_loss_scaling_factor: float = 0.1
    index_n_heads: int | None = None
    index_head_dim: int = 128
    index_topk: int = 2048
    dsa_phase: str = "sparse"
    dsa_indexer_loss_coeff: float = 0.0

    def __post_init__(self) -> None:
        # Derived, so that an override of v_head_dim or the head count cannot leave them stale.
        object.__setattr__(self, "head_dim", self.v_head_dim)
        object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.position_embedding != "none":
            raise ConfigError(f"{self.family} flavor: position_embedding must be 'none' (multi-latent attention "
                              f"applies its own RoPE), got {self.position_embedding!r}")
        for name, value in _FIXED_SWITCHES.items():
            if getattr(self, name) != value:
                raise ConfigError(f"{self.family} flavor: {name}={getattr(self, name)!r} is not supported by the "
                                  f"DeepSeek layers (needs {value!r})")
        super().__post_init__()
        self._check_attention()
        self._check_experts()
        self._check_sparse_attention()
        if self.mtp_num_layers < 0 or self.mtp_loss_scaling_factor < 0:
            raise ConfigError(f"{self.family} flavor: mtp_num_layers and mtp_loss_scaling_factor must be >= 0, got "
                              f"{self.mtp_num_layers} and {self.mtp_loss_scaling_factor}")

    def _check_attention(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{self.family} flavor: {name} must be positive, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ConfigError(f"{self.family} flavor: q_lora_rank must be positive or null, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"{self.family} flavor: qk_rope_head_dim ({self.qk_rope_head_dim}) must be even "
                              "(RoPE rotates channel pairs)")
        if self.yarn_factor is not None and self.yarn_factor <= 0:
            raise ConfigError(f"{self.family} flavor: yarn_factor must be positive or null, got {self.yarn_factor}")

    def _check_sparse_attention(self) -> None:
        if self.index_n_heads is None:
            return
        where = f"{self.family} flavor"
        if min(self.index_n_heads, self.index_head_dim, self.index_topk) <= 0:
            raise ConfigError(f"{where}: index_n_heads, index_head_dim and index_topk must be positive, got "
                              f"{self.index_n_heads}, {self.index_head_dim}, {self.index_topk}")
        if self.qk_rope_head_dim > self.index_head_dim:
            raise ConfigError(f"{where}: the indexer rotates qk_rope_head_dim ({self.qk_rope_head_dim}) of its "
                              f"index_head_dim ({self.index_head_dim}) channels: it must be at least that")
        if self.dsa_phase not in DSA_PHASES:
            raise ConfigError(f"{where}: dsa_phase {self.dsa_phase!r} is not one of {', '.join(DSA_PHASES)}")
        if self.dsa_phase == "dense_warmup" and not self.dsa_indexer_loss_coeff > 0:
            raise ConfigError(f"{where}: the dense warm-up trains the indexers on their loss alone; set "
                              f"dsa_indexer_loss_coeff > 0 (got {self.dsa_indexer_loss_coeff})")
        if self.dsa_indexer_loss_coeff < 0:
            raise ConfigError(f"{where}: dsa_indexer_loss_coeff must be >= 0, got {self.dsa_indexer_loss_coeff}")

    def _check_experts(self) -> None:
        if self.moe_score_function not in SCORE_FUNCTIONS:
            raise ConfigError(f"{self.family} flavor: moe_score_function {self.moe_score_function!r} is not "
                              f"supported; supported: {', '.join(SCORE_FUNCTIONS)}")
        if self.moe_aux_loss_type not in AUX_LOSS_TYPES:
            raise ConfigError(f"{self.family} flavor: moe_aux_loss_type {self.moe_aux_loss_type!r} is not "
                              f"supported; supported: {', '.join(AUX_LOSS_TYPES)}")
        if not 0 <= self.first_k_dense <= self.num_layers:
            raise ConfigError(f"{self.family} flavor: first_k_dense must be in [0, num_layers={self.num_layers}], "
                              f"got {self.first_k_dense}")
        if self.num_experts is None:
            return
        if self.first_k_dense == self.num_layers:
            raise ConfigError(f"{self.family} flavor: first_k_dense={self.first_k_dense} leaves no MoE layer; "
                              "set num_experts null for a dense model")
        if self.moe_expert_bias and self.moe_score_function != "sigmoid":
            raise ConfigError(f"{self.family} flavor: moe_expert_bias needs moe_score_function 'sigmoid'")
        if self.moe_score_function == "sigmoid" and not self.moe_norm_topk_prob:
            raise ConfigError(f"{self.family} flavor: sigmoid routing always renormalises the chosen scores; "
                              "moe_norm_topk_prob must be true")
        if self.moe_routed_scaling_factor <= 0 or self.moe_bias_update_rate < 0:
            raise ConfigError(f"{self.family} flavor: moe_routed_scaling_factor must be positive and "
                              f"moe_bias_update_rate >= 0, got {self.moe_routed_scaling_factor} and "
                              f"{self.moe_bias_update_rate}")
        groups, chosen = self.moe_router_num_groups, self.moe_router_group_topk
        if (groups is None) != (chosen is None):
            raise ConfigError(f"{self.family} flavor: set both moe_router_num_groups and moe_router_group_topk, or "
                              "neither")
        if groups is not None and chosen is not None and (
            groups < 1 or self.num_experts % groups or not 1 <= chosen <= groups
            or self.moe_router_topk < chosen or (self.num_experts // groups) * chosen < self.moe_router_topk
        ):
            raise ConfigError(
                f"{self.family} flavor: group-limited routing needs num_experts ({self.num_experts}) divisible by "
                f"moe_router_num_groups ({groups}), 1 <= moe_router_group_topk ({chosen}) <= groups, and the chosen "
                f"groups to hold at least moe_router_topk ({self.moe_router_topk}) experts"
            )

    # -- derived ---------------------------------------------------------------------------------------------

    @property
    def qk_head_dim(self) -> int:
        """Channels of each query/key head: the position-free part plus the rotated part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """For each decoder layer, whether its MLP is a mixture of experts (all dense without experts)."""
        return tuple(self.num_experts is not None and i >= self.first_k_dense for i in range(self.num_layers))

    @property
    def is_dsa(self) -> bool:
        """Whether attention is DeepSeek sparse attention (an indexer picks the keys)."""
        return self.index_n_heads is not None

    @property
    def masked_attention_blocker(self) -> str | None:
        """The indexer's top-k runs over each query's causal prefix (:mod:`loongforge.models.sparse_attention`)."""
        return "DeepSeek sparse attention (index_n_heads)" if self.is_dsa else None

    @property
    def context_parallel_blocker(self) -> str | None:
        """Multi-token prediction rolls labels across the sequence, which core's context-parallel split does not
        reproduce; MLA itself splits over cp ranks."""
        if self.is_dsa:
            return "DeepSeek sparse attention"
        return "multi-token prediction" if self.mtp_num_layers else None

    # -- the model-family contract -----------------------------------------------------------------------------

    def trained_parameters(self) -> tuple[str, ...]:
        """The dense warm-up trains the DSA indexers alone (DeepSeek-V3.2 report, Sec. 2.1)."""
        return ("*.core_attention.indexer.*",) if self.is_dsa and self.dsa_phase == "dense_warmup" else ()

    @property
    def lora_linears(self) -> tuple[str, ...]:
        """MLA's projections (the query's one or its low-rank pair, the key/value latent's pair, the output) and the
        MLP's."""
        query = ("linear_q_proj",) if self.q_lora_rank is None else ("linear_q_down_proj", "linear_q_up_proj")
        return (*query, "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj", "linear_fc1", "linear_fc2")

    def decoder_spec(self) -> Any:
        """DeepSeek's layers, ``MLATransformerConfig`` and MTP block
        (:func:`loongforge.models.deepseek.layer_spec.decoder_spec`) in core's ``GPTModel`` chunk."""
        from loongforge.models.deepseek.layer_spec import decoder_spec

        return decoder_spec(self)

    def hf_adapter(self) -> Any:
        """The DeepSeek-V2/V3 Hugging Face layout (``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM``)."""
        from loongforge.models.deepseek.hf import DeepSeekHFAdapter

        return DeepSeekHFAdapter(self)

    # -- the planner's slots ------------------------------------------------------------------------------------

    def num_params(self, *, include_embeddings: bool = True, active: bool = False) -> int:
        """Parameters with the MTP blocks (:func:`~loongforge.models.deepseek.counts.deepseek_num_params`);
        ``active``: those one token uses (its ``moe_router_topk`` experts)."""
        from loongforge.models.deepseek.counts import deepseek_num_params

        return deepseek_num_params(self, include_embeddings=include_embeddings, active=active)

    def decoder_terms(self, kernels: str = "te") -> Any:
        """MLA, dense-then-MoE layers and MTP blocks by part
        (:func:`~loongforge.models.deepseek.counts.deepseek_decoder_terms`)."""
        from loongforge.models.deepseek.counts import deepseek_decoder_terms

        return deepseek_decoder_terms(self, kernels)

    def check_layout(self, layout: Any) -> list[Any]:
        """Core's decoder checks, plus what MLA's column-parallel down-projections need: tp dividing
        ``q_lora_rank`` and ``kv_lora_rank + qk_rope_head_dim``."""
        from loongforge.models.sizing import LayoutProblem

        problems = list(super().check_layout(layout))
        widths = {"kv_lora_rank + qk_rope_head_dim": self.kv_lora_rank + self.qk_rope_head_dim}
        if self.q_lora_rank is not None:
            widths["q_lora_rank"] = self.q_lora_rank
        if self.is_dsa and layout.tp > 1:
            problems.append(LayoutProblem(f"tp={layout.tp}: DeepSeek sparse attention runs at tp=1 here (its indexer "
                                          "is not split yet)", "tp with DeepSeek sparse attention"))
        for name, width in widths.items():
            if width % layout.tp:
                problems.append(LayoutProblem(f"tp={layout.tp} must divide the model's {name} ({width}): MLA's "
                                              "down-projections are split over tp", "tp does not divide MLA ranks"))
        return problems
