"""transformers' Qwen2-VL / Qwen2.5-VL / Qwen3-VL (dense and MoE) checkpoints <->
:class:`~loongforge_vlm.model.vlm.VisionLanguageModel`.

A whole checkpoint is two checkpoints side by side, and each half goes through the adapter that already exists for
it: the vision tower (``model.visual.*``) through :mod:`loongforge_vlm.encoders.qwen_vit_adapter`, the language
model (``model.language_model.*`` + ``lm_head``) through core's :mod:`loongforge.models.hf_adapter` (a Qwen2
decoder; Qwen3's for Qwen3-VL, Qwen3-MoE's for Qwen3-VL-MoE). Our state dict is ``encoder.*`` + ``language_model.*``
(megatron names, vocabulary padded as ``build_model`` pads it at TP=1). Both directions are reshapes, concatenations
and slices, so ``ours -> HF -> ours`` and ``HF -> ours -> HF`` are bitwise (padded vocabulary rows come back as
zeros). transformers 5 names are written; the published pre-v5 files (``visual.*``, ``model.*``) are read too.
Qwen3-VL's published files already use the transformers 5 names. Qwen3-VL-MoE's modules hold each layer's experts
fused as core's Qwen3-MoE adapter reads them (``experts.gate_up_proj`` ``[E, 2I, H]``, ``experts.down_proj``
``[E, H, I]``); the published files store both transposed (``[E, H, 2I]``, ``[E, I, H]``), transformers 5's
``save_pretrained`` writes the in-memory orientation, and transformers reads either, transposing a tensor whose
shape is not its module's. :func:`saved_layout` writes the published orientation (which transformers 5 transposes on
load, as it does the published files) and :func:`in_memory_layout` reads both by transformers' rule, so
:func:`to_hf` / :func:`from_hf` speak the in-memory layout only.

``config.json`` <-> :class:`~loongforge_vlm.model.flavors.VLMFlavor`: the nested (transformers 5) and the flat
published layout are read; a setting our model does not implement is a one-line :class:`ConfigError` naming the
file and key. InternVL (``InternVLForConditionalGeneration``) and LLaVA-OneVision
(``LlavaOnevisionForConditionalGeneration``) checkpoints take the same entry points, which hand them to
:mod:`loongforge_vlm.model.internvl_interop` and :mod:`loongforge_vlm.model.llava_onevision_interop` (both the LLaVA
layout, :mod:`loongforge_vlm.model.llava_layout`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from loongforge.errors import ConfigError, LoongForgeError
from loongforge.models.decoder_model import padded_vocab_size
from loongforge.models.hf_adapter import flavor_from_hf_config as text_flavor_from_hf_config
from loongforge.models.hf_adapter import hf_tensor_shapes, hf_to_megatron, megatron_to_hf

from loongforge_vlm.encoders import qwen_vit_adapter
from loongforge_vlm.encoders.qwen_vit_flavors import ACTIVATIONS as _VISION_ACT
from loongforge_vlm.encoders.qwen_vit_flavors import QwenViTFlavor
from loongforge_vlm.model import internvl_interop, llava_layout, llava_onevision_interop
from loongforge_vlm.model.flavors import VLMFlavor
from loongforge_vlm.model.hf_adapter import ARCHITECTURES

#: The core decoder family (and its transformers class) of each architecture's language model.
_TEXT_FAMILIES = {"Qwen2VLForConditionalGeneration": ("qwen2", "Qwen2ForCausalLM"),
                  "Qwen2_5_VLForConditionalGeneration": ("qwen2", "Qwen2ForCausalLM"),
                  "Qwen3VLForConditionalGeneration": ("qwen3", "Qwen3ForCausalLM"),
                  "Qwen3VLMoeForConditionalGeneration": ("qwen3-moe", "Qwen3MoeForCausalLM")}
#: The one architecture whose decoder is routed (the stored expert orientation is its own, see the module docstring).
MOE_ARCHITECTURE = "Qwen3VLMoeForConditionalGeneration"
#: Qwen3VLMoeTextConfig's defaults of its MoE keys. Every layer is routed (``decoder_sparse_step`` 1, no
#: ``mlp_only_layers``) in all published sizes, the only form read.
_MOE_TEXT_DEFAULTS = {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                      "router_aux_loss_coef": 0.001, "decoder_sparse_step": 1, "mlp_only_layers": []}
#: Name endings of a Qwen3-VL-MoE layer's fused expert tensors (stored in two orientations).
EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
VISUAL, LANGUAGE, LM_HEAD = "model.visual.", "model.language_model.", "lm_head.weight"
_LEGACY_VISUAL, _LEGACY_LANGUAGE = "visual.", "model."
#: The LLaVA-layout architectures, each with its module (``claims``, ``flavor_from_hf_config``, ``hf_config_dict``,
#: ``from_hf``, ``to_hf``).
_LLAVA_LAYOUTS = {module.ARCHITECTURE: module for module in (internvl_interop, llava_onevision_interop)}
_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
#: Defaults of keys a config may omit (transformers' config classes).
_TEXT_DEFAULTS = {"rms_norm_eps": 1e-5, "max_position_embeddings": 32768, "hidden_act": "silu",
                  "use_sliding_window": False, "attention_dropout": 0.0}
_VISION_DEFAULTS = {
    "qwen2-vl": {"depth": 32, "embed_dim": 1280, "hidden_size": 3584, "mlp_ratio": 4, "num_heads": 16,
                 "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                 "hidden_act": "quick_gelu"},
    "qwen2.5-vl": {"depth": 32, "hidden_size": 3584, "intermediate_size": 3420, "num_heads": 16, "in_channels": 3,
                   "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "tokens_per_second": 4,
                   "window_size": 112, "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31],
                   "hidden_act": "silu"},
    "qwen3-vl": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "in_channels": 3,
                 "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 3584,
                 "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
                 "hidden_act": "gelu_pytorch_tanh"},
}


# -- config.json ----------------------------------------------------------------------------------------------

def _family(raw: Mapping[str, Any], where: str) -> tuple[str, str]:
    archs = raw.get("architectures") or []
    if archs and archs[0] in ARCHITECTURES:
        return archs[0], ARCHITECTURES[archs[0]][0]
    by_type = {model_type: arch for arch, (_, model_type) in ARCHITECTURES.items()}
    if not archs and raw.get("model_type") in by_type:
        arch = by_type[raw["model_type"]]
        return arch, ARCHITECTURES[arch][0]
    found = f"architectures {archs[0]!r}" if archs else f"model_type {raw.get('model_type')!r}"
    raise ConfigError(f"{where}: {found} is not a supported vision-language model; supported: "
                      f"{', '.join(ARCHITECTURES)}")


def _vision_flavor(vision: Mapping[str, Any], family: str, out_dim: int, where: str) -> QwenViTFlavor:
    v = {**_VISION_DEFAULTS[family], **{k: x for k, x in vision.items() if x is not None}}
    v.setdefault("in_channels", v.get("in_chans", 3))
    if "spatial_patch_size" in vision:  # published Qwen2-VL files
        v["patch_size"] = vision["spatial_patch_size"]
    if v["hidden_act"] != _VISION_ACT[family]:
        raise ConfigError(f"{where}: vision_config.hidden_act {v['hidden_act']!r} is not supported for {family} "
                          f"(needs {_VISION_ACT[family]!r})")
    theta = (v.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    common = dict(family=family, num_heads=v["num_heads"], num_layers=v["depth"], in_channels=v["in_channels"],
                  patch_size=v["patch_size"], temporal_patch_size=v["temporal_patch_size"],
                  spatial_merge_size=v["spatial_merge_size"], rope_theta=float(theta))
    if family == "qwen2-vl":
        flavor = QwenViTFlavor(dim=v["embed_dim"], ffn_dim=v["embed_dim"] * v["mlp_ratio"], out_dim=v["hidden_size"],
                               **common)
        out_key = "hidden_size"
    elif family == "qwen3-vl":
        flavor = QwenViTFlavor(dim=v["hidden_size"], ffn_dim=v["intermediate_size"], out_dim=v["out_hidden_size"],
                               num_position_embeddings=v["num_position_embeddings"],
                               deepstack_layers=tuple(v["deepstack_visual_indexes"]), **common)
        out_key = "out_hidden_size"
    else:
        flavor = QwenViTFlavor(dim=v["hidden_size"], ffn_dim=v["intermediate_size"], out_dim=v["out_hidden_size"],
                               window_size=v["window_size"], full_attention_blocks=tuple(v["fullatt_block_indexes"]),
                               **common)
        out_key = "out_hidden_size"
    if flavor.out_dim != out_dim:
        raise ConfigError(f"{where}: vision_config.{out_key} ({flavor.out_dim}) must equal the text hidden_size "
                          f"({out_dim})")
    return flavor


def _text_flavor(text: Mapping[str, Any], tied: bool, where: str, prefix: str, architecture: str) -> Any:
    moe = architecture == MOE_ARCHITECTURE
    t = {**_TEXT_DEFAULTS, **(_MOE_TEXT_DEFAULTS if moe else {}), **{k: x for k, x in text.items() if x is not None}}
    if moe:
        for key, needed in (("decoder_sparse_step", 1), ("mlp_only_layers", [])):
            if t[key] != needed:
                raise ConfigError(f"{where}: {prefix}{key}={t[key]!r} is not supported (needs {needed!r}: every "
                                  "decoder layer routed)")
        # transformers' Qwen3VLMoeTextTopKRouter always renormalises the chosen probabilities, whatever
        # norm_topk_prob a file carries; so does ours (core's reader reads a missing key as true).
        t.pop("norm_topk_prob", None)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if not isinstance(t.get(key), int):
            raise ConfigError(f"{where}: key {prefix}{key} is missing or not an integer")
    for key, needed in (("hidden_act", "silu"), ("use_sliding_window", False), ("attention_dropout", 0.0)):
        if t[key] != needed:
            raise ConfigError(f"{where}: {prefix}{key}={t[key]!r} is not supported (needs {needed!r})")
    rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
    if not rope.get("mrope_section"):
        raise ConfigError(f"{where}: key {prefix}rope_parameters.mrope_section is missing (Qwen VLMs use M-RoPE)")
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope"):
        raise ConfigError(f"{where}: {prefix}rope_parameters.rope_type {rope.get('rope_type')!r} is not supported "
                          "(needs 'default')")
    rope = {"rope_theta": t.get("rope_theta", 1000000.0), **rope}
    text_family, text_architecture = _TEXT_FAMILIES[architecture]
    values = {**t, "rope_parameters": rope, "tie_word_embeddings": tied, "architectures": [text_architecture]}
    try:
        return text_flavor_from_hf_config(SimpleNamespace(**values), family=text_family)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def flavor_from_hf_config(raw: Mapping[str, Any], *, where: str = "config.json") -> VLMFlavor:
    """The flavor a Qwen2-VL / Qwen2.5-VL / Qwen3-VL (or InternVL, LLaVA-OneVision) ``config.json`` mapping describes
    (``where`` names it in errors)."""
    for module in _LLAVA_LAYOUTS.values():
        if module.claims(raw):
            return module.flavor_from_hf_config(raw, where=where)
    architecture, family = _family(raw, where)
    nested = isinstance(raw.get("text_config"), Mapping)
    text = raw["text_config"] if nested else raw
    # transformers ties the output layer by the top-level key; a text_config's own (Qwen3VLMoeTextConfig defaults
    # it to true) counts only where the top level has none.
    tied = bool(raw["tie_word_embeddings"] if "tie_word_embeddings" in raw else text.get("tie_word_embeddings"))
    foundation = _text_flavor(text, tied, where, "text_config." if nested else "", architecture)
    if not isinstance(raw.get("vision_config"), Mapping):
        raise ConfigError(f"{where}: key vision_config is missing")
    encoder = _vision_flavor(raw["vision_config"], family, foundation.hidden_size, where)
    tokens = {key: raw.get(key, default) for key, default in zip(_TOKEN_KEYS, (151655, 151656, 151652, 151653),
                                                                  strict=True)}
    per_second = raw["vision_config"].get("tokens_per_second", 4) if family == "qwen2.5-vl" else None
    try:
        return VLMFlavor(encoder=encoder, foundation=foundation, tokens_per_second=per_second,
                         hf_architecture=architecture, **tokens)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def read_hf_config(directory: str | Path) -> VLMFlavor:
    """The flavor of the checkpoint directory's ``config.json``."""
    path = Path(directory).expanduser() / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    return flavor_from_hf_config(raw, where=str(path))


def hf_config_dict(flavor: VLMFlavor, dtype: str = "float32") -> dict[str, Any]:
    """The transformers 5 ``config.json`` of ``flavor`` (``Qwen2VLConfig(**d)`` / ``Qwen2_5_VLConfig(**d)`` /
    ``Qwen3VLConfig(**d)`` / ``Qwen3VLMoeConfig(**d)``; the LLaVA layouts' are their modules')."""
    if flavor.hf_architecture in _LLAVA_LAYOUTS:
        return _LLAVA_LAYOUTS[flavor.hf_architecture].hf_config_dict(flavor, dtype)
    if flavor.hf_architecture not in ARCHITECTURES or not isinstance(flavor.encoder, QwenViTFlavor):
        raise ConfigError(f"vlm flavor with architecture {flavor.hf_architecture!r} has no Hugging Face format; "
                          f"supported: {', '.join(ARCHITECTURES)}")
    family, model_type = ARCHITECTURES[flavor.hf_architecture]
    text, vit = flavor.foundation, flavor.encoder
    text_config = dict(
        model_type=f"{model_type}_text", hidden_size=text.hidden_size, intermediate_size=text.ffn_hidden_size,
        num_hidden_layers=text.num_layers, num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_query_groups, vocab_size=text.vocab_size,
        max_position_embeddings=text.max_position_embeddings, rms_norm_eps=text.norm_eps, hidden_act="silu",
        rope_parameters={"rope_type": "default", "mrope_section": list(text.mrope_section),
                         "rope_theta": text.rope_theta},
    )
    if family == "qwen3-vl":
        text_config.update(head_dim=text.kv_channels, attention_bias=False)
        text_config["rope_parameters"]["mrope_interleaved"] = text.mrope_interleaved
    else:
        text_config["use_sliding_window"] = False
    if flavor.hf_architecture == MOE_ARCHITECTURE:
        text_config.update(_moe_text_config(text))
    vision_config: dict[str, Any] = dict(
        model_type=f"{model_type}_vision", depth=vit.num_layers, num_heads=vit.num_heads,
        in_channels=vit.in_channels, patch_size=vit.patch_size, temporal_patch_size=vit.temporal_patch_size,
        spatial_merge_size=vit.spatial_merge_size, hidden_act=_VISION_ACT[family],
        rope_parameters={"rope_type": "axial", "rope_theta": vit.rope_theta},
    )
    if family == "qwen2-vl":
        if vit.ffn_dim % vit.dim:
            raise ConfigError(f"qwen2-vl encoder: ffn_dim {vit.ffn_dim} is not a multiple of dim {vit.dim} "
                              "(transformers stores mlp_ratio)")
        vision_config.update(embed_dim=vit.dim, mlp_ratio=vit.ffn_dim // vit.dim, hidden_size=vit.out_dim)
    elif family == "qwen3-vl":
        vision_config.update(hidden_size=vit.dim, intermediate_size=vit.ffn_dim, out_hidden_size=vit.out_dim,
                             num_position_embeddings=vit.num_position_embeddings,
                             deepstack_visual_indexes=list(vit.deepstack_layers))
    else:
        vision_config.update(hidden_size=vit.dim, intermediate_size=vit.ffn_dim, out_hidden_size=vit.out_dim,
                             window_size=vit.window_size, fullatt_block_indexes=list(vit.full_attention_blocks),
                             tokens_per_second=flavor.tokens_per_second)
    return {"architectures": [flavor.hf_architecture], "model_type": model_type, "dtype": dtype,
            "tie_word_embeddings": text.tie_word_embeddings, "text_config": text_config,
            "vision_config": vision_config, **{key: getattr(flavor, key) for key in _TOKEN_KEYS}}


def _moe_text_config(text: Any) -> dict[str, Any]:
    """The MoE keys of a Qwen3-VL-MoE ``text_config``; a decoder its router or layers cannot express is refused."""
    if not text.num_experts or not text.moe_norm_topk_prob or text.moe_shared_expert_intermediate_size:
        raise ConfigError("Qwen3VLMoeForConditionalGeneration: the decoder needs routed experts with renormalised "
                          "top-k probabilities and no shared expert (num_experts set, moe_norm_topk_prob true, "
                          "moe_shared_expert_intermediate_size null)")
    return dict(num_experts=text.num_experts, num_experts_per_tok=text.moe_router_topk,
                moe_intermediate_size=text.moe_ffn_hidden_size, router_aux_loss_coef=text.moe_aux_loss_coeff,
                decoder_sparse_step=1, mlp_only_layers=[])


# -- state dicts ----------------------------------------------------------------------------------------------

def _megatron_names(flavor: VLMFlavor) -> set[str]:
    """The language model's megatron tensor names (derived from core's mapping on shape-only tensors)."""
    text = flavor.foundation
    shapes = {name: torch.empty(shape, device="meta") for name, shape in hf_tensor_shapes(text).items()}
    return set(hf_to_megatron(shapes, text, padded_vocab_size=padded_vocab_size(text.vocab_size)))


def check_language_state(state: Mapping[str, torch.Tensor], flavor: VLMFlavor) -> None:
    """The language model's transformers tensors (``model.*``, ``lm_head.weight``): every one present with its
    shape, nothing else."""
    expected = hf_tensor_shapes(flavor.foundation)
    for name, shape in expected.items():
        if name not in state:
            raise LoongForgeError(f"transformers VLM state dict lacks '{name}' of shape {shape}; is the flavor right?")
        if tuple(state[name].shape) != shape:
            raise LoongForgeError(f"transformers VLM state dict: '{name}' has shape {tuple(state[name].shape)}, "
                                  f"expected {shape}")
    extra = sorted(set(state) - set(expected))
    if extra:
        raise LoongForgeError(f"transformers VLM state dict: '{extra[0]}' has no counterpart "
                              f"({len(extra)} unexpected language-model tensor(s))")


def check_megatron_names(state: Mapping[str, torch.Tensor], flavor: VLMFlavor) -> None:
    """Our language model's tensors (megatron names, ``_extra_state`` left out): exactly the flavor's."""
    expected = _megatron_names(flavor)
    for problem, names in (("lacks", expected - set(state)), ("has unexpected", set(state) - expected)):
        if names:
            raise LoongForgeError(f"loongforge VLM state dict {problem} language-model tensor "
                                  f"'language_model.{sorted(names)[0]}' ({len(names)} in all); is the flavor right?")


def from_hf(state: Mapping[str, torch.Tensor], flavor: VLMFlavor) -> dict[str, torch.Tensor]:
    """A ``*VLForConditionalGeneration`` state dict (transformers 5 or published layout) -> ours."""
    if flavor.hf_architecture in _LLAVA_LAYOUTS:
        return _LLAVA_LAYOUTS[flavor.hf_architecture].from_hf(state, flavor)
    legacy = not any(name.startswith(VISUAL) for name in state)
    visual, language = (_LEGACY_VISUAL, _LEGACY_LANGUAGE) if legacy else (VISUAL, LANGUAGE)
    text: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.startswith(visual):
            continue
        if name.startswith(language):
            text["model." + name[len(language):]] = tensor
        elif name == LM_HEAD:
            if not flavor.foundation.tie_word_embeddings:  # a tied model's lm_head is the embedding again
                text[name] = tensor
        else:
            raise LoongForgeError(f"transformers VLM state dict: '{name}' belongs to neither the vision tower "
                                  f"({visual}*) nor the language model ({language}*, {LM_HEAD})")
    check_language_state(text, flavor)
    encoder = qwen_vit_adapter.from_hf(state, flavor.encoder, prefix=visual)
    vocab = padded_vocab_size(flavor.foundation.vocab_size)
    decoder = hf_to_megatron(text, flavor.foundation, padded_vocab_size=vocab)
    return {**{f"encoder.{k}": v for k, v in encoder.items()}, **{f"language_model.{k}": v for k, v in decoder.items()}}


def saved_layout(state: Mapping[str, torch.Tensor], flavor: VLMFlavor) -> dict[str, torch.Tensor]:
    """transformers 5 names -> the names in published checkpoint files (``visual.*``, ``model.*``), which is also
    what transformers 5's ``save_pretrained`` writes, so older and newer versions both read our exports. Qwen3-VL's
    published files keep the transformers 5 names."""
    if any(name.startswith(llava_layout.VISION) for name in state):
        return llava_layout.saved_layout(state)
    if flavor.encoder.family == "qwen3-vl":
        return _transposed_experts(state, flavor)
    renamed = {}
    for name, tensor in state.items():
        if name.startswith(VISUAL):
            name = _LEGACY_VISUAL + name[len(VISUAL):]
        elif name.startswith(LANGUAGE):
            name = _LEGACY_LANGUAGE + name[len(LANGUAGE):]
        renamed[name] = tensor
    return renamed


def in_memory_layout(state: Mapping[str, torch.Tensor], flavor: VLMFlavor) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint directory as transformers' modules hold them (what :func:`from_hf` reads):
    Qwen3-VL-MoE's fused experts transposed where their shape is not the module's, as transformers loads them (an
    expert tensor that is square in its last two dimensions is taken as it is, as transformers takes it). Other
    layouts pass as they are (their file names are read directly)."""
    if flavor.hf_architecture != MOE_ARCHITECTURE:
        return dict(state)
    text = flavor.foundation
    experts, width, hidden = text.num_experts, text.moe_ffn_hidden_size, text.hidden_size
    module_shapes = dict(zip(EXPERT_TENSORS, ((experts, 2 * width, hidden), (experts, hidden, width)), strict=True))
    out = {}
    for name, tensor in state.items():
        kind = next((k for k in EXPERT_TENSORS if name.endswith(k)), None)
        if kind is not None and tuple(tensor.shape) != module_shapes[kind]:
            tensor = tensor.transpose(1, 2).contiguous()
        out[name] = tensor
    return out


def _transposed_experts(state: Mapping[str, torch.Tensor], flavor: VLMFlavor) -> dict[str, torch.Tensor]:
    """Qwen3-VL-MoE's fused expert tensors in the published orientation (``[E, H, 2I]``, ``[E, I, H]``), the rest
    as they are; a dense model's state unchanged."""
    if flavor.hf_architecture != MOE_ARCHITECTURE:
        return dict(state)
    return {name: tensor.transpose(1, 2).contiguous() if name.endswith(EXPERT_TENSORS) else tensor
            for name, tensor in state.items()}


def to_hf(state: Mapping[str, torch.Tensor], flavor: VLMFlavor) -> dict[str, torch.Tensor]:
    """Our state dict (``VisionLanguageModel.state_dict()``) -> transformers 5 names."""
    if flavor.hf_architecture in _LLAVA_LAYOUTS:
        return _LLAVA_LAYOUTS[flavor.hf_architecture].to_hf(state, flavor)
    encoder, decoder = {}, {}
    for name, tensor in state.items():
        if name.endswith("_extra_state"):
            continue
        if name.startswith("encoder."):
            encoder[name[len("encoder."):]] = tensor
        elif name.startswith("language_model."):
            decoder[name[len("language_model."):]] = tensor
        else:
            raise LoongForgeError(f"loongforge VLM state dict: '{name}' has no Hugging Face counterpart")
    check_megatron_names(decoder, flavor)
    out = qwen_vit_adapter.to_hf(encoder, flavor.encoder, prefix=VISUAL)
    for name, tensor in megatron_to_hf(decoder, flavor.foundation).items():
        out[LANGUAGE + name[len("model."):] if name.startswith("model.") else name] = tensor
    return out
