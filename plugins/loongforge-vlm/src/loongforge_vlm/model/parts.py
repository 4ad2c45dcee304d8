"""Composing a VLM from config parts: ``model: {encoder: ..., projector: ..., foundation: ...}``.

Each part is a registered name (``siglip-tiny``, ``qwen3-tiny``), a mapping naming one plus field overrides
(``{name: llama-debug, num_layers: 4}``), or -- for a part the model already has -- a mapping of overrides alone.
The projector is ``mlp`` (with optional ``merge``/``hidden_dim``), a mapping of those fields, or
``patch-merger`` (the Qwen ViT's own merger). A part's mapping may also carry how it trains (``lr``, ``freeze``,
``unfreeze_at_step`` ...: :mod:`loongforge_vlm.model.part_options`). Widths follow the backbone: a swapped
``foundation`` resizes the projector's output (the MLP's, or the Qwen merger's ``out_dim``), which is what makes
"swap the LLM" a one-line change. Torch-free, like the flavors.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from loongforge.errors import ConfigError
from loongforge.models.family import ModelFamily
from loongforge.models.flavor import DecoderFlavor, replace_fields

from loongforge_vlm.encoders.internvit_flavors import InternViTFlavor
from loongforge_vlm.encoders.qwen_vit_flavors import QwenViTFlavor
from loongforge_vlm.encoders.siglip_flavors import SiglipFlavor
from loongforge_vlm.model.flavors import PART_ROLES

#: Projector names a config may use.
PROJECTORS = ("mlp", "patch-merger")
#: Encoder flavors a config may name as ``model.encoder``.
ENCODER_KINDS = (QwenViTFlavor, SiglipFlavor, InternViTFlavor)
#: Vision token ids of a model composed from parts alone: those of the ``byte-vision`` tokenizer.
DEFAULT_TOKENS = dict(image_token_id=259, vision_start_token_id=260, vision_end_token_id=261)


def _named(role: str, value: Any, current: Any, registry: Any, where: str, kinds: tuple[type, ...]) -> Any:
    """A name, ``{name: ..., **overrides}`` or ``{**overrides}`` (on ``current``) -> a flavor of ``kinds``."""
    location = f"model.{role} in {where}"
    if isinstance(value, str):
        flavor = registry.load(value, where=location)
    elif isinstance(value, dict):
        overrides = dict(value)
        name = overrides.pop("name", None)
        if name is not None and not isinstance(name, str):
            raise ConfigError(f"model.{role}.name in {where}: expected a registered name, got {name!r}")
        base = registry.load(name, where=location) if name is not None else current
        if base is None:
            raise ConfigError(f"{location}: a mapping without 'name' overrides the model's own {role}, "
                              "and this model has none")
        flavor = base.with_overrides(**overrides) if overrides else base
    else:
        raise ConfigError(f"{location}: expected a registered name or a mapping, got {value!r}")
    if not isinstance(flavor, kinds):
        wanted = " or ".join(kind.__name__ for kind in kinds)
        raise ConfigError(f"{location}: '{value}' is a {type(flavor).__name__}, not a {wanted}")
    return flavor


def _projector(value: Any, encoder: Any, where: str) -> Any:
    """``mlp`` / ``{merge, hidden_dim}`` -> an :class:`MlpProjectorFlavor`; ``patch-merger`` -> ``None``."""
    from loongforge_vlm.model.flavors import MlpProjectorFlavor

    location = f"model.projector in {where}"
    if isinstance(value, dict) and set(value) == {"name"}:  # {name: ...}: what a mapping with options leaves
        value = value["name"]
    if value == "patch-merger":
        if not isinstance(encoder, QwenViTFlavor):
            raise ConfigError(f"{location}: 'patch-merger' is the Qwen ViT's own projector; a SigLIP encoder needs "
                              "'mlp'")
        return None
    if value == "mlp":
        return MlpProjectorFlavor(merge=2)
    if isinstance(value, dict):
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(MlpProjectorFlavor)} - {"name"})
        if unknown or value.get("name", "mlp") != "mlp":
            raise ConfigError(f"{location}: an mlp projector takes merge and hidden_dim, got {sorted(value)}")
        return MlpProjectorFlavor(**{k: v for k, v in value.items() if k != "name"})
    raise ConfigError(f"{location}: one of {', '.join(PROJECTORS)} or a mapping, got {value!r}")


def overridden_part(role: str, value: Any, current: Any) -> Any:
    """The part ``VLMFlavor.with_overrides`` gets as ``role``: a flavor as it is, or a mapping.

    Why mappings: a saved config's ``model.overrides`` holds a part as its fields alone -- YAML keeps no class -- and
    ``loongforge convert hf-to-mcore`` writes a whole part there whenever the model's differs from the nearest
    registered one's (a LLaVA-OneVision SigLIP beside internvl-tiny's InternViT). Field names the model's own part
    has override it; otherwise the mapping must be all the fields one kind of part takes, and builds that part.
    """
    from loongforge_vlm.model.flavors import MlpProjectorFlavor

    if not isinstance(value, dict):
        return value
    kinds = {"encoder": ENCODER_KINDS, "projector": (MlpProjectorFlavor,), "foundation": (DecoderFlavor,)}[role]
    if current is not None and set(value) <= {f.name for f in dataclasses.fields(current)}:
        return replace_fields(current, value, what=f"vlm {role}")
    fitting = [kind for kind in kinds if _builds(kind, value)]
    if len(fitting) != 1:
        names = " or ".join(kind.__name__ for kind in kinds)
        raise ConfigError(f"vlm flavor: override {role}={value!r} is neither fields of the model's {role} nor all "
                          f"the fields of one {names}")
    return fitting[0](**{name: tuple(v) if isinstance(v, list) else v for name, v in value.items()})


def _builds(kind: type, fields: dict[str, Any]) -> bool:
    """Whether ``fields`` name only fields of the dataclass ``kind`` and every one it requires."""
    known = dataclasses.fields(kind)
    required = {f.name for f in known if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return required <= set(fields) <= {f.name for f in known}


def compose_parts(base: Any, parts: dict[str, Any], *, registry: Any, where: str, defaults: dict[str, Any]) -> Any:
    """``base`` (a :class:`VLMFlavor`, or ``None`` for parts alone) with ``parts`` replaced; ``defaults`` fill the
    fields a model composed from nothing needs (token ids)."""
    from loongforge_vlm.model.flavors import VLMFlavor
    from loongforge_vlm.model.part_options import split_options

    split = {role: split_options(role, value, where) for role, value in parts.items()}
    options = {**dict(getattr(base, "part_options", ())), **{role: o for role, (_, o) in split.items() if o}}
    parts = {role: value for role, (value, _) in split.items() if value is not None}
    encoder = _named("encoder", parts["encoder"], getattr(base, "encoder", None), registry, where,
                     ENCODER_KINDS) if "encoder" in parts else getattr(base, "encoder", None)
    foundation = _named("foundation", parts["foundation"], getattr(base, "foundation", None), registry, where,
                        (DecoderFlavor,)) if "foundation" in parts else getattr(base, "foundation", None)
    missing = [role for role, part in (("encoder", encoder), ("foundation", foundation)) if part is None]
    if missing:
        raise ConfigError(f"{where}: a vision-language model needs model.{' and model.'.join(missing)}")
    if "projector" in parts:
        projector = _projector(parts["projector"], encoder, where)
    elif base is not None and isinstance(base.encoder, type(encoder)):
        projector = base.projector
    else:
        projector = None if isinstance(encoder, QwenViTFlavor) else _projector("mlp", encoder, where)
    if isinstance(encoder, QwenViTFlavor) and encoder.out_dim != foundation.hidden_size:
        encoder = encoder.with_overrides(out_dim=foundation.hidden_size)  # the merger projects to the backbone
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(VLMFlavor)} if base is not None else {}
    fields = {**defaults, **fields, "encoder": encoder, "foundation": foundation, "projector": projector,
              "part_options": tuple(options.items())}
    if parts:  # a model with swapped parts no longer has a Hugging Face layout to convert to (options alone keep it)
        fields["hf_architecture"] = None
    if "encoder" in options and options["encoder"].recompute is not None:
        fields["encoder_recompute"] = options["encoder"].recompute
    try:
        return VLMFlavor(**fields)
    except ConfigError as exc:
        raise ConfigError(f"{where}: model parts: {exc}") from None


@dataclasses.dataclass(frozen=True)
class VLMComposer(ModelFamily):
    """The registered ``vlm`` model: what ``model: {encoder, projector, foundation}`` without a name composes
    (``default_composition``); a :class:`VLMFlavor` once its parts are given."""

    part_roles: ClassVar[tuple[str, ...]] = PART_ROLES
    default_composition: ClassVar[bool] = True

    @property
    def family_name(self) -> str:
        return "vlm"

    def with_parts(self, parts: dict[str, Any], *, registry: Any, where: str) -> Any:
        return compose_parts(None, parts, registry=registry, where=where, defaults=DEFAULT_TOKENS)


def describe_composer(_: VLMComposer) -> str:
    return ("vision-language model composed from config parts: model: {encoder: <encoder>, projector: "
            "mlp|patch-merger, foundation: <any LLM>}")
