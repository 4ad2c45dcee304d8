"""A run killed with SIGKILL and resumed must reproduce an uninterrupted run's losses bit for bit (fp32, CPU).

Three subprocess runs of the real CLI on the tiny ``llama-debug`` model: uninterrupted (12 steps, no
checkpoints); checkpointing every 6 steps and SIGKILLed by a plugin right after step 8 (between two saves);
then the same CLI command again, which must resume from step 6 (ignoring a half-written ``.tmp`` save) and
log the same loss floats for steps 7..12. Subprocesses keep megatron's global state out of the test process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

CONFIG = """
run: {output_dir: OUT, seed: 7}
model: {name: llama-debug}
data: {seq_length: 64}
optimizer: {lr: 0.001}
scheduler: {warmup_steps: 3}
training: {steps: 12, micro_batch_size: 2, global_batch_size: 4, threads: 1}
checkpoint: {interval: INTERVAL, keep_last: 3}
logging: {interval: 1, progress: false, tensorboard: false}
"""

#: Registers a plugin that SIGKILLs this process at the end of step KILL_AT, then runs the CLI as usual.
KILLER = textwrap.dedent(
    """
    import os, signal, sys
    from loongforge import get_host, hookimpl
    from loongforge.cli import main

    class Killer:
        @hookimpl
        def loongforge_on_step_end(self, step):
            if step == int(os.environ["KILL_AT"]):
                os.kill(os.getpid(), signal.SIGKILL)

    get_host().register(Killer(), "killer")
    sys.exit(main(sys.argv[1:]))
    """
)


def _write_config(tmp_path: Path, name: str, interval: int) -> tuple[Path, Path]:
    out = tmp_path / name
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(CONFIG.replace("OUT", str(out)).replace("INTERVAL", str(interval)))
    return cfg, out


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in rows]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return {row["step"]: row["loss"] for row in rows}


def test_sigkill_then_resume_matches_uninterrupted_run_exactly(tmp_path):
    cfg, out = _write_config(tmp_path, "straight", interval=0)
    done = _run(["-m", "loongforge.cli", "train", str(cfg), "checkpoint.save_at_end=false"])
    assert done.returncode == 0, done.stderr[-3000:]
    reference = _losses(out)
    assert sorted(reference) == list(range(1, 13))

    cfg, out = _write_config(tmp_path, "killed", interval=6)
    killed = _run(["-c", KILLER, "train", str(cfg)], KILL_AT="8")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-0000006"
    assert sorted(_losses(out)) == list(range(1, 9))
    half = ckpts / ".tmp-step-0000012"  # what a kill during the next save would leave behind
    (half / "model_optim").mkdir(parents=True)
    (half / "trainer.json").write_text('{"step": 12')

    resumed = _run(["-m", "loongforge.cli", "train", str(cfg)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "step-0000006 at step 6" in resumed.stdout
    losses = _losses(out)
    assert sorted(losses) == list(range(1, 13))
    for step in range(1, 13):
        assert losses[step] == reference[step], f"step {step}: {losses[step]!r} != {reference[step]!r}"
    assert (ckpts / "latest").read_text().strip() == "step-0000012"
    assert not half.exists()


def test_checkpointing_script_needs_no_main_guard(tmp_path):
    """megatron's default checkpoint writer starts a ``spawn`` process, which re-imports an unguarded script
    and fails; our synchronous writer must not start any process."""
    cfg, out = _write_config(tmp_path, "script", interval=1)
    script = tmp_path / "train_script.py"
    script.write_text(
        "import multiprocessing\n"
        "import loongforge\n"
        f"loongforge.train({str(cfg)!r}, ['training.steps=2'])\n"
        "assert not multiprocessing.active_children(), multiprocessing.active_children()\n"
        "print('SCRIPT-OK')\n"
    )
    done = _run([str(script)])
    assert done.returncode == 0 and "SCRIPT-OK" in done.stdout, done.stderr[-3000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-0000002"
