"""``loongforge plan`` output: the top layouts with their memory and time breakdowns, and the rejections."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from loongforge.planner.hardware import format_bytes
from loongforge.planner.planner import Evaluated, Plan
from loongforge.planner.task_planner import TaskPlan

_MEMORY_SHORT = {"weights": "w", "grads": "g", "optimizer": "opt", "activations": "act", "backward_peak": "bwd",
                 "fixed": "fix", "gathered": "gath"}


def _memory_breakdown(ev: Evaluated) -> str:
    return " ".join(f"{_MEMORY_SHORT.get(k, k)} {format_bytes(v)}" for k, v in ev.memory.terms.items() if v > 0)


def _time_breakdown(ev: Evaluated) -> str:
    total = ev.time.total or 1.0
    return " ".join(f"{k} {v / total:.0%}" for k, v in sorted(ev.time.terms.items(), key=lambda kv: -kv[1])
                    if v / total >= 0.005)


def explain(plan: Any) -> list[str]:
    """Why the best layout won, in a few lines (also logged by ``parallel: auto``); ``plan`` is a megatron
    :class:`Plan` or a task model's :class:`~loongforge.planner.task_planner.TaskPlan`."""
    best = plan.best
    sizes = getattr(plan, "workload", None)
    lines = [
        f"chose {best.describe(sizes)}: predicted peak {format_bytes(best.memory.total)} per rank of "
        f"{format_bytes(plan.cluster.device_memory)} (budget {format_bytes(plan.budget)}), "
        f"step {best.time.total:.3g} s",
    ]
    if len(plan.ranked) > 1:
        second = plan.ranked[1]
        lines.append(f"runner-up {second.describe(sizes)}: step {second.time.total:.3g} s "
                     f"({second.pace / best.pace - 1:+.1%}{plan.pace_unit}), peak "
                     f"{format_bytes(second.memory.total)}")
    considered = len(plan.ranked) + sum(plan.rejected.values())
    reasons = ", ".join(f"{n} {why}" for why, n in plan.rejected.most_common())
    lines.append(f"{considered} layouts considered, {len(plan.ranked)} fit" + (f"; rejected: {reasons}" if reasons
                                                                              else ""))
    return lines


def print_plan(plan: Plan, top: int = 5, console: Console | None = None) -> None:
    """The ranked table, the rejection counts and (when nothing fits) the nearest misses."""
    console = console or Console(width=200, soft_wrap=False)
    w, c = plan.workload, plan.cluster
    console.print(f"{w.model.family_name} {w.terms().num_layers} layers, seq {w.seq_length}, {w.precision}, on "
                  f"{c.num_devices} x {format_bytes(c.device_memory)} ({c.ranks_per_node} per node)")
    for part in w.components:  # parts outside the decoder, on the first stage (their memory is the term named so)
        console.print(f"+ {part.name} on the first stage: {part.description}")
    _print_ranking(plan, top, console)


def print_task_plan(plan: TaskPlan, model: str, top: int = 5, console: Console | None = None) -> None:
    """:func:`print_plan` for a task model's torch-native layouts."""
    console = console or Console(width=200, soft_wrap=False)
    s, c = plan.sizes, plan.cluster
    models = f"{s.models} models of " if s.models > 1 else ""
    console.print(f"{model}: {models}{s.blocks} blocks, {s.sample}, {plan.precision}, on {c.num_devices} x "
                  f"{format_bytes(c.device_memory)} ({c.ranks_per_node} per node)")
    for note in s.notes:
        console.print(f"note: {note}")
    _print_ranking(plan, top, console)


def _print_ranking(plan: Any, top: int, console: Console) -> None:
    sizes = getattr(plan, "workload", None)
    c = plan.cluster
    rows = plan.ranked[:top] if plan.ranked else plan.near_misses
    title = f"Top {len(rows)} layouts" if plan.ranked else "Nearest misses (none fits)"
    table = Table(title=title, title_justify="left")
    for column in ("#", "layout", "peak/rank", "step s", "memory", "time"):
        table.add_column(column, overflow="fold")
    for i, ev in enumerate(rows, 1):
        share = ev.memory.total / c.device_memory
        table.add_row(str(i), ev.describe(sizes), f"{format_bytes(ev.memory.total)} ({share:.0%})",
                      f"{ev.time.total:.3g}", _memory_breakdown(ev), _time_breakdown(ev))
    console.print(table)
    if plan.rejected:
        rejected = Table(title="Rejected", title_justify="left")
        rejected.add_column("reason")
        rejected.add_column("layouts", justify="right")
        for why, n in plan.rejected.most_common():
            rejected.add_row(why, str(n))
        console.print(rejected)
    if plan.ranked:
        for line in explain(plan):
            console.print(line)
    else:
        console.print(plan.infeasible_message())
