"""Training's progress display: a rich bar (step/total, ETA, then loss, lr, gradient norm, speed and MFU as the
terminal's width allows) or plain log lines.

The mode is the one every LoongForge job uses (:func:`loongforge.progress.progress_mode`): the bar on a terminal,
plain lines when stdout is not one (CI, ``tee``, subprocesses) or ``logging.progress`` is false, nothing with
``LOONGFORGE_PROGRESS=off`` (``plain``/``rich`` force a mode). Only rank 0 displays anything. The bar is refreshed
from ``update`` calls by rich's own thread at a few Hz, so per-step cost is a dict update.

The step count and the time left come first and are never dropped: on a narrow terminal the statistics lose MFU,
then the gradient norm, then the learning rate, then the speed. The time left is measured from the end of the first
step on, so start-up (building, compiling, the first step's warm-up) does not inflate it.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from loongforge.progress import progress_mode

#: Columns the bar's fixed parts take besides the statistics ("train", the bar, "N/M", "eta 1:02:03", spaces).
_FIXED_WIDTH = 12 + 20 + 2 * 7 + 14
#: Statistics in the order they are dropped when the line would not fit.
_DROP_ORDER = ("mfu", "grad_norm", "lr", "speed")


def _fields(metrics: dict[str, Any]) -> dict[str, str]:
    grad_norm = metrics.get("grad_norm")
    fields = {"loss": f"loss {metrics['loss']:.4f}", "lr": f"lr {metrics['lr']:.3e}",
              "grad_norm": f"grad_norm {grad_norm:.3f}" if grad_norm is not None else "grad_norm n/a",
              "speed": (f"{metrics['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in metrics
                        else f"{metrics['samples_per_s']:,.1f} samples/s")}  # task models count samples
    if "mfu" in metrics:
        fields["mfu"] = f"MFU {metrics['mfu']:.1%}"
    return fields


def _fmt(metrics: dict[str, Any], width: int | None = None) -> str:
    """The statistics of a step, within ``width`` characters when given (fields dropped in :data:`_DROP_ORDER`)."""
    fields = _fields(metrics)
    for name in _DROP_ORDER:
        if width is None or len(" | ".join(fields.values())) <= width:
            break
        fields.pop(name, None)
    return " | ".join(fields.values())


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class ProgressDisplay:
    """Shows training progress on rank 0; ``enabled=False`` (``logging.progress``) keeps to plain lines."""

    def __init__(self, total_steps: int, *, start_step: int, rank: int, enabled: bool) -> None:
        self.total = total_steps
        mode = progress_mode(sys.stdout) if rank == 0 else "off"
        if mode == "rich" and not enabled:
            mode = "plain"
        self.active = mode != "off"
        self.live = mode == "rich"
        self.console = Console()
        #: (step, time) at the end of the first step this run took: the steady-state clock's origin.
        self._origin: tuple[int, float] | None = None
        self._start_step = start_step
        self._bar: Progress | None = None
        if self.live:
            self._bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(bar_width=20),
                MofNCompleteColumn(),
                TextColumn("{task.fields[eta]}"),
                TextColumn("{task.fields[stats]}"),
                console=self.console,
                transient=False,
            )
            self._task = self._bar.add_task("train", total=total_steps, completed=start_step, stats="", eta="")
            self._bar.start()

    def eta(self, step: int) -> float | None:
        """Seconds left after ``step`` at the steady-state rate (``None`` until two steps have ended)."""
        now = time.perf_counter()
        if self._origin is None:
            self._origin = (step, now)
            return None
        first, then = self._origin
        return (now - then) / (step - first) * (self.total - step) if step > first else None

    def update(self, step: int, metrics: dict[str, Any], *, logged: bool) -> None:
        """Advance to ``step``; on logging steps print a line (plain mode) or refresh the stats (bar)."""
        eta = self.eta(step)
        left = "eta ?" if eta is None else f"eta {_clock(eta)}"
        if self._bar is not None:
            fields: dict[str, Any] = {"completed": step, "eta": left}
            if logged:
                fields["stats"] = _fmt(metrics, max(self.console.width - _FIXED_WIDTH, 0))
            self._bar.update(self._task, **fields)
        elif self.active and logged:
            shown = "?" if eta is None else f"{eta:.0f}s"
            print(f"step {step}/{self.total} | {_fmt(metrics)} | eta {shown}", flush=True)

    def evaluation(self, step: int, values: dict[str, float]) -> None:
        """An evaluation's numbers at ``step``, one line above the bar (or plainly)."""
        self.message(f"step {step}/{self.total} | " + " | ".join(f"val_{name} {value:.4f}"
                                                                  for name, value in values.items()))

    def message(self, text: str) -> None:
        """Print a line above the bar (or plainly) on rank 0; nothing when progress is off."""
        if self.active:
            if self._bar is not None:
                self._bar.console.print(text, markup=False, highlight=False)
            else:
                print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
