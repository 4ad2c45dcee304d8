"""What the Slurm tests share: the tiny quickstart, submitting a job and waiting for it, and reading what a run
trained (a module of its own, not the conftest: ``from conftest import`` would find another directory's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
#: The quickstart made tiny: one layer, 32-token sequences, no sampling, every step logged, saves only at the end
#: (and on a signal).
TINY = ("model.overrides.num_layers=1", "data.seq_length=32", "training.micro_batch_size=2",
        "training.sample_tokens=0", "logging.interval=1", "logging.progress=false", "logging.tensorboard=false",
        "checkpoint.interval=0")
#: What a step trained: the metrics.jsonl fields that must match bit for bit (the rest are timings).
TRAINED = ("step", "loss", "grad_norm", "lr", "skipped")
#: The CLI of this environment (its Python is the one the scripts default to, so the jobs run it too).
LOONGFORGE = (sys.executable, "-m", "loongforge.cli")
#: Seconds any one job may take before the test gives up on it (and cancels it).
JOB_TIMEOUT = 600


def trained(metrics: Path) -> list[dict]:
    """Each line of a run's metrics.jsonl, reduced to :data:`TRAINED`."""
    return [{key: record.get(key) for key in TRAINED} for record in map(json.loads, metrics.read_text().splitlines())]


def reference_run(out: Path, *overrides: str) -> list[dict]:
    """The quickstart under ``loongforge train --nproc 2`` (no Slurm): what each step trained."""
    result = subprocess.run([*LOONGFORGE, "train", str(QUICKSTART), "--nproc", "2", *TINY, *overrides,
                             f"run.output_dir={out}"], capture_output=True, text=True, timeout=JOB_TIMEOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return trained(out / "metrics.jsonl")


def write_script(path: Path, *args: str) -> Path:
    """``loongforge launch slurm ARGS --write PATH`` (the user's command) for the quickstart."""
    result = subprocess.run([*LOONGFORGE, "launch", "slurm", str(QUICKSTART), *args, "--write", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return path


@dataclass
class Job:
    """A submitted ``sbatch --wait``: its id, and its process until it ends."""

    id: str
    sbatch: subprocess.Popen
    workdir: Path

    @classmethod
    def submit(cls, script: Path) -> Job:
        # The job inherits this environment (sbatch --export=ALL): SLURM_CONF, and one OpenMP thread per rank as in
        # the reference runs (the script's default too: 2 CPUs shared by 2 ranks).
        sbatch = subprocess.Popen(["sbatch", "--parsable", "--wait", str(script)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, cwd=script.parent,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
        job_id = sbatch.stdout.readline().strip().split(";")[0]
        assert job_id.isdigit(), sbatch.communicate()[1]
        return cls(job_id, sbatch, script.parent)

    def wait(self) -> int:
        """``sbatch --wait``'s status: the job's exit status once it has ended (after any requeues)."""
        try:
            self.sbatch.communicate(timeout=JOB_TIMEOUT)
        finally:
            if self.sbatch.poll() is None:
                subprocess.run(["scancel", self.id], timeout=30)
                self.sbatch.kill()
        return self.sbatch.returncode

    @property
    def batch_log(self) -> str:
        """The batch script's output, Slurm's slurm-JOBID.out in the working directory (appended across requeues)."""
        return (self.workdir / f"slurm-{self.id}.out").read_text()
