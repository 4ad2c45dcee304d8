"""Tensor by tensor comparison of two :class:`~loongforge.diffing.trace.Trace` s, and of two runs' metrics.

A difference is relative to the first side's largest magnitude (``max |a - b| / max |a|``), so one tolerance
serves weights, activations and gradients of any scale (a gradient at least against a round-off floor, see
:data:`GRADIENT_FLOOR`); a tensor only one side has, or of another shape, differs infinitely.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

#: :attr:`Difference.kind` values, in the order a step computes them.
PARAMETER, OUTPUT, GRADIENT = "parameter", "forward output", "gradient"
#: A gradient is measured against at least this fraction of its model's largest gradient: below that it is fp32
#: round-off, which differs between implementations (an attention key bias's gradient is zero in exact arithmetic,
#: softmax ignoring a constant per query, and two implementations compute different ~1e-13 residues of it).
GRADIENT_FLOOR = 1e-6


@dataclass(frozen=True)
class Difference:
    """How far one tensor of side B is from side A's: ``max_abs`` and ``rel`` (``inf`` when they cannot be compared,
    ``why`` says how)."""

    kind: str
    name: str
    max_abs: float
    rel: float
    why: str = ""

    def describe(self) -> str:
        if self.why:
            return f"{self.kind} of {self.name}: {self.why}"
        return f"{self.kind} of {self.name}: max abs {self.max_abs:.3g}, relative {self.rel:.3g}"


def tensor_difference(kind: str, name: str, a: torch.Tensor | None, b: torch.Tensor | None, *,
                      floor: float = 0.0) -> Difference:
    """``b`` against ``a``, relative to ``a``'s largest magnitude or ``floor``, whichever is larger."""
    if a is None or b is None:
        return Difference(kind, name, math.inf, math.inf, f"only in run {'A' if b is None else 'B'}")
    if a.shape != b.shape and a.squeeze().shape == b.squeeze().shape:  # a unit axis one side keeps: same values
        a, b = a.squeeze(), b.squeeze()
    if a.shape != b.shape:
        return Difference(kind, name, math.inf, math.inf, f"shape {list(a.shape)} vs {list(b.shape)}")
    if a.numel() == 0:
        return Difference(kind, name, 0.0, 0.0)
    gap = (a - b).abs().max().item()
    scale = max(a.abs().max().item(), floor)
    if math.isnan(gap):
        return Difference(kind, name, math.nan, math.inf, "not finite on one side")
    return Difference(kind, name, gap, gap / scale if scale > 0 else (0.0 if gap == 0 else math.inf))


def compare_tensors(kind: str, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[Difference]:
    """Every tensor of ``a`` (in its order), then those only ``b`` has; gradients relative to at least
    :data:`GRADIENT_FLOOR` times ``a``'s largest."""
    names = [*a, *(name for name in b if name not in a)]
    largest = max((t.abs().max().item() for t in a.values() if t.numel()), default=0.0)
    floor = GRADIENT_FLOOR * largest if kind == GRADIENT else 0.0
    return [tensor_difference(kind, name, a.get(name), b.get(name), floor=floor) for name in names]


def first_beyond(differences: list[Difference], rtol: float) -> Difference | None:
    """The first difference above ``rtol`` in the order a step computes the tensors (``None``: all within it).

    Parameters and forward outputs are listed in forward order already; gradients are searched from the last
    parameter back, because the backward pass computes the output layer's first and the embedding's last -- a
    kernel whose backward is wrong in layer 3 of 4 makes every earlier gradient wrong too, and layer 3 is where to
    look."""
    ordered = reversed(differences) if differences and differences[0].kind == GRADIENT else differences
    return next((d for d in ordered if not d.rel <= rtol), None)


@dataclass(frozen=True)
class MetricsParting:
    """Where two runs' metrics part: the steps both logged, and the first of them whose ``key`` differs beyond the
    tolerance (``None``: none) with both values."""

    common_steps: int
    step: int | None = None
    key: str = ""
    values: tuple[float | None, float | None] = (None, None)


def read_metrics(run: Path) -> dict[int, dict]:
    """A run's metrics.jsonl by step (the last row of a step wins: a rewound step was trained again)."""
    rows: dict[int, dict] = {}
    for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            rows[int(row["step"])] = row
    return rows


def compare_metrics(a: dict[int, dict], b: dict[int, dict], rtol: float,
                    keys: tuple[str, ...] = ("loss", "grad_norm")) -> MetricsParting:
    steps = sorted(set(a) & set(b))
    for step in steps:
        for key in keys:
            x, y = a[step].get(key), b[step].get(key)
            if x is None and y is None:
                continue
            if x is None or y is None or not abs(x - y) <= rtol * max(abs(x), 1e-12):
                return MetricsParting(len(steps), step, key, (x, y))
    return MetricsParting(len(steps))
