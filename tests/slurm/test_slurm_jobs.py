"""The script ``loongforge launch slurm`` writes, submitted to a real Slurm (issue 20).

A one-node cluster with 2 CPUs (tests/slurm/cluster.sh: Debian's slurmctld, slurmd and munge on localhost) runs
``sbatch --wait`` of the generated script for the tiny quickstart with 2 ranks, and every step's loss, gradient
norm and learning rate must equal the same layout under ``loongforge train --nproc 2`` bit for bit:

* tp=2 and dp=2, uninterrupted (one node: one torchrun agent, ``--nproc-per-node 2``, c10d rendezvous on it);
* tp=2 preempted: once step 3 is in metrics.jsonl the job gets ``scancel --signal=USR1`` -- delivered to the job
  step's processes, as ``#SBATCH --signal=USR1@LEAD`` delivers Slurm's time-limit warning. Every rank saves at the
  next step boundary and exits 3, the script requeues the job (``scontrol requeue``), and the requeued job resumes
  from that checkpoint and finishes: the same losses as the uninterrupted run, each step once;
* an error to fix (an output directory under a regular file): every rank exits 2 and the job ends with status 2,
  not requeued.

What this does not test: several nodes (one machine), GPUs, and the time limit's own warning (it comes from
Slurm's once-every-30-seconds time-limit check; ``scancel --signal`` takes the same path to the processes).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from slurm_helpers import TINY, Job, reference_run, trained, write_script

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.distributed]

TP_STEPS, DP_STEPS = 120, 40


@pytest.fixture(scope="module")
def tp2_reference(tmp_path_factory) -> list[dict]:
    return reference_run(tmp_path_factory.mktemp("tp2-ref") / "run", "parallel.tp=2", f"training.steps={TP_STEPS}")


def _script(workdir: Path, *overrides: str, extra: tuple[str, ...] = ()) -> Path:
    """The script for one node x 2 ranks on the test node's 2 CPUs, writing the run under ``workdir/run``."""
    return write_script(workdir / "train.sbatch", "--nodes", "1", "--nproc-per-node", "2", "--cpus-per-task", "2",
                        "--chdir", str(workdir), *extra, *TINY, *overrides, f"run.output_dir={workdir / 'run'}")


def _statuses(workdir: Path, job: Job) -> list[str]:
    return [path.read_text().strip() for path in sorted((workdir / "run" / "slurm" / job.id).glob("rank-*.status"))]


def test_tp2_job_equals_nproc_2(slurm, tmp_path, tp2_reference):
    job = Job.submit(_script(tmp_path, "parallel.tp=2", f"training.steps={TP_STEPS}"))
    assert job.wait() == 0, job.batch_log
    assert "[loongforge] finished" in job.batch_log
    assert trained(tmp_path / "run" / "metrics.jsonl") == tp2_reference
    assert len(tp2_reference) == TP_STEPS
    assert _statuses(tmp_path, job) == ["0", "0"]
    logs = tmp_path / "run" / "slurm" / job.id
    assert "parallel: tp=2 pp=1 dp=1 (torchrun, world size 2)" in (logs / "rank-00000.log").read_text()
    assert "rank 1 on " in (logs / "rank-00001.log").read_text()


def test_dp2_job_equals_nproc_2(slurm, tmp_path):
    reference = reference_run(tmp_path / "ref", f"training.steps={DP_STEPS}")
    job = Job.submit(_script(tmp_path, f"training.steps={DP_STEPS}"))
    assert job.wait() == 0, job.batch_log
    assert trained(tmp_path / "run" / "metrics.jsonl") == reference
    assert len(reference) == DP_STEPS
    log = (tmp_path / "run" / "slurm" / job.id / "rank-00000.log").read_text()
    assert "parallel: tp=1 pp=1 dp=2 (torchrun, world size 2)" in log


def test_preempted_job_is_requeued_and_resumes_bit_exactly(slurm, tmp_path, tp2_reference):
    job = Job.submit(_script(tmp_path, "parallel.tp=2", f"training.steps={TP_STEPS}"))
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and '"step": 3,' in metrics.read_text()):
        assert job.sbatch.poll() is None and time.monotonic() < deadline, "the job ended before step 3"
        time.sleep(0.1)
    signal = subprocess.run(["scancel", "--signal=USR1", job.id], capture_output=True, text=True, timeout=60)
    assert signal.returncode == 0, signal.stderr

    assert job.wait() == 0, job.batch_log
    log = job.batch_log
    assert "[loongforge] preempted (saved a checkpoint): requeueing (requeue 1 of 10)" in log
    assert f"[loongforge] job {job.id}, run 2:" in log
    assert log.rstrip().endswith(f"[loongforge] finished; rank logs in {tmp_path / 'run' / 'slurm' / job.id}")

    rank0 = (tmp_path / "run" / "slurm" / job.id / "rank-00000.log").read_text()
    saved = [int(line.split(" at step ")[1].split()[0]) for line in rank0.splitlines()
             if line.startswith("[loongforge] preempted by SIGUSR1 at step ")]
    assert len(saved) == 1 and 3 <= saved[0] < TP_STEPS, rank0
    assert f"resumed from {tmp_path / 'run' / 'checkpoints' / f'step-{saved[0]:07d}'} at step {saved[0]}" in rank0
    assert "requeue 1, torchrun restart 0" in rank0
    assert trained(metrics) == tp2_reference  # every step once, the uninterrupted run's numbers


def test_error_to_fix_is_not_requeued(slurm, tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    job = Job.submit(write_script(tmp_path / "train.sbatch", "--nproc-per-node", "2", "--chdir", str(tmp_path),
                                  "--log-dir", str(tmp_path / "logs"), *TINY, f"run.output_dir={blocker / 'run'}"))
    assert job.wait() == 2, job.batch_log
    assert "a rank exited with status 2 (an error to fix" in job.batch_log
    assert "requeueing" not in job.batch_log and ", run 2:" not in job.batch_log
    logs = tmp_path / "logs" / job.id
    assert (logs / "rank-00000.status").read_text() == "2\n"
    # rank 1 may have been stopped by torchrun after rank 0 exited: then it left no status
    assert {path.read_text() for path in logs.glob("rank-*.status")} == {"2\n"}
    errors = [line for line in (logs / "rank-00000.log").read_text().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "run.output_dir" in errors[0], errors
