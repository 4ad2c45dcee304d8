"""Certification recipes: the tiny training runs ``loongforge certify`` trains on a backend and on the CPU reference.

Each installed modality registers its own (``loongforge_register_certification_recipes``), so certifying a backend
exercises every kind of model the installation trains -- core's dense and MoE decoders here, the plugins' VLM,
diffusion and policy models there -- through the one contract: a run config, the parallel layouts the model can
take, and whether the model is a megatron decoder the module-by-module checks can trace. A recipe names no device:
certify trains it on each side.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Layout:
    """A parallel layout certify runs a recipe at: ``processes`` ranks and the config ``overrides`` that make their
    global batch the one-process run's (the task engine, without gradient accumulation, halves
    ``training.micro_batch_size`` for dp=2; megatron keeps ``training.global_batch_size``)."""

    processes: int
    overrides: tuple[str, ...] = ()


@dataclass(frozen=True)
class CertificationRecipe:
    """What certify trains for one modality.

    ``config`` is a run config (the YAML mapping a user writes) that needs no download: generated or shipped data.
    Certify sets ``run.output_dir``, ``training.steps`` and ``training.precision``, checkpoints half-way and at the end,
    and logs every step; everything else is the recipe's, so keep it to seconds a step on a CPU (evaluation and sampling
    after training off). ``layouts`` are the parallel layouts this model can run, by name; ``default_layouts`` those
    certify runs unless ``--layouts`` says otherwise (default: all). The ``modules`` and ``weights`` checks trace the
    recipe's checkpoints with :mod:`loongforge.diffing.worker` (a megatron model on a replayed batch, a task model
    through its task's ``validation_loss``). ``suite``: the :class:`~loongforge.testing.family_suite.ModelFamilySuite`
    attributes ``loongforge certify --family`` needs for the model this recipe trains beyond its defaults
    (``never_trained``, ``config_overrides`` on this recipe's config for a task family, ...).
    """

    description: str
    config: Mapping[str, Any]
    layouts: Mapping[str, Layout] = field(default_factory=dict)
    default_layouts: tuple[str, ...] | None = None
    suite: Mapping[str, Any] = field(default_factory=dict)

    def run_config(self, steps: int, precision: str) -> dict[str, Any]:
        """The config every run of this recipe trains (certify's settings over the recipe's)."""
        config = copy.deepcopy(dict(self.config))
        config.setdefault("training", {}).update(steps=steps, precision=precision)
        config["checkpoint"] = {"interval": max(1, steps // 2), "keep_last": 4, "resume": "never",
                                "save_at_end": True}
        config["logging"] = {"interval": 1, "progress": False, "tensorboard": False}
        return config

    def chosen_layouts(self, requested: tuple[str, ...] | None) -> tuple[str, ...]:
        """The layouts to run: ``requested`` (``None``: the defaults) among those this recipe has."""
        if requested is None:
            return tuple(self.default_layouts if self.default_layouts is not None else self.layouts)
        return tuple(name for name in requested if name in self.layouts)


def _decoder_config(model: str) -> dict[str, Any]:
    """The quickstart's run cut to seconds: ``model`` on the shipped corpus, 8 sequences of 64 tokens a step."""
    return {
        "run": {"name": f"certify-{model}", "seed": 1234},
        "model": model,
        "data": {"dataset": "shipped-corpus", "tokenizer": "byte", "seq_length": 64},
        "optimizer": {"lr": 2.0e-3, "min_lr": 2.0e-4, "weight_decay": 0.1, "grad_clip": 1.0},
        "scheduler": {"warmup_steps": 2, "decay": "cosine"},
        "training": {"micro_batch_size": 4, "global_batch_size": 8, "sample_tokens": 0, "threads": 1},
    }


#: core's dense decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU; every megatron layout on two ranks.
DENSE_DECODER = CertificationRecipe(
    description="llama-tiny on shipped-corpus, sequences of 64, global batch 8",
    config=_decoder_config("llama-tiny"),
    layouts={"tp2": Layout(2, ("parallel.tp=2",)), "pp2": Layout(2, ("parallel.pp=2",)), "dp2": Layout(2),
             "tp2-sp": Layout(2, ("parallel.tp=2", "parallel.sequence_parallel=true")),
             "dp2-distopt": Layout(2, ("parallel.distributed_optimizer=true",))},
    default_layouts=("tp2", "pp2", "dp2"),
)
#: core's mixture of experts: the router, expert dispatch and the expert-parallel all-to-all.
MOE_DECODER = CertificationRecipe(
    description="qwen3-moe-tiny on shipped-corpus, sequences of 64, global batch 8",
    config=_decoder_config("qwen3-moe-tiny"),
    layouts={"ep2": Layout(2, ("parallel.ep=2",)), "dp2": Layout(2),
             # megatron's MoE layers need sequence parallelism at tp > 1
             "tp2-sp": Layout(2, ("parallel.tp=2", "parallel.sequence_parallel=true"))},
)


def register_core_recipes(registry: Any) -> None:
    registry.register("llm", DENSE_DECODER, description="dense decoder (llama-tiny)")
    registry.register("llm-moe", MOE_DECODER, description="mixture-of-experts decoder (qwen3-moe-tiny)")
