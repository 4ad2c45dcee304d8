"""LoongForge checkpoint directories as weight containers: find one, rebuild its model, load or write weights.

A training checkpoint (``step-N/``) and a converted one (``loongforge convert hf-to-mcore``) share a layout:
``model_optim/`` in megatron ``dist_checkpointing`` format, ``config.yaml`` naming the model, ``metadata.json``
and a verified ``manifest.json``. A converted checkpoint holds model weights only (no optimizer, no trainer
state), so it starts a run through ``model.load`` rather than resuming one; it also keeps the source's
``config.json`` and tokenizer files under ``hf_source/`` so converting back reproduces them. Both kinds carry the
tokenizer their weights were trained with (:mod:`loongforge.checkpoint.carried_tokenizer`).

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

from loongforge.checkpoint.carried_tokenizer import (
    DESCRIPTOR,
    TOKENIZER_DIR,
    agrees,
    carried_tokenizer,
    hf_tokenizer_dir,
)
from loongforge.checkpoint.layout import fsync_tree
from loongforge.checkpoint.manifest import hash_files, list_files, write_manifest
from loongforge.checkpoint.saver import CONFIG_YAML, METADATA_JSON, MODEL_OPTIM, unwrap_model
from loongforge.checkpoint.torch_dist import InProcessTorchDistSaveStrategy
from loongforge.checkpoint.trust import check_dist_checkpoint
from loongforge.config.loader import config_to_dict, load_checkpoint_config
from loongforge.config.schema import LoongForgeConfig
from loongforge.errors import InteropError
from loongforge.interop.hf_checkpoint import CarriedFiles, copy_carried_files, prepare_out, publish
from loongforge.models.family import ModelFamily
from loongforge.models.hf_format import CONFIG_JSON

#: Directory of a converted checkpoint holding the source ``config.json`` and tokenizer files.
HF_SOURCE = "hf_source"
MODEL_ONLY_FORMAT = "loongforge-model-only"


def resolve_family(config: LoongForgeConfig) -> ModelFamily:
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
    from loongforge.models.lora import base_params_dtype  # a LoRA run's bf16 base (model.lora.base_dtype)

    return metadata.get("dtype") or base_params_dtype(config.model.lora, config.training.precision)


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def hf_side_files(
    config: LoongForgeConfig, checkpoint: Path | None = None
) -> tuple[dict[str, Any] | None, CarriedFiles]:
    """``(source config.json mapping, what else to carry)`` into a HF export of ``checkpoint`` (or of the run
    ``config`` describes, for ``checkpoint.save_hf``).

    A converted checkpoint's ``hf_source/`` supplies both; otherwise a run's ``model.load: hf:DIR`` supplies the
    config and the generation files, and the tokenizer is the one the run trained with: the checkpoint's own copy
    (:func:`checkpoint_tokenizer`), else ``data.tokenizer``.
    """
    if checkpoint is not None and (checkpoint / HF_SOURCE).is_dir():
        source = checkpoint / HF_SOURCE
        return _read_json(source / CONFIG_JSON), CarriedFiles(source, carried_tokenizer(source))
    load = config.model.load or ""
    hf_dir = Path(load[3:]).expanduser() if load.startswith("hf:") else None
    tokenizer = checkpoint_tokenizer(checkpoint, config) if checkpoint is not None else config.data.tokenizer
    return (_read_json(hf_dir / CONFIG_JSON) if hf_dir else None), CarriedFiles(hf_dir, tokenizer)


def checkpoint_tokenizer(path: Path, config: LoongForgeConfig) -> str | None:
    """The tokenizer checkpoint ``path`` (whose recorded config is ``config``) was trained or converted with, as a
    ``data.tokenizer`` value; ``None`` when none is known (a converted checkpoint whose source had none).

    The copy it carries (``tokenizer/`` of a training checkpoint, ``hf_source/`` of a converted one) is the answer,
    after checking that ``config.yaml`` names the same kind: a disagreement means the directory was assembled from
    two runs, and decoding with either could print garbage, so it is refused. A training checkpoint written before
    tokenizers were carried falls back to ``config.yaml``'s ``data.tokenizer``, which that run did train with; a
    converted one's ``config.yaml`` recorded a default, never a fact, so it does not.
    """
    for directory in (path / TOKENIZER_DIR, path / HF_SOURCE):
        carried = carried_tokenizer(directory)
        if carried is None:
            continue
        if not agrees(carried, config.data.tokenizer):
            shown = DESCRIPTOR if hf_tokenizer_dir(carried) is None else "tokenizer.json"
            raise InteropError(f"{path}: carries tokenizer '{carried}' ({directory.name}/{shown}) but its "
                               f"config.yaml says data.tokenizer '{config.data.tokenizer}', so which one its "
                               "weights were trained with is unknown (generate takes --tokenizer)")
        return carried
    metadata = _read_json(path / METADATA_JSON) or {}
    return None if metadata.get("format") == MODEL_ONLY_FORMAT else (config.data.tokenizer or None)


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


def load_trained_weights(path: Path, model_chunks: list[Any], config: LoongForgeConfig) -> None:
    """Load checkpoint ``path`` (whose config is ``config``) into plain ``model_chunks`` at any layout: for a LoRA run,
    with its adapters loaded and folded into the base weights (shard by shard), which is what the run trained and
    what an export writes -- the one way ``generate``, ``convert`` and ``model.load`` read a trained model. The
    chunks come back without adapters and with their parameters' ``requires_grad`` untouched."""
    from loongforge.models.lora import add_lora, merge_lora

    if config.model.lora is not None:
        add_lora(model_chunks, config.model.lora, config.run.seed)
    load_model_weights(path, model_chunks)
    for chunk in model_chunks:
        merge_lora(chunk)


def load_trained_model(path: Path, model: Any, config: LoongForgeConfig) -> Any:
    """:func:`load_trained_weights` for one model built at TP=PP=1; returns the plain model."""
    load_trained_weights(path, [model], config)
    return model


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
                _template([model]), str(tmp / MODEL_OPTIM),
                sharded_strategy=InProcessTorchDistSaveStrategy(progress="writing checkpoint tensors"),
            )
        (tmp / HF_SOURCE).mkdir()
        copy_carried_files(hf_source, tmp / HF_SOURCE)
        if (hf_source / CONFIG_JSON).is_file():
            (tmp / HF_SOURCE / CONFIG_JSON).write_bytes((hf_source / CONFIG_JSON).read_bytes())
        (tmp / CONFIG_YAML).write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False), encoding="utf-8")
        (tmp / METADATA_JSON).write_text(
            json.dumps({"format": MODEL_ONLY_FORMAT, **metadata}, indent=1, sort_keys=True) + "\n", encoding="utf-8"
        )
        write_manifest(tmp, step=0, entries=hash_files(tmp, list_files(tmp), progress=f"hashing {out_dir}"))
        fsync_tree(tmp)
        publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
