"""transformers' ``LlavaOnevisionForConditionalGeneration`` checkpoints <-> our SigLIP + AnyRes flavors and state
dicts.

LLaVA-OneVision is a SigLIP tower whose last block's output (before the final LayerNorm: ``vision_feature_layer``
-1, ``vision_feature_select_strategy`` ``full``) goes through a two-layer GELU projector into a Qwen2 decoder, with
AnyRes tiling (``image_grid_pinpoints``, ``vision_aspect_ratio: anyres_max_N``) and a learned ``image_newline``. Its
tensors follow the LLaVA layout (:mod:`loongforge_vlm.model.llava_layout`) with SigLIP's names under
``model.vision_tower.`` (transformers 5's names; the published files' ``vision_model.`` level, which transformers 5
renames on loading, is not read) and the newline as our ``projector.newline``. The tower's final LayerNorm is not
used, so our tower has none: it is left out on import and written as the identity on export. Videos (pooled frames)
are not modelled: the video token id is not read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from loongforge.errors import ConfigError

from loongforge_vlm.encoders import siglip
from loongforge_vlm.encoders.anyres import grid_pinpoints
from loongforge_vlm.encoders.siglip_flavors import SiglipFlavor
from loongforge_vlm.model import llava_layout
from loongforge_vlm.model.flavors import MlpProjectorFlavor, VLMFlavor
from loongforge_vlm.model.hf_adapter import LLAVA_ONEVISION_ARCHITECTURE, LLAVA_ONEVISION_MODEL_TYPE

ARCHITECTURE, MODEL_TYPE = LLAVA_ONEVISION_ARCHITECTURE, LLAVA_ONEVISION_MODEL_TYPE
#: Settings of transformers' LLaVA-OneVision that our model hard-wires, with the values it needs.
_FIXED = {"projector_hidden_act": "gelu", "vision_feature_layer": -1, "vision_feature_select_strategy": "full",
          "multimodal_projector_bias": True}
#: ``LlavaOnevisionConfig``'s defaults: its image token, the budget prefix, and the pinpoints (6x6 tiles of 384px).
IMAGE_TOKEN_ID, BUDGET_PREFIX = 151646, "anyres_max_"
_DEFAULT_GRID, _DEFAULT_TILE = 6, 384


def _tower_to_hf(state: Mapping[str, torch.Tensor], flavor: SiglipFlavor, prefix: str) -> dict[str, torch.Tensor]:
    """Our tower -> transformers' names under ``prefix``, with the unused final LayerNorm as the identity."""
    out = {prefix + name: tensor for name, tensor in siglip.to_hf_state_dict(state, flavor).items()}
    like = next(iter(state.values()))
    out[f"{prefix}post_layernorm.weight"] = torch.ones(flavor.dim, dtype=like.dtype, device=like.device)
    out[f"{prefix}post_layernorm.bias"] = torch.zeros(flavor.dim, dtype=like.dtype, device=like.device)
    return out


LAYOUT = llava_layout.LlavaLayout(
    title="LLaVA-OneVision",
    tower_from_hf=lambda state, flavor, prefix: siglip.from_hf_state_dict(state, flavor, prefix=prefix),
    tower_to_hf=_tower_to_hf,
    extras=(("projector.newline", "model.image_newline"),))


def claims(raw: Mapping[str, Any]) -> bool:
    """Whether a ``config.json`` mapping is a LLaVA-OneVision one (``architectures``, else ``model_type``)."""
    archs = raw.get("architectures") or []
    return archs[0] == ARCHITECTURE if archs else raw.get("model_type") == MODEL_TYPE


# -- config.json ----------------------------------------------------------------------------------------------

def _budget(raw: Mapping[str, Any], where: str) -> int:
    """``N`` of ``vision_aspect_ratio: anyres_max_N``."""
    ratio = raw.get("vision_aspect_ratio", f"{BUDGET_PREFIX}9")
    budget = ratio.removeprefix(BUDGET_PREFIX) if isinstance(ratio, str) else ""
    if not isinstance(ratio, str) or not ratio.startswith(BUDGET_PREFIX) or not budget.isdigit():
        raise ConfigError(f"{where}: vision_aspect_ratio={ratio!r} is not supported (needs 'anyres_max_N')")
    return int(budget)


def flavor_from_hf_config(raw: Mapping[str, Any], *, where: str = "config.json") -> VLMFlavor:
    """The flavor a ``LlavaOnevisionConfig`` mapping describes; what our model does not implement is a one-line
    error."""
    for key, needed in _FIXED.items():
        if raw.get(key, needed) != needed:
            raise ConfigError(f"{where}: {key}={raw[key]!r} is not supported (needs {needed!r})")
    vision = raw.get("vision_config", {})
    if not isinstance(vision, Mapping):
        raise ConfigError(f"{where}: key vision_config must be a mapping")
    text = raw.get("text_config")
    # transformers ties the output layer by the top-level flag, or by the text config's when that one is unset.
    tied = bool(raw.get("tie_word_embeddings") or (isinstance(text, Mapping) and text.get("tie_word_embeddings")))
    foundation = llava_layout.read_text_flavor(text, tied, where)
    pinpoints = raw.get("image_grid_pinpoints") or grid_pinpoints(_DEFAULT_GRID, _DEFAULT_TILE)
    try:
        encoder = SiglipFlavor.from_hf_config(vision).with_overrides(
            post_norm=False, anyres_pinpoints=[tuple(p) for p in pinpoints], anyres_max_tiles=_budget(raw, where))
        image_token = raw.get("image_token_id", raw.get("image_token_index", IMAGE_TOKEN_ID))
        return VLMFlavor(encoder=encoder, projector=MlpProjectorFlavor(merge=1), foundation=foundation,
                         image_token_id=image_token, hf_architecture=ARCHITECTURE)
    except ConfigError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith(where) else f"{where}: {message}") from None


def hf_config_dict(flavor: VLMFlavor, dtype: str = "float32") -> dict[str, Any]:
    """The transformers 5 ``config.json`` of ``flavor`` (``LlavaOnevisionConfig(**d)``)."""
    projector, encoder = flavor.projector, flavor.encoder
    width = flavor.foundation.hidden_size
    if not isinstance(encoder, SiglipFlavor) or not encoder.anyres or encoder.post_norm or projector is None \
            or projector.merge != 1 or projector.norm or projector.hidden_dim not in (None, width):
        raise ConfigError("vlm flavor: LLaVA-OneVision's layout needs an AnyRes SigLIP encoder without post_norm and "
                          "an unmerged, unnormed MLP projector at the backbone's width")
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "dtype": dtype,
            "tie_word_embeddings": flavor.foundation.tie_word_embeddings,
            "text_config": llava_layout.text_config(flavor.foundation),
            "vision_config": {"model_type": "siglip_vision_model", **encoder.to_hf_config()},
            "image_grid_pinpoints": [list(p) for p in encoder.pinpoints],
            "vision_aspect_ratio": f"{BUDGET_PREFIX}{encoder.anyres_max_tiles}",
            "image_token_index": flavor.image_token_id, **_FIXED}


# -- state dicts ----------------------------------------------------------------------------------------------

def from_hf(state: Mapping[str, torch.Tensor], flavor: VLMFlavor) -> dict[str, torch.Tensor]:
    """A ``LlavaOnevisionForConditionalGeneration`` state dict (transformers 5 or saved names) -> ours."""
    return llava_layout.from_hf(state, flavor, LAYOUT)


def to_hf(state: Mapping[str, torch.Tensor], flavor: VLMFlavor) -> dict[str, torch.Tensor]:
    """Our state dict (``VisionLanguageModel.state_dict()``) -> transformers 5 names."""
    return llava_layout.to_hf(state, flavor, LAYOUT)
