"""LoongForge's own components, registered through the same hooks as any external plugin.

This module is the ``core`` entry point of the ``loongforge`` group. It must stay torch-free: it only
records names and import paths; the targets are imported when a run uses them.
"""

from __future__ import annotations

from loongforge.plugins import hookimpl

SUMMARY = "LoongForge core: CPU backend, Llama/Qwen families on megatron-core, token datasets, HF interop"


@hookimpl
def loongforge_register_devices(registry):
    registry.register(
        "cpu",
        "loongforge.devices.cpu:CPUBackend",
        aliases=("host",),
        description="Built-in CPU backend (gloo); patches megatron-core to run without CUDA",
    )


@hookimpl
def loongforge_register_models(registry):
    from loongforge.models.deepseek.registration import register_deepseek_models
    from loongforge.models.qwen3_next.registration import register_models as register_qwen3_next
    from loongforge.models.registration import register_builtin_models

    register_builtin_models(registry)
    register_qwen3_next(registry)
    register_deepseek_models(registry)


@hookimpl
def loongforge_register_hf_architectures(registry):
    from loongforge.models.deepseek.registration import register_deepseek_hf_architectures
    from loongforge.models.hf_config import register_decoder_hf_architectures
    from loongforge.models.qwen3_next.registration import register_hf_architectures as register_qwen3_next

    register_decoder_hf_architectures(registry)
    register_qwen3_next(registry)
    register_deepseek_hf_architectures(registry)


@hookimpl
def loongforge_register_parallel_strategies(registry):
    registry.register(
        "megatron",
        "loongforge.parallel.megatron:MegatronStrategy",
        aliases=("mcore",),
        description="megatron-core tensor/pipeline/data parallelism with sequence parallel and distributed optimizer",
    )
    for name, what in (("ddp", "DistributedDataParallel"), ("zero1", "DDP + ZeRO-1 sharded AdamW state"),
                       ("fsdp2", "fully_shard: parameters, grads and optimizer state sharded"),
                       ("hsdp", "fully_shard on a replicate x shard mesh")):
        registry.register(name, f"loongforge.parallel.torch_native:{name.upper()}",
                          description=f"torch-native {what} (models the task engine trains)")


@hookimpl
def loongforge_register_datasets(registry):
    from loongforge.data.registration import register_builtin_datasets

    register_builtin_datasets(registry)


@hookimpl
def loongforge_register_rewards(registry):
    from loongforge.train.rl.rewards import register_builtin_rewards

    register_builtin_rewards(registry)


@hookimpl
def loongforge_register_certification_recipes(registry):
    from loongforge.certify.recipes import register_core_recipes

    register_core_recipes(registry)


@hookimpl
def loongforge_register_tokenizers(registry):
    from loongforge.data.registration import register_builtin_tokenizers

    register_builtin_tokenizers(registry)


@hookimpl
def loongforge_modify_model(model, config):
    """``model.load``: start from Hugging Face (``hf:DIR``) or LoongForge checkpoint weights; then ``model.lora`` /
    ``model.freeze``: add adapters and freeze weights. One function, so the order is fixed: weights are loaded
    under the base model's names before adapters join them. A task model (one plain module) takes ``model.freeze``
    only (``check`` refuses ``model.lora`` for it)."""
    if config.model.load:
        from loongforge.interop.online import load_initial_weights

        load_initial_weights(model, config)
    if not isinstance(model, list):  # the task engine's one plain module (megatron's chunks come as a list)
        if config.model.freeze:
            from loongforge.config.sections import origin_of
            from loongforge.models.task_freeze import freeze_task_model

            freeze_task_model(model, config.model.freeze, origin_of(config.source, "model.freeze"))
        return None
    from loongforge.interop.mcore_checkpoint import resolve_family

    family = resolve_family(config)
    trained = family.trained_parameters()  # a training phase of the family's own (DSA warm-up)
    groups = family.parameter_groups()  # its parts' own settings (frozen ones freeze here)
    if config.model.lora is not None or config.model.freeze or trained or any(g.frozen for g in groups):
        from loongforge.models.lora import apply_adapters

        apply_adapters(model, config, trained=trained, groups=groups)
    return None


@hookimpl
def loongforge_on_checkpoint_save(trainer, path, extra_state):
    """``checkpoint.save_hf``: also write the checkpoint's weights in Hugging Face format under ``<path>/hf``."""
    if not trainer.config.checkpoint.save_hf:
        return
    from loongforge.interop.online import HF_SUBDIR, save_hf_copy

    save_hf_copy(trainer, path)
    extra_state["hf"] = {"dir": HF_SUBDIR}


@hookimpl
def loongforge_register_commands(commands):
    """Core's sub-commands (``train``, ``check``, ``convert``, ``launch`` ...), its LLM converters and its LLM
    evaluator, through the same hook plugins use to add theirs."""
    from loongforge.cli import register_core_commands
    from loongforge.cluster.command import register_launch_command
    from loongforge.core_converters import register_core_converters
    from loongforge.evaluation.command import register_eval_handler

    register_core_commands(commands)
    register_launch_command(commands)
    register_core_converters(commands)
    register_eval_handler(commands)
