"""What ``model.load`` names, checked against the run's model: shared by the pre-flight check and the run.

Its own module so that ``loongforge check`` can check a Hugging Face directory without importing megatron-core
(only a LoongForge checkpoint source needs the checkpoint reader, imported when one is named).

A ``model.load: hf:DIR`` without a ``model.name`` has been named by then
(:func:`loongforge.models.hf_adopt.adopt_hf_model`, called by name resolution).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loongforge.checkpoint.layout import find_checkpoint
from loongforge.config.schema import LoongForgeConfig
from loongforge.errors import InteropError
from loongforge.models.hf_format import model_differences, read_hf_model


def model_load_source(config: LoongForgeConfig, flavor: Any) -> Path:
    """The directory ``model.load`` names (``hf:DIR`` or a LoongForge checkpoint), after checking that it describes
    ``flavor`` (every differing field named). The checkpoint's recorded config imports a ``pkg.module:attr`` name
    only if this run trusts it (``run.trust_code``)."""
    spec = config.model.load or ""
    if spec.startswith("hf:"):
        directory = Path(spec[3:]).expanduser()
        hf = read_hf_model(directory)
        source = hf.path
        diffs = model_differences(hf.family, flavor)
    else:
        from loongforge.interop.mcore_checkpoint import checkpoint_config, resolve_family

        directory = find_checkpoint(spec)
        source = directory / "config.yaml"
        recorded = checkpoint_config(directory, trust_code=config.run.trust_code)
        diffs = model_differences(resolve_family(recorded), flavor)
    if diffs:
        raise InteropError(f"model.load in {config.source}: {source} does not match model '{config.model.name}': "
                           f"{'; '.join(diffs)}")
    return directory
