"""transformers' ``InternVLForConditionalGeneration`` checkpoints <-> our InternVL flavors and state dicts.

The tensors follow the LLaVA layout (:mod:`loongforge_vlm.model.llava_layout`), with InternViT
(:mod:`loongforge_vlm.encoders.internvit`) as the tower and a normed projector; both round trips are bitwise.

``config.json`` carries the text and vision configs, ``downsample_ratio`` (our projector's merge is its inverse) and
``image_token_id``; the ``<img>``/``</img>`` ids live in the tokenizer, so they are written as
``vision_start_token_id``/``vision_end_token_id`` and read with InternVL's ids as defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from loongforge.errors import ConfigError

from loongforge_vlm.encoders import internvit
from loongforge_vlm.encoders.internvit_flavors import InternViTFlavor
from loongforge_vlm.model import llava_layout
from loongforge_vlm.model.flavors import INTERNVL_TOKENS, MlpProjectorFlavor, VLMFlavor
from loongforge_vlm.model.hf_adapter import INTERNVL_ARCHITECTURE, INTERNVL_MODEL_TYPE

ARCHITECTURE, MODEL_TYPE = INTERNVL_ARCHITECTURE, INTERNVL_MODEL_TYPE
#: Settings of transformers' InternVL that our model hard-wires, with the values it needs.
_FIXED = {"projector_hidden_act": "gelu", "vision_feature_layer": -1, "vision_feature_select_strategy": "default"}
#: The tensors: InternViT's names directly under ``model.vision_tower.``.
LAYOUT = llava_layout.LlavaLayout(
    title="InternVL",
    tower_from_hf=lambda state, flavor, prefix: internvit.from_hf_state_dict(state, flavor, prefix=prefix),
    tower_to_hf=lambda state, flavor, prefix: internvit.to_hf_state_dict(state, flavor, prefix=prefix))


def claims(raw: Mapping[str, Any]) -> bool:
    """Whether a ``config.json`` mapping is an InternVL one (``architectures``, else ``model_type``)."""
    archs = raw.get("architectures") or []
    return archs[0] == ARCHITECTURE if archs else raw.get("model_type") == MODEL_TYPE


# -- config.json ----------------------------------------------------------------------------------------------

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
    foundation = llava_layout.read_text_flavor(raw.get("text_config"), bool(raw.get("tie_word_embeddings", True)),
                                              where)
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
    text = llava_layout.text_config(flavor.foundation)
    tokens = {key: getattr(flavor, key) for key in INTERNVL_TOKENS}
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "dtype": dtype,
            "tie_word_embeddings": flavor.foundation.tie_word_embeddings, "text_config": text,
            "vision_config": {"model_type": "internvl_vision", **encoder.to_hf_config()},
            "downsample_ratio": 1 / projector.merge, "image_seq_length": (encoder.grid_size // projector.merge) ** 2,
            **_FIXED, **tokens}


# -- state dicts ----------------------------------------------------------------------------------------------

def from_hf(state: Mapping[str, torch.Tensor], flavor: VLMFlavor) -> dict[str, torch.Tensor]:
    """An ``InternVLForConditionalGeneration`` state dict (transformers 5 or saved names) -> ours."""
    return llava_layout.from_hf(state, flavor, LAYOUT)


def to_hf(state: Mapping[str, torch.Tensor], flavor: VLMFlavor) -> dict[str, torch.Tensor]:
    """Our state dict (``VisionLanguageModel.state_dict()``) -> transformers 5 names."""
    return llava_layout.to_hf(state, flavor, LAYOUT)
