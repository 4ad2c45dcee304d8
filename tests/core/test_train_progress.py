"""Training's progress display: the step count and the time left survive a narrow terminal, the time left comes
from the steady-state step time (start-up does not count), and ``LOONGFORGE_PROGRESS`` governs training as it
governs every other job."""

from __future__ import annotations

import io

import pytest
from loongforge.train import progress as train_progress
from loongforge.train.progress import ProgressDisplay, _fmt
from rich.console import Console

METRICS = {"loss": 2.54321, "lr": 1.9e-3, "grad_norm": 0.7234, "tokens_per_s": 2609.4, "samples_per_s": 10.2,
           "mfu": 0.084}


def test_fields_are_dropped_from_the_least_needed_and_never_the_loss():
    full = _fmt(METRICS)
    assert full == "loss 2.5432 | lr 1.900e-03 | grad_norm 0.723 | 2,609 tok/s | MFU 8.4%"
    assert _fmt(METRICS, len(full)) == full
    assert _fmt(METRICS, len(full) - 1) == "loss 2.5432 | lr 1.900e-03 | grad_norm 0.723 | 2,609 tok/s"
    assert _fmt(METRICS, 30) == "loss 2.5432 | 2,609 tok/s"
    assert _fmt(METRICS, 0) == "loss 2.5432"


@pytest.mark.parametrize("columns", [120, 80, 60])
def test_the_bar_keeps_step_count_and_eta_at_narrow_widths(columns, monkeypatch):
    """Rendered at 120, 80 and 60 columns: the line fits, and holds the step count and the time left."""
    monkeypatch.setenv("LOONGFORGE_PROGRESS", "rich")
    out = io.StringIO()
    monkeypatch.setattr(train_progress, "Console", lambda: Console(file=out, width=columns, force_terminal=True,
                                                                   color_system=None))
    clock = iter([100.0, 101.0, 102.0])
    monkeypatch.setattr(train_progress.time, "perf_counter", lambda: next(clock))
    display = ProgressDisplay(200, start_step=0, rank=0, enabled=True)
    for step in (1, 2, 3):
        display.update(step, METRICS, logged=True)
    display.close()
    last = [line for line in out.getvalue().splitlines() if "3/200" in line][-1]
    assert len(last.rstrip()) <= columns and "eta 3:17" in last and "loss 2.5432" in last, last


def test_plain_lines_measure_the_time_left_from_the_first_step_on(monkeypatch, capsys):
    monkeypatch.setenv("LOONGFORGE_PROGRESS", "plain")
    clock = iter([50.0, 52.0, 54.0])  # step 1 ends 50 s after the run began (start-up), then 2 s per step
    monkeypatch.setattr(train_progress.time, "perf_counter", lambda: next(clock))
    display = ProgressDisplay(10, start_step=0, rank=0, enabled=True)
    for step in (1, 2, 3):
        display.update(step, METRICS, logged=True)
    lines = capsys.readouterr().out.splitlines()
    assert [line.rsplit(" | ", 1)[1] for line in lines] == ["eta ?", "eta 16s", "eta 14s"]


def test_off_silences_training_too(monkeypatch, capsys):
    monkeypatch.setenv("LOONGFORGE_PROGRESS", "off")
    display = ProgressDisplay(10, start_step=0, rank=0, enabled=True)
    display.update(1, METRICS, logged=True)
    display.message("saved checkpoint x")
    display.close()
    assert capsys.readouterr().out == ""
