"""``python -m loongforge.cluster.rank LOG_DIR COMMAND...``: one rank of a scheduler's job, run as ``loongforge
COMMAND...`` in this process, with its output in ``LOG_DIR/rank-NNNNN.log`` and its exit status in
``LOG_DIR/rank-NNNNN.status`` (NNNNN: the global ``RANK`` torchrun gives it).

Why a wrapper: torchrun reports every worker that failed as its own status 1, whatever the worker returned, so a job
script cannot tell a run that saved and stopped on a preemption signal (status 3: requeue it) from a config error
(2: requeueing repeats it) or a crash. Each rank therefore leaves the status ``loongforge`` returned where the
script reads it (:mod:`loongforge.cluster.slurm`). A rank killed outright leaves none, which the script counts as a
crash. The same file gives every rank one log, named by its global rank and appended across torchrun restarts and
requeues (torchrun's own ``--log-dir`` makes a directory per attempt and local rank instead).

The command runs in this process, not a child, so the signals Slurm and torchrun send reach the training loop
directly.

``--keep-output`` leaves the output where it goes (a Kubernetes pod's log, :mod:`loongforge.cluster.agent`) and
records the status only. A rank whose previous attempt under the same torchrun (``TORCHELASTIC_RESTART_COUNT`` > 0)
recorded status 2 -- an error to fix, which a restart repeats -- exits 2 again at once, so torchrun's
``--max-restarts`` cannot spend minutes per restart loading a run that fails the same way.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path


def log_path(log_dir: Path, rank: int) -> Path:
    return log_dir / f"rank-{rank:05d}.log"


def status_path(log_dir: Path, rank: int) -> Path:
    return log_dir / f"rank-{rank:05d}.status"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    keep_output = bool(argv) and argv[0] == "--keep-output"
    argv = argv[1:] if keep_output else argv
    if len(argv) < 2 or "RANK" not in os.environ:
        print("usage: RANK=R python -m loongforge.cluster.rank [--keep-output] LOG_DIR COMMAND... (run by torchrun, "
              "which sets RANK)", file=sys.stderr)
        return 2
    log_dir, command = Path(argv[0]), argv[1:]
    rank = int(os.environ["RANK"])
    log_dir.mkdir(parents=True, exist_ok=True)
    status_file = status_path(log_dir, rank)
    if _failed_to_fix_before(status_file):
        print(f"[loongforge] rank {rank}: the previous attempt exited with status 2 (an error to fix, see its "
              "output); not running it again", file=sys.stderr, flush=True)
        return 2
    status_file.unlink(missing_ok=True)  # an earlier attempt's status must not speak for this one
    if not keep_output:
        _redirect_output(log_path(log_dir, rank), rank)

    from loongforge.cli import main as loongforge_main

    status = 1  # what Python exits with after an exception escapes
    try:
        status = loongforge_main(command)
    except SystemExit as exc:  # argparse's usage errors
        status = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        raise
    finally:
        _write_status(status_file, status)
    return status


def _failed_to_fix_before(status_file: Path) -> bool:
    """Whether this is a torchrun restart after which this rank's previous attempt recorded status 2."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0 or not status_file.is_file():
        return False
    try:
        return status_file.read_text(encoding="utf-8").strip() == "2"
    except OSError:
        return False


def _redirect_output(path: Path, rank: int) -> None:
    """Point this process's stdout and stderr (the file descriptors, so C libraries' output follows) at ``path``,
    appending, after a line saying which attempt of which job this is."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    job = os.environ.get("SLURM_JOB_ID", "-")
    print(f"[loongforge] rank {rank} on {socket.gethostname()}: job {job}, requeue "
          f"{os.environ.get('SLURM_RESTART_COUNT', '0')}, torchrun restart "
          f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", flush=True)


def _write_status(path: Path, status: int) -> None:
    """Write ``status`` so that a reader sees the whole number or no file (temporary file, then rename)."""
    partial = path.with_suffix(".status.tmp")
    partial.write_text(f"{status}\n", encoding="utf-8")
    os.replace(partial, path)


if __name__ == "__main__":
    sys.exit(main())
