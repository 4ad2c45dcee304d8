"""``benchmarks/llm_pretrain.py`` refuses arguments it cannot measure with before it starts any worker: a run whose
steps are all warm-up would have no timed step to take a median of, and an unknown side would be silently dropped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "llm_pretrain.py"


def _run(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *arguments], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("steps, warmup", [(3, 5), (5, 5)])
def test_steps_not_beyond_warmup_is_a_usage_error(steps, warmup):
    result = _run("--steps", str(steps), "--warmup", str(warmup), "--sides", "plain")
    assert result.returncode == 2, result.stderr
    assert f"--steps ({steps}) must exceed --warmup ({warmup})" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_side_is_named_with_the_known_ones():
    result = _run("--sides", "plain,plian", "--steps", "6", "--warmup", "1")
    assert result.returncode != 0
    assert "unknown side(s) plian" in result.stderr
    assert "loongforge-compiled" in result.stderr
    assert "Traceback" not in result.stderr
