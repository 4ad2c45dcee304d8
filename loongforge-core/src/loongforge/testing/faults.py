"""Faults injected into a copy of a task checkpoint, for tests of ``loongforge diff`` (and of anything else that
must notice a changed model): one tensor scaled, or ``model.overrides`` changed in its config -- the two ways a
model silently differs from its twin (a weight that moved, a setting that changes one operation). The copy's
manifest is rewritten, so it verifies as a checkpoint of its own.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml


def recipe_checkpoint(recipe: Any, out: str | Path, *, steps: int = 1) -> Path:
    """Train a :class:`~loongforge.certify.recipes.CertificationRecipe` on the CPU for ``steps`` steps into ``out``
    (``loongforge train`` in a process of its own) and return its last checkpoint: a small real checkpoint of that
    kind of model to inject faults into."""
    from loongforge.testing.runs import quiet_env

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = out / "recipe.yaml"
    config.write_text(yaml.safe_dump(recipe.run_config(steps, "fp32"), sort_keys=False), encoding="utf-8")
    command = [sys.executable, "-m", "loongforge.cli", "train", str(config), f"run.output_dir={out / 'run'}",
               "--device", "cpu"]
    done = subprocess.run(command, capture_output=True, text=True,
                          env=quiet_env())
    if done.returncode != 0:
        raise RuntimeError(f"training the recipe failed: {done.stderr[-2000:]}")
    return out / "run" / "checkpoints" / f"step-{steps:07d}"


def faulty_checkpoint(source: str | Path, target: str | Path, *, tensor: tuple[str, float] | None = None,
                      overrides: dict[str, Any] | None = None) -> Path:
    """``target``: a copy of the task checkpoint ``source`` (a step directory) with ``tensor`` -- ``(name,
    factor)`` -- scaled in ``model.safetensors`` and/or ``overrides`` merged into the config's
    ``model.overrides``."""
    from safetensors.torch import load_file, save_file

    from loongforge.checkpoint.layout import CONFIG_YAML
    from loongforge.checkpoint.manifest import MANIFEST, write_manifest

    source, target = Path(source), Path(target)
    shutil.copytree(source, target)
    if tensor is not None:
        name, factor = tensor
        tensors = load_file(str(target / "model.safetensors"))
        if name not in tensors:
            raise KeyError(f"{source}: no tensor '{name}' (has {', '.join(sorted(tensors)[:8])}, ...)")
        tensors[name] = tensors[name] * factor
        save_file(tensors, str(target / "model.safetensors"))
    if overrides:
        config_path = target / CONFIG_YAML
        config = yaml.safe_load(config_path.read_text(encoding="utf-8"))
        model = config["model"] if isinstance(config["model"], dict) else {"name": config["model"]}
        model["overrides"] = {**(model.get("overrides") or {}), **overrides}
        config["model"] = model
        config_path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    step = json.loads((target / MANIFEST).read_text(encoding="utf-8"))["step"]
    write_manifest(target, step=step)  # hashes the changed files anew
    return target
