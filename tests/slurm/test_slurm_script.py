"""``loongforge launch slurm`` without a cluster: the script's options and its decisions, refusals, the shipped
recipe, and the per-rank wrapper (issue 20). These need no Slurm daemons (unmarked: ``nox -s tests`` runs them);
test_slurm_jobs.py submits the same scripts to a real Slurm.

The decisions after ``srun`` -- end, requeue, or stop requeueing -- are run in bash against stand-ins for ``srun``
and ``scontrol`` on PATH: ``srun`` records the command line and environment it was given and leaves the rank
statuses the case calls for, ``scontrol`` names two nodes and records a requeue. Each case of the table runs the
real generated script.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from loongforge.cli import main
from slurm_helpers import QUICKSTART, REPO

RECIPE = REPO / "launch" / "slurm" / "quickstart-2x8.sbatch"


def _launch(capsys, *args: str) -> tuple[int, str, str]:
    status = main(["launch", "slurm", *args])
    out, err = capsys.readouterr()
    return status, out, err


def _directives(script: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([a-z-]+)(?:=(.*))?$", script, flags=re.M))


def test_shipped_recipe_is_what_its_command_writes(capsys, monkeypatch, tmp_path):
    readme = (RECIPE.parent / "README.md").read_text()
    block = re.search(r"```bash\n(loongforge launch slurm .*?)\n```", readme, re.S)[1]
    command = shlex.split(block.replace("\\\n", ""))
    assert command[-2:] == ["--write", "launch/slurm/quickstart-2x8.sbatch"]
    monkeypatch.chdir(REPO)
    assert main([*command[1:-2], "--write", str(tmp_path / "again.sbatch")]) == 0
    assert (tmp_path / "again.sbatch").read_text() == RECIPE.read_text()
    assert os.access(tmp_path / "again.sbatch", os.X_OK)


def test_two_gpu_nodes(capsys):
    script = RECIPE.read_text()
    subprocess.run(["bash", "-n", str(RECIPE)], check=True)
    assert _directives(script) == {
        "job-name": "quickstart", "nodes": "2", "ntasks-per-node": "1", "cpus-per-task": "64", "gpus-per-node": "8",
        "time": "4:00:00", "chdir": "/shared/loongforge", "open-mode": "append", "signal": "USR1@90", "requeue": ""}
    assert "--nproc-per-node=8" in script and "--max-restarts=2" in script
    assert "OMP_NUM_THREADS:-8}" in script  # 64 CPUs shared by 8 ranks


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["launch", "slurm", "--help"])
    out = capsys.readouterr().out
    assert exited.value.code == 0
    for option in ("--nodes", "--nproc-per-node", "--gpus-per-node", "--time", "--partition", "--account",
                   "--log-dir", "--no-requeue", "--max-requeues", "--signal-lead-s", "--max-restarts", "--write"):
        assert option in out
    assert "(default: the first one free there from 20000 + job id % 10000 on)" in " ".join(out.split())


def test_cpu_job_asks_for_no_gpus_and_shares_its_cpus(capsys):
    status, script, _ = _launch(capsys, str(QUICKSTART), "--nodes", "3", "--nproc-per-node", "4", "--cpus-per-task",
                                "16", "--no-requeue", "--partition", "cpu", "--account", "proj", "--job-name", "tiny",
                                "--signal-lead-s", "120", "training.steps=5")
    assert status == 0
    directives = _directives(script)
    assert "gpus-per-node" not in directives and directives["no-requeue"] == ""
    assert (directives["nodes"], directives["partition"], directives["account"], directives["job-name"],
            directives["signal"]) == ("3", "cpu", "proj", "tiny", "USR1@120")
    assert "OMP_NUM_THREADS:-4}" in script and "PET_SHUTDOWN_TIMEOUT=110" in script
    assert "scontrol requeue" not in script


@pytest.fixture
def fake_slurm(tmp_path):
    """Stand-ins for srun and scontrol (see the module docstring); returns the directory they record into."""
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record.mkdir()
    (bin_dir / "srun").write_text(textwrap.dedent(f"""\
        #!/bin/bash
        printf '%s\\n' "$@" > {record}/srun-args
        env > {record}/srun-env
        logs=$(printf '%s\\n' "$@" | grep -A1 -x loongforge.cluster.rank | tail -n 1)
        rank=0
        for status in $FAKE_STATUSES; do
            [ "$status" = - ] || echo "$status" > "$logs/rank-0000$rank.status"
            rank=$((rank + 1))
        done
        exit "$FAKE_SRUN_EXIT"
        """))
    (bin_dir / "scontrol").write_text(textwrap.dedent(f"""\
        #!/bin/bash
        case "$1" in
            show) printf 'node1\\nnode2\\n' ;;
            requeue) echo "$2" > {record}/requeued ;;
        esac
        """))
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    return record


def _run_script(script: Path, workdir: Path, *, statuses: str, srun_exit: int, restarts: int | None = None):
    env = {**os.environ, "PATH": f"{workdir / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_ID": "4321",
           "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NNODES": "2", "FAKE_STATUSES": statuses,
           "FAKE_SRUN_EXIT": str(srun_exit)}
    env.pop("OMP_NUM_THREADS", None)
    if restarts is not None:
        env["SLURM_RESTART_COUNT"] = str(restarts)
    return subprocess.run(["bash", str(script)], cwd=workdir, env=env, capture_output=True, text=True, timeout=60)


#: (srun's status, each rank's status or - for none, SLURM_RESTART_COUNT, --requeue) -> (job status, requeued?,
#: the script's last line)
CASES = {
    "finished": ((0, "0 0", None, True), (0, False, "[loongforge] finished")),
    "preempted": ((1, "3 3", None, True), (3, True, "preempted (saved a checkpoint): requeueing (requeue 1 of 4)")),
    "preempted, the other rank stopped by torchrun": ((1, "3 -", 2, True), (3, True, "requeueing (requeue 3 of 4)")),
    "an error to fix": ((1, "2 -", None, True), (2, False, "a rank exited with status 2 (an error to fix")),
    "crashed": ((1, "1 -", None, True), (1, True, "crashed (torchrun status 1, rank statuses: 1): requeueing")),
    "killed outright": ((137, "- -", None, True), (137, True, "crashed (torchrun status 137, rank statuses:)")),
    "out of requeues": ((1, "3 3", 4, True), (3, False, "not requeued (4 of 4 requeues done)")),
    "--no-requeue": ((1, "3 3", None, False), (3, False, "not requeued (--no-requeue)")),
}


@pytest.mark.parametrize("case", CASES)
def test_what_the_script_does_after_srun(case, capsys, tmp_path, fake_slurm):
    (srun_exit, statuses, restarts, requeue), (status, requeued, last_line) = CASES[case]
    script = tmp_path / "job.sbatch"
    assert main(["launch", "slurm", str(QUICKSTART), "--nodes", "2", "--nproc-per-node", "1", "--cpus-per-task", "2",
                 "--max-requeues", "4", "--log-dir", str(tmp_path / "logs"), "--rdzv-port", "29400",
                 "--requeue" if requeue else "--no-requeue", "--write", str(script), "training.steps=5"]) == 0
    result = _run_script(script, tmp_path, statuses=statuses, srun_exit=srun_exit, restarts=restarts)
    assert result.returncode == status, result.stdout + result.stderr
    assert last_line in result.stdout.splitlines()[-1]
    assert (fake_slurm / "requeued").exists() == requeued
    if requeued:
        assert (fake_slurm / "requeued").read_text() == "4321\n"

    args = (fake_slurm / "srun-args").read_text().splitlines()
    assert args == ["--ntasks-per-node=1", "--cpus-per-task=2", sys.executable, "-m", "torch.distributed.run",
                    "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", "--rdzv-endpoint=node1:29400",
                    "--rdzv-id=4321", "--max-restarts=0", "-m", "loongforge.cluster.rank",
                    f"{tmp_path / 'logs'}/4321", "train", str(QUICKSTART), "training.steps=5",
                    "checkpoint.resume=auto"]
    env = dict(line.split("=", 1) for line in (fake_slurm / "srun-env").read_text().splitlines() if "=" in line)
    assert (env["PET_SIGNALS_TO_HANDLE"], env["PET_SHUTDOWN_TIMEOUT"], env["OMP_NUM_THREADS"],
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"]) == ("SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "80", "2", "1")


def test_rendezvous_port_follows_the_job_id(capsys, tmp_path, fake_slurm):
    script = tmp_path / "job.sbatch"
    assert main(["launch", "slurm", str(QUICKSTART), "--nproc-per-node", "2", "--write", str(script)]) == 0
    _run_script(script, tmp_path, statuses="0 0", srun_exit=0)
    assert "--rdzv-endpoint=node1:24321" in (fake_slurm / "srun-args").read_text().splitlines()


@pytest.mark.parametrize(("args", "message"), [
    ((), "--nproc-per-node is required without --gpus-per-node"),
    (("--nproc-per-node", "0"), "--nproc-per-node must be >= 1, got 0"),
    (("--gpus-per-node", "8", "--nodes", "0"), "--nodes must be >= 1, got 0"),
    (("--nproc-per-node", "2", "--signal-lead-s", "30", "--shutdown-timeout-s", "30"),
     "--shutdown-timeout-s 30 must be below --signal-lead-s 30"),
    (("--nproc-per-node", "2", "--time", "4h"), "--time '4h' is not a Slurm time limit"),
    (("--nproc-per-node", "2", "--rdzv-port", "70000"), "--rdzv-port must be <= 65535"),
    (("--nproc-per-node", "2", "checkpoint.resume=never"), "always passes checkpoint.resume=auto"),
    (("--nproc-per-node", "2", "parallel.tp=3"), "quickstart.yaml: tp*pp*cp*dp must equal the 2 processes"),
    (("--nodes", "2", "--gpus-per-node", "2", "parallel.tp=8"), "must equal the 4 processes"),
    (("--nproc-per-node", "2", "training.stepz=3"), "training.stepz"),
    (("--nproc-per-node", "2", "--bogus"), "unrecognized arguments: --bogus"),
    (("--nproc-per-node", "2", "--partition", "gpu large"), "--partition 'gpu large' cannot be an #SBATCH value"),
    (("--nproc-per-node", "2", "run.name=my run"), "run.name in "),
    (("--nproc-per-node", "2", "--write", "/nonexistent/dir/job.sbatch"), "--write /nonexistent/dir/job.sbatch"),
])
def test_mistakes_are_one_line(capsys, args, message):
    status, out, err = _launch(capsys, str(QUICKSTART), *args)
    assert status == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and message in err, err


def test_rank_wrapper_logs_and_records_the_status(tmp_path):
    env = {**os.environ, "RANK": "3"}
    done = subprocess.run([sys.executable, "-m", "loongforge.cluster.rank", str(tmp_path), "list", "models"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "" and done.stderr == ""
    log = (tmp_path / "rank-00003.log").read_text()
    assert log.startswith("[loongforge] rank 3 on ") and "llama-tiny" in log
    assert (tmp_path / "rank-00003.status").read_text() == "0\n"

    env["RANK"] = "0"
    failed = subprocess.run([sys.executable, "-m", "loongforge.cluster.rank", str(tmp_path), "train",
                             str(tmp_path / "missing.yaml")], env=env, capture_output=True, text=True, timeout=120)
    assert failed.returncode == 2
    errors = [line for line in (tmp_path / "rank-00000.log").read_text().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "missing.yaml" in errors[0]
    assert (tmp_path / "rank-00000.status").read_text() == "2\n"
