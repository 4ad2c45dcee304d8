"""What the launchers ask the schedulers for, and what they restart (issue 45, item 8).

Measured on main: ``loongforge launch k8s`` pods requested no CPU or memory unless ``--cpu``/``--memory`` were given
(BestEffort pods: placed anywhere, evicted first); a config error (``loongforge`` status 2) was retried by JobSet and
PyTorchJob, because torchrun turns every failed worker into its own status 1; the sbatch rendezvous port
(``20000 + job id % 10000``) collided for two jobs on one head node whose ids agree modulo 10000; a job without
``--cpus-per-task`` got Slurm's default of one CPU for all its ranks.

Now the pods request CPU and memory from the config by default; each pod runs torchrun under
``loongforge.cluster.agent``, which exits 2 when a rank did (and a restart attempt of such a rank ends at once), and
the manifests' failure policies never restart a 2; the sbatch script takes the first port free on the head node from
the job's own on; a CPU job asks for a CPU per rank (``training.threads`` per rank when set).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from loongforge.cli import main
from loongforge.cluster.agent import PREEMPTED, RESTART, verdict

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")


def _k8s(capsys, *args: str) -> dict:
    assert main(["launch", "k8s", QUICKSTART, "--nodes", "1", "--gpus-per-node", "2", "--image", "img:1",
                 "--checkpoint-pvc", "ck", *args]) == 0
    _, workload = yaml.safe_load_all(capsys.readouterr().out)
    return workload


def _requests(workload: dict) -> dict:
    if workload["kind"] == "TrainJob":
        return workload["spec"]["trainer"]["resourcesPerNode"]["requests"]
    spec = workload["spec"]
    pod = (spec["replicatedJobs"][0]["template"]["spec"]["template"]["spec"] if workload["kind"] == "JobSet"
           else spec["pytorchReplicaSpecs"]["Master"]["template"]["spec"])
    return pod["containers"][0]["resources"]["requests"]


@pytest.mark.parametrize("kind", ["jobset", "pytorchjob", "trainjob"])
def test_pods_request_cpu_and_memory_from_the_config(kind, capsys):
    assert _requests(_k8s(capsys, "--kind", kind)) == {"cpu": "8", "memory": "32Gi"}  # 2 ranks x (4 CPUs, 16 GiB)
    assert _requests(_k8s(capsys, "--kind", kind, "training.threads=6")) == {"cpu": "12", "memory": "32Gi"}
    assert _requests(_k8s(capsys, "--kind", kind, "--cpu", "30", "--memory", "100Gi")) == {"cpu": "30",
                                                                                          "memory": "100Gi"}


def test_the_failure_policies_never_restart_an_error_to_fix(capsys):
    jobset = _k8s(capsys)
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    (container,) = job["template"]["spec"]["containers"]
    assert container["command"] == ["python3", "-m", "loongforge.cluster.agent"]
    assert {"action": "FailJob", "onExitCodes": {"containerName": container["name"], "operator": "In",
                                                 "values": [2]}} in job["podFailurePolicy"]["rules"]
    first = jobset["spec"]["failurePolicy"]["rules"][0]  # the first matching rule applies: before the restarts
    assert first["action"] == "FailJobSet" and first["onJobFailureReasons"] == ["PodFailurePolicy"]
    # the Job controller's message for a pod failing the exit-code rule above (rule index 1)
    message = f"Container {container['name']} for pod ns/x-node-0-0-abcde failed with exit code 2 matching FailJob " \
              "rule at index 1"
    assert any(pattern in message for pattern in first["onJobFailureMessagePatterns"])
    pytorchjob = _k8s(capsys, "--kind", "pytorchjob")
    for replica in pytorchjob["spec"]["pytorchReplicaSpecs"].values():
        assert replica["restartPolicy"] == "ExitCode"  # Kubeflow retries statuses above 127 only
        assert replica["template"]["spec"]["containers"][0]["command"] == container["command"]
    assert (PREEMPTED, RESTART) == (143, 134) and min(PREEMPTED, RESTART) > 127


def test_the_pod_status_says_what_the_ranks_did():
    assert verdict(0, [0, 0])[0] == 0
    assert verdict(1, [2])[0] == 2 and verdict(1, [3, 2])[0] == 2  # an error to fix wins
    assert verdict(143, [3, 3]) == (PREEMPTED, "preempted: the ranks saved a checkpoint; a restart resumes from it")
    assert verdict(1, [4])[0] == RESTART and verdict(1, [])[0] == RESTART  # a hang, a rank killed outright


def test_a_config_error_ends_the_pod_with_2_and_torchrun_restarts_cost_nothing(tmp_path):
    """The pod's command for real (one rank, torchrun's ``--max-restarts 2``), on a config that does not exist:
    plain torchrun exits 1, the agent 2; the restarted attempts stop at once instead of loading everything again."""
    torchrun = ["--standalone", "--nproc-per-node", "1", "--module", "loongforge.cli", "train",
                str(tmp_path / "missing.yaml")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    plain = subprocess.run([sys.executable, "-m", "torch.distributed.run", *torchrun], capture_output=True, text=True,
                           timeout=300, env=env)
    assert plain.returncode == 1  # what JobSet and PyTorchJob saw: a crash like any other
    agent = subprocess.run([sys.executable, "-m", "loongforge.cluster.agent", "--max-restarts", "2", *torchrun],
                           capture_output=True, text=True, timeout=300, env=env)
    output = agent.stdout + agent.stderr
    assert agent.returncode == 2, output[-3000:]
    assert output.count("missing.yaml") >= 1 and output.count("error: ") == 1, output[-3000:]
    assert output.count("the previous attempt exited with status 2 (an error to fix") == 2, output[-3000:]
    assert "[loongforge] pod exits with status 2: a rank exited with status 2 (an error to fix)" in output


def _script(tmp_path: Path, *args: str) -> str:
    script = tmp_path / "job.sbatch"
    assert main(["launch", "slurm", QUICKSTART, "--write", str(script), *args]) == 0
    return script.read_text()


def _fake_slurm(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f"#!/bin/bash\nprintf '%s\\n' \"$@\" > {tmp_path}/srun-args\n")
    (bin_dir / "scontrol").write_text("#!/bin/bash\n[ \"$1\" = show ] && printf 'node1\\nnode2\\n'\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    return bin_dir


def test_two_jobs_on_one_head_node_get_different_rendezvous_ports(tmp_path, capsys):
    """Job 14321 would have taken 20000 + 14321 % 10000 = 24321, the port job 4321 already holds on that node."""
    _script(tmp_path, "--nproc-per-node", "2")
    bin_dir = _fake_slurm(tmp_path)
    with socket.socket() as first_job:  # job 4321's rendezvous store, listening on the head node
        first_job.bind(("0.0.0.0", 24321))
        first_job.listen()
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "14321",
               "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NNODES": "1", "SLURMD_NODENAME": "node1"}
        subprocess.run(["bash", str(tmp_path / "job.sbatch")], cwd=tmp_path, env=env, capture_output=True,
                       timeout=120)
    arguments = (tmp_path / "srun-args").read_text().splitlines()
    assert "--rdzv-endpoint=node1:24322" in arguments, arguments


def test_a_job_asks_for_the_cpus_its_ranks_use(tmp_path):
    def directives(*args: str) -> str:
        script = _script(tmp_path, *args)
        return "\n".join(line for line in script.splitlines() if line.startswith(("#SBATCH --cpus", "export OMP")))

    assert directives("--nproc-per-node", "2") == textwrap.dedent("""\
        #SBATCH --cpus-per-task=2
        export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}""")  # a CPU per rank: Slurm's default is one for all of them
    assert directives("--gpus-per-node", "8", "training.threads=4") == textwrap.dedent("""\
        #SBATCH --cpus-per-task=32
        export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}""")
    assert directives("--gpus-per-node", "8") == "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}"  # the site's default
    assert directives("--nproc-per-node", "2", "--cpus-per-task", "16").startswith("#SBATCH --cpus-per-task=16")
