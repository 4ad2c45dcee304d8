"""Name the registered model a Hugging Face directory describes: ``(model.name, model.overrides)`` for its flavor.

``model.load: hf:DIR`` without a ``model.name`` names the model from DIR (:func:`adopt_hf_model`): DIR's
``config.json`` read through the architecture table of :mod:`loongforge.models.hf_config`, written into the config
as the nearest registered flavor of that family plus the fields that differ (:func:`name_flavor`, what
``loongforge convert`` records), so the run's saved config and every checkpoint's ``config.yaml`` rebuild the model
without DIR. Torch-free (``loongforge check`` resolves names through it) and below :mod:`loongforge.resolve`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from loongforge.config.schema import LoongForgeConfig
from loongforge.errors import InteropError
from loongforge.models.flavor import DecoderFlavor
from loongforge.models.hf_config import flavor_differences, read_hf_config


def name_flavor(flavor: DecoderFlavor, requested: str | None, where: str) -> tuple[str, dict]:
    """``(model.name, model.overrides)`` that rebuild ``flavor`` from the registry.

    With ``requested`` the named flavor must match exactly; otherwise the built-in flavor of the same family
    with the fewest differing fields is the base -- the closest in size among those, so that messages naming the
    model name a sensible one -- and the differences become overrides.
    """
    from loongforge.models.flavor import flavor_num_params
    from loongforge.models.registration import all_flavors
    from loongforge.plugins import get_host

    if requested:
        registry = get_host().registry("model")
        name = registry.entry(requested, where="--model").name
        diffs = flavor_differences(flavor, registry.load(name))
        if diffs:
            raise InteropError(f"{where} does not match model '{name}': {'; '.join(diffs)}")
        return name, {}
    candidates = [(n, f) for n, f in all_flavors().items() if f.family == flavor.family]
    size = flavor_num_params(flavor)
    name, base = min(candidates, key=lambda item: (len(flavor_differences(flavor, item[1])),
                                                  abs(flavor_num_params(item[1]) - size)))
    overrides = {
        f.name: getattr(flavor, f.name)
        for f in dataclasses.fields(DecoderFlavor)
        if getattr(flavor, f.name) != getattr(base, f.name)
    }
    return name, overrides


def adopt_hf_model(config: LoongForgeConfig) -> bool:
    """Name the model of a config whose ``model.load`` is ``hf:DIR`` and whose ``model.name`` is unset (null, no parts):
    ``model.name`` and ``model.overrides`` become what DIR's ``config.json`` describes, the user's own
    ``model.overrides`` on top (so one that changes the shape is refused by :func:`model_load_source`, naming the
    field). Returns whether it did; a second call finds the name set and does nothing. A directory whose
    ``config.json`` is missing or describes an architecture we do not build is a one-line :class:`InteropError`."""
    model = config.model
    load = model.load or ""
    if model.name or model.parts or not load.startswith("hf:"):
        return False
    try:
        hf = read_hf_config(Path(load[3:]).expanduser())
    except InteropError as exc:
        raise InteropError(f"{config.source}: model.load: {exc}") from None
    model.name, inferred = name_flavor(hf.flavor, None, str(hf.path))
    model.overrides = {**inferred, **model.overrides}
    return True
