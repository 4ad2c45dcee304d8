"""Build a megatron-core ``GPTModel`` from a :class:`DecoderFlavor` on a device backend.

The flavor says *what* model (sizes, family switches), the backend's spec provider says *which modules*
implement it on this device, and :class:`ParallelSettings` says how it is split. Megatron's parallel state
(``initialize_model_parallel``) must already be set up with the same TP/PP sizes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.activations import squared_relu
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from loongforge.errors import ConfigError
from loongforge.models.flavor import DecoderFlavor, flavor_num_params
from loongforge.models.layer_spec import decoder_block_spec
from loongforge.models.mrope import InterleavedMultimodalRotary
from loongforge.models.rope import rope_inv_freq
from loongforge.parallel.sequence_chunks import SequenceChunk
from loongforge.parallel.sequence_pieces import SequencePieces, per_token_rotary

__all__ = ["DecoderSpec", "ParallelSettings", "build_model", "flavor_num_params", "padded_vocab_size",
           "transformer_config"]

#: Embedding rows are padded to a multiple of this (and of TP) so that vocab-parallel shards are equal and
#: matmuls aligned; the multiple does not depend on TP, so padded models are identical across layouts.
VOCAB_PAD_MULTIPLE = 128

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


@dataclass(frozen=True)
class ParallelSettings:
    """How the model is split: tensor (tp), pipeline (pp, optional virtual stages vpp), sequence parallel, and
    for MoE models expert parallel (ep), expert tensor parallel (etp; None: tp) and the token dispatcher."""

    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    vpp: int | None = None
    ep: int = 1
    etp: int | None = None
    moe_dispatcher: str = "alltoall"
    #: Context-parallel size: each rank holds 1/cp of every sequence; how attention exchanges it (megatron's
    #: ``cp_comm_type``: ``a2a`` Ulysses, ``p2p`` ring, ``a2a+p2p`` hybrid) and the hybrid's Ulysses group size.
    cp: int = 1
    cp_comm_type: str | None = None
    cp_a2a_size: int | None = None

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1 or (self.vpp is not None and self.vpp < 1):
            raise ConfigError(f"parallel sizes must be >= 1, got tp={self.tp} pp={self.pp} vpp={self.vpp}")
        if self.ep < 1 or self.cp < 1 or (self.etp is not None and self.etp < 1):
            raise ConfigError(f"parallel sizes must be >= 1, got ep={self.ep} cp={self.cp} etp={self.etp}")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel needs tp > 1 (it splits the sequence across TP ranks)")


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (HF ``gelu_new``/``gelu_pytorch_tanh``; GPT-2, Phi-2, Gemma)."""
    return F.gelu(x, approximate="tanh")


#: ``DecoderFlavor.activation`` -> the function megatron's MLP applies (to the gate half when gated).
ACTIVATION_FUNCS: dict[str, Any] = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": gelu_tanh, "relu": F.relu,
                                    "squared_relu": squared_relu}


def resolve_dtype(params_dtype: str | torch.dtype) -> torch.dtype:
    """``"fp32"``/``"bf16"``/``"fp16"`` (or a torch dtype) -> torch dtype."""
    if isinstance(params_dtype, torch.dtype):
        return params_dtype
    try:
        return _DTYPES[params_dtype.lower()]
    except KeyError:
        raise ConfigError(f"unknown params_dtype '{params_dtype}'; use one of fp32, bf16, fp16") from None


def padded_vocab_size(vocab_size: int, tp: int = 1) -> int:
    """``vocab_size`` rounded up to a multiple of ``lcm(VOCAB_PAD_MULTIPLE, tp)``."""
    multiple = math.lcm(VOCAB_PAD_MULTIPLE, tp)
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class DecoderSpec:
    """How a family's decoder departs from core's layer: the slot a family fills when its layers are not table rows.

    ``layer_specs(provider, config)`` returns one megatron ``ModuleSpec`` per layer of the *whole* model (dense or
    MoE, attention kind, its own layer classes), built with the device's ``provider`` (``BackendSpecProvider``);
    core keeps the layers this pipeline (and virtual) stage builds, as megatron's ``get_gpt_decoder_block_spec``
    does. ``config_class`` is the ``TransformerConfig`` subclass the layers read (megatron's
    ``MLATransformerConfig`` for Multi-Latent Attention) and ``config_fields`` its fields beyond what the flavor
    sets, which take precedence over core's (a family may, say, choose its own load-balancing loss type); both
    default to plain ``TransformerConfig``. ``mtp_block_spec(provider, config, vp_stage)`` returns megatron's
    ``MultiTokenPredictionBlock`` spec for the stage that holds it (``None`` elsewhere): the block's loss is added to
    training's through megatron's ``MTPLossAutoScaler`` and skipped where no labels are given (logits, generation).
    Passed to :meth:`loongforge.models.chunks.ChunkBuild.decoder_chunk`, so the family keeps core's embedding,
    output layer, vocabulary padding, RoPE and weight init.
    """

    layer_specs: Callable[[Any, TransformerConfig], Sequence[ModuleSpec]] | None = None
    config_class: type[TransformerConfig] = TransformerConfig
    config_fields: Mapping[str, Any] = field(default_factory=dict)
    mtp_block_spec: Callable[[Any, TransformerConfig, int | None], ModuleSpec | None] | None = None


def transformer_config(
    flavor: DecoderFlavor, *, params_dtype: str | torch.dtype = "fp32",
    parallel: ParallelSettings | None = None, extra_config: dict[str, Any] | None = None,
    spec: DecoderSpec | None = None,
) -> TransformerConfig:
    """The megatron ``TransformerConfig`` for ``flavor``: its norm, activation, gating and biases, no dropout.

    ``extra_config`` holds the device's additions (FP8 recipe, CUDA graphs; see
    ``DeviceBackend.megatron_settings``); they are applied last. ``spec`` names the config class and the fields a
    family's own layers read (:class:`DecoderSpec`).
    """
    spec = spec or DecoderSpec()
    parallel = parallel or ParallelSettings()
    dtype = resolve_dtype(params_dtype)
    if flavor.num_layers % parallel.pp:
        raise ConfigError(f"num_layers ({flavor.num_layers}) is not divisible by pp ({parallel.pp})")
    if flavor.num_query_groups % parallel.tp:
        raise ConfigError(f"num_query_groups ({flavor.num_query_groups}) is not divisible by tp ({parallel.tp})")
    if flavor.context_parallel_blocker is not None and parallel.cp > 1:
        raise ConfigError(f"{flavor.context_parallel_blocker} is not supported with context parallelism "
                          f"(cp={parallel.cp}); use cp=1")
    core: dict[str, Any] = dict(
        **_moe_kwargs(flavor, parallel),
        num_layers=flavor.num_layers,
        hidden_size=flavor.hidden_size,
        ffn_hidden_size=flavor.ffn_hidden_size,
        num_attention_heads=flavor.num_attention_heads,
        num_query_groups=flavor.num_query_groups,
        kv_channels=flavor.kv_channels,
        normalization=flavor.normalization,
        layernorm_zero_centered_gamma=flavor.norm_zero_centered,
        layernorm_epsilon=flavor.norm_eps,
        gated_linear_unit=flavor.gated_linear_unit,
        activation_func=ACTIVATION_FUNCS[flavor.activation],
        add_bias_linear=flavor.add_bias_linear,
        add_qkv_bias=flavor.add_qkv_bias or flavor.add_bias_linear,
        qk_layernorm=flavor.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=flavor.fused_swiglu,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        init_method_std=0.02,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # Initialise full weights on CPU and slice them per rank: the model is the same for every TP size.
        use_cpu_initialization=True,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        context_parallel_size=parallel.cp,
        cp_comm_type=parallel.cp_comm_type if parallel.cp > 1 else None,
        hierarchical_context_parallel_sizes=([parallel.cp_a2a_size, parallel.cp // parallel.cp_a2a_size]
                                             if parallel.cp > 1 and parallel.cp_a2a_size else None),
        virtual_pipeline_model_parallel_size=parallel.vpp,
        sequence_parallel=parallel.sequence_parallel,
        mrope_section=None if flavor.mrope_section is None else list(flavor.mrope_section),
        **_attention_kwargs(flavor),
    )
    return spec.config_class(**{**core, **spec.config_fields, **(extra_config or {})})


def _attention_kwargs(flavor: DecoderFlavor) -> dict[str, Any]:
    """Megatron's sliding-window and score-scale settings for ``flavor`` (none for full attention).

    ``window_size`` ``(w - 1, 0)``: the query and the ``w - 1`` tokens before it (Hugging Face's window ``w``).
    """
    kwargs: dict[str, Any] = {}
    if flavor.sliding_window is not None:
        kwargs.update(window_size=(flavor.sliding_window - 1, 0),
                      window_attn_skip_freq=flavor.sliding_window_full_every)
    if flavor.query_pre_attn_scalar is not None:
        kwargs["softmax_scale"] = flavor.query_pre_attn_scalar**-0.5
    return kwargs


def _moe_kwargs(flavor: DecoderFlavor, parallel: ParallelSettings) -> dict[str, Any]:
    """Megatron's MoE settings for ``flavor`` (none for a dense flavor).

    Dropless routing (no capacity factor) as in Mixtral and Qwen3-MoE; the per-micro-batch switch
    load-balancing loss (``aux_loss``); the router in fp32. ``moe_router_pre_softmax`` is megatron's name for
    "softmax over all experts, then top-k, no renormalisation" (``moe_norm_topk_prob=False``); the default
    (top-k then softmax over the chosen logits) equals softmax-top-k-renormalise. Renormalised top-1, which
    megatron refuses (a softmax over one logit), chooses the same expert through the full softmax and gets its
    weight of exactly 1 from :class:`_UnitTopOneWeight`. Grouped GEMM is left to the
    device's ``extra_config`` (it needs Transformer Engine); the local path runs experts one after another.
    """
    if flavor.num_experts is None:
        if parallel.ep > 1:
            raise ConfigError(f"ep={parallel.ep} needs a mixture-of-experts model (num_experts is not set)")
        return {}
    if flavor.num_experts % parallel.ep:
        raise ConfigError(f"num_experts ({flavor.num_experts}) is not divisible by ep ({parallel.ep})")
    return {
        "num_moe_experts": flavor.num_experts,
        "moe_router_topk": flavor.moe_router_topk,
        "moe_ffn_hidden_size": flavor.moe_ffn_hidden_size,
        "moe_shared_expert_intermediate_size": flavor.moe_shared_expert_intermediate_size,
        "moe_aux_loss_coeff": flavor.moe_aux_loss_coeff,
        "moe_router_load_balancing_type": "aux_loss" if flavor.moe_aux_loss_coeff else "none",
        "moe_router_pre_softmax": not flavor.moe_norm_topk_prob or flavor.renormalised_top1,
        "moe_router_dtype": "fp32",
        "moe_token_dispatcher_type": parallel.moe_dispatcher,
        "moe_grouped_gemm": False,
        "expert_model_parallel_size": parallel.ep,
        "expert_tensor_parallel_size": parallel.etp or parallel.tp,
    }


def build_model(
    flavor: DecoderFlavor,
    *,
    backend: Any,
    params_dtype: str | torch.dtype = "fp32",
    pre_process: bool = True,
    post_process: bool = True,
    parallel: ParallelSettings | None = None,
    vp_stage: int | None = None,
    extra_config: dict[str, Any] | None = None,
    scatter_embedding_sequence_parallel: bool = True,
    spec: DecoderSpec | None = None,
) -> GPTModel:
    """A megatron ``GPTModel`` for ``flavor`` with layers from ``backend.spec_provider()``.

    ``pre_process``/``post_process`` say whether this pipeline stage holds the embedding / the output layer
    (megatron's ``is_pipeline_first_stage``/``is_pipeline_last_stage``); ``vp_stage`` selects the virtual
    pipeline chunk. The backend's patches must have been applied (``backend.apply_patches()``).
    ``scatter_embedding_sequence_parallel=False`` makes the embedding return the whole sequence even with
    sequence parallelism, for callers (vision-language models) that edit it before scattering it themselves.
    ``spec`` carries a family's own layers and config class (:class:`DecoderSpec`).
    """
    parallel = parallel or ParallelSettings()
    spec = spec or DecoderSpec()
    config = transformer_config(flavor, params_dtype=params_dtype, parallel=parallel, extra_config=extra_config,
                                spec=spec)
    _reset_megatron_moe_state()  # a family's own layers may hold experts that the flavor does not describe
    provider = backend.spec_provider()
    position_embedding = flavor.position_embedding
    if position_embedding == "rope" and flavor.mrope_section is not None:
        position_embedding = "mrope"
    mtp_block = spec.mtp_block_spec(provider, config, vp_stage) if spec.mtp_block_spec is not None else None
    model = (PackedRowsGPTModel if mtp_block is None else _MTPModel)(
        config=config,
        mtp_block_spec=mtp_block,
        transformer_layer_spec=decoder_block_spec(provider, config, flavor, vp_stage=vp_stage,
                                                  layer_specs=spec.layer_specs),
        vocab_size=padded_vocab_size(flavor.vocab_size, parallel.tp),
        max_sequence_length=flavor.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=flavor.tie_word_embeddings,
        position_embedding_type=position_embedding,
        rotary_percent=flavor.rotary_percent,
        rotary_base=int(flavor.rope_theta),
        vp_stage=vp_stage,
        scatter_embedding_sequence_parallel=scatter_embedding_sequence_parallel,
    )
    if flavor.position_embedding == "rope":
        model.rotary_pos_emb.inv_freq = rope_inv_freq(flavor.rotary_dim, flavor.rope_theta, flavor.rope_scaling)
    if flavor.mrope_interleaved:
        model.rotary_pos_emb = InterleavedMultimodalRotary(model.rotary_pos_emb, flavor.mrope_section)
    if flavor.renormalised_top1:
        _UnitTopOneWeight.attach(model)
    if flavor.output_layer_bias and post_process:
        _add_output_bias(model.output_layer, config)
    if flavor.embedding_multiplier is not None and pre_process:
        model.embedding.register_forward_hook(_EmbeddingScale(flavor.embedding_multiplier))
    if flavor.final_logit_softcapping is not None and post_process:
        model.output_layer.register_forward_hook(_LogitSoftcap(flavor.final_logit_softcapping))
    padded = padded_vocab_size(flavor.vocab_size, parallel.tp)
    if padded != flavor.vocab_size and post_process:  # after any soft-capping: the padded rows stay excluded
        model.output_layer.register_forward_hook(_PaddedVocabMask(flavor.vocab_size, padded, parallel.tp))
    return model


class PackedRowsGPTModel(GPTModel):
    """Megatron's ``GPTModel`` that also takes packed rows split over context-parallel ranks.

    Such a row (``packed_seq_params`` :class:`~loongforge.parallel.sequence_pieces.SequencePieces`) holds pieces
    of many sequences whose positions restart per sequence, so RoPE must rotate each token by its own position
    (``position_ids``); megatron's table is laid out for one whole sequence per row. So must a chunk of a sequence
    (``parallel.seq_chunks``, :class:`~loongforge.parallel.sequence_chunks.SequenceChunk`), whose positions start
    where the chunk does. Nothing changes otherwise."""

    def _preprocess(self, *args: Any, **kwargs: Any) -> tuple:
        out = super()._preprocess(*args, **kwargs)
        if isinstance(chunk := kwargs.get("packed_seq_params"), SequenceChunk) and out[1] is not None:
            return (out[0], per_token_rotary(self.rotary_pos_emb, chunk.rotary_positions()), *out[2:])
        if not isinstance(kwargs.get("packed_seq_params"), SequencePieces) or out[1] is None:
            return out
        if self.position_embedding_type != "rope":
            raise ConfigError(f"packed rows under context parallelism (data.pack with parallel.cp > 1) take rotary "
                              f"or learned positions, not '{self.position_embedding_type}'; set data.pack: false")
        return (out[0], per_token_rotary(self.rotary_pos_emb, kwargs["position_ids"]), *out[2:])


class _MTPModel(PackedRowsGPTModel):
    """Megatron's ``GPTModel`` with multi-token-prediction blocks that also answers without labels.

    Megatron runs the blocks whenever the model holds them and needs labels to do so; the blocks only add a
    training loss, so where no labels are given (logits, evaluation by logits, generation) they are skipped and the
    model answers as the decoder alone does."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> Any:
        """Megatron ties a later stage's copy of the embedding (the blocks read it) to the first stage's through
        the data-parallel group named in ``metadata``, which megatron's own trainer always passes; so does this."""
        if metadata is None:
            from megatron.core import parallel_state

            metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
        return super().sharded_state_dict(prefix, sharded_offsets, metadata)

    def _postprocess(self, hidden_states: Any, input_ids: Any, position_ids: Any, labels: Any, *args: Any,
                     **kwargs: Any) -> Any:
        if labels is not None:
            return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs)
        kwargs["mtp_in_postprocess"] = False
        blocks, self.config.mtp_num_layers = self.config.mtp_num_layers, None  # megatron's switch for the MTP loss
        try:
            return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs)
        finally:
            self.config.mtp_num_layers = blocks


class _UnitTopOneWeight:
    """Router forward hook: the chosen expert's weight is exactly 1 (renormalised top-1 routing).

    Megatron computes it with ``moe_router_pre_softmax`` (the full softmax picks the same expert as the logits
    do) and this replaces the routing probabilities by the routing map, as renormalising one probability does: the
    loss sends the router no gradient through the weight, the load-balancing loss (added inside the router) still
    reaches it."""

    @classmethod
    def attach(cls, model: Any) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        for module in model.modules():
            if isinstance(module, TopKRouter):
                module.register_forward_hook(cls())

    def __call__(self, router: Any, inputs: Any, output: tuple[torch.Tensor, torch.Tensor]) -> Any:
        probs, routing_map = output
        return routing_map.to(probs.dtype), routing_map


def _reset_megatron_moe_state() -> None:
    """Forget megatron's two process-wide MoE states before an MoE model is built.

    The routers add their load-balancing losses to a module-level tracker sized by the number of layers of the
    first model that wrote to it, and the aux loss's backward scale is created by the first backward through an MoE
    layer (0-dim without a schedule, ``[1]`` under one). A model built later in the same process (a test, a notebook,
    a second run) must inherit neither: a tracker of another size fails its first step, stale losses inflate its
    aux loss, a scale of another shape fails its first backward.
    """
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    moe_utils.get_moe_layer_wise_logging_tracker().clear()
    MoEAuxLossAutoScaler.main_loss_backward_scale = None


def _add_output_bias(output_layer: Any, config: TransformerConfig) -> None:
    """Give megatron's LM head (built with ``bias=False`` by ``GPTModel``) a vocab-parallel bias (Phi-2).

    ``ColumnParallelLinear`` adds ``self.bias`` when it is set and checkpoints it sharded like the weight's
    rows, so a zero bias with the tensor-parallel attributes megatron gives its own biases is all it takes.
    """
    rows = output_layer.output_size_per_partition
    output_layer.bias = torch.nn.Parameter(torch.zeros(rows, dtype=config.params_dtype))
    set_tensor_model_parallel_attributes(output_layer.bias, True, 0, 1)
    output_layer.bias.allreduce = True


class _PaddedVocabMask:
    """Forward hook on the LM head: logits of the padded vocabulary rows become the dtype's lowest value.

    Megatron pads the vocabulary (:func:`padded_vocab_size`) and its cross-entropy runs over every row, so the
    padded rows' logits would take probability mass from the true vocabulary: with 130 tokens padded to 256
    the loss differs from Hugging Face's by 0.6 nats. Masked here, the softmax (and so the loss, its gradient and
    any argmax) covers the true vocabulary only, at every TP size: each rank masks the padded rows of its own
    vocab shard (the last shards hold them), and a gathered output is masked past ``vocab_size``. The lowest
    finite value rather than ``-inf`` keeps ``0 * logit`` terms finite; its exponential is 0 either way.
    """

    def __init__(self, vocab_size: int, padded_size: int, tp: int) -> None:
        from megatron.core import parallel_state

        self.vocab_size, self.padded_size, self.shard = vocab_size, padded_size, padded_size // tp
        self.shard_start = parallel_state.get_tensor_model_parallel_rank() * self.shard if tp > 1 else 0

    def __call__(self, module: Any, args: Any, output: tuple[torch.Tensor, Any]) -> tuple[torch.Tensor, Any]:
        logits, bias = output
        width = logits.shape[-1]
        start = self.shard_start if width == self.shard else 0
        true_rows = self.vocab_size - start
        if true_rows >= width:
            return logits, bias
        padded = torch.arange(width, device=logits.device) >= max(true_rows, 0)
        return logits.masked_fill(padded, torch.finfo(logits.dtype).min), bias


class _EmbeddingScale:
    """Forward hook multiplying the embedding output by a constant (Gemma's ``sqrt(hidden_size)``).

    Megatron's ``LanguageModelEmbedding`` has no multiplier; the constant is cast to the activation dtype
    first, as Hugging Face does, so bf16 runs round it the same way.
    """

    def __init__(self, multiplier: float) -> None:
        self.multiplier = multiplier

    def __call__(self, module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output * torch.tensor(self.multiplier, dtype=output.dtype, device=output.device)


class _LogitSoftcap:
    """Forward hook on the LM head: logits ``x`` become ``cap * tanh(x / cap)`` (Gemma-2's final soft-capping).

    Megatron's ``GPTModel`` has no such option; the hook runs before its loss, so training sees the capped
    logits as Hugging Face's model does.
    """

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def __call__(self, module: Any, args: Any, output: tuple[torch.Tensor, Any]) -> tuple[torch.Tensor, Any]:
        logits, bias = output
        return torch.tanh(logits / self.cap) * self.cap, bias
