"""A rank SIGKILLed -- or frozen -- under an elastic launcher: the group restarts, resumes from the newest checkpoint
and finishes bit for bit like a run that was never interrupted, with every rank holding the same state (issues 17
and 45).

Three 2-process gloo runs of ``llama-debug`` (12 steps, a checkpoint every 5, ``checkpoint.resume: auto``), each next
to an uninterrupted run of the same layout and launcher:

* ``tp=2`` under ``torchrun --max-restarts 1``: rank 1 is killed at the end of step 7, between two saves. torch's
  launcher restarts the group on the store the dead one used (the case :mod:`loongforge.parallel.distributed`
  namespaces per attempt); the new group resumes from step 5.
* ``dp=2`` under ``loongforge train --nproc 2 --max-restarts 1``: rank 0 -- the rank that writes metrics.jsonl,
  the manifest and the commit -- is killed inside the save of step 10, leaving a half-made ``.tmp-step-0000010``;
  the launcher restarts both processes, which resume from step 5 and save step 10 again.
* ``dp=2`` under ``loongforge train --nproc 2 --max-restarts 1 --dist-timeout 10`` (issue 45, item 3): rank 1
  stops itself with SIGSTOP at the end of step 7. On main the other rank waited in a collective for gloo's
  hard-coded 30 minutes and the launcher, which watches for dead processes only, waited with it. Now rank 0's
  watchdog ends the attempt with one line naming rank 1 and status 4, the launcher kills the stopped rank (it cannot
  act on SIGTERM) and restarts the group within the timeout + 60 s of the freeze, and the new group resumes from
  step 5. Its uninterrupted run is the previous case's (same launcher and layout).

Asserted as torchft's tests assert replicas agree, on the state itself: after the restart every rank's gathered
full weights and Adam moments (tensor-parallel shards all-gathered, per global parameter name) are bit-identical
on all ranks -- the dp replicas hold the same tensors, both tp ranks assemble the same full ones -- and equal the
uninterrupted run's; metrics.jsonl has every step once with the uninterrupted run's loss, grad norm and lr.

``loongforge train --max-restarts`` restarts crashed processes only: a group that saved and stopped on SIGTERM ends
with status 3 and is not started again, and misuse of the option is a one-line error before any process starts.

The faults and the state digests come from a plugin (``elastic_probe``) that every rank discovers as an installed
distribution (a ``.dist-info`` on ``PYTHONPATH``), as a user's plugin would be found.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from example_packages import plugin_site
from loongforge.checkpoint.manifest import verify_manifest
from loongforge.cli import main

CONFIG = """
run: {output_dir: OUT, seed: 7}
model: {name: llama-debug}
data: {seq_length: 64}
optimizer: {lr: 0.001}
scheduler: {warmup_steps: 3}
training: {steps: 12, micro_batch_size: 2, global_batch_size: 4, threads: 1}
checkpoint: {interval: 5, keep_last: 3, resume: auto}
logging: {interval: 4, progress: false, tensorboard: false}
"""
STEPS = 12

#: FAULT INJECTION and state probe. With KILL_AT (``step-end:N`` or ``save:N``), rank KILL_RANK sends itself
#: KILL_SIGNAL (default SIGKILL) there once per run: the first process to get there creates PROBE_DIR/killed.json
#: (exclusively, with its rank, pid and the time) and is signalled, so a restarted group runs through. At the end
#: of training every rank writes PROBE_DIR/rankR.json: per global parameter name, the sha256 of the full
#: (tensor-parallel-gathered) weight and Adam moments.
PROBE = textwrap.dedent(
    '''
    import hashlib
    import json
    import os
    import signal
    import time
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from loongforge import hookimpl


    def _kill_once(moment):
        if os.environ.get("KILL_AT") != moment or os.environ["RANK"] != os.environ["KILL_RANK"]:
            return
        try:
            fd = os.open(Path(os.environ["PROBE_DIR"]) / "killed.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:  # the restarted group: the fault fired already
            return
        os.write(fd, json.dumps({"rank": int(os.environ["RANK"]), "pid": os.getpid(), "time": time.time()}).encode())
        os.fsync(fd)
        os.close(fd)
        os.kill(os.getpid(), getattr(signal, os.environ.get("KILL_SIGNAL", "SIGKILL")))


    @hookimpl
    def loongforge_on_step_end(step):
        _kill_once(f"step-end:{step}")


    @hookimpl
    def loongforge_on_checkpoint_save(trainer):
        _kill_once(f"save:{trainer.step}")


    def _full(param, local):
        """The unsharded tensor of ``local``: ``param``'s tensor-parallel shard, or state shaped like it."""
        from megatron.core import parallel_state

        world = parallel_state.get_tensor_model_parallel_world_size()
        if world == 1 or not getattr(param, "tensor_model_parallel", False):
            return local
        shards = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(shards, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        # megatron cuts the full tensor into world * stride pieces and gives rank r pieces r, r + world, ...
        dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
        pieces = [shard.chunk(stride, dim=dim) for shard in shards]
        return torch.cat([pieces[r][s] for s in range(stride) for r in range(world)], dim=dim)


    def _digest(tensor):
        return hashlib.sha256(tensor.detach().contiguous().numpy().tobytes()).hexdigest()


    @hookimpl
    def loongforge_on_train_end(trainer):
        from megatron.core import parallel_state
        from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer

        from loongforge.checkpoint.saver import unwrap_model
        from loongforge.parallel.init import global_parameters

        assert isinstance(trainer.optimizer, ChainedOptimizer), type(trainer.optimizer)
        adam_state = {}  # fp32 training: the Adam state is keyed by the model's own parameters
        for optimizer in trainer.optimizer.chained_optimizers:
            assert isinstance(optimizer, FP32Optimizer), type(optimizer)
            adam_state.update(optimizer.optimizer.state)
        state = {}
        for chunk in trainer.model:
            for name, param in global_parameters(unwrap_model(chunk)):
                moments = adam_state[param]
                state[name] = {key: _digest(_full(param, tensor)) for key, tensor in
                               (("weight", param.data), ("exp_avg", moments["exp_avg"]),
                                ("exp_avg_sq", moments["exp_avg_sq"]))}
        probe = {"pid": os.getpid(), "step": trainer.step, "state": state,
                 "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                 "dp_rank": parallel_state.get_data_parallel_rank()}
        path = Path(os.environ["PROBE_DIR"]) / f"rank{dist.get_rank()}.json"
        path.write_text(json.dumps(probe, sort_keys=True))
    '''
)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A directory holding the ``elastic_probe`` plugin as an installed distribution (for ``PYTHONPATH``)."""
    return plugin_site(tmp_path_factory.mktemp("site"), "elastic_probe", PROBE)


@dataclass(frozen=True)
class Case:
    #: The command before ``train CONFIG`` and the arguments after it.
    launcher: list[str]
    arguments: list[str]
    #: The parallel dimension the two ranks span (``tp`` or ``dp``).
    spans: str
    #: The fault: environment of the probe.
    fault: dict[str, str]
    #: What the output says when the group was restarted.
    restarted: str
    #: The case whose uninterrupted run stands for this one's (the same launcher and layout); ``None``: its own.
    reference: str | None = None


CASES = {
    "tp2-torchrun": Case(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
         "1", "-m", "loongforge.cli"], ["parallel.tp=2"], "tp", {"KILL_AT": "step-end:7", "KILL_RANK": "1"},
        "(torchrun, restart 1, world size 2)"),
    "dp2-nproc": Case(
        [sys.executable, "-m", "loongforge.cli"], ["--nproc", "2", "--max-restarts", "1"], "dp",
        {"KILL_AT": "save:10", "KILL_RANK": "0"},
        "[loongforge] rank 0 was killed by SIGKILL: restarting the 2 processes (restart 1 of 1)"),
    "dp2-nproc-frozen": Case(
        [sys.executable, "-m", "loongforge.cli"], ["--nproc", "2", "--max-restarts", "1", "--dist-timeout", "10"], "dp",
        {"KILL_AT": "step-end:7", "KILL_RANK": "1", "KILL_SIGNAL": "SIGSTOP"},
        "[loongforge] rank 0 exited with status 4: restarting the 2 processes (restart 1 of 1)", reference="dp2-nproc"),
}
#: The hang watchdog's line for the frozen case: rank 0 waits in step 7's end-of-step vote (the preemption check)
#: when rank 1 stops after its step 7, so rank 0's last step boundary came after step 6.
HUNG = ("[loongforge] error: hung: rank 1 stopped responding (no heartbeat for 2.5 s: the process is stopped, frozen "
        "or gone); no step after step 6 finished in 10 s (distributed.timeout_s); exiting with status 4 so the job "
        "restarts from its newest checkpoint")


def _train(root: Path, name: str, case: Case, site: Path, status: int = 0, **fault: str) -> tuple[Path, str]:
    """One 2-process run of ``case``'s command, which must exit with ``status``; returns its output directory
    (metrics, checkpoints, probe/) and its output (stdout and stderr), each line prefixed with the time it came."""
    out = root / name
    (out / "probe").mkdir(parents=True)
    config = root / f"{name}.yaml"
    config.write_text(CONFIG.replace("OUT", str(out)))
    python_path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": python_path, "OMP_NUM_THREADS": "1", "PROBE_DIR": str(out / "probe"), **fault}
    with subprocess.Popen([*case.launcher, "train", str(config), *case.arguments], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=env) as process:
        timer = threading.Timer(600, process.kill)  # a hang fails the test below instead of holding up the suite
        timer.start()
        output = "".join(f"{time.time():.3f} {line}" for line in process.stdout)
        timer.cancel()
    assert process.returncode == status, output[-5000:]
    return out, output


def _line(output: str, text: str) -> tuple[float, str]:
    """The time and the line of ``output`` (as :func:`_train` returns it) that holds ``text`` (exactly one)."""
    (found,) = [line.split(" ", 1) for line in output.splitlines() if text in line]
    return float(found[0]), found[1]


def _rows(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in rows]
    assert steps == list(range(1, STEPS + 1)), f"steps logged: {steps}"  # no hole, no duplicate
    return {row["step"]: row for row in rows}


def _probes(out: Path) -> list[dict]:
    return [json.loads((out / "probe" / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, site):
    """The uninterrupted run of a case (its output directory), made once for the cases that share it."""
    runs: dict[str, Path] = {}

    def run(name: str) -> Path:
        if name not in runs:
            runs[name], _ = _train(tmp_path_factory.mktemp(name), "straight", CASES[name], site)
        return runs[name]

    return run


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.slow
@pytest.mark.distributed
def test_killed_rank_restarts_and_continues_bit_exactly_with_equal_ranks(tmp_path, site, uninterrupted, name):
    case = CASES[name]
    reference_out = uninterrupted(case.reference or name)
    killed_out, output = _train(tmp_path, "killed", case, site, **case.fault)

    killed = json.loads((killed_out / "probe" / "killed.json").read_text())
    assert killed["rank"] == int(case.fault["KILL_RANK"])
    assert case.restarted in output, output[-5000:]
    if case.fault.get("KILL_SIGNAL") == "SIGSTOP":  # named in one line, and the attempt over within timeout + 60 s
        assert _line(output, "hung:")[1].strip() == HUNG, output[-5000:]
        assert _line(output, case.restarted)[0] - killed["time"] < 10 + 60, output[-5000:]
    ckpts = killed_out / "checkpoints"
    assert f"resumed from {ckpts / 'step-0000005'} at step 5" in output, output[-5000:]

    reference, rows = _rows(reference_out), _rows(killed_out)
    for step in range(1, STEPS + 1):
        for key in ("loss", "grad_norm", "lr"):
            assert rows[step][key] == reference[step][key], f"step {step} {key}: {rows[step][key]!r} != " \
                                                           f"{reference[step][key]!r}"

    probes, reference_probes = _probes(killed_out), _probes(reference_out)
    assert sorted(probe[f"{case.spans}_rank"] for probe in probes) == [0, 1]
    assert all(probe["step"] == STEPS and probe["pid"] != killed["pid"] for probe in probes)  # the new group's
    assert len(probes[0]["state"]) >= 10  # every weight of the model, not an empty dict
    assert probes[0]["state"] == probes[1]["state"], "the ranks hold different states after the restart"
    assert reference_probes[0]["state"] == reference_probes[1]["state"]
    assert probes[0]["state"] == reference_probes[0]["state"], "the state differs from the uninterrupted run's"

    # The killed save's .tmp-step-0000010 (dp2) is gone: the restarted group saved step 10 again.
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-0000005", "step-0000010", "step-0000012"]
    for step in (5, 10, 12):
        verify_manifest(ckpts / f"step-{step:07d}")


@pytest.mark.slow
@pytest.mark.distributed
def test_a_preempted_group_is_not_restarted(tmp_path, site):
    """``--max-restarts`` restarts crashed processes only: a rank that saved and stopped on SIGTERM (status 3) ends
    the launch with status 3, so a job script can requeue it, and its checkpoint is where the requeued job resumes."""
    out, output = _train(tmp_path, "preempted", CASES["dp2-nproc"], site, status=3, KILL_AT="step-end:3",
                         KILL_RANK="1", KILL_SIGNAL="SIGTERM")
    assert "preempted by SIGTERM at step 3 of 12" in output, output[-5000:]
    assert "restarting the 2 processes" not in output, output[-5000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-0000003"]


@pytest.mark.parametrize("arguments,message", [
    (["--max-restarts", "1"], "error: --max-restarts restarts the processes that --nproc starts; under torchrun, "
                              "give torchrun its own --max-restarts"),
    (["--nproc", "2", "--max-restarts", "-1"], "error: --max-restarts must be >= 0, got -1"),
    (["--nproc", "2", "--max-restarts", "2", "checkpoint.resume=never"],
     "error: {config}: --max-restarts restarts the processes from the newest checkpoint, which needs "
     "checkpoint.resume: auto (it is 'never')"),
], ids=["without-nproc", "negative", "resume-never"])
def test_max_restarts_misuse_is_one_line_before_any_process_starts(tmp_path, capsys, arguments, message):
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG.replace("OUT", str(tmp_path / "out")))
    assert main(["train", str(config), *arguments]) == 2
    assert capsys.readouterr().err.strip() == message.format(config=config)
    assert not (tmp_path / "out").exists()
