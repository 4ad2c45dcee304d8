"""Core's decoder families in Hugging Face format: one :class:`HFFamily` row per family (torch-free data).

A row says everything core knows of a family's ``*ForCausalLM`` format: its architecture and ``model_type``, the
defaults of its transformers config class, how its ``config.json`` spells each key, which switches its model
hard-codes or cannot express, and where its tensors live (:class:`HFNames`).
:mod:`loongforge.models.hf_config` reads and writes ``config.json`` from a row and
:mod:`loongforge.models.hf_adapter` turns its names into the tensor-by-tensor mapping both ways, so a family that
differs only in names, keys and switches is a new row, not new code. Plugin families are not rows here: they
register their own reader and adapter (``loongforge_register_hf_architectures``).

Tensor names are relative: ``layers`` + ``.<i>.`` + a per-layer name, or a top-level prefix (``.weight`` and
``.bias`` are appended by the adapter).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: ``HFNames.qkv_layout`` values. ``separate``: ``q_proj``/``k_proj``/``v_proj``; ``stacked``: one tensor
#: ``[q; k; v]`` (GPT-2's ``c_attn``); ``per_head``: one tensor with ``[q, k, v]`` of each head in turn
#: (GPT-NeoX's ``query_key_value``), which is megatron's per-group layout when every head is its own group.
QKV_LAYOUTS: tuple[str, ...] = ("separate", "stacked", "per_head")


@dataclass(frozen=True)
class HFNames:
    """The tensor names of one family (defaults: Llama's, which Qwen, Mixtral and Gemma share)."""

    embed: str = "model.embed_tokens"
    layers: str = "model.layers"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    #: Learned absolute position embeddings (GPT-2's ``wpe``); ``None`` for families without.
    position: str | None = None
    input_norm: str = "input_layernorm"
    #: The pre-MLP norm; ``None`` where the layer has one shared norm (Phi-2).
    mlp_norm: str | None = "post_attention_layernorm"
    #: Norms of the attention and MLP outputs (Gemma-2's sandwich norms; ``DecoderFlavor.post_norms``).
    post_attn_norm: str | None = None
    post_mlp_norm: str | None = None
    #: ``(q, k, v)`` for the ``separate`` layout, one name otherwise.
    qkv: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    qkv_layout: str = "separate"
    q_norm: str = "self_attn.q_norm"
    k_norm: str = "self_attn.k_norm"
    proj: str = "self_attn.o_proj"
    #: ``(gate, up)`` for a gated MLP, one name for an ungated one.
    fc1: tuple[str, ...] = ("mlp.gate_proj", "mlp.up_proj")
    fc2: str = "mlp.down_proj"
    #: Linear weights stored ``[in, out]`` (GPT-2's ``Conv1D``) instead of ``torch.nn.Linear``'s ``[out, in]``.
    transposed: bool = False
    #: Names above are those of checkpoint files; transformers 5 renames some on load (GPT-NeoX's ``embed_out``
    #: is the module's ``lm_head``). File name -> module name, so in-memory state dicts are read too.
    in_memory: tuple[tuple[str, str], ...] = ()
    #: The base model's prefix that some published files omit (the hub's ``openai-community/gpt2`` stores
    #: ``h.0...``/``wte.weight``, saved from ``GPT2Model``); such names are read as if it were there.
    base_prefix: str = ""


LLAMA = HFNames()
#: ``GPT2LMHeadModel`` (https://huggingface.co/openai-community/gpt2).
GPT2 = HFNames(
    embed="transformer.wte", layers="transformer.h", final_norm="transformer.ln_f", position="transformer.wpe",
    input_norm="ln_1", mlp_norm="ln_2", qkv=("attn.c_attn",), qkv_layout="stacked", proj="attn.c_proj",
    fc1=("mlp.c_fc",), fc2="mlp.c_proj", transposed=True, base_prefix="transformer.",
)
#: ``GPTNeoXForCausalLM`` (https://huggingface.co/EleutherAI/pythia-160m).
NEOX = HFNames(
    embed="gpt_neox.embed_in", layers="gpt_neox.layers", final_norm="gpt_neox.final_layer_norm",
    lm_head="embed_out", in_memory=(("embed_out.weight", "lm_head.weight"),), qkv=("attention.query_key_value",),
    qkv_layout="per_head", proj="attention.dense",
    fc1=("mlp.dense_h_to_4h",), fc2="mlp.dense_4h_to_h",
)
#: ``PhiForCausalLM`` (https://huggingface.co/microsoft/phi-2).
PHI = HFNames(final_norm="model.final_layernorm", mlp_norm=None, proj="self_attn.dense", fc1=("mlp.fc1",),
              fc2="mlp.fc2")

#: ``Gemma2ForCausalLM`` (https://huggingface.co/google/gemma-2-2b).
GEMMA2 = HFNames(mlp_norm="pre_feedforward_layernorm", post_attn_norm="post_attention_layernorm",
                 post_mlp_norm="post_feedforward_layernorm")

#: Hugging Face ``hidden_act`` names -> ``DecoderFlavor.activation``.
HF_ACTIVATIONS: dict[str, str] = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
                                  "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu", "relu2": "squared_relu"}
#: The name written for each activation when neither the source config nor the family's row spells it.
HF_ACTIVATION_NAMES: dict[str, str] = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh",
                                       "relu": "relu", "squared_relu": "relu2"}
#: ``config.json`` keys of architecture values, Llama's spelling (a row's ``keys`` override them).
_LLAMA_KEYS: dict[str, str] = {"norm_eps": "rms_norm_eps"}
#: (key, value our models need) for switches the Llama-style families' configs may carry.
_LLAMA_UNSUPPORTED: tuple[tuple[str, Any], ...] = (
    ("attention_bias", False), ("mlp_bias", False), ("use_sliding_window", False), ("router_jitter_noise", 0.0),
    ("decoder_sparse_step", 1), ("mlp_only_layers", []))


@dataclass(frozen=True)
class HFFamily:
    """One decoder family's Hugging Face format (defaults: Llama's, which the Llama-style families share)."""

    architecture: str
    model_type: str
    #: Values of keys a ``config.json`` may omit: the defaults of the family's transformers config class.
    defaults: dict[str, Any]
    names: HFNames = LLAMA
    #: Architecture value -> ``config.json`` key, where the family's spelling differs from Llama's.
    keys: dict[str, str] = field(default_factory=dict)
    #: Keys the family's ``config.json`` does not have (its attention is multi-head, its head_dim implied).
    absent_keys: tuple[str, ...] = ()
    #: Flavor switches its transformers model hard-codes.
    switches: dict[str, Any] = field(default_factory=dict)
    #: ``hidden_act`` values it reads (``None``: any of :data:`HF_ACTIVATIONS`) ...
    activations: tuple[str, ...] | None = ("silu",)
    #: ... and the spelling it writes for an activation (its reference checkpoints' names).
    activation_names: dict[str, str] = field(default_factory=dict)
    #: (key, value our model needs) for switches its model has and ours does not.
    unsupported: tuple[tuple[str, Any], ...] = _LLAMA_UNSUPPORTED
    #: Its sliding window is a size (``None`` = off; Mixtral), refused unless null.
    window_by_size: bool = False
    #: ``intermediate_size`` may be null, meaning 4 * hidden (GPT-2's ``n_inner``).
    intermediate_optional: bool = False
    qk_layernorm: bool = False
    add_qkv_bias: bool = False
    #: Token embeddings scaled by ``sqrt(hidden_size)`` (Gemma).
    embedding_scaled: bool = False
    #: The ``attention_bias`` value written (``None``: not written).
    attention_bias: bool | None = False
    #: How its MoE checkpoints name experts: ``"mixtral"`` (``block_sparse_moe.experts.<e>.w1/w3/w2``, the expert
    #: width in ``intermediate_size``, ``num_local_experts``) or ``"qwen"`` (``mlp.experts.<e>.gate_proj/...``,
    #: ``moe_intermediate_size``, ``num_experts``); ``None`` for a dense family.
    moe_layout: str | None = None
    #: Pre-transformers-5 RoPE keys (theta, partial fraction) where they are not ``rope_theta`` /
    #: ``partial_rotary_factor`` (GPT-NeoX's ``rotary_emb_base`` / ``rotary_pct``).
    legacy_rope_keys: tuple[str, str] | None = None
    #: Switches read from keys only this family has (``get(key)`` -> flavor fields) and the keys written for them
    #: (flavor -> ``config.json`` keys); see :mod:`loongforge.models.hf_config`.
    read_extra: Callable[[Callable[[str], Any]], dict[str, Any]] | None = None
    write_extra: Callable[[Any], dict[str, Any]] | None = None

    def key(self, name: str) -> str:
        """The ``config.json`` key that holds architecture value ``name`` (Llama spelling) in this family."""
        return self.keys.get(name, _LLAMA_KEYS.get(name, name))


def _neox_read(get: Callable[[str], Any]) -> dict[str, Any]:
    return {"residual": "parallel"} if get("use_parallel_residual") is not False else {}


def _neox_write(flavor: Any) -> dict[str, Any]:
    return {"use_parallel_residual": flavor.residual == "parallel"}


def _gemma2_read(get: Callable[[str], Any]) -> dict[str, Any]:
    """Gemma-2's soft-capping, score scale and sliding-window layers.

    ``layer_types`` (``sliding_attention``/``full_attention`` per layer; transformers' default when absent: every
    second layer full) must be "full every n-th layer" or all one kind, megatron's ``window_attn_skip_freq`` forms.
    """
    layers = get("num_hidden_layers")
    types = get("layer_types") or ["full_attention" if (i + 1) % 2 == 0 else "sliding_attention" for i in range(layers)]
    full = [i for i, kind in enumerate(types) if kind == "full_attention"]
    window = get("sliding_window") if len(full) < len(types) else None
    every = full[0] + 1 if full and window is not None else None
    if every is not None and full != list(range(every - 1, layers, every)):
        from loongforge.errors import ConfigError

        raise ConfigError(f"layer_types {types} is not supported: full attention must be every n-th layer")
    return dict(attn_logit_softcapping=get("attn_logit_softcapping"),
                final_logit_softcapping=get("final_logit_softcapping"),
                query_pre_attn_scalar=get("query_pre_attn_scalar"), sliding_window=window,
                sliding_window_full_every=every)


def _gemma2_write(flavor: Any) -> dict[str, Any]:
    every = flavor.sliding_window_full_every
    types = ["sliding_attention" if flavor.sliding_window is not None and (every is None or (i + 1) % every)
             else "full_attention" for i in range(flavor.num_layers)]
    return dict(attn_logit_softcapping=flavor.attn_logit_softcapping,
                final_logit_softcapping=flavor.final_logit_softcapping,
                query_pre_attn_scalar=flavor.query_pre_attn_scalar, sliding_window=flavor.sliding_window,
                layer_types=types)


_QWEN_MOE_DEFAULTS = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                      "norm_topk_prob": False, "router_aux_loss_coef": 0.001}
#: family -> its row; the real-size defaults come from the transformers config classes (each family module cites
#: a published config.json).
FAMILIES: dict[str, HFFamily] = {
    "llama": HFFamily("LlamaForCausalLM", "llama", {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6}),
    "qwen2": HFFamily("Qwen2ForCausalLM", "qwen2", {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
                      add_qkv_bias=True, attention_bias=None),
    "qwen3": HFFamily("Qwen3ForCausalLM", "qwen3", {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
                      qk_layernorm=True),
    "mixtral": HFFamily("MixtralForCausalLM", "mixtral",
                        {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5, "num_local_experts": 8,
                         "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001},
                        window_by_size=True, moe_layout="mixtral"),
    "qwen3-moe": HFFamily("Qwen3MoeForCausalLM", "qwen3_moe",
                          {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, **_QWEN_MOE_DEFAULTS},
                          qk_layernorm=True, moe_layout="qwen"),
    "gpt2": HFFamily("GPT2LMHeadModel", "gpt2",
                     {"n_positions": 1024, "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new",
                      "tie_word_embeddings": True},
                     names=GPT2, absent_keys=("num_key_value_heads", "head_dim"),
                     keys={"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
                           "max_position_embeddings": "n_positions", "intermediate_size": "n_inner",
                           "norm_eps": "layer_norm_epsilon", "hidden_act": "activation_function"},
                     switches={"normalization": "LayerNorm", "gated_linear_unit": False, "add_bias_linear": True,
                               "position_embedding": "learned_absolute"},
                     activations=None, activation_names={"gelu_tanh": "gelu_new"},
                     unsupported=(("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                                  ("reorder_and_upcast_attn", False), ("add_cross_attention", False)),
                     intermediate_optional=True, attention_bias=None),
    "gpt-neox": HFFamily("GPTNeoXForCausalLM", "gpt_neox",
                         {"max_position_embeddings": 2048, "layer_norm_eps": 1e-5, "hidden_act": "gelu",
                          "use_parallel_residual": True},
                         names=NEOX, absent_keys=("num_key_value_heads", "head_dim"),
                         keys={"norm_eps": "layer_norm_eps"},
                         switches={"normalization": "LayerNorm", "gated_linear_unit": False, "add_bias_linear": True},
                         activations=None, unsupported=(("attention_bias", True),), attention_bias=True,
                         legacy_rope_keys=("rotary_emb_base", "rotary_pct"), read_extra=_neox_read,
                         write_extra=_neox_write),
    "phi": HFFamily("PhiForCausalLM", "phi",
                    {"max_position_embeddings": 2048, "layer_norm_eps": 1e-5, "hidden_act": "gelu_new"},
                    names=PHI, absent_keys=("head_dim",), keys={"norm_eps": "layer_norm_eps"},
                    switches={"normalization": "LayerNorm", "gated_linear_unit": False, "add_bias_linear": True,
                              "residual": "parallel_shared_norm", "output_layer_bias": True},
                    activations=None, activation_names={"gelu_tanh": "gelu_new"},
                    unsupported=(("qk_layernorm", False),), attention_bias=None),
    "gemma": HFFamily("GemmaForCausalLM", "gemma",
                      {"max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh",
                       "tie_word_embeddings": True},
                      switches={"norm_zero_centered": True}, activations=("gelu_pytorch_tanh", "gelu"),
                      embedding_scaled=True),
    "gemma2": HFFamily("Gemma2ForCausalLM", "gemma2",
                       {"max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
                        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
                        "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": 30.0,
                        "attn_logit_softcapping": 50.0},
                       names=GEMMA2, keys={"hidden_act": "hidden_activation"},
                       switches={"norm_zero_centered": True, "post_norms": True},
                       activations=("gelu_pytorch_tanh",),
                       unsupported=(*_LLAMA_UNSUPPORTED, ("use_bidirectional_attention", None)),
                       embedding_scaled=True, read_extra=_gemma2_read, write_extra=_gemma2_write),
}
_DEFAULT_ROW = HFFamily("LlamaForCausalLM", "llama", {})


def hf_family(family: str) -> HFFamily:
    """The row of ``family``; a family not listed (a plugin's Llama-shaped decoder) reads as Llama's layout."""
    return FAMILIES.get(family, _DEFAULT_ROW)


def hf_names(family: str) -> HFNames:
    """The tensor names of ``family``'s Hugging Face checkpoints."""
    return hf_family(family).names


def config_key(family: str, name: str) -> str:
    """The ``config.json`` key that holds architecture value ``name`` (Llama spelling) in ``family``."""
    return hf_family(family).key(name)


def with_base_prefix(names: list[str], family: str) -> dict[str, str]:
    """Canonical name -> stored name for a checkpoint's tensor ``names``: the identity, except for a file that
    omits ``family``'s base-model prefix everywhere (:attr:`HFNames.base_prefix`), whose names gain it."""
    prefix = hf_names(family).base_prefix
    if not prefix or any(name.startswith(prefix) for name in names):
        return {name: name for name in names}
    return {(name if name.startswith("lm_head.") else prefix + name): name for name in names}
