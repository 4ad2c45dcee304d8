"""Name the registered model a Hugging Face directory describes: ``(model.name, model.overrides)`` for its flavor.

``model.load: hf:DIR`` without a ``model.name`` names the model from DIR (:func:`adopt_hf_model`): DIR's
``config.json`` read by the family registered for its architecture (:mod:`loongforge.models.hf_format`), written
into the config as the nearest registered model of that family plus the fields that differ (:func:`name_model`,
what ``loongforge convert`` records), so the run's saved config and every checkpoint's ``config.yaml`` rebuild the model
without DIR. Torch-free (``loongforge check`` resolves names through it) and below :mod:`loongforge.resolve`.
"""

from __future__ import annotations

from pathlib import Path

from loongforge.config.schema import LoongForgeConfig
from loongforge.errors import InteropError
from loongforge.models.family import ModelFamily
from loongforge.models.hf_format import model_differences, read_hf_model


def _size(model: ModelFamily) -> int:
    """Parameters of ``model`` (0 when its family does not count them): what breaks ties between equally close
    flavors."""
    return model.num_params() or 0


def name_model(model: ModelFamily, requested: str | None, where: str) -> tuple[str, dict]:
    """``(model.name, model.overrides)`` that rebuild ``model`` from the registry.

    With ``requested`` the named model must match exactly; otherwise the registered model of the same class and
    family with the fewest differing fields is the base -- the closest in size among those, so that messages
    naming the model name a sensible one -- and the differences become overrides.
    """
    import dataclasses

    from loongforge.plugins import get_host

    registry = get_host().registry("model")
    if requested:
        name = registry.entry(requested, where="--model").name
        diffs = model_differences(model, registry.load(name))
        if diffs:
            raise InteropError(f"{where} does not match model '{name}': {'; '.join(diffs)}")
        return name, {}
    candidates = [(entry.name, entry.load()) for entry in registry.entries()]
    candidates = [(n, m) for n, m in candidates if type(m) is type(model) and m.family_name == model.family_name]
    if not candidates:
        raise InteropError(f"{where}: no registered model of family {model.family_name} to name it after; pass "
                           "--model NAME")
    size = _size(model)
    name, base = min(candidates, key=lambda item: (len(model_differences(model, item[1])),
                                                  abs(_size(item[1]) - size)))
    overrides = {
        f.name: getattr(model, f.name)
        for f in dataclasses.fields(model)
        if getattr(model, f.name) != getattr(base, f.name)
    }
    return name, overrides


def adopt_hf_model(config: LoongForgeConfig) -> bool:
    """Name the model of a config whose ``model.load`` is ``hf:DIR`` and whose ``model.name`` is unset (null, no parts):
    ``model.name`` and ``model.overrides`` become what DIR's ``config.json`` describes, the user's own
    ``model.overrides`` on top (so one that changes the shape is refused by :func:`model_load_source`, naming the
    field). Returns whether it did; a second call finds the name set and does nothing. A directory whose
    ``config.json`` is missing or describes an architecture no installed family reads is a one-line
    :class:`InteropError`."""
    model = config.model
    load = model.load or ""
    if model.name or model.parts or not load.startswith("hf:"):
        return False
    try:
        hf = read_hf_model(Path(load[3:]).expanduser())
    except InteropError as exc:
        raise InteropError(f"{config.source}: model.load: {exc}") from None
    model.name, inferred = name_model(hf.family, None, str(hf.path))
    model.overrides = {**inferred, **model.overrides}
    return True
