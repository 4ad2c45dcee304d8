"""Where each decoder family's tensors live in a Hugging Face ``*ForCausalLM`` state dict (torch-free data).

One row per family; :mod:`loongforge.models.hf_adapter` turns a row into the tensor-by-tensor mapping both
ways, so a new family whose tensors differ only in names and in how QKV/MLP are stored is a new row, not new
code. Every name is relative: ``layers`` + ``.<i>.`` + a per-layer name, or a top-level prefix (``.weight`` and
``.bias`` are appended by the adapter).
"""

from __future__ import annotations

from dataclasses import dataclass
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

#: family -> its names; a family not listed (a plugin's Llama-shaped decoder) uses :data:`LLAMA`.
BY_FAMILY: dict[str, HFNames] = {"gpt2": GPT2, "gpt-neox": NEOX, "phi": PHI, "gemma2": GEMMA2}


def hf_names(family: str) -> HFNames:
    """The tensor names of ``family``'s Hugging Face checkpoints."""
    return BY_FAMILY.get(family, LLAMA)


def with_base_prefix(names: list[str], family: str) -> dict[str, str]:
    """Canonical name -> stored name for a checkpoint's tensor ``names``: the identity, except for a file that
    omits ``family``'s base-model prefix everywhere (:attr:`HFNames.base_prefix`), whose names gain it."""
    prefix = hf_names(family).base_prefix
    if not prefix or any(name.startswith(prefix) for name in names):
        return {name: name for name in names}
    return {(name if name.startswith("lm_head.") else prefix + name): name for name in names}


# -- config.json -------------------------------------------------------------------------------------------

#: family -> (``architectures[0]``, ``model_type``, defaults of keys a config.json may omit), the defaults being
#: those of the family's transformers config class (real sizes: each family module cites its config.json).
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", "llama", {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6}),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6}),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6}),
    "mixtral": ("MixtralForCausalLM", "mixtral", {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5,
                                                  "num_local_experts": 8, "num_experts_per_tok": 2,
                                                  "router_aux_loss_coef": 0.001}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", "qwen3_moe", {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                                                       "num_experts": 128, "num_experts_per_tok": 8,
                                                       "moe_intermediate_size": 768, "norm_topk_prob": False,
                                                       "router_aux_loss_coef": 0.001}),
    "gpt2": ("GPT2LMHeadModel", "gpt2", {"n_positions": 1024, "layer_norm_epsilon": 1e-5,
                                         "activation_function": "gelu_new", "tie_word_embeddings": True}),
    "gpt-neox": ("GPTNeoXForCausalLM", "gpt_neox", {"max_position_embeddings": 2048, "layer_norm_eps": 1e-5,
                                                    "hidden_act": "gelu", "use_parallel_residual": True}),
    "phi": ("PhiForCausalLM", "phi", {"max_position_embeddings": 2048, "layer_norm_eps": 1e-5,
                                      "hidden_act": "gelu_new"}),
    "gemma": ("GemmaForCausalLM", "gemma", {"max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
                                            "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True}),
    "gemma2": ("Gemma2ForCausalLM", "gemma2", {"max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
                                               "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
                                               "query_pre_attn_scalar": 256, "sliding_window": 4096,
                                               "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0}),
}

#: ``config.json`` key of each architecture value, where a family's name differs from Llama's.
_LLAMA_KEYS: dict[str, str] = {"norm_eps": "rms_norm_eps"}
CONFIG_KEYS: dict[str, dict[str, str]] = {
    "gpt2": {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
             "max_position_embeddings": "n_positions", "intermediate_size": "n_inner",
             "norm_eps": "layer_norm_epsilon", "hidden_act": "activation_function"},
    "gpt-neox": {"norm_eps": "layer_norm_eps"},
    "phi": {"norm_eps": "layer_norm_eps"},
    "gemma2": {"hidden_act": "hidden_activation"},
}
#: Keys a family's ``config.json`` does not have (its attention is multi-head, its head_dim implied).
ABSENT_KEYS: dict[str, tuple[str, ...]] = {
    "gpt2": ("num_key_value_heads", "head_dim"),
    "gpt-neox": ("num_key_value_heads", "head_dim"),
    "phi": ("head_dim",),
}

#: Hugging Face ``hidden_act`` names -> ``DecoderFlavor.activation``.
HF_ACTIVATIONS: dict[str, str] = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
                                  "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu", "relu2": "squared_relu"}
#: The name written for each activation when the source config does not already spell it.
HF_ACTIVATION_NAMES: dict[str, str] = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh",
                                       "relu": "relu", "squared_relu": "relu2"}
#: Preferred spellings per family (what its reference checkpoints use).
FAMILY_ACTIVATION_NAMES: dict[str, dict[str, str]] = {"gpt2": {"gelu_tanh": "gelu_new"},
                                                      "phi": {"gelu_tanh": "gelu_new"}}

#: Flavor switches a family always has (its transformers model hard-codes them).
FAMILY_SWITCHES: dict[str, dict[str, object]] = {
    "gpt2": {"normalization": "LayerNorm", "gated_linear_unit": False, "add_bias_linear": True,
             "position_embedding": "learned_absolute"},
    "gpt-neox": {"normalization": "LayerNorm", "gated_linear_unit": False, "add_bias_linear": True},
    "phi": {"normalization": "LayerNorm", "gated_linear_unit": False, "add_bias_linear": True,
            "residual": "parallel_shared_norm", "output_layer_bias": True},
    "gemma": {"norm_zero_centered": True},
    "gemma2": {"norm_zero_centered": True, "post_norms": True},
}


def config_key(family: str, name: str) -> str:
    """The ``config.json`` key that holds architecture value ``name`` (Llama spelling) in ``family``."""
    return CONFIG_KEYS.get(family, _LLAMA_KEYS).get(name, _LLAMA_KEYS.get(name, name))
