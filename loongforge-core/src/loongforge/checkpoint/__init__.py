"""Checkpoints: atomic, verified save/resume of everything a run needs to continue bit-exactly.

Layout of a checkpoint root (``checkpoint.dir``)::

    step-0000006/           one complete checkpoint (made visible by a rename, never written in place)
      model_optim/          megatron dist_checkpointing: model + optimizer sharded state (reshardable)
      trainer-rank00000.pt  per-rank state: RNG states, data position (torch.load(weights_only=True))
      trainer.json          step, scheduler state, plugin extra_state
      config.yaml           the resolved run config
      metadata.json         versions, device backend and why it was chosen, parallel layout, time
      tokenizer/            the run's tokenizer: Hugging Face tokenizer files, or loongforge_tokenizer.json
                            naming a tokenizer without files (``byte``, a plugin kind); ``generate`` uses it
      manifest.json         written last: every file with its size, sha256 and block hashes (hashed by the
                            rank that wrote it, merged by rank 0)
    .tmp-step-0000009/      a save in progress -- written in the background with checkpoint.async_save -- or
                            killed; never loaded, removed by the next save
    step-0000008.corrupt/   failed verification when the resume scan or the pruner looked at it: quarantined
                            (never listed, counted, loaded or deleted; remove it yourself)
    latest                  name of the newest complete checkpoint (replaced atomically)

This package's top level stays torch-free: the directory/manifest logic is usable by ``loongforge`` commands
that must answer instantly. :mod:`loongforge.checkpoint.saver` holds the torch/megatron parts.
"""

from __future__ import annotations

from loongforge.checkpoint.layout import CheckpointDir, list_checkpoints, step_dir_name
from loongforge.checkpoint.manifest import CheckpointCorruptError, verify_manifest, write_manifest

__all__ = [
    "CheckpointCorruptError",
    "CheckpointDir",
    "list_checkpoints",
    "step_dir_name",
    "verify_manifest",
    "write_manifest",
]
