"""transformers' ``InternVLForConditionalGeneration`` checkpoints <-> our InternVL flavors and state dicts.

A checkpoint is three parts side by side, each through the adapter that exists for it: the vision tower
(``model.vision_tower.*``) through :mod:`loongforge_vlm.encoders.internvit`, the projector
(``model.multi_modal_projector.*``: ``layer_norm``, ``linear_1``, ``linear_2``) by renaming, and the language model
(``model.language_model.*`` + ``lm_head``) through core's decoder adapter for whatever family ``text_config`` names
(Qwen2, Qwen3, Llama ...). All mappings are reshapes, concatenations and slices, so both round trips are bitwise.
transformers 5 names are what :func:`to_hf` gives; the names ``save_pretrained`` writes (``vision_tower.*``,
``multi_modal_projector.*``, ``language_model.model.*``, ``language_model.lm_head.weight``, which the published
``-hf`` checkpoints use) are read too and written by :func:`saved_layout`.

``config.json`` carries the text and vision configs, ``downsample_ratio`` (our projector's merge is its inverse) and
``image_token_id``; the ``<img>``/``</img>`` ids live in the tokenizer, so they are written as
``vision_start_token_id``/``vision_end_token_id`` and read with InternVL's ids as defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from loongforge.errors import ConfigError, LoongForgeError
from loongforge.models.decoder_model import padded_vocab_size
from loongforge.models.hf_adapter import hf_to_megatron, megatron_to_hf
from loongforge.models.hf_config import DecoderHFReader
from loongforge.models.hf_config import hf_config_dict as text_config_dict
from loongforge.models.hf_layouts import FAMILIES

from loongforge_vlm.encoders import internvit
from loongforge_vlm.encoders.internvit_flavors import InternViTFlavor
from loongforge_vlm.model.flavors import INTERNVL_TOKENS, MlpProjectorFlavor, VLMFlavor
from loongforge_vlm.model.hf_adapter import INTERNVL_ARCHITECTURE, INTERNVL_MODEL_TYPE

ARCHITECTURE, MODEL_TYPE = INTERNVL_ARCHITECTURE, INTERNVL_MODEL_TYPE
#: transformers 5 prefixes (in memory) and the saved ones, per part.
VISION, PROJECTOR, LANGUAGE, LM_HEAD = ("model.vision_tower.", "model.multi_modal_projector.",
                                        "model.language_model.", "lm_head.weight")
SAVED = {VISION: "vision_tower.", PROJECTOR: "multi_modal_projector.", LANGUAGE: "language_model.model.",
         LM_HEAD: "language_model.lm_head.weight"}
#: Our projector's module names -> transformers'.
_PROJECTOR_NAMES = {"norm": "layer_norm", "fc1": "linear_1", "fc2": "linear_2"}
#: Settings of transformers' InternVL that our model hard-wires, with the values it needs.
_FIXED = {"projector_hidden_act": "gelu", "vision_feature_layer": -1, "vision_feature_select_strategy": "default"}


def claims(raw: Mapping[str, Any]) -> bool:
    """Whether a ``config.json`` mapping is an InternVL one (``architectures``, else ``model_type``)."""
    archs = raw.get("architectures") or []
    return archs[0] == ARCHITECTURE if archs else raw.get("model_type") == MODEL_TYPE


# -- config.json ----------------------------------------------------------------------------------------------

def _text_flavor(text: Any, tied: bool, where: str) -> Any:
    if not isinstance(text, Mapping):
        raise ConfigError(f"{where}: key text_config is missing")
    family = next((name for name, row in FAMILIES.items() if row.model_type == text.get("model_type", "qwen2")), None)
    if family is None:
        raise ConfigError(f"{where}: text_config.model_type {text.get('model_type')!r} is not a decoder family core "
                          f"reads; supported: {', '.join(row.model_type for row in FAMILIES.values())}")
    try:
        return DecoderHFReader(family).read_config({**text, "tie_word_embeddings": tied}, Path(where))
    except LoongForgeError as exc:
        raise ConfigError(f"{where}: text_config: {str(exc).removeprefix(where + ': ')}") from None


def flavor_from_hf_config(raw: Mapping[str, Any], *, where: str = "config.json") -> VLMFlavor:
    """The flavor an ``InternVLConfig`` mapping describes; what our model does not implement is a one-line error."""
    for key, needed in _FIXED.items():
        if raw.get(key, needed) != needed:
            raise ConfigError(f"{where}: {key}={raw[key]!r} is not supported (needs {needed!r})")
    ratio = raw.get("downsample_ratio", 0.5)
    merge = round(1 / ratio) if ratio > 0 else 0
    if merge < 1 or merge * ratio != 1:
        raise ConfigError(f"{where}: downsample_ratio={ratio!r} is not supported (needs 1/n: 0.5, 0.25 ...)")
    if not isinstance(raw.get("vision_config", {}), Mapping):
        raise ConfigError(f"{where}: key vision_config must be a mapping")
    # transformers ties the output layer by the top-level flag, whose InternVLConfig default is true.
    foundation = _text_flavor(raw.get("text_config"), bool(raw.get("tie_word_embeddings", True)), where)
    try:
        encoder = InternViTFlavor.from_hf_config(raw.get("vision_config", {}), where=f"{where}: vision_config")
        tokens = {key: raw.get(key, default) for key, default in INTERNVL_TOKENS.items()}
        return VLMFlavor(encoder=encoder, projector=MlpProjectorFlavor(merge=merge, norm=True), foundation=foundation,
                         hf_architecture=ARCHITECTURE, **tokens)
    except ConfigError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith(where) else f"{where}: {message}") from None


def hf_config_dict(flavor: VLMFlavor, dtype: str = "float32") -> dict[str, Any]:
    """The transformers 5 ``config.json`` of ``flavor`` (``InternVLConfig(**d)``)."""
    projector, encoder = flavor.projector, flavor.encoder
    if not isinstance(encoder, InternViTFlavor) or projector is None or not projector.norm \
            or projector.hidden_dim not in (None, flavor.foundation.hidden_size):
        raise ConfigError("vlm flavor: InternVL's layout needs an InternViT encoder and a normed MLP projector at the "
                          "backbone's width")
    text = text_config_dict(flavor.foundation, "fp32")
    for key in ("architectures", "torch_dtype", "dtype"):
        text.pop(key, None)
    tokens = {key: getattr(flavor, key) for key in INTERNVL_TOKENS}
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "dtype": dtype,
            "tie_word_embeddings": flavor.foundation.tie_word_embeddings, "text_config": text,
            "vision_config": {"model_type": "internvl_vision", **encoder.to_hf_config()},
            "downsample_ratio": 1 / projector.merge, "image_seq_length": (encoder.grid_size // projector.merge) ** 2,
            **_FIXED, **tokens}


# -- state dicts ----------------------------------------------------------------------------------------------

def _projector_hf(name: str) -> str:
    module, param = name.split(".")
    return f"{_PROJECTOR_NAMES[module]}.{param}"


def from_hf(state: Mapping[str, torch.Tensor], flavor: VLMFlavor) -> dict[str, torch.Tensor]:
    """An ``InternVLForConditionalGeneration`` state dict (transformers 5 or saved names) -> ours."""
    from loongforge_vlm.model.hf_interop import check_language_state

    saved = not any(name.startswith(VISION) for name in state)
    prefix = SAVED if saved else {p: p for p in SAVED}
    text: dict[str, torch.Tensor] = {}
    projector: dict[str, torch.Tensor] = {}
    theirs_projector = {_projector_hf(name): name for name in _projector_names(flavor)}
    for name, tensor in state.items():
        if name.startswith(prefix[VISION]):
            continue
        if name.startswith(prefix[PROJECTOR]):
            rest = name[len(prefix[PROJECTOR]):]
            if rest not in theirs_projector:
                raise LoongForgeError(f"transformers InternVL state dict: '{name}' is not a projector parameter")
            projector[f"projector.{theirs_projector[rest]}"] = tensor.clone()
        elif name.startswith(prefix[LANGUAGE]):
            text["model." + name[len(prefix[LANGUAGE]):]] = tensor
        elif name == prefix[LM_HEAD]:
            if not flavor.foundation.tie_word_embeddings:  # a tied model's head is the embedding again
                text[LM_HEAD] = tensor
        else:
            raise LoongForgeError(f"transformers InternVL state dict: '{name}' belongs to no part (vision tower "
                                  f"{prefix[VISION]}*, projector {prefix[PROJECTOR]}*, language model "
                                  f"{prefix[LANGUAGE]}*, {prefix[LM_HEAD]})")
    missing = sorted(set(f"projector.{n}" for n in _projector_names(flavor)) - set(projector))
    if missing:
        raise LoongForgeError(f"transformers InternVL state dict lacks the projector's '{missing[0]}'")
    check_language_state(text, flavor)
    encoder = internvit.from_hf_state_dict(state, flavor.encoder, prefix=prefix[VISION])
    decoder = hf_to_megatron(text, flavor.foundation, padded_vocab_size=padded_vocab_size(flavor.foundation.vocab_size))
    return {**{f"encoder.{k}": v for k, v in encoder.items()}, **projector,
            **{f"language_model.{k}": v for k, v in decoder.items()}}


def _projector_names(flavor: VLMFlavor) -> list[str]:
    from loongforge_vlm.model.flavors import projector_shapes

    return list(projector_shapes(flavor))


def to_hf(state: Mapping[str, torch.Tensor], flavor: VLMFlavor) -> dict[str, torch.Tensor]:
    """Our state dict (``VisionLanguageModel.state_dict()``) -> transformers 5 names."""
    from loongforge_vlm.model.hf_interop import check_megatron_names

    parts: dict[str, dict[str, torch.Tensor]] = {"encoder": {}, "projector": {}, "language_model": {}}
    for name, tensor in state.items():
        if name.endswith("_extra_state"):
            continue
        part, _, rest = name.partition(".")
        if part not in parts:
            raise LoongForgeError(f"loongforge InternVL state dict: '{name}' has no Hugging Face counterpart")
        parts[part][rest] = tensor
    check_megatron_names(parts["language_model"], flavor)
    expected = set(_projector_names(flavor))
    if set(parts["projector"]) != expected:
        odd = sorted(set(parts["projector"]) ^ expected)[0]
        raise LoongForgeError(f"loongforge InternVL state dict: projector tensor 'projector.{odd}' is missing or "
                              "unexpected; is the flavor right?")
    out = internvit.to_hf_state_dict(parts["encoder"], flavor.encoder, prefix=VISION)
    out.update({PROJECTOR + _projector_hf(name): tensor.clone() for name, tensor in parts["projector"].items()})
    for name, tensor in megatron_to_hf(parts["language_model"], flavor.foundation).items():
        out[LANGUAGE + name[len("model."):] if name.startswith("model.") else name] = tensor
    return out


def saved_layout(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5 names -> the names ``save_pretrained`` writes (and the published ``-hf`` files use)."""
    renamed = {}
    for name, tensor in state.items():
        prefix = LM_HEAD if name == LM_HEAD else next((p for p in (VISION, PROJECTOR, LANGUAGE) if name.startswith(p)),
                                                      None)
        if prefix is None:
            raise LoongForgeError(f"InternVL state dict: '{name}' is not a transformers 5 InternVL name")
        renamed[SAVED[prefix] + name[len(prefix):]] = tensor
    return renamed
