"""Progress display: a rich bar (step/total, loss, lr, tokens/s, MFU where known, ETA) or plain log lines.

Plain lines are used when stdout is not a terminal (CI, ``tee``, subprocesses) or ``logging.progress`` is
false, so logs stay greppable. Only rank 0 displays anything. The bar is refreshed from ``update`` calls by
rich's own thread at a few Hz, so per-step cost is a dict update.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


def _fmt(metrics: dict[str, Any]) -> str:
    grad_norm = metrics.get("grad_norm")
    norm = f"{grad_norm:.3f}" if grad_norm is not None else "n/a"  # None when clipping is off
    speed = (f"{metrics['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in metrics
             else f"{metrics['samples_per_s']:,.1f} samples/s")  # task models (diffusion, VLA) count samples
    mfu = f" | MFU {metrics['mfu']:.1%}" if "mfu" in metrics else ""
    return f"loss {metrics['loss']:.4f} | lr {metrics['lr']:.3e} | grad_norm {norm} | {speed}{mfu}"


class ProgressDisplay:
    """Shows training progress on rank 0; ``live`` picks the bar over plain lines."""

    def __init__(self, total_steps: int, *, start_step: int, rank: int, enabled: bool) -> None:
        self.total = total_steps
        self.active = rank == 0
        self.live = self.active and enabled and sys.stdout.isatty()
        self.console = Console()
        self._start = time.perf_counter()
        self._start_step = start_step
        self._bar: Progress | None = None
        if self.live:
            self._bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(bar_width=24),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self._task = self._bar.add_task("train", total=total_steps, completed=start_step, stats="")
            self._bar.start()

    def update(self, step: int, metrics: dict[str, Any], *, logged: bool) -> None:
        """Advance to ``step``; on logging steps print a line (plain mode) or refresh the stats (bar)."""
        if self._bar is not None:
            if logged:
                self._bar.update(self._task, completed=step, stats=_fmt(metrics))
            else:
                self._bar.update(self._task, completed=step)
        elif self.active and logged:
            done = step - self._start_step
            elapsed = time.perf_counter() - self._start
            eta = elapsed / done * (self.total - step) if done else 0.0
            print(f"step {step}/{self.total} | {_fmt(metrics)} | eta {eta:.0f}s", flush=True)

    def evaluation(self, step: int, values: dict[str, float]) -> None:
        """An evaluation's numbers at ``step``, one line above the bar (or plainly)."""
        self.message(f"step {step}/{self.total} | " + " | ".join(f"val_{name} {value:.4f}"
                                                                  for name, value in values.items()))

    def message(self, text: str) -> None:
        """Print a line above the bar (or plainly) on rank 0."""
        if self.active:
            if self._bar is not None:
                self._bar.console.print(text, markup=False, highlight=False)
            else:
                print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
