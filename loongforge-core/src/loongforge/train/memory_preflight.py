"""The pre-flight's memory check: a batch that cannot fit on a device even at the planner's lowest estimate is
refused by ``check`` and ``train`` in one line, before anything is allocated.

Why the lowest estimate: the planner's model (:mod:`loongforge.planner.memory`) is calibrated for choosing between
layouts, not for promising that one fits, so the check asks it for the cheapest way this layout could run -- every
layer recomputed in full -- and refuses only when even that exceeds the device's memory (a ``micro_batch_size`` of
1e12 would otherwise try to allocate terabytes). A model whose family states no planner terms, or a device that
reports no memory (and no ``parallel.planner.device_memory``), is not checked.
"""

from __future__ import annotations

from typing import Any

from loongforge.config.schema import LoongForgeConfig
from loongforge.config.sections import origin_of
from loongforge.errors import ConfigError


def check_batch_fits(config: LoongForgeConfig, family: Any, backend: Any, layout: Any, num_microbatches: int,
                     world_size: int) -> None:
    """Raise a one-line :class:`ConfigError` naming ``training.micro_batch_size`` when one rank of ``layout`` needs
    more than its device's memory even with full recompute."""
    from loongforge.planner.auto import cluster_from_options, kernels_of, workload_for
    from loongforge.planner.hardware import device_facts, format_bytes
    from loongforge.planner.layouts import Candidate, RecomputePlan
    from loongforge.planner.memory import estimate_memory

    facts = device_facts(backend)
    if family.decoder_terms() is None or ("device_memory" not in facts and config.parallel.planner.device_memory
                                          is None):
        return  # nothing to size, or nothing to compare with
    memory = cluster_from_options(config.parallel.planner, world_size, facts).device_memory
    layers_per_stage = family.decoder.num_layers // (layout.pp * layout.num_chunks)
    cheapest = Candidate(
        tp=layout.tp, pp=layout.pp, dp=layout.dp, cp=layout.cp, ep=layout.ep, etp=layout.etp or layout.tp,
        vpp=layout.num_chunks, sequence_parallel=layout.sequence_parallel,
        distributed_optimizer=layout.distributed_optimizer, micro_batch_size=config.training.micro_batch_size,
        num_microbatches=num_microbatches, recompute=RecomputePlan("full", num_layers=layers_per_stage))
    least = estimate_memory(workload_for(config, family, kernels_of(backend)), cheapest).total
    if least > memory:
        key = "training.micro_batch_size"
        raise ConfigError(
            f"{origin_of(config.source, key)}: {key}={config.training.micro_batch_size} with data.seq_length="
            f"{config.data.seq_length} needs at least {format_bytes(least)} per rank (every layer recomputed), more "
            f"than the device's {format_bytes(memory)}; lower them, or split the model over more ranks")
