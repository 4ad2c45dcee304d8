"""``loongforge plan CONFIG --devices N [--device-memory 80GiB] ...``: the planner from the command line.

Imports no torch: the model comes from the flavor registry, the device facts from the flags (then the
config's ``parallel.planner``, then GPU defaults), so planning a 64-GPU run works on a laptop.
"""

from __future__ import annotations

import argparse
import dataclasses

from loongforge.errors import ConfigError
from loongforge.planner.auto import cluster_from_options, search_space, workload_for
from loongforge.planner.calibrate import load_calibration
from loongforge.planner.hardware import GIB
from loongforge.planner.planner import plan
from loongforge.planner.report import print_plan

#: Device facts when neither the flags nor the config give them: a current 80 GiB datacenter GPU.
GPU_FACTS = {"device_memory": 80 * GIB, "ranks_per_node": 8}


def plan_command(args: argparse.Namespace) -> int:
    """Print the plan; an impossible request is a :class:`ConfigError` naming the devices/memory that would do."""
    from loongforge.config import load_config
    from loongforge.config.resolve import resolve_model_flavor

    config = load_config(args.config, args.overrides)
    flavor = resolve_model_flavor(config)
    options = config.parallel.planner
    flags = {"device_memory": args.device_memory, "ranks_per_node": args.ranks_per_node,
             "device_tflops": args.device_tflops, "intra_node_gbps": args.intra_node_gbps,
             "inter_node_gbps": args.inter_node_gbps, "calibration": args.calibration, "margin": args.margin}
    options = dataclasses.replace(options, **{k: v for k, v in flags.items() if v is not None})
    cluster = cluster_from_options(options, args.devices, GPU_FACTS)
    calibration = load_calibration(options.calibration)
    result = plan(workload_for(config, flavor, args.kernels), cluster, search_space(config),
                  memory_coefficients=calibration.memory, time_coefficients=calibration.time, margin=options.margin)
    print_plan(result, top=args.top)
    if not result.ranked:
        raise ConfigError(result.infeasible_message())
    return 0
