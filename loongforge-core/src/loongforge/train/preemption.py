"""Preemption: SIGTERM or SIGUSR1 (Slurm's warning before it kills a job) become a checkpoint at the next step
boundary and exit status 3, instead of losing the work since the last interval save.

Why a flag and a boundary: a signal lands anywhere -- mid-forward, inside a collective, during a save -- so the
handler only records it, and the loop (:mod:`loongforge.train.loop`) saves where the state is whole. A second
signal while that save runs changes nothing, so it cannot tear the save either.

Why the ranks vote: Slurm signals every task, but a ``kill`` may reach one rank only, and a checkpoint is written
by all ranks together. At every step boundary of a multi-process run the ranks combine their flags with one
all-reduce of a single integer, so all of them save the same step or none does.

The handlers exist only while a run is in :func:`loongforge.train.run.run_training` -- from before the model is built,
so a signal that arrives during start-up is answered at the first step boundary instead of killing the rank -- and
only in the main thread (Python delivers signals there); the handlers that
were there before come back afterwards. ``loongforge train --nproc`` forwards the same signals from its launcher to
every rank (:mod:`loongforge.parallel.launch`).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from loongforge.errors import TrainingPreempted

#: The signals that ask a run to save and stop (``checkpoint.save_on_signal``), those of them this platform has.
PREEMPTION_SIGNALS = tuple(getattr(signal, name) for name in TrainingPreempted.signals if hasattr(signal, name))


class PreemptionWatch:
    """Records a preemption signal while entered; :meth:`requested` says, the same on every rank, whether to stop.

    ``device``: where the flag is all-reduced (the device of this rank's collectives) when ``world_size > 1``.
    Disabled (``checkpoint.save_on_signal: false``), it installs nothing and never asks for a stop.
    """

    def __init__(self, *, enabled: bool, world_size: int = 1, device: Any = None) -> None:
        self.enabled = enabled
        self.world_size = world_size
        self.device = device
        #: The signal this process received (``None``: none yet).
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def connect(self, *, world_size: int, device: Any) -> None:
        """Once the process group exists: vote over ``world_size`` ranks, all-reducing on ``device``."""
        self.world_size = world_size
        self.device = device

    def __enter__(self) -> PreemptionWatch:
        if self.enabled and threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._record) for sig in PREEMPTION_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def requested(self) -> str | None:
        """At a step boundary: the name of the signal some rank received (``"SIGTERM"``), else ``None``.

        Collective when ``world_size > 1`` (every rank calls it at the same boundaries)."""
        if not self.enabled:
            return None
        signum = self.received or 0
        if self.world_size > 1:
            signum = _highest_over_ranks(signum, self.device)
        return signal.Signals(signum).name if signum else None


def _highest_over_ranks(value: int, device: Any) -> int:
    """The largest of every rank's ``value`` (one all-reduce of one integer)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([value], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())
