"""The LLaVA checkpoint layout transformers gives InternVL and LLaVA-OneVision alike <-> our state dicts.

Why shared: both are three parts side by side -- a vision tower (``model.vision_tower.*``), the projector
(``model.multi_modal_projector.*``: ``layer_norm``, ``linear_1``, ``linear_2``) and a language model
(``model.language_model.*`` + ``lm_head``) -- and differ only in the tower (and a few top-level parameters such as
LLaVA-OneVision's ``image_newline``). A :class:`LlavaLayout` names what differs; the rest is here once: the tower
through its own adapter, the projector by renaming, the language model through core's decoder adapter for whatever
family ``text_config`` names. All mappings are reshapes, concatenations and slices, so both round trips are bitwise.
transformers 5 names are what :func:`to_hf` gives; the names ``save_pretrained`` writes (``vision_tower.*``,
``multi_modal_projector.*``, ``language_model.model.*``, ``language_model.lm_head.weight``, top-level parameters
without ``model.``) are read too and written by :func:`saved_layout`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from loongforge.errors import ConfigError, LoongForgeError
from loongforge.models.decoder_model import padded_vocab_size
from loongforge.models.hf_adapter import hf_to_megatron, megatron_to_hf
from loongforge.models.hf_config import DecoderHFReader
from loongforge.models.hf_config import hf_config_dict as decoder_config_dict
from loongforge.models.hf_layouts import FAMILIES

from loongforge_vlm.model.flavors import VLMFlavor, projector_shapes

#: transformers 5 prefixes (in memory) and the saved ones, per part.
VISION, PROJECTOR, LANGUAGE, LM_HEAD = ("model.vision_tower.", "model.multi_modal_projector.",
                                        "model.language_model.", "lm_head.weight")
SAVED = {VISION: "vision_tower.", PROJECTOR: "multi_modal_projector.", LANGUAGE: "language_model.model.",
         LM_HEAD: "language_model.lm_head.weight"}
#: transformers 5's prefix of the model's own parameters, which ``save_pretrained`` drops.
_MODEL = "model."
#: Our projector's module names -> transformers'.
_PROJECTOR_NAMES = {"norm": "layer_norm", "fc1": "linear_1", "fc2": "linear_2"}

#: ``(state, encoder flavor, prefix) -> state``: a tower adapter, from transformers' names under ``prefix`` to ours, or
#: from ours to transformers' under ``prefix``.
TowerAdapter = Callable[[Mapping[str, torch.Tensor], Any, str], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class LlavaLayout:
    """What one LLaVA-layout architecture adds to the shared mapping."""

    #: The model's name in errors ("InternVL").
    title: str
    tower_from_hf: TowerAdapter
    tower_to_hf: TowerAdapter
    #: Our top-level parameters and their transformers 5 names (``("projector.newline", "model.image_newline")``).
    extras: tuple[tuple[str, str], ...] = ()


def read_text_flavor(text: Any, tied: bool, where: str) -> Any:
    """The decoder flavor of a ``text_config`` mapping, through core's reader of its family (``model_type``)."""
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


def text_config(foundation: Any) -> dict[str, Any]:
    """The ``text_config`` of a decoder flavor (what the nested config holds: no architectures or dtype)."""
    text = decoder_config_dict(foundation, "fp32")
    for key in ("architectures", "torch_dtype", "dtype"):
        text.pop(key, None)
    return text


def _projector_hf(name: str) -> str:
    module, param = name.split(".")
    return f"{_PROJECTOR_NAMES[module]}.{param}"


def _projector_names(flavor: VLMFlavor, layout: LlavaLayout) -> list[str]:
    """Our projector's tensors that sit under transformers' projector module (the extras are elsewhere)."""
    extras = {ours.removeprefix("projector.") for ours, _ in layout.extras}
    return [name for name in projector_shapes(flavor) if name not in extras]


def from_hf(state: Mapping[str, torch.Tensor], flavor: VLMFlavor, layout: LlavaLayout) -> dict[str, torch.Tensor]:
    """A transformers state dict of the layout (transformers 5 or saved names) -> ours."""
    from loongforge_vlm.model.hf_interop import check_language_state

    saved = not any(name.startswith(VISION) for name in state)
    prefix = SAVED if saved else {p: p for p in SAVED}
    extras = {(theirs.removeprefix(_MODEL) if saved else theirs): ours for ours, theirs in layout.extras}
    text: dict[str, torch.Tensor] = {}
    projector: dict[str, torch.Tensor] = {}
    theirs_projector = {_projector_hf(name): name for name in _projector_names(flavor, layout)}
    for name, tensor in state.items():
        if name.startswith(prefix[VISION]):
            continue
        if name in extras:
            projector[extras[name]] = tensor.clone()
        elif name.startswith(prefix[PROJECTOR]):
            rest = name[len(prefix[PROJECTOR]):]
            if rest not in theirs_projector:
                raise LoongForgeError(f"transformers {layout.title} state dict: '{name}' is not a projector parameter")
            projector[f"projector.{theirs_projector[rest]}"] = tensor.clone()
        elif name.startswith(prefix[LANGUAGE]):
            text["model." + name[len(prefix[LANGUAGE]):]] = tensor
        elif name == prefix[LM_HEAD]:
            if not flavor.foundation.tie_word_embeddings:  # a tied model's head is the embedding again
                text[LM_HEAD] = tensor
        else:
            raise LoongForgeError(f"transformers {layout.title} state dict: '{name}' belongs to no part (vision tower "
                                  f"{prefix[VISION]}*, projector {prefix[PROJECTOR]}*, language model "
                                  f"{prefix[LANGUAGE]}*, {prefix[LM_HEAD]}{''.join(', ' + e for e in extras)})")
    missing = sorted({f"projector.{n}" for n in projector_shapes(flavor)} - set(projector))
    if missing:
        raise LoongForgeError(f"transformers {layout.title} state dict lacks the projector's '{missing[0]}'")
    check_language_state(text, flavor)
    encoder = layout.tower_from_hf(state, flavor.encoder, prefix[VISION])
    decoder = hf_to_megatron(text, flavor.foundation, padded_vocab_size=padded_vocab_size(flavor.foundation.vocab_size))
    return {**{f"encoder.{k}": v for k, v in encoder.items()}, **projector,
            **{f"language_model.{k}": v for k, v in decoder.items()}}


def to_hf(state: Mapping[str, torch.Tensor], flavor: VLMFlavor, layout: LlavaLayout) -> dict[str, torch.Tensor]:
    """Our state dict (``VisionLanguageModel.state_dict()``) -> transformers 5 names."""
    from loongforge_vlm.model.hf_interop import check_megatron_names

    parts: dict[str, dict[str, torch.Tensor]] = {"encoder": {}, "projector": {}, "language_model": {}}
    for name, tensor in state.items():
        if name.endswith("_extra_state"):
            continue
        part, _, rest = name.partition(".")
        if part not in parts:
            raise LoongForgeError(f"loongforge {layout.title} state dict: '{name}' has no Hugging Face counterpart")
        parts[part][rest] = tensor
    check_megatron_names(parts["language_model"], flavor)
    expected = set(projector_shapes(flavor))
    if set(parts["projector"]) != expected:
        odd = sorted(set(parts["projector"]) ^ expected)[0]
        raise LoongForgeError(f"loongforge {layout.title} state dict: projector tensor 'projector.{odd}' is missing or "
                              "unexpected; is the flavor right?")
    out = layout.tower_to_hf(parts["encoder"], flavor.encoder, VISION)
    extras = dict(layout.extras)
    for name, tensor in parts["projector"].items():
        theirs = extras.get(f"projector.{name}") or PROJECTOR + _projector_hf(name)
        out[theirs] = tensor.clone()
    for name, tensor in megatron_to_hf(parts["language_model"], flavor.foundation).items():
        out[LANGUAGE + name[len("model."):] if name.startswith("model.") else name] = tensor
    return out


def saved_layout(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5 names -> the names ``save_pretrained`` writes (and the published ``-hf`` files use)."""
    renamed = {}
    for name, tensor in state.items():
        prefix = LM_HEAD if name == LM_HEAD else next((p for p in (VISION, PROJECTOR, LANGUAGE) if name.startswith(p)),
                                                      None)
        if prefix is not None:
            renamed[SAVED[prefix] + name[len(prefix):]] = tensor
        elif name.startswith(_MODEL) and "." not in name[len(_MODEL):]:  # the model's own parameters
            renamed[name[len(_MODEL):]] = tensor
        else:
            raise LoongForgeError(f"LLaVA-layout state dict: '{name}' is not a transformers 5 name of its parts")
    return renamed
