"""``loongforge train --nproc N``: start N local training processes with torch's elastic launcher.

Why not just document ``torchrun``: for one machine the convenience matters, and going through
``torch.distributed.run`` (standalone rendezvous on a free port) gives the children exactly the
environment torchrun gives them (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``), so there
is one code path for both. The layout is checked against N before any process starts (a wrong ``tp`` fails
in a second, not after N imports of megatron), threads are divided between the processes, and a failing
child's exit status is returned without torch's failure report: rank 0 has already printed the reason.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from loongforge.errors import ConfigError


def launch_local(config: Any, nproc: int, child_args: Sequence[str]) -> int:
    """Run ``python -m loongforge.cli *child_args`` in ``nproc`` processes on this machine; return the exit status."""
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        raise ConfigError("--nproc starts its own processes; under torchrun, leave it out")
    from loongforge.plugins import get_registry

    strategy = get_registry("strategy").load(config.parallel.strategy, where=f"parallel.strategy in {config.source}")
    strategy.validate(config.parallel, nproc, config.source)

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # torchrun would set 1 thread per process and warn; sharing the cores is the better default.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    args = parse_args(["--standalone", "--nproc-per-node", str(nproc), "--module", "loongforge.cli", *child_args])
    elastic_log = logging.getLogger("torch.distributed.elastic")
    level = elastic_log.level
    elastic_log.setLevel(logging.CRITICAL)  # its "failed (exitcode: 2)" report repeats what rank 0 printed
    try:
        run(args)
    except ChildFailedError as exc:
        _, failure = exc.get_first_failure()
        return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode  # killed by a signal
    finally:
        elastic_log.setLevel(level)
    return 0
