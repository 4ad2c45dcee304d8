"""``loongforge launch slurm CONFIG``: an sbatch script that trains CONFIG on N nodes, requeued when preempted.

What the script does, and why each piece is there:

* **One torchrun agent per node** (``srun --ntasks-per-node=1``), each starting ``--nproc-per-node`` ranks, with
  c10d rendezvous on the node the batch script runs on (``SLURMD_NODENAME``, the allocation's first node) at a port
  derived from the job id and checked there before use: the first free port from ``20000 + job id % 10000`` on, so
  two jobs on one head node do not collide even when their ids agree modulo 10000, nor with a port another program
  holds (``--rdzv-port`` pins it). ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives every torchrun restart a fresh
  store on every node (docs/reliability.md, "Elastic restarts").
* **Preemption.** ``#SBATCH --signal=USR1@LEAD`` has Slurm send SIGUSR1 to every process of the job step -- the
  agents and the ranks, not the batch shell -- LEAD seconds before the time limit; scancel and a preempting job send
  SIGTERM (to the batch shell too; the ranks then have Slurm's KillWait or GraceTime to save). Each rank saves at
  its next step boundary and exits 3 (``checkpoint.save_on_signal``). torchrun is told to handle SIGUSR1 as well as
  its usual signals and to wait ``--shutdown-timeout`` for the ranks instead of killing them (given as its ``PET_*``
  variables, which a torch older than those flags ignores). The batch shell ignores SIGUSR1, so a
  ``scancel --full --signal=USR1`` cannot end the script mid-save.
* **Requeue.** torchrun turns every failed worker into its own status 1, so the ranks run under
  :mod:`loongforge.cluster.rank`, which leaves each rank's real status next to its log. After ``srun``: 0 ends the
  job; a status 2 on any rank (an error to fix: requeueing would repeat it) ends it with 2; a preempted run (3)
  or a crash is requeued with ``scontrol requeue`` while ``SLURM_RESTART_COUNT`` is below ``--max-requeues``. The
  requeued job resumes from the newest checkpoint that verifies (``checkpoint.resume=auto`` is always passed) and
  finishes bit-exactly; once training is done a rerun prints "nothing to do" and exits 0.
* **Logs.** The batch log is Slurm's ``slurm-JOBID.out`` in the job's working directory (appended across
  requeues): the script's own lines and the agents'. Each rank writes ``LOG_DIR/JOBID/rank-NNNNN.log`` (global
  rank), appended across torchrun restarts and requeues.
* **Devices.** ``--gpus-per-node G`` asks Slurm for G GPUs per node and starts G ranks per node; without it the
  job asks for none and the config's ``device`` decides (``auto``: the CPU, over gloo, when no accelerator is
  visible). OpenMP threads are the node's CPUs (``--cpus-per-task``) divided among its ranks. Without
  ``--cpus-per-task`` the job asks for ``training.threads`` CPUs per rank (one per rank when that is unset and no
  GPUs are asked for: Slurm's own default, one CPU for the whole task, would put every rank on it); a GPU job with
  neither gets the site's default (``DefCpuPerGPU``).

The config is loaded and its layout checked for N x P ranks before anything is printed, so a mistake is one
``error:`` line here rather than a job that fails in the queue. Nothing here talks to Slurm.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loongforge.cluster.layout import check_layout
from loongforge.config import load_config
from loongforge.errors import ConfigError

#: Signals torchrun passes on to its ranks: its defaults plus SIGUSR1, Slurm's warning before the time limit.
SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
#: Seconds of the warning kept back from torchrun's shutdown timeout, for the ranks to exit and the script to requeue.
SHUTDOWN_MARGIN = 10
#: The rendezvous port is the first one free on the first node from ``RDZV_PORT_BASE + job id % RDZV_PORT_SPAN`` on
#: (wrapping within the span) unless ``--rdzv-port`` is given.
RDZV_PORT_BASE, RDZV_PORT_SPAN = 20000, 10000
#: Slurm's ``--time`` formats: minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
_TIME = re.compile(r"^(\d+-)?\d+(:\d+){0,2}$")


@dataclass(frozen=True)
class SlurmJob:
    """What the script is made from, every value already checked."""

    config: str  #: the config path as given (relative paths are relative to ``chdir``)
    overrides: tuple[str, ...]  #: the user's overrides, then ``checkpoint.resume=auto``
    job_name: str
    nodes: int
    nproc_per_node: int
    gpus_per_node: int | None
    cpus_per_task: int | None
    time: str | None
    partition: str | None
    account: str | None
    chdir: str
    log_dir: str
    python: str
    requeue: bool
    max_requeues: int
    signal_lead_s: int
    shutdown_timeout_s: int
    max_restarts: int
    rdzv_port: int | None


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("Prints the script (or writes it with --write); submit it with sbatch. Checkpoints and LOG_DIR "
                     "must be on storage every node sees. See docs/cluster.md.")
    parser.add_argument("config", help="the run's YAML config (read here to check it; the job reads it from --chdir)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. training.steps=50")
    parser.add_argument("--nodes", type=int, default=1, metavar="N", help="nodes, one torchrun agent each (default 1)")
    parser.add_argument("--nproc-per-node", type=int, metavar="P",
                        help="ranks per node (default: --gpus-per-node; required without it)")
    parser.add_argument("--gpus-per-node", type=int, metavar="G", help="GPUs to ask for on each node (default: none)")
    parser.add_argument("--cpus-per-task", type=int, metavar="C",
                        help="CPUs of each node for its agent and ranks (#SBATCH --cpus-per-task; default: "
                             "training.threads per rank, else one per rank without --gpus-per-node)")
    parser.add_argument("--time", help="time limit, in Slurm's format (e.g. 4:00:00 or 2-00:00:00)")
    parser.add_argument("--partition", help="partition (#SBATCH --partition)")
    parser.add_argument("--account", help="account to charge (#SBATCH --account)")
    parser.add_argument("--job-name", help="job name (default: run.name)")
    parser.add_argument("--chdir", help="the job's working directory (default: this one)")
    parser.add_argument("--log-dir", help="where each job's rank logs go, as LOG_DIR/JOBID/rank-NNNNN.log "
                                          "(default: RUN_OUTPUT_DIR/slurm)")
    parser.add_argument("--python", default=sys.executable,
                        help="the Python with LoongForge installed, on every node (default: this one, "
                             f"{sys.executable})")
    parser.add_argument("--requeue", action=argparse.BooleanOptionalAction, default=True,
                        help="requeue the job when it is preempted or crashes (default: yes)")
    parser.add_argument("--max-requeues", type=int, default=10, metavar="R",
                        help="stop requeueing after R requeues of the job (SLURM_RESTART_COUNT; default 10)")
    parser.add_argument("--signal-lead-s", type=int, default=90, metavar="S",
                        help="send SIGUSR1 S seconds before the time limit, for the preemption save (default 90)")
    parser.add_argument("--shutdown-timeout-s", type=int, metavar="S",
                        help="how long torchrun waits for signalled ranks to save and exit before it kills them "
                             f"(default: the signal lead minus {SHUTDOWN_MARGIN})")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="torchrun restarts of crashed ranks inside the allocation, before a requeue (default 0)")
    parser.add_argument("--rdzv-port", type=int, metavar="PORT",
                        help=f"rendezvous port on the first node (default: the first one free there from "
                             f"{RDZV_PORT_BASE} + job id %% {RDZV_PORT_SPAN} on)")
    parser.add_argument("--write", metavar="PATH", help="write the script to PATH (executable) instead of printing it")


def run(args: argparse.Namespace) -> int:
    script = render(job_from(args))
    if args.write is None:
        sys.stdout.write(script)
        return 0
    path = Path(args.write)
    try:
        path.write_text(script, encoding="utf-8")
        path.chmod(0o755)
    except OSError as exc:
        raise ConfigError(f"--write {args.write}: {exc.strerror}") from exc
    print(f"wrote {path}; submit it with: sbatch {shlex.quote(str(path))}", file=sys.stderr)
    return 0


def job_from(args: argparse.Namespace) -> SlurmJob:
    """Check the flags and the config (as ``train`` checks it on N x P ranks); one ``ConfigError`` if not."""
    nproc = args.nproc_per_node if args.nproc_per_node is not None else args.gpus_per_node
    if nproc is None:
        raise ConfigError("--nproc-per-node is required without --gpus-per-node (ranks per node)")
    lead = args.signal_lead_s
    shutdown = args.shutdown_timeout_s if args.shutdown_timeout_s is not None else lead - SHUTDOWN_MARGIN
    for flag, value, least in (("--nodes", args.nodes, 1), ("--nproc-per-node", nproc, 1),
                               ("--gpus-per-node", args.gpus_per_node, 1), ("--cpus-per-task", args.cpus_per_task, 1),
                               ("--max-requeues", args.max_requeues, 0), ("--signal-lead-s", lead, 1),
                               ("--shutdown-timeout-s", shutdown, 1), ("--max-restarts", args.max_restarts, 0),
                               ("--rdzv-port", args.rdzv_port, 1)):
        if value is not None and value < least:
            raise ConfigError(f"{flag} must be >= {least}, got {value}")
    if shutdown >= lead:
        raise ConfigError(f"--shutdown-timeout-s {shutdown} must be below --signal-lead-s {lead}: torchrun must have "
                          "stopped before the time limit, for the script to requeue the job")
    if args.rdzv_port is not None and args.rdzv_port > 65535:
        raise ConfigError(f"--rdzv-port must be <= 65535, got {args.rdzv_port}")
    if args.time is not None and not _TIME.match(args.time):
        raise ConfigError(f"--time {args.time!r} is not a Slurm time limit (minutes, H:M:S, or D-H:M:S)")
    for item in args.overrides:
        key, _, value = item.partition("=")
        if key.strip() == "checkpoint.resume" and value.strip() != "auto":
            raise ConfigError(f"override {item!r}: a requeued job resumes from its newest checkpoint, so launch slurm "
                              "always passes checkpoint.resume=auto")

    overrides = (*args.overrides, "checkpoint.resume=auto")
    config = load_config(args.config, overrides)
    check_layout(config, args.nodes * nproc)
    cpus = args.cpus_per_task if args.cpus_per_task is not None else default_cpus(config, nproc, args.gpus_per_node)
    chdir = args.chdir if args.chdir is not None else os.getcwd()
    job_name = args.job_name if args.job_name is not None else config.run.name
    for flag, value in (("--job-name" if args.job_name is not None else f"run.name in {config.source} (the job name)",
                         job_name), ("--partition", args.partition), ("--account", args.account), ("--chdir", chdir)):
        if value is not None and (not value or any(c.isspace() for c in value)):
            raise ConfigError(f"{flag} {value!r} cannot be an #SBATCH value: it is empty or holds whitespace")
    return SlurmJob(config=args.config, overrides=overrides, job_name=job_name,
                    nodes=args.nodes, nproc_per_node=nproc, gpus_per_node=args.gpus_per_node,
                    cpus_per_task=cpus, time=args.time, partition=args.partition,
                    account=args.account, chdir=chdir,
                    log_dir=args.log_dir if args.log_dir is not None else f"{config.run.output_dir}/slurm",
                    python=args.python, requeue=args.requeue, max_requeues=args.max_requeues if args.requeue else 0,
                    signal_lead_s=lead, shutdown_timeout_s=shutdown, max_restarts=args.max_restarts,
                    rdzv_port=args.rdzv_port)



def default_cpus(config: Any, nproc: int, gpus_per_node: int | None) -> int | None:
    """``--cpus-per-task`` when it is not given: ``training.threads`` per rank; one per rank for a CPU job without
    it; ``None`` (the site's default per GPU) for a GPU job without it."""
    if config.training.threads:
        return nproc * config.training.threads
    return nproc if gpus_per_node is None else None


#: Prints the first port from ``argv[1]`` on (wrapping within the job-id range) that nothing on this node holds;
#: ``argv[1]`` itself when all of the 200 tried are taken, so that torchrun's own error names it.
_FREE_PORT = f"""\
import socket, sys
first = int(sys.argv[1])
for i in range(200):
    port = {RDZV_PORT_BASE} + (first - {RDZV_PORT_BASE} + i) % {RDZV_PORT_SPAN}
    with socket.socket() as probe:
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            continue
    print(port)
    break
else:
    print(first)
"""


def _directives(job: SlurmJob) -> list[str]:
    options: list[tuple[str, object | None]] = [
        ("job-name", job.job_name), ("nodes", job.nodes), ("ntasks-per-node", 1),
        ("cpus-per-task", job.cpus_per_task), ("gpus-per-node", job.gpus_per_node), ("time", job.time),
        ("partition", job.partition), ("account", job.account), ("chdir", job.chdir), ("open-mode", "append"),
        ("signal", f"USR1@{job.signal_lead_s}"),
    ]
    lines = [f"#SBATCH --{name}={value}" for name, value in options if value is not None]
    return [*lines, "#SBATCH --requeue" if job.requeue else "#SBATCH --no-requeue"]


def _thread_count(job: SlurmJob) -> str:
    """OpenMP threads per rank: the node's CPUs (``--cpus-per-task``) shared by its ranks, at least one."""
    if job.cpus_per_task is None:
        return "1"
    return str(max(1, job.cpus_per_task // job.nproc_per_node))


def _verdict(job: SlurmJob) -> str:
    """The shell that ends the job after srun: done, an error to fix, or preempted/crashed -> requeue (capped)."""
    stop = ('echo "[loongforge] $why: not requeued (--no-requeue); submit the script again to resume"'
            if not job.requeue else
            'echo "[loongforge] $why: not requeued ($restarts of $max_requeues requeues done); '
            'submit the script again to resume"')
    requeue = "" if not job.requeue else """\
if [ "$restarts" -lt "$max_requeues" ]; then
    echo "[loongforge] $why: requeueing (requeue $((restarts + 1)) of $max_requeues) to resume from the checkpoint"
    scontrol requeue "$SLURM_JOB_ID" && exit "$status"
fi
"""
    return f"""\
statuses=" $(cat "$logs"/rank-*.status 2>/dev/null | tr '\\n' ' ')"
if [ "$status" -eq 0 ]; then
    echo "[loongforge] finished; rank logs in $logs"
    exit 0
elif [[ $statuses == *" 2 "* ]]; then
    echo "[loongforge] a rank exited with status 2 (an error to fix, see $logs): not requeued"
    exit 2
elif [[ $statuses == *" 3 "* ]]; then
    why="preempted (saved a checkpoint)" status=3
else
    why="crashed (torchrun status $status, rank statuses:${{statuses% }})"
fi
{requeue}{stop}
exit "$status"
"""


def render(job: SlurmJob) -> str:
    """The sbatch script for ``job``."""
    q = shlex.quote
    world = job.nodes * job.nproc_per_node
    first_port = f"$(({RDZV_PORT_BASE} + SLURM_JOB_ID % {RDZV_PORT_SPAN}))"
    port = (str(job.rdzv_port) if job.rdzv_port is not None
            else f'$("$python" - {first_port} <<\'PORT\'\n{_FREE_PORT}PORT\n)')
    srun_cpus = f" --cpus-per-task={job.cpus_per_task}" if job.cpus_per_task is not None else ""
    train = " ".join(q(part) for part in ("train", job.config, *job.overrides))
    header = "\n".join(_directives(job))
    requeues = (f"Preempted or crashed, the job is requeued up to {job.max_requeues} times" if job.requeue
                else "Preempted or crashed, the job is not requeued (--no-requeue)")
    return f"""\
#!/bin/bash
# Written by `loongforge launch slurm`: {job.config} on {job.nodes} node(s) x {job.nproc_per_node} rank(s) = {world}.
# Submit with sbatch. Batch log: slurm-JOBID.out in the working directory; rank logs: {job.log_dir}/JOBID/.
# {requeues} (docs/cluster.md); resubmitting resumes too.
{header}
set -u

python={q(job.python)}
logs={q(job.log_dir)}/"$SLURM_JOB_ID"
max_requeues={job.max_requeues}
restarts=${{SLURM_RESTART_COUNT:-0}}

trap '' USR1  # SIGUSR1 is for the ranks: a signal to the whole job must not end this script mid-save
mkdir -p "$logs"
rm -f "$logs"/rank-*.status
# the rendezvous host is this node (Slurm runs the batch script on the allocation's first node), where its port
# is checked free
head=${{SLURMD_NODENAME:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}}
port={port}
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # a fresh rendezvous store for each torchrun restart, on every node
export PET_SIGNALS_TO_HANDLE={SIGNALS} PET_SHUTDOWN_TIMEOUT={job.shutdown_timeout_s}
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-{_thread_count(job)}}}
echo "[loongforge] job $SLURM_JOB_ID, run $((restarts + 1)): $SLURM_NNODES node(s) x {job.nproc_per_node} rank(s), \\
rendezvous $head:$port, rank logs in $logs"

srun --ntasks-per-node=1{srun_cpus} \\
    "$python" -m torch.distributed.run \\
    --nnodes="$SLURM_NNODES" --nproc-per-node={job.nproc_per_node} \\
    --rdzv-backend=c10d --rdzv-endpoint="$head:$port" --rdzv-id="$SLURM_JOB_ID" \\
    --max-restarts={job.max_restarts} \\
    -m loongforge.cluster.rank "$logs" \\
    {train}
status=$?
{_verdict(job)}"""
