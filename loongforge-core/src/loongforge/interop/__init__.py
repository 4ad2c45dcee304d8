"""Hugging Face interop: read and write HF checkpoint directories, convert to and from LoongForge checkpoints,
reshard full weights onto any tensor/pipeline layout, and load/save HF weights during a run.

Importing this package is cheap (torch-free); the modules below import torch and megatron when used:

* :mod:`~loongforge.models.hf_config` -- ``config.json`` <-> :class:`~loongforge.models.flavor.DecoderFlavor`;
* :mod:`~loongforge.interop.hf_checkpoint` -- safetensors shards, index files, carried tokenizer files;
* :mod:`~loongforge.interop.sharding` -- full (TP=1, PP=1) tensors <-> this rank's shards, via megatron's
  ``sharded_state_dict``;
* :mod:`~loongforge.interop.mcore_checkpoint` -- LoongForge checkpoint directories (model weights only);
* :mod:`~loongforge.interop.world` -- a one-process megatron world for work outside a run;
* :mod:`~loongforge.interop.convert` -- ``loongforge convert``; :mod:`~loongforge.interop.online` -- the
  ``model.load: hf:`` and ``checkpoint.save_hf`` hooks; :mod:`~loongforge.interop.generate` --
  ``loongforge generate``.
"""

from __future__ import annotations
