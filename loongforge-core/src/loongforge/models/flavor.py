"""``DecoderFlavor``: the hyperparameters that define one decoder-only transformer size.

Families (Llama, Qwen2, Qwen3, their mixture-of-experts siblings Mixtral and Qwen3-MoE, GPT-2, GPT-NeoX,
Phi-2, Gemma) differ only in switches -- the norm, the MLP activation and gating, biases, position embedding,
partial rotary, parallel residual, QK-norm, explicit head_dim, tied embeddings, RoPE scaling, experts in place
of the MLP -- so one flat, torch-free description serves all of them. Each switch is data that
:mod:`loongforge.models.decoder_model` maps to megatron-core's own ``TransformerConfig``/``GPTModel`` options; every
default is the Llama behaviour, so a flavor that names none of them is the Llama decoder it always was.
Names in the registry point at flavors; ``with_overrides`` lets a config shrink or tweak one (``num_layers=2``
for a smoke run) without a new table entry.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loongforge.errors import ConfigError
from loongforge.models.family import ModelFamily

if TYPE_CHECKING:
    from loongforge.models.sizing import DecoderTerms, LayoutProblem
    from loongforge.parallel.megatron import Layout

#: RoPE scaling types ``build_model`` implements (Hugging Face ``rope_type`` names).
ROPE_SCALING_TYPES: tuple[str, ...] = ("llama3", "linear")
#: ``normalization`` values (megatron's names).
NORMALIZATIONS: tuple[str, ...] = ("RMSNorm", "LayerNorm")
#: ``activation`` values: SiLU, exact (erf) GELU, tanh-approximated GELU, ReLU, squared ReLU.
ACTIVATIONS: tuple[str, ...] = ("silu", "gelu", "gelu_tanh", "relu", "squared_relu")
#: ``position_embedding`` values (megatron's ``position_embedding_type`` names).
POSITION_EMBEDDINGS: tuple[str, ...] = ("rope", "learned_absolute", "none")
#: ``residual`` values: ``x + attn(n1 x)`` then ``+ mlp(n2 .)`` (Llama); ``x + attn(n1 x) + mlp(n2 x)``
#: (GPT-NeoX); ``x + attn(n x) + mlp(n x)`` with one norm (Phi-2).
RESIDUALS: tuple[str, ...] = ("sequential", "parallel", "parallel_shared_norm")


@dataclass(frozen=True)
class DecoderFlavor(ModelFamily):
    """A pre-norm decoder; by default RMSNorm, RoPE, SwiGLU MLP, no biases, grouped-query attention (Llama).

    Architecture switches (vocabularies in the module-level tuples): ``normalization`` RMSNorm/LayerNorm (a
    LayerNorm has a bias); ``norm_zero_centered`` stores norm weights as ``gamma - 1`` and applies ``1 + w``
    (Gemma); ``activation`` and ``gated_linear_unit`` (SwiGLU = silu gated, GeGLU = gelu_tanh gated, GPT-2 =
    gelu_tanh ungated); ``add_bias_linear`` puts a bias on every linear (``add_qkv_bias``: QKV only);
    ``position_embedding`` RoPE / learned absolute / none, ``rotary_percent`` the fraction of each head that
    RoPE rotates (GPT-NeoX 0.25, Phi-2 0.4); ``residual`` sequential or one of the parallel forms;
    ``output_layer_bias`` a bias on the LM head (Phi-2); ``embedding_multiplier`` scales the token embeddings
    (Gemma: ``sqrt(hidden_size)``).

    Gemma-2 switches: ``post_norms`` normalises the attention and MLP outputs before each residual add (its
    ``post_attention_layernorm``/``post_feedforward_layernorm``); ``attn_logit_softcapping`` /
    ``final_logit_softcapping`` ``c`` replace attention scores / output logits ``x`` by ``c * tanh(x / c)``;
    ``sliding_window`` ``w`` lets a token attend to itself and the ``w - 1`` before it, in every layer or, with
    ``sliding_window_full_every`` ``n``, in all but every ``n``-th layer (megatron's ``window_attn_skip_freq``);
    ``query_pre_attn_scalar`` ``s`` scales scores by ``s ** -0.5`` instead of ``head_dim ** -0.5``.

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
    of the ``(3, batch, seq)`` position ids. ``None`` is plain 1D RoPE. ``mrope_interleaved`` (Qwen3-VL) assigns
    the frequencies to the axes round-robin instead -- frequency ``j`` follows height when ``j % 3 == 1`` and
    ``j < 3 * sections[1]``, width when ``j % 3 == 2`` and ``j < 3 * sections[2]``, time otherwise -- so every axis
    gets high and low frequencies alike.
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
    mrope_interleaved: bool = False
    normalization: str = "RMSNorm"
    norm_zero_centered: bool = False
    activation: str = "silu"
    gated_linear_unit: bool = True
    add_bias_linear: bool = False
    position_embedding: str = "rope"
    rotary_percent: float = 1.0
    residual: str = "sequential"
    output_layer_bias: bool = False
    embedding_multiplier: float | None = None
    post_norms: bool = False
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    sliding_window: int | None = None
    sliding_window_full_every: int | None = None
    query_pre_attn_scalar: float | None = None

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
        if self.mrope_interleaved and self.mrope_section is None:
            raise ConfigError(f"{self.family} flavor: mrope_interleaved needs mrope_section (the M-RoPE sections)")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type not in ROPE_SCALING_TYPES:
                raise ConfigError(
                    f"{self.family} flavor: rope_scaling type {rope_type!r} is not supported; "
                    f"supported: {', '.join(ROPE_SCALING_TYPES)}"
                )
        self._check_switches()

    def _check_switches(self) -> None:
        """Each architecture switch against its vocabulary, in one line naming the switch."""
        for name, allowed in (("normalization", NORMALIZATIONS), ("activation", ACTIVATIONS),
                              ("position_embedding", POSITION_EMBEDDINGS), ("residual", RESIDUALS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{self.family} flavor: {name} {getattr(self, name)!r} is not supported; "
                                  f"supported: {', '.join(allowed)}")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ConfigError(f"{self.family} flavor: rotary_percent must be in (0, 1], got {self.rotary_percent}")
        if self.rotary_percent != 1.0 and self.position_embedding != "rope":
            raise ConfigError(f"{self.family} flavor: rotary_percent {self.rotary_percent} needs "
                              f"position_embedding 'rope', not {self.position_embedding!r}")
        if self.position_embedding == "rope" and int(self.kv_channels * self.rotary_percent) % 2:
            raise ConfigError(f"{self.family} flavor: rotary_percent {self.rotary_percent} of head_dim "
                              f"{self.kv_channels} must rotate an even number of dimensions")
        if self.residual != "sequential" and self.num_experts is not None:
            raise ConfigError(f"{self.family} flavor: residual {self.residual!r} is not supported with experts "
                              "(use residual 'sequential')")
        for name in ("embedding_multiplier", "attn_logit_softcapping", "final_logit_softcapping", "sliding_window",
                     "query_pre_attn_scalar"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{self.family} flavor: {name} must be positive, got {getattr(self, name)}")
        if self.sliding_window_full_every is not None and (
            self.sliding_window is None or self.sliding_window_full_every < 2
        ):
            raise ConfigError(f"{self.family} flavor: sliding_window_full_every must be >= 2 and needs "
                              f"sliding_window, got {self.sliding_window_full_every} with {self.sliding_window}")
        if self.post_norms and (self.residual != "sequential" or self.num_experts is not None):
            raise ConfigError(f"{self.family} flavor: post_norms needs residual 'sequential' and a dense MLP")

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (0 without RoPE); the rest pass through unchanged."""
        return int(self.kv_channels * self.rotary_percent) if self.position_embedding == "rope" else 0

    @property
    def is_moe(self) -> bool:
        """Whether the MLP of each layer is a mixture of experts."""
        return self.num_experts is not None

    @property
    def fused_swiglu(self) -> bool:
        """Whether the MLP runs through megatron's fused SwiGLU entry point (``bias_activation_fusion``).

        Dense SwiGLU decoders do, as Megatron-LM's ``--swiglu`` does by default; the device supplies the kernel
        (megatron's compiled one on GPU, :mod:`loongforge.devices.megatron_cpu.swiglu` on CPU), which keeps only
        the ``linear_fc1`` output for backward. MoE decoders keep the unfused path: their experts scale the
        activation by the router's probabilities, which is megatron's separate weighted kernel.
        """
        return self.gated_linear_unit and self.activation == "silu" and not self.is_moe

    @property
    def masked_attention_blocker(self) -> str | None:
        """Why this decoder's attention takes the plain causal mask only -- not the block-diagonal one of packed rows
        (``data.pack``) -- or ``None`` when it takes any. Core's and megatron's attention take any mask."""
        return None

    @property
    def context_parallel_blocker(self) -> str | None:
        """Why this decoder cannot split its sequences over context-parallel ranks, or ``None`` when it can: core's
        attention soft-caps logits and applies sliding windows over whole sequences only."""
        if self.attn_logit_softcapping is not None:
            return "attn_logit_softcapping"
        if self.sliding_window is not None:
            return "sliding_window"
        return None

    @property
    def kv_channels(self) -> int:
        """Per-head dimension (megatron's ``kv_channels``)."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    def with_overrides(self, **overrides: Any) -> DecoderFlavor:
        """A copy with some fields replaced; an unknown field name is a :class:`ConfigError`."""
        return replace_fields(self, overrides)

    # -- the model-family contract (loongforge.models.family) -------------------------------------------------

    @property
    def family_name(self) -> str:
        return self.family

    @property
    def decoder(self) -> DecoderFlavor:
        """An LLM is its own megatron decoder."""
        return self

    def build_chunk(self, build: Any) -> Any:
        """Core's ``GPTModel`` chunk, its layers from the device's spec provider (``build.backend``) -- this
        flavor's own where :meth:`decoder_spec` names them."""
        return build.decoder_chunk(self)

    @property
    def lora_linears(self) -> tuple[str, ...]:
        """Module names of the tensor-parallel linears in this decoder's layers: what ``model.lora.targets`` may name
        (``loongforge check`` refuses anything else before a model is built). A family with its own layers names
        its own."""
        return ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")

    def decoder_spec(self) -> Any:
        """How this decoder's layers depart from core's (a :class:`~loongforge.models.decoder_model.DecoderSpec`:
        per-layer specs, config class and fields, a multi-token-prediction block), or ``None`` for core's layers.
        :meth:`~loongforge.models.chunks.ChunkBuild.decoder_chunk` asks for it, so the decoder is the same whoever
        builds it: the family itself, or a composed model (a VLM) that holds it as its foundation."""
        return None

    def hf_adapter(self) -> Any:
        """Core's decoder adapter (``*ForCausalLM`` names and ``config.json``) for the families core knows a
        Hugging Face format of (:data:`loongforge.models.hf_config.FAMILIES`); ``None`` for any other."""
        from loongforge.models.decoder_hf import DecoderHFAdapter
        from loongforge.models.hf_config import FAMILIES

        return DecoderHFAdapter(self) if self.family in FAMILIES else None

    def reference_implementation(self) -> Any:
        """Transformers' ``*ForCausalLM`` (:class:`~loongforge.models.decoder_reference.TransformersCausalLM`) for
        the families core knows a Hugging Face format of; ``None`` for any other."""
        from loongforge.models.decoder_reference import TransformersCausalLM
        from loongforge.models.hf_config import FAMILIES

        return TransformersCausalLM(self) if self.family in FAMILIES else None

    def num_params(self, *, include_embeddings: bool = True) -> int:
        """:func:`flavor_num_params` of this grouped-query decoder (a subclass with other layers counts its own)."""
        return flavor_num_params(self, include_embeddings=include_embeddings)

    def decoder_terms(self, kernels: str = "te") -> DecoderTerms:
        """Core's grouped-query layer by part (:class:`loongforge.models.sizing.DecoderTerms`).

        Parameters: QKV and output projections split by tp (with the QKV bias), two norms and the QK-norm weights
        replicated, a SwiGLU-sized MLP (``3 h f``) split by tp, or a replicated router, the experts and a
        tp-split shared expert. Activations per token, following Korthikanti et al. (2022) counted against
        autograd's saved tensors (:mod:`loongforge.planner.memory`): per norm its input, output and ``1/row``
        (split only with sequence parallelism); attention's QKV output, rotated q and k, output and one
        log-sum-exp per head (dropped by recomputing ``core_attn``), plus the QK-norm's copy and statistics; a
        fused SwiGLU keeps ``3 f``, an unfused one (``local`` kernels, MoE experts) ``5 f`` (``3 f`` with
        Transformer Engine), each routed token its permuted copy. FLOPs: the projections, the MLP (or ``k``
        experts, the router and the shared expert) and causal attention ``2 q`` per position.
        """
        from loongforge.models.sizing import (
            SELECTIVE_CHOICES_DENSE,
            SELECTIVE_CHOICES_MOE,
            ActivationPart,
            DecoderTerms,
            FlopPart,
            ParamPart,
        )

        h, d, n, g = self.hidden_size, self.kv_channels, self.num_attention_heads, self.num_query_groups
        q, kv = n * d, g * d
        projections = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if self.add_qkv_bias else 0)
        params = [ParamPart("attention", projections, "tp"),
                  ParamPart("norms", 2 * h + (2 * d if self.qk_layernorm else 0), "none")]
        attention = (q + 2 * kv) + q + kv + q + ((q + n + g) if self.qk_layernorm else 0)
        activations = [ActivationPart("norms", 2 * (2 * h + 1), "sp"),
                       ActivationPart("attention", attention, "tp"),
                       ActivationPart("attention", n, "tp", recomputed_by=("core_attn",))]
        flops = [FlopPart("attention_projections", 2 * (h * (q + 2 * kv) + q * h), width=q, split="tp")]
        glu = 5 if kernels == "local" else 3
        if self.num_experts:
            e, k, width = self.num_experts, self.moe_router_topk, self.moe_ffn_hidden_size or 0
            shared = self.moe_shared_expert_intermediate_size or 0
            params += [ParamPart("router", e * h, "none"), ParamPart("shared_expert", 3 * h * shared, "tp"),
                       ParamPart("experts", e * 3 * h * width, "expert")]
            activations += [ActivationPart("router", e + 5 * k, "none"),
                            ActivationPart("experts", k * h, "none", recomputed_by=("moe",)),
                            ActivationPart("experts", k * (glu + 1) * width, "etp", recomputed_by=("moe",))]
            if shared:
                activations.append(ActivationPart("shared_expert", glu * shared, "tp",
                                                  recomputed_by=("shared_experts", "moe")))
            flops += [FlopPart("experts", 2 * k * 3 * h * width, width=width, split="etp",
                               recomputed_by=("mlp", "moe")),
                      FlopPart("router", 2 * e * h, recomputed_by=("mlp", "moe"))]
            if shared:
                flops.append(FlopPart("shared_expert", 2 * 3 * h * shared, width=shared, split="tp",
                                      recomputed_by=("mlp", "moe")))
        else:
            f = self.ffn_hidden_size
            params.append(ParamPart("mlp", 3 * h * f, "tp"))
            activations.append(ActivationPart("mlp", (3 if self.fused_swiglu else glu) * f, "tp",
                                              recomputed_by=("mlp",)))
            flops.append(FlopPart("mlp", 2 * 3 * h * f, width=f, split="tp", recomputed_by=("mlp",)))
        flops.append(FlopPart("core_attention", 2 * q, per_position=True, recomputed_by=("core_attn",)))
        return DecoderTerms(
            num_layers=self.num_layers, hidden_size=h, vocab_size=self.vocab_size, params=tuple(params),
            activations=tuple(activations), flops=tuple(flops), tie_word_embeddings=self.tie_word_embeddings,
            num_experts=self.num_experts, moe_router_topk=self.moe_router_topk if self.num_experts else 0,
            context_parallel_width=2 * q + 2 * kv, attention_heads=n, query_width=q, kv_width=kv,
            selective_recompute=SELECTIVE_CHOICES_MOE if self.num_experts else SELECTIVE_CHOICES_DENSE)

    @property
    def renormalised_top1(self) -> bool:
        """Top-1 routing whose one chosen probability is renormalised (Mixtral with ``num_experts_per_tok: 1``):
        every routing weight is exactly 1, so the loss sends the router no gradient; only a load-balancing loss
        (``moe_aux_loss_coeff``) trains it. Inference is well defined (transformers runs it)."""
        return self.num_experts is not None and self.moe_router_topk == 1 and self.moe_norm_topk_prob

    def check_layout(self, layout: Layout) -> list[LayoutProblem]:
        """Heads and query groups divisible by tp (and, with context parallelism, which this decoder's attention
        must allow -- :attr:`context_parallel_blocker` --, by the ranks its ``cp_mode`` splits heads over:
        :attr:`~loongforge.parallel.megatron.Layout.head_split`), layers by pp*vpp, experts by ep and the expert
        width by etp; expert parallelism only with experts, and MoE at tp > 1 only with sequence parallelism.
        Training also needs a router that learns: renormalised top-1 routing without a load-balancing loss gives it
        no gradient at all (:attr:`renormalised_top1`); converting and generating such a model is fine."""
        from loongforge.models.sizing import LayoutProblem, expert_tp

        heads, groups, layers = self.num_attention_heads, self.num_query_groups, self.num_layers
        problems: list[LayoutProblem] = []
        if self.renormalised_top1 and not self.moe_aux_loss_coeff:
            problems.append(LayoutProblem(
                f"{self.family}: moe_router_topk 1 with moe_norm_topk_prob (renormalised routing weights) gives every "
                "token weight 1 and, without a load-balancing loss (moe_aux_loss_coeff 0), the router no gradient; "
                "set moe_aux_loss_coeff > 0, moe_router_topk >= 2, or moe_norm_topk_prob false",
                "router gets no gradient"))
        if heads % layout.tp or groups % layout.tp:
            problems.append(LayoutProblem(f"tp={layout.tp} must divide the model's attention heads ({heads}) and "
                                          f"query groups ({groups})", "tp does not divide heads/query groups"))
        if layout.cp > 1:  # first whether this attention splits sequences at all, then whether its heads divide
            blocker = self.context_parallel_blocker
            if blocker is not None:
                problems.append(LayoutProblem(f"parallel.cp={layout.cp}: the model's {blocker} is not supported "
                                              "with context parallelism; use cp=1", f"cp with {blocker}"))
            split = layout.head_split
            if heads % split or groups % split:
                over, size = ("cp_a2a_size", layout.cp_a2a_size) if layout.cp_mode == "hybrid" else ("cp", layout.cp)
                problems.append(LayoutProblem(
                    f"tp*{over}={layout.tp}*{size} must divide the model's attention heads ({heads}) and query "
                    f"groups ({groups}) (cp_mode {layout.cp_mode} splits the heads over {over}; cp_mode ring "
                    "does not)", "cp does not divide heads per tp rank or the sequence"))
        stages = layout.pp * layout.num_chunks
        if layers % stages:
            problems.append(LayoutProblem(f"the model's {layers} layers do not split into pp*vpp={layout.pp}*"
                                          f"{layout.num_chunks} = {stages} equal stages", "pp does not divide layers"))
        experts, reason = self.num_experts, "ep*etp does not divide the ranks of a stage or experts"
        if experts is None:
            if layout.ep > 1:
                problems.append(LayoutProblem(f"parallel.ep={layout.ep} needs a mixture-of-experts model", reason))
            return problems
        if experts % layout.ep:
            problems.append(LayoutProblem(f"parallel.ep={layout.ep} must divide the model's {experts} experts",
                                          reason))
        etp = expert_tp(layout)
        if (self.moe_ffn_hidden_size or 0) % etp:
            problems.append(LayoutProblem(f"etp={etp} must divide the expert width moe_ffn_hidden_size "
                                          f"({self.moe_ffn_hidden_size})", reason))
        if layout.tp > 1 and not layout.sequence_parallel:
            problems.append(LayoutProblem(f"an MoE model at tp={layout.tp} needs parallel.sequence_parallel",
                                          "MoE at tp > 1 needs sequence parallelism"))
        return problems


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
    """Parameter count of ``flavor`` with the unpadded vocabulary, as published model sizes count it.

    Learned position embeddings count as embeddings; a shared-norm parallel layer has one norm.
    """
    h, f, d = flavor.hidden_size, flavor.ffn_hidden_size, flavor.kv_channels
    q, kv = flavor.num_attention_heads * d, flavor.num_query_groups * d
    bias = flavor.add_bias_linear
    fc1_out = 2 if flavor.gated_linear_unit else 1
    if flavor.num_experts is not None:  # experts (gate/up/down each), router, optional shared expert
        mlp = flavor.num_experts * ((fc1_out + 1) * h * flavor.moe_ffn_hidden_size + h)
        mlp += 3 * h * (flavor.moe_shared_expert_intermediate_size or 0)
    else:
        mlp = (fc1_out + 1) * h * f + (fc1_out * f + h if bias else 0)  # fc1 (gate/up or one), fc2, biases
    norm = h * (2 if flavor.normalization == "LayerNorm" else 1)
    norms = 1 if flavor.residual == "parallel_shared_norm" else 2
    norms += 2 if flavor.post_norms else 0
    layer = h * (q + 2 * kv) + q * h + mlp + norms * norm  # qkv, proj, mlp, norms
    if flavor.add_qkv_bias or bias:
        layer += q + 2 * kv
    if bias:
        layer += h  # attention output projection
    if flavor.qk_layernorm:
        layer += 2 * d
    total = flavor.num_layers * layer + norm  # + final norm
    if flavor.output_layer_bias:
        total += flavor.vocab_size
    if include_embeddings:
        total += flavor.vocab_size * h * (1 if flavor.tie_word_embeddings else 2)
        if flavor.position_embedding == "learned_absolute":
            total += flavor.max_position_embeddings * h
    return total
