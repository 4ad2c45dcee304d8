"""Every hook a LoongForge plugin can implement.

Plugins implement these with the :data:`loongforge.hookimpl` marker, in a module (or object) named by an
entry point in the ``loongforge`` group. An implementation may accept a subset of a hook's arguments, so
hooks can gain arguments without breaking existing plugins. Core's own parts (the CPU backend, the LLM
families, the data sets, its commands) register through these same hooks.

**Call order, the same for every hook.** :class:`loongforge.plugins.PluginHost` calls implementations itself
(never through pluggy's own call loop, whose order is last-registered-first): first every ``tryfirst=True``
implementation, then the plain ones, then every ``trylast=True`` one; inside each group in *registration
order*. Registration order is: ``core`` first, then entry-point plugins sorted by name, then in-process
plugins and the run's ``optimizations:`` in the order they are registered (config order). So core's
implementation of a hook runs before any plugin's plain one -- e.g. core's ``loongforge_modify_model`` loads
``model.load`` weights before a plugin wraps the model -- unless that plugin asks for ``tryfirst=True``.
New-style ``wrapper=True`` and old-style ``hookwrapper=True`` implementations are refused at registration:
with one stated order there is nothing to wrap around that chaining (``loongforge_modify_model``) cannot do.

**Results.** Only ``loongforge_balance_samples`` is ``firstresult`` (it chooses one answer): the first
non-None result, in the order above, wins and later implementations are not called. ``loongforge_modify_model``
is chained: each implementation receives the model the previous one returned. Every other hook's return value
is ignored.

Collector hooks receive a registry and add named components to it; they run once, when the registries are
first used; they must stay cheap and must not import torch (register ``"module:attr"`` strings for heavy
targets). Lifecycle hooks are called on every rank at the points their docstrings name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from loongforge.commands import CommandRegistry
    from loongforge.config.schema import LoongForgeConfig
    from loongforge.registry import Registry
    from loongforge.train.trainer import Trainer

hookspec = pluggy.HookspecMarker("loongforge")

# ---------------------------------------------------------------------------------------------------
# Registration (collector hooks): called once, when the registries are first used.
# ---------------------------------------------------------------------------------------------------


@hookspec
def loongforge_register_devices(registry: Registry) -> None:
    """Register device backends.

    :param registry: the ``device`` registry; ``registry.register(name, target, aliases=(), description="")``
        where ``target`` is a :class:`loongforge.devices.base.DeviceBackend` subclass or its import path.
        Called in the stated order (module docstring); the order does not matter: a name taken twice raises,
        naming both providers.
    """


@hookspec
def loongforge_register_models(registry: Registry) -> None:
    """Register model flavors and families.

    :param registry: the ``model`` registry; targets are objects implementing
        :class:`loongforge.models.family.ModelFamily` (for LLM decoders, a
        :class:`loongforge.models.flavor.DecoderFlavor`), or their import paths.
    """


@hookspec
def loongforge_register_parallel_strategies(registry: Registry) -> None:
    """Register parallel strategies (``parallel.strategy`` in a config).

    :param registry: the ``strategy`` registry; targets describe how a model is split and wrapped.
    """


@hookspec
def loongforge_register_datasets(registry: Registry) -> None:
    """Register dataset kinds (``data.dataset`` in a config).

    :param registry: the ``dataset`` registry; targets build a dataset from the data config and a tokenizer.
    """


@hookspec
def loongforge_register_tokenizers(registry: Registry) -> None:
    """Register tokenizer kinds (the part of ``data.tokenizer`` before ``:``).

    :param registry: the ``tokenizer`` registry.
    """


@hookspec
def loongforge_register_optimizations(registry: Registry) -> None:
    """Register optimizations a config can switch on under ``optimizations:``.

    :param registry: the ``optimization`` registry; targets are subclasses of
        :class:`loongforge.optimizations.Optimization` (or their import paths) naming the dataclass of their
        ``optimizations.<name>:`` section in ``options_type``. Core validates the section against it (``check``
        and ``train`` alike), instantiates the class with it and registers the instance's hook implementations
        for the run (after every entry-point plugin, in the config's order).
    """


@hookspec
def loongforge_register_hf_architectures(registry: Registry) -> None:
    """Register the Hugging Face architectures a model family reads (``config.json``'s ``architectures[0]``).

    :param registry: the ``hf_architecture`` registry; ``registry.register("Olmo2ForCausalLM", reader,
        aliases=("olmo2",))`` with the architecture's class name as the name, its ``model_type`` as an alias (the
        lookup for a ``config.json`` without ``architectures``), and a :class:`loongforge.models.family.HFReader`
        (or its import path) as the target. ``model.load: hf:DIR``, ``loongforge convert hf-to-mcore`` and
        ``loongforge check`` read every Hugging Face directory through the reader registered for it and the
        returned model's ``hf_adapter()``; core's decoder families register here too. An architecture claimed
        twice raises, naming both providers.
    """


@hookspec
def loongforge_register_rewards(registry: Registry) -> None:
    """Register rewards for ``training.phase: grpo`` (``grpo.reward``, or a prompt line's ``reward``).

    :param registry: the ``reward`` registry; a target is a callable (or its import path) called as
        ``reward(completion=..., answer=..., prompt=...)`` with the reply's text (its end-of-turn token left out),
        the prompt line's ``answer`` and the rendered prompt, returning a finite ``float`` (a
        :class:`loongforge.train.rl.rewards.Reward`). It runs on every rank that samples replies, once per reply,
        so it must be deterministic and cheap. Core registers ``exact-match``, ``regex`` and ``numeric``; a config
        may also name any ``pkg.module:function`` (code execution, as every import path in a config).
    """


@hookspec
def loongforge_register_certification_recipes(registry: Registry) -> None:
    """Register the tiny training runs ``loongforge certify`` trains on a device backend and on the CPU reference.

    :param registry: the ``certification_recipe`` registry; the target is a
        :class:`loongforge.certify.recipes.CertificationRecipe` (or its import path): a run config needing no
        download, the parallel layouts the model can take (:class:`~loongforge.certify.recipes.Layout`, each with
        the overrides that keep the one-process global batch) and whether the model is a megatron decoder the
        module-by-module checks trace. Register one per kind of model the plugin trains, so that certifying a
        backend exercises it; core registers ``llm`` and ``llm-moe``.
    """


@hookspec
def loongforge_register_commands(commands: CommandRegistry) -> None:
    """Add sub-commands to the ``loongforge`` command line (core's own commands register here too).

    :param commands: ``commands.add(name, help=..., configure=fn(parser), run=fn(args) -> int)`` adds
        ``loongforge NAME``; ``configure`` adds its arguments to an :class:`argparse.ArgumentParser` and ``run``
        receives the parsed namespace and returns the exit status. ``commands.add_handler(point, name, claims=...,
        ...)`` offers a handler to ``loongforge convert`` / ``eval``, which run the first whose
        ``claims(source, trust_code=...)`` is true (:mod:`loongforge.commands`).
        A name taken twice raises, naming both providers.
    """


# ---------------------------------------------------------------------------------------------------
# Configuration and model building.
# ---------------------------------------------------------------------------------------------------


@hookspec
def loongforge_configure(config: LoongForgeConfig) -> None:
    """Adjust the resolved config before anything is built (e.g. fill device-specific defaults).

    :param config: the config of the run; modify it in place. Return value ignored.
    """


@hookspec
def loongforge_modify_model(model: list[Any], config: LoongForgeConfig) -> list[Any] | None:
    """Wrap or modify the model after it is built and before the optimizer is created.

    Chained in the stated order (module docstring): each implementation receives what the previous one
    returned. Core's own implementation (``model.load`` weights, then ``model.lora``/``model.freeze``) is a
    plain one registered first, so a plain or ``trylast`` plugin implementation sees loaded weights and
    adapters; a ``tryfirst`` one runs before them (it sees freshly initialised weights).

    :param model: the model chunks (a list of modules, one per virtual pipeline stage).
    :param config: the run's config.
    :return: a replacement list of model chunks, or None to keep ``model`` (possibly modified in place).
    """


# ---------------------------------------------------------------------------------------------------
# Data: called by data paths whose samples vary in length.
# ---------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def loongforge_balance_samples(samples: list[dict[str, Any]], dp_group: Any) -> list[dict[str, Any]] | None:
    """Redistribute this step's samples across the data-parallel ranks, e.g. to even out their compute.

    ``firstresult``: stops at the first non-None result in the stated order (module docstring).

    Called on every data-parallel rank, with its own samples, before they are batched for the step (so before
    packing). The caller must normalise the loss by a global count (all ranks' tokens), so that which rank trains
    a sample does not change the gradient. A data path that calls this hook sets ``dp_balanced = True`` on the
    batch iterator it gives the trainer, so that an optimization can tell at train start whether it applies; a
    data path with fixed rows also sets ``dp_token_cap`` (tokens a rank's rows hold) and ``dp_fits(lengths)`` (can
    these samples be packed into one rank's rows). Plugins may add per-step numbers to ``trainer.step_metrics``.
    loongforge-vlm's packed image-text data is such a path (``training.loss_normalization: global_tokens``).

    :param samples: this rank's samples, a list of dicts of tensors whose first dimension varies per sample
        (``tokens`` [n] counts the sample's text and vision tokens; an optional ``encoder_work`` [2] int64 gives
        what a vision encoder computes for it: its patches and the sum over its attention blocks of their length
        squared).
    :param dp_group: the data-parallel ``torch.distributed.ProcessGroup``.
    :return: the samples this rank trains on (None everywhere: unchanged).
    """


# ---------------------------------------------------------------------------------------------------
# Training lifecycle: called by the trainer on every rank, in the stated order; return values ignored.
# ---------------------------------------------------------------------------------------------------


@hookspec
def loongforge_on_train_start(trainer: Trainer) -> None:
    """Called after model, optimizer, data and any resumed state are ready, before the first step.

    :param trainer: the run's :class:`loongforge.train.trainer.Trainer` (its docstring lists the attributes a
        plugin may read and set); ``trainer.step`` is the number of completed steps.
    """


@hookspec
def loongforge_on_step_end(trainer: Trainer, step: int, metrics: dict[str, Any]) -> None:
    """Called after each optimizer step.

    :param trainer: the run's trainer; set ``trainer.should_stop = True`` to end training after this step.
    :param step: the number of completed steps.
    :param metrics: this step's metrics (``loss``, ``lr``, ``grad_norm``, ``tokens_per_s`` ...); plugins may add keys.
    """


@hookspec
def loongforge_on_train_end(trainer: Trainer, metrics: dict[str, Any]) -> None:
    """Called once after the last step (also when training stops early), before the process exits.

    :param trainer: the run's trainer.
    :param metrics: summary metrics of the run.
    """


@hookspec
def loongforge_on_checkpoint_save(trainer: Trainer, path: str, extra_state: dict[str, Any]) -> None:
    """Called while a checkpoint is written, before it is made visible.

    :param trainer: the run's trainer.
    :param path: the (temporary) checkpoint directory being written.
    :param extra_state: a JSON-serialisable dict saved with the checkpoint; add plugin state under your name.
    """


@hookspec
def loongforge_on_checkpoint_load(trainer: Trainer, path: str, extra_state: dict[str, Any]) -> None:
    """Called after a checkpoint was verified and loaded.

    :param trainer: the run's trainer.
    :param path: the checkpoint directory.
    :param extra_state: the dict that ``loongforge_on_checkpoint_save`` implementations filled.
    """
