"""``task.init`` held to the model before anything is built, from the headers of its files alone.

Why: training loads ``task.init`` right after building the model, and a directory of another model, another size or
damaged files ended there -- a ``load_state_dict`` shape mismatch or a safetensors header error as a traceback, after
the build. The pre-flight (:mod:`loongforge_diffusion.preflight`) reads only what says which tensors a directory holds
and their shapes: a LoongForge task checkpoint's manifest (sizes; training verifies the hashes) and the header of its
``model.safetensors``, or a released model's files through the family's own reader; the names and shapes must be the
model's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from loongforge.errors import ConfigError, LoongForgeError

#: What a LoongForge task checkpoint keeps its weights in (:mod:`loongforge.train.engines.task`).
WEIGHTS = "model.safetensors"


def check_init(config: Any, path: str, expected: Mapping[str, tuple[int, ...]],
               released: Callable[[str], Mapping[str, Any]]) -> str:
    """One summary line when the weights ``path`` names fit ``expected`` (the model's names and shapes), else a
    one-line :class:`ConfigError` naming ``task.init``; ``released(path)`` reads a directory that is no LoongForge
    checkpoint (the family's released layout)."""
    where = f"{config.source}: task.init {path}"
    try:
        found = _checkpoint_shapes(Path(path).expanduser()) or released(path)
    except LoongForgeError as exc:
        said = str(exc).removeprefix(f"task.init {path}: ")
        raise ConfigError(f"{where}: {said}") from None
    missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or extra:
        raise ConfigError(f"{where}: its weights do not fit the model: missing {missing[:3]} ({len(missing)}), "
                          f"unexpected {extra[:3]} ({len(extra)})")
    wrong = next((name for name in expected if tuple(found[name]) != tuple(expected[name])), None)
    if wrong is not None:
        raise ConfigError(f"{where}: '{wrong}' has shape {list(found[wrong])}; the model's is "
                          f"{list(expected[wrong])} (model.overrides)")
    return f"task.init: {len(found)} tensors of {path} fit the model"


def _checkpoint_shapes(directory: Path) -> dict[str, tuple[int, ...]] | None:
    """The tensors of a LoongForge task checkpoint (its manifest's sizes checked), ``None`` for another directory."""
    from loongforge.checkpoint.manifest import MANIFEST, verify_manifest

    from loongforge_diffusion.wan.checkpoint import meta_tensors, weight_files

    if not (directory / MANIFEST).is_file():
        return None
    verify_manifest(directory, "none")
    located = {name: file for name, file in weight_files(directory).items() if file.name == WEIGHTS}
    return {name: tuple(t.shape) for name, t in meta_tensors(located).items()}


def model_shapes(build: Callable[[], Any]) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the state dict of the module ``build()`` makes, built on the meta device (no
    memory, no initialisation)."""
    import torch

    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in build().state_dict().items()}
