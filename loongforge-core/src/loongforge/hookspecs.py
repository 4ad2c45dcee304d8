"""Every hook a LoongForge plugin can implement.

Plugins implement these with the :data:`loongforge.hookimpl` marker, in a module (or object) named by an
entry point in the ``loongforge`` group. An implementation may accept a subset of a hook's arguments, so
hooks can gain arguments without breaking existing plugins. Core's own parts (the CPU backend, the LLM
families, the data sets) register through these same hooks.

Collector hooks receive a :class:`loongforge.registry.Registry` and add named components to it; they must
stay cheap and must not import torch (register ``"module:attr"`` strings for heavy targets). Lifecycle
hooks are called by the trainer at the points their docstrings name.
"""

from __future__ import annotations

from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("loongforge")

# ---------------------------------------------------------------------------------------------------
# Registration (collector hooks): called once when the plugin manager is built.
# ---------------------------------------------------------------------------------------------------


@hookspec
def loongforge_register_devices(registry: Any) -> None:
    """Register device backends.

    :param registry: the ``device`` registry; ``registry.register(name, target, aliases=(), description="")``
        where ``target`` is a :class:`loongforge.devices.base.DeviceBackend` subclass or its import path.
    """


@hookspec
def loongforge_register_models(registry: Any) -> None:
    """Register model flavors and families.

    :param registry: the ``model`` registry; targets are flavor objects a registered family can build
        (for LLMs, :class:`loongforge.models.flavor.DecoderFlavor`), or their import paths.
    """


@hookspec
def loongforge_register_parallel_strategies(registry: Any) -> None:
    """Register parallel strategies (``parallel.strategy`` in a config).

    :param registry: the ``strategy`` registry; targets describe how a model is split and wrapped.
    """


@hookspec
def loongforge_register_datasets(registry: Any) -> None:
    """Register dataset kinds (``data.dataset`` in a config).

    :param registry: the ``dataset`` registry; targets build a dataset from the data config and a tokenizer.
    """


@hookspec
def loongforge_register_tokenizers(registry: Any) -> None:
    """Register tokenizer kinds (the part of ``data.tokenizer`` before ``:``).

    :param registry: the ``tokenizer`` registry.
    """


@hookspec
def loongforge_register_optimizations(registry: Any) -> None:
    """Register optimizations a config can switch on under ``optimizations:``.

    :param registry: the ``optimization`` registry; targets are callables taking the optimization's
        settings mapping and returning an object with lifecycle-hook methods, registered for the run.
    """


# ---------------------------------------------------------------------------------------------------
# Configuration and model building.
# ---------------------------------------------------------------------------------------------------


@hookspec
def loongforge_configure(config: Any) -> None:
    """Adjust the resolved config before anything is built (e.g. fill device-specific defaults).

    :param config: the :class:`loongforge.config.LoongForgeConfig` of the run; modify it in place.
    """


@hookspec
def loongforge_modify_model(model: Any, config: Any) -> Any:
    """Wrap or modify the model after it is built and before the optimizer is created.

    :param model: the model chunks (a list of modules, one per virtual pipeline stage).
    :param config: the run's config.
    :return: a replacement list of model chunks, or None to keep ``model`` (possibly modified in place).
        Implementations are chained: each receives what the previous one returned.
    """


# ---------------------------------------------------------------------------------------------------
# Data: called by data paths whose samples vary in length.
# ---------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def loongforge_balance_samples(samples: Any, dp_group: Any) -> Any:
    """Redistribute this step's samples across the data-parallel ranks, e.g. to even out their compute.

    Called on every data-parallel rank, with its own samples, before they are batched for the step (so before
    packing). The caller must normalise the loss by a global count (all ranks' tokens), so that which rank trains
    a sample does not change the gradient. A data path that calls this hook sets ``dp_balanced = True`` on the
    batch iterator it gives the trainer, so that an optimization can tell at train start whether it applies; a
    data path with fixed rows also sets ``dp_token_cap`` (tokens a rank's rows hold) and ``dp_fits(lengths)`` (can
    these samples be packed into one rank's rows). Plugins may add per-step numbers to ``trainer.step_metrics``.
    loongforge-vlm's packed image-text data is such a path (``training.loss_normalization: global_tokens``).

    :param samples: this rank's samples, a list of dicts of tensors whose first dimension varies per sample
        (``tokens`` [n] counts the sample's text and vision tokens).
    :param dp_group: the data-parallel process group.
    :return: the samples this rank trains on; stops at the first non-None result (None everywhere: unchanged).
    """


# ---------------------------------------------------------------------------------------------------
# Training lifecycle: called by the trainer on every rank.
# ---------------------------------------------------------------------------------------------------


@hookspec
def loongforge_on_train_start(trainer: Any) -> None:
    """Called after model, optimizer, data and any resumed state are ready, before the first step.

    :param trainer: the :class:`loongforge.train.trainer.Trainer`; ``trainer.step`` is the next step index.
    """


@hookspec
def loongforge_on_step_end(trainer: Any, step: int, metrics: dict) -> None:
    """Called after each optimizer step.

    :param step: the number of completed steps.
    :param metrics: this step's metrics (``loss``, ``lr``, ``grad_norm``, ``tokens_per_s`` ...); plugins may add keys.
    """


@hookspec
def loongforge_on_train_end(trainer: Any, metrics: dict) -> None:
    """Called once after the last step (also when training stops early), before the process exits.

    :param metrics: summary metrics of the run.
    """


@hookspec
def loongforge_on_checkpoint_save(trainer: Any, path: str, extra_state: dict) -> None:
    """Called while a checkpoint is written, before it is made visible.

    :param path: the (temporary) checkpoint directory being written.
    :param extra_state: a JSON-serialisable dict saved with the checkpoint; add plugin state under your name.
    """


@hookspec
def loongforge_on_checkpoint_load(trainer: Any, path: str, extra_state: dict) -> None:
    """Called after a checkpoint was verified and loaded.

    :param path: the checkpoint directory.
    :param extra_state: the dict that ``loongforge_on_checkpoint_save`` implementations filled.
    """
