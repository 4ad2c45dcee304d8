"""``python3 -m loongforge.cluster.agent TORCHRUN_ARGS...``: torchrun for one Kubernetes pod, whose exit status says
what happened to its ranks.

Why: torchrun exits 1 whenever a worker failed, whatever the worker returned, so a pod could not tell Kubernetes a
config error (``loongforge`` status 2: an error to fix, which every restart repeats) from a crash worth a restart --
JobSet and PyTorchJob restarted the pod group for both, up to ``--max-restarts`` times. Here torch's launcher runs
in this process with the same arguments a person gives torchrun (``--module loongforge.cli train ...``), each rank
under :mod:`loongforge.cluster.rank`, which records its status in a directory of this pod (its output stays on the
pod's log). Afterwards the pod exits with:

* ``0`` -- training finished;
* ``2`` -- a rank exited with status 2 (a config or data error, an unusable checkpoint): never restarted, by the
  manifests' failure policies (:mod:`loongforge.cluster.k8s`) nor by torchrun inside the pod (a rank whose previous
  attempt exited 2 exits 2 again at once instead of loading everything to fail the same way);
* :data:`PREEMPTED` (143) -- the ranks saved a checkpoint on SIGTERM/SIGUSR1 and stopped: restart and resume;
* :data:`RESTART` (134) -- anything else (a crash, a rank killed, a hang the watchdog found): restart and resume.

Both restartable statuses are above 127, the range Kubeflow's ``restartPolicy: ExitCode`` retries; 1-127 it treats as
permanent. Signals reach torch's agent directly (it is this process), which passes them on to the ranks as torchrun
would.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

#: The pod's exit status after the ranks saved and stopped on a preemption signal (128 + SIGTERM).
PREEMPTED = 143
#: The pod's exit status after a crash, a killed rank or a hang: retryable (128 + SIGABRT).
RESTART = 134
#: ``loongforge``'s status for an error the user must fix (:mod:`loongforge.cli`).
ERROR_TO_FIX = 2
#: ``loongforge train``'s status after a preemption save (:class:`loongforge.errors.TrainingPreempted`).
SAVED_AND_STOPPED = 3


def rank_statuses(directory: Path) -> list[int]:
    """The statuses the ranks of this pod recorded in ``directory`` (a rank killed outright records none)."""
    statuses = []
    for path in sorted(directory.glob("rank-*.status")):
        try:
            statuses.append(int(path.read_text(encoding="utf-8").strip()))
        except (OSError, ValueError):
            continue
    return statuses


def verdict(launcher_status: int, statuses: Sequence[int]) -> tuple[int, str]:
    """The pod's exit status and a line saying why, from torchrun's outcome and the ranks' recorded statuses."""
    if launcher_status == 0:
        return 0, "finished"
    if ERROR_TO_FIX in statuses:
        return ERROR_TO_FIX, "a rank exited with status 2 (an error to fix): not to be restarted"
    if SAVED_AND_STOPPED in statuses:
        return PREEMPTED, "preempted: the ranks saved a checkpoint; a restart resumes from it"
    shown = ", ".join(map(str, statuses)) or "none recorded"
    return RESTART, f"the ranks failed (rank statuses: {shown}); a restart resumes from the newest checkpoint"


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if not (args.module and args.training_script == "loongforge.cli"):
        print("usage: python3 -m loongforge.cluster.agent TORCHRUN_OPTIONS --module loongforge.cli COMMAND...",
              file=sys.stderr)
        return ERROR_TO_FIX
    with tempfile.TemporaryDirectory(prefix="loongforge-ranks-") as statuses:
        args.training_script = "loongforge.cluster.rank"
        args.training_script_args = ["--keep-output", statuses, *args.training_script_args]
        status = 0
        try:
            run(args)
        except ChildFailedError:
            status = 1
        except SignalException as exc:  # the pod is being stopped: torch's agent passed the signal on and waited
            status = 128 + int(exc.sigval)
        code, why = verdict(status, rank_statuses(Path(statuses)))
    print(f"[loongforge] pod exits with status {code}: {why}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
