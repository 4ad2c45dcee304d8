"""``loongforge plan CONFIG --devices N [--device-memory 80GiB] ...``: the planner from the command line.

With ``--device-memory`` (or ``parallel.planner.device_memory``) it plans for a cluster described by the
flags (then the config's ``parallel.planner``, then GPU defaults) and imports no torch, so planning a 64-GPU
run works on a laptop. Without it, it plans for the devices of the machine it runs on: the backend
``loongforge train`` would pick (``LOONGFORGE_DEVICE``, then the config's ``device:``) answers through
:func:`~loongforge.planner.hardware.device_facts`, and the flags still win over what it reports.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

from loongforge.errors import ConfigError
from loongforge.planner.auto import cluster_from_options, search_space, workload_for
from loongforge.planner.calibrate import load_calibration
from loongforge.planner.hardware import GIB, ClusterSpec, device_facts
from loongforge.planner.planner import plan
from loongforge.planner.report import print_plan, print_task_plan
from loongforge.planner.task_planner import plan_task

#: The cluster a given device memory describes, unless flags say otherwise: nodes of 8 current datacenter GPUs
#: (the speeds are :class:`~loongforge.planner.hardware.ClusterSpec`'s defaults).
GPU_FACTS = {"device_memory": 80 * GIB, "ranks_per_node": 8}


def plan_command(args: argparse.Namespace) -> int:
    """Print the plan; an impossible request is a :class:`ConfigError` naming the devices/memory that would do."""
    from loongforge.config import load_config
    from loongforge.resolve import resolve_model_flavor

    if args.seq_length is not None:
        if args.seq_length < 1:
            raise ConfigError(f"--seq-length must be a positive number of tokens, got {args.seq_length}")
        args.overrides = [*args.overrides, f"data.seq_length={args.seq_length}"]
    config = load_config(args.config, args.overrides)
    family = resolve_model_flavor(config)
    sizes = task_terms_for(config, family, args.sample_shape) if family.engine != "megatron" else None
    workload = workload_for(config, family, args.kernels) if sizes is None else None
    options = config.parallel.planner
    flags = {"device_memory": args.device_memory, "ranks_per_node": args.ranks_per_node,
             "device_tflops": args.device_tflops, "intra_node_gbps": args.intra_node_gbps,
             "inter_node_gbps": args.inter_node_gbps, "host_gbps": args.host_gbps, "calibration": args.calibration,
             "margin": args.margin}
    options = dataclasses.replace(options, **{k: v for k, v in flags.items() if v is not None})
    facts = GPU_FACTS if options.device_memory is not None else machine_facts(config, args.devices)
    cluster = cluster_from_options(options, args.devices, facts)
    print(describe_devices(cluster))
    calibration = load_calibration(options.calibration)
    if sizes is not None:
        result = plan_task(sizes, cluster, precision=config.training.precision,
                           micro_batch_size=config.training.micro_batch_size, margin=options.margin,
                           time_coefficients=calibration.time, fixed_bytes=calibration.memory.fixed_bytes)
        print_task_plan(result, config.model.name or family.family_name, top=args.top)
    else:
        result = plan(workload, cluster, search_space(config, family), memory_coefficients=calibration.memory,
                      time_coefficients=calibration.time, margin=options.margin)
        print_plan(result, top=args.top)
    if not result.ranked:
        raise ConfigError(result.infeasible_message())
    if args.write:
        if sizes is not None:
            _write_yaml(load_config(args.config, [*args.overrides, *result.best.candidate.overrides(sizes)]),
                        args.write)
        else:
            write_planned_config(config, result, args.write)
        print(f"wrote {args.write}: loongforge train {args.write} --nproc {args.devices}")
    return 0


def task_terms_for(config: Any, family: Any, flag: str | None) -> Any:
    """A task-engine model's :class:`~loongforge.models.task_terms.TaskTerms` for one sample of ``--sample-shape``
    (``AxBxC``), else ``parallel.planner.sample_shape``, else the config's data; a family that states none is
    refused in one line."""
    shape = config.parallel.planner.sample_shape
    if flag is not None:
        try:
            shape = [int(part) for part in flag.lower().split("x")]
        except ValueError:
            raise ConfigError(f"--sample-shape {flag!r}: expected sizes joined by x, e.g. 21x60x104") from None
    if shape is not None and (not shape or min(shape) < 1):
        raise ConfigError(f"{config.source}: the sample shape {shape} must be positive sizes")
    sizes = family.task_terms(config, tuple(shape) if shape is not None else None)
    if sizes is None:
        raise ConfigError(f"{config.source}: model '{config.model.name}' is trained by the {family.engine} engine "
                          "and states no sizes for the planner (ModelFamily.task_terms)")
    return sizes


def write_planned_config(config: Any, result: Any, path: str) -> None:
    """``config`` with the plan's best layout applied (:func:`~loongforge.planner.auto.apply_plan`), as YAML: what
    ``loongforge check``/``train`` load back with nothing left for the planner to choose."""
    from loongforge.planner.auto import apply_plan

    _write_yaml(apply_plan(config, result), path)


def _write_yaml(config: Any, path: str) -> None:
    """``config`` as the YAML ``loongforge check``/``train`` load back."""
    import yaml

    from loongforge.config.loader import config_to_dict

    with open(path, "w", encoding="utf-8") as out:
        yaml.safe_dump(config_to_dict(config), out, sort_keys=False)


def machine_facts(config: Any, num_devices: int) -> dict[str, Any]:
    """The facts of the device backend this machine would train ``config`` on (selection probes, then asks).

    A CPU "device" is a process on this host, and what the host offers each one (its node, its share of memory
    and cores) depends on how many run here. Outside a launcher, ``--devices N`` on the CPU backend is the run
    ``loongforge train --nproc N`` starts: N processes on this one host, each told ``LOCAL_WORLD_SIZE=N``. The
    facts are asked in that environment, so the plan (tp up to N in one node) agrees with what ``--nproc`` runs
    and with what ``parallel: auto`` later computes inside those processes.
    """
    from loongforge.devices.selection import select_backend
    from loongforge.plugins import get_host

    env = os.environ.get("LOONGFORGE_DEVICE")
    request, source = (env, "LOONGFORGE_DEVICE") if env else (config.device or "auto", f"device in {config.source}")
    backend, _reason = select_backend(request, get_host().registry("device"), source=source)
    if backend.device_type != "cpu" or "LOCAL_WORLD_SIZE" in os.environ:
        return device_facts(backend)
    with _local_world_size(num_devices):
        return device_facts(backend)


@contextlib.contextmanager
def _local_world_size(processes: int) -> Iterator[None]:
    """``LOCAL_WORLD_SIZE`` as ``--nproc`` sets it for its processes, for the duration of the block."""
    os.environ["LOCAL_WORLD_SIZE"] = str(processes)
    try:
        yield
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]


def describe_devices(cluster: ClusterSpec) -> str:
    """One line naming the device and the speeds the time model uses (so a surprising ranking can be traced)."""
    return (f"devices: {cluster.name}; {cluster.device_flops / 1e12:.3g} TFLOP/s achieved, links "
            f"{cluster.intra_node_bandwidth / 1e9:.3g} GB/s in a node, {cluster.inter_node_bandwidth / 1e9:.3g} GB/s "
            f"across, {cluster.latency * 1e6:.3g} us per collective")
