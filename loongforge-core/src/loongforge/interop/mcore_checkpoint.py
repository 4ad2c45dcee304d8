"""LoongForge checkpoint directories as weight containers: find one, rebuild its model, load or write weights.

A training checkpoint (``step-N/``) and a converted one (``loongforge convert hf-to-mcore``) share a layout:
``model_optim/`` in megatron ``dist_checkpointing`` format, ``config.yaml`` naming the model, ``metadata.json``
and a verified ``manifest.json``. A converted checkpoint holds model weights only (no optimizer, no trainer
state), so it starts a run through ``model.load`` rather than resuming one; it also keeps the source's
``config.json`` and tokenizer files under ``hf_source/`` so converting back reproduces them.

Weights are read with ``dist_checkpointing`` into the model as built, at whatever tensor/pipeline layout:
megatron reshards on load.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
import yaml
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import CheckpointingException

from loongforge.checkpoint.layout import fsync_tree
from loongforge.checkpoint.manifest import write_manifest
from loongforge.checkpoint.saver import CONFIG_YAML, METADATA_JSON, MODEL_OPTIM, unwrap_model
from loongforge.checkpoint.torch_dist import InProcessTorchDistSaveStrategy
from loongforge.checkpoint.trust import check_dist_checkpoint
from loongforge.config.loader import config_to_dict, load_checkpoint_config
from loongforge.config.schema import LoongForgeConfig
from loongforge.errors import InteropError
from loongforge.interop.hf_checkpoint import copy_carried_files, prepare_out, publish
from loongforge.models.family import ModelFamily
from loongforge.models.hf_config import CONFIG_JSON

#: Directory of a converted checkpoint holding the source ``config.json`` and tokenizer files.
HF_SOURCE = "hf_source"
MODEL_ONLY_FORMAT = "loongforge-model-only"


def resolve_flavor(config: LoongForgeConfig) -> ModelFamily:
    """The model ``config.model`` describes (registry name or ``pkg.module:factory``, parts, then overrides):
    the family whose ``build_chunk`` rebuilds the checkpoint's model."""
    from loongforge.resolve import resolve_model_flavor

    return resolve_model_flavor(config)


def checkpoint_config(path: Path, *, trust_code: bool = False) -> LoongForgeConfig:
    """The run config saved in checkpoint ``path``; its ``pkg.module:attr`` names import only with ``trust_code``
    (the user's ``--trust-code``, see :func:`~loongforge.config.loader.load_checkpoint_config`)."""
    return load_checkpoint_config(path / CONFIG_YAML, trust_code=trust_code)


def checkpoint_dtype(path: Path, config: LoongForgeConfig) -> str:
    """The dtype (fp32/bf16/fp16) the weights were saved in: recorded by conversion, else the run's precision."""
    metadata = json.loads((path / METADATA_JSON).read_text(encoding="utf-8"))
    return metadata.get("dtype") or config.training.precision


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def hf_side_files(
    config: LoongForgeConfig, checkpoint: Path | None = None
) -> tuple[dict[str, Any] | None, Path | None]:
    """``(source config.json mapping, directory with tokenizer files)`` to carry into a HF export.

    A converted checkpoint's ``hf_source/`` wins; otherwise a run's ``model.load: hf:DIR`` supplies the config
    and its ``data.tokenizer: hf:DIR`` (else the ``model.load`` directory) the tokenizer files.
    """
    if checkpoint is not None and (checkpoint / HF_SOURCE).is_dir():
        source = checkpoint / HF_SOURCE
        return _read_json(source / CONFIG_JSON), source
    load = config.model.load or ""
    hf_dir = Path(load[3:]).expanduser() if load.startswith("hf:") else None
    tokenizer = config.data.tokenizer
    tokenizer_dir = Path(tokenizer[3:]).expanduser() if tokenizer.startswith("hf:") else None
    return (_read_json(hf_dir / CONFIG_JSON) if hf_dir else None), tokenizer_dir or hf_dir


def _template(model_chunks: list[Any]) -> dict[str, Any]:
    return {f"model{i}": unwrap_model(chunk).sharded_state_dict() for i, chunk in enumerate(model_chunks)}


def load_model_weights(path: Path, model_chunks: list[Any]) -> None:
    """Load the model weights of checkpoint ``path`` into ``model_chunks`` (any layout; optimizer state is not read),
    after :func:`~loongforge.checkpoint.trust.check_dist_checkpoint` has found that reading them runs no code."""
    check_dist_checkpoint(path / MODEL_OPTIM)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            state = dist_checkpointing.load(_template(model_chunks), str(path / MODEL_OPTIM))
    except (CheckpointingException, dcp.CheckpointException) as exc:
        failures = getattr(exc, "failures", None)
        cause = next(iter(failures.values()))[0] if failures else exc
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise InteropError(f"checkpoint {path} does not fit the model its config.yaml names: {first}") from exc
    for i, chunk in enumerate(model_chunks):
        unwrap_model(chunk).load_state_dict(state[f"model{i}"])


def load_trained_model(path: Path, model: Any, config: LoongForgeConfig) -> Any:
    """``model`` (built at TP=PP=1 for checkpoint ``path``, whose config is ``config``) with the checkpoint's weights:
    for a LoRA run, with its adapters loaded and folded into the base weights, which is what the run trained and what
    an export writes -- the one way ``generate`` and ``convert`` read a trained model. Returns the plain model."""
    from loongforge.models.lora import apply_lora, merge_lora

    if config.model.lora is None:
        load_model_weights(path, [model])
        return model
    apply_lora([model], config.model.lora, config.run.seed)
    load_model_weights(path, [model])
    return merge_lora(model)


def write_model_checkpoint(
    out_dir: Path,
    model: Any,
    *,
    config: LoongForgeConfig,
    metadata: dict[str, Any],
    hf_source: Path,
) -> Path:
    """Write ``model``'s weights as a model-only LoongForge checkpoint at ``out_dir`` (atomically).

    ``config`` is saved as ``config.yaml``; ``hf_source``'s ``config.json`` and tokenizer files are kept.
    """
    tmp = prepare_out(out_dir)
    try:
        (tmp / MODEL_OPTIM).mkdir()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            dist_checkpointing.save(
                _template([model]), str(tmp / MODEL_OPTIM), sharded_strategy=InProcessTorchDistSaveStrategy()
            )
        (tmp / HF_SOURCE).mkdir()
        copy_carried_files(hf_source, tmp / HF_SOURCE)
        if (hf_source / CONFIG_JSON).is_file():
            (tmp / HF_SOURCE / CONFIG_JSON).write_bytes((hf_source / CONFIG_JSON).read_bytes())
        (tmp / CONFIG_YAML).write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False), encoding="utf-8")
        (tmp / METADATA_JSON).write_text(
            json.dumps({"format": MODEL_ONLY_FORMAT, **metadata}, indent=1, sort_keys=True) + "\n", encoding="utf-8"
        )
        write_manifest(tmp, step=0)
        fsync_tree(tmp)
        publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
