"""Hugging Face weights inside a run: ``model.load`` before training, ``checkpoint.save_hf`` at each save.

Core's built-in plugin (:mod:`loongforge.builtin`) calls these from its ``loongforge_modify_model`` and
``loongforge_on_checkpoint_save`` hooks, so the trainer knows nothing about Hugging Face. Both work at any
tensor/pipeline layout through :mod:`loongforge.interop.sharding`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from loongforge.config.schema import LoongForgeConfig
from loongforge.errors import InteropError
from loongforge.interop.load_source import model_load_source
from loongforge.interop.mcore_checkpoint import (
    checkpoint_config,
    hf_side_files,
    load_trained_weights,
    resolve_family,
)

#: Sub-directory of a checkpoint that ``checkpoint.save_hf`` fills.
HF_SUBDIR = "hf"
_DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def load_initial_weights(model_chunks: list[Any], config: LoongForgeConfig) -> None:
    """Load ``model.load`` (``hf:DIR`` or a LoongForge checkpoint) into this rank's freshly built chunks.

    The source must describe the same model as ``model.name`` + ``model.overrides``; every field that differs
    is named; rank 0 says what was loaded. A run that then resumes from its own checkpoint overwrites
    these weights, which is what "ignored when resuming" means.
    """
    from megatron.core import parallel_state

    from loongforge.interop.hf_checkpoint import check_hf_tensors, index_hf_tensors, load_hf_tensors
    from loongforge.interop.sharding import load_full_state
    from loongforge.models.decoder_model import padded_vocab_size

    spec = config.model.load or ""
    flavor = resolve_family(config)
    directory = model_load_source(config, flavor)
    if spec.startswith("hf:"):
        infos = index_hf_tensors(directory)
        check_hf_tensors(infos, flavor, directory)
        decoder = flavor.decoder
        tp = parallel_state.get_tensor_model_parallel_world_size()
        vocab = padded_vocab_size(decoder.vocab_size, tp) if decoder is not None else None
        full = flavor.hf_adapter().from_hf(load_hf_tensors(infos), padded_vocab_size=vocab)
        load_full_state(model_chunks, full)
        message = f"loaded {len(infos)} Hugging Face tensors from {directory}"
    else:
        recorded = checkpoint_config(directory, trust_code=config.run.trust_code)
        load_trained_weights(directory, model_chunks, recorded)  # a LoRA checkpoint: its adapters folded in
        message = f"loaded model weights from checkpoint {directory}"
    if _rank() == 0:
        print(f"[loongforge] model.load: {message}", flush=True)


def save_hf_copy(trainer: Any, path: str) -> Path | None:
    """Write the trainer's model as a HF directory ``<path>/hf`` (collective; rank 0 writes, returns the dir)."""
    from loongforge.interop.hf_checkpoint import write_hf_checkpoint
    from loongforge.interop.sharding import gather_full_state
    from loongforge.resolve import model_label

    config = trainer.config
    family = resolve_family(config)
    adapter = family.hf_adapter()
    if adapter is None:
        raise InteropError(f"{config.source}: checkpoint.save_hf is set but model '{model_label(config, family)}' "
                           "has no Hugging Face counterpart (its family supplies no hf_adapter)")
    full = gather_full_state(trainer.model)
    if _rank() != 0:
        return None
    if full is None:
        raise InteropError("gathering the model for checkpoint.save_hf returned nothing on rank 0")
    if config.model.lora is not None:  # export a plain model: the adapters folded into their base weights
        from loongforge.models.lora import merge_lora_state_dict

        full = merge_lora_state_dict(full, config.model.lora)
    dtype = _DTYPE_NAMES[str(full["embedding.word_embeddings.weight"].dtype)]
    base, carry = hf_side_files(config)
    out = Path(path) / HF_SUBDIR
    return write_hf_checkpoint(out, adapter.to_hf(full), adapter.config_json(dtype, base), carry_from=carry)
