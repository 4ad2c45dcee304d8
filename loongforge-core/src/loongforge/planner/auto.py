"""``parallel: auto``: choose the run's layout with the planner for its actual world size and devices.

The run's config names the model, sequence length, batch and precision; the world size comes from the
launcher, the device facts from ``parallel.planner`` or the device backend
(:func:`~loongforge.planner.hardware.device_facts`). The chosen layout replaces ``parallel``,
``training.micro_batch_size`` (and the global batch's cut) and ``model.recompute`` in a copy of the config;
the decision (layout, predictions, inputs, rejection counts) goes into the run's checkpoint metadata.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from loongforge.config.chunk_settings import chunk_counts
from loongforge.config.offload_settings import offloaded_layer_indices
from loongforge.config.schema import LoongForgeConfig, RecomputeConfig
from loongforge.errors import ConfigError
from loongforge.models.family import ModelFamily
from loongforge.planner.calibrate import load_calibration
from loongforge.planner.hardware import ClusterSpec, device_facts, parse_bytes
from loongforge.planner.layouts import SearchSpace
from loongforge.planner.memory import Workload
from loongforge.planner.planner import Plan, plan


def cluster_from_options(options: Any, num_devices: int, facts: dict[str, Any]) -> ClusterSpec:
    """A :class:`ClusterSpec` from ``parallel.planner`` options (or CLI flags) over the backend's facts."""
    values = dict(facts)
    if options.device_memory is not None:
        values["device_memory"] = parse_bytes(options.device_memory, "parallel.planner.device_memory")
    if options.ranks_per_node is not None:
        values["ranks_per_node"] = options.ranks_per_node
    if options.device_tflops is not None:
        values["device_flops"] = options.device_tflops * 1e12
    if options.intra_node_gbps is not None:
        values["intra_node_bandwidth"] = options.intra_node_gbps * 1e9
    if options.inter_node_gbps is not None:
        values["inter_node_bandwidth"] = options.inter_node_gbps * 1e9
    if options.host_gbps is not None:
        values["host_bandwidth"] = options.host_gbps * 1e9
    known = set(ClusterSpec.__dataclass_fields__)
    values = {k: v for k, v in values.items() if k in known and k != "num_devices"}
    if "device_memory" not in values:
        raise ConfigError(f"the device backend ({values.get('name', 'unnamed')}) does not report its memory; set "
                          "parallel.planner.device_memory (or --device-memory), e.g. 80GiB")
    return ClusterSpec(num_devices=num_devices, **values)


def workload_for(config: LoongForgeConfig, family: ModelFamily, kernels: str) -> Workload:
    """What the planner sizes: ``family`` -- its megatron decoder (a composed model's language backbone) as the
    family's own slots state it (``decoder_terms``, ``check_layout``) -- and the parts the family reports outside it
    (``planner_parts``: a VLM's vision encoder). A task-engine model has no megatron layout (``loongforge plan`` sizes
    it through :mod:`~loongforge.planner.task_planner` instead): a one-line :class:`ConfigError`."""
    decoder = family.decoder
    if family.engine != "megatron" or decoder is None:
        raise ConfigError(f"{config.source}: model '{config.model.name}' is trained by the {family.engine} engine; "
                          "parallel: auto chooses megatron layouts only (`loongforge plan` ranks a task model's "
                          "torch-native layouts where its family states its sizes; --write saves the best)")
    offload = config.training.offload_activations
    offloaded = (frozenset() if offload is None or offload.layers == "auto"
                 else offloaded_layer_indices(offload, decoder.num_layers, config.source))
    return Workload(decoder, config.data.seq_length, config.training.precision, kernels=kernels,
                    components=tuple(family.planner_parts(config)), family=family, offloaded_layers=offloaded)


def search_space(config: LoongForgeConfig, family: ModelFamily) -> SearchSpace:
    """Keep the config's global batch (then the micro-batch size is the planner's to pick); without one, keep
    its micro-batch size (the global batch follows dp, as for a fixed layout). The context-parallel mode is the
    config's (``auto``: the planner's), and so are activation offload (``layers: auto``: the planner's) and the
    chunked pipeline's count (``parallel.seq_chunks: auto``: the planner's, where ``family``'s decoder allows it)."""
    gbs = config.training.global_batch_size
    offload = config.training.offload_activations
    return SearchSpace(global_batch_size=gbs, micro_batch_size=None if gbs else config.training.micro_batch_size,
                       max_cp=1 if config.data.pack else 8, cp_mode=config.parallel.cp_mode,
                       cp_a2a_size=config.parallel.cp_a2a_size,
                       choose_offload=offload is not None and offload.layers == "auto",
                       chunk_counts=chunk_counts(config, family.decoder))


def kernels_of(backend: Any) -> str:
    """Which activation profile the backend's layers follow (see :class:`~loongforge.planner.memory.Workload`)."""
    if backend.device_type == "cpu":
        return "local"
    return "te" if backend.supports("te") else "local"


def plan_for_run(config: LoongForgeConfig, flavor: ModelFamily, backend: Any, world_size: int) -> Plan:
    """The plan for this run; ``flavor`` is the resolved model (a composed VLM or a plain decoder)."""
    options = config.parallel.planner
    cluster = cluster_from_options(options, world_size, device_facts(backend))
    calibration = load_calibration(options.calibration)
    return plan(workload_for(config, flavor, kernels_of(backend)), cluster, search_space(config, flavor),
                memory_coefficients=calibration.memory, time_coefficients=calibration.time, margin=options.margin)


def apply_plan(config: LoongForgeConfig, result: Plan) -> LoongForgeConfig:
    """A copy of ``config`` with the best layout of ``result`` written into it (``auto`` switched off): the parallel
    sizes with the context-parallel mode and the chunk count, the batch cut, recompute and (where the planner chose
    it) offload."""
    best = result.best.candidate
    resolved = copy.deepcopy(config)
    resolved.parallel = dataclasses.replace(resolved.parallel, auto=False, **best.parallel_config())
    resolved.training.micro_batch_size = best.micro_batch_size
    resolved.training.global_batch_size = best.micro_batch_size * best.num_microbatches * best.dp
    recompute = best.recompute.as_config()
    resolved.model.recompute = RecomputeConfig(**recompute) if recompute else None
    offload = config.training.offload_activations
    if offload is not None and offload.layers == "auto":  # the planner's choice: the layers, or none
        layers = sorted(best.offloaded_layers(result.workload.terms().num_layers))
        resolved.training.offload_activations = dataclasses.replace(offload, layers=layers) if layers else None
    return resolved
