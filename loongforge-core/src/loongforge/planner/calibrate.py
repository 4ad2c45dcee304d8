"""Fit the memory and time models' coefficients to measured runs, and read/write a calibration file.

A calibration file (JSON) holds :class:`~loongforge.planner.memory.Coefficients` under ``memory`` and
:class:`~loongforge.planner.timing.TimeCoefficients` under ``time``, plus where they came from; ``loongforge
plan --calibration FILE`` and ``parallel.planner.calibration`` read it. ``benchmarks/planner_calibration.py``
measures runs (:mod:`loongforge.train.measure`) and writes one.

Both fits are linear least squares with two unknowns:

* memory: ``measured - (weights + grads + optimizer) = scale x (activations + re-run activations)
  + scale x workspace x one layer's activations``;
* time: ``measured - communication = FLOP-time / flops_scale + overhead_per_layer x layer-passes``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loongforge.errors import ConfigError
from loongforge.planner.hardware import ClusterSpec
from loongforge.planner.layouts import Candidate
from loongforge.planner.memory import Coefficients, Workload, estimate_memory
from loongforge.planner.timing import TimeCoefficients, estimate_time

_STATIC = ("weights", "grads", "optimizer")
_COMPUTE = ("compute", "bubble", "stage_imbalance")


@dataclass(frozen=True)
class Measurement:
    """One measured layout: the highest per-rank peak (bytes) and the median step time (s)."""

    workload: Workload
    candidate: Candidate
    cluster: ClusterSpec
    peak_bytes: float
    step_time: float


@dataclass(frozen=True)
class Calibration:
    memory: Coefficients = Coefficients()
    time: TimeCoefficients = TimeCoefficients()
    source: str = "defaults"

    def to_json(self) -> dict[str, Any]:
        return {"memory": dataclasses.asdict(self.memory), "time": dataclasses.asdict(self.time),
                "source": self.source}


def load_calibration(path: str | Path | None) -> Calibration:
    """The calibration in ``path`` (None: the defaults); unknown keys are an error naming the file."""
    if path is None:
        return Calibration()
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return Calibration(Coefficients(**data.get("memory", {})), TimeCoefficients(**data.get("time", {})),
                           str(data.get("source", path)))
    except FileNotFoundError:
        raise ConfigError(f"{path}: calibration file not found") from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{path}: not a planner calibration file ({exc})") from None


def save_calibration(calibration: Calibration, path: str | Path) -> None:
    Path(path).write_text(json.dumps(calibration.to_json(), indent=2) + "\n", encoding="utf-8")


def _solve2(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Least squares ``y = a x1 + b x2`` over ``(x1, x2, y)`` rows, with a and b kept non-negative."""
    s11 = sum(x1 * x1 for x1, _, _ in rows)
    s22 = sum(x2 * x2 for _, x2, _ in rows)
    s12 = sum(x1 * x2 for x1, x2, _ in rows)
    s1y = sum(x1 * y for x1, _, y in rows)
    s2y = sum(x2 * y for _, x2, y in rows)
    det = s11 * s22 - s12 * s12
    if det > 1e-12 * max(s11 * s22, 1e-300):
        a, b = (s1y * s22 - s2y * s12) / det, (s2y * s11 - s1y * s12) / det
        if a >= 0 and b >= 0:
            return a, b
    # One coefficient at zero: the better of the two one-variable fits.
    only_a = (max(s1y / s11, 0.0) if s11 else 0.0, 0.0)
    only_b = (0.0, max(s2y / s22, 0.0) if s22 else 0.0)

    def err(ab: tuple[float, float]) -> float:
        return sum((y - ab[0] * x1 - ab[1] * x2) ** 2 for x1, x2, y in rows)

    return min(only_a, only_b, key=err)


def fit_memory(measurements: list[Measurement]) -> Coefficients:
    """Activation scale and backward workspace (in layers) that best explain the measured peaks."""
    rows = []
    for m in measurements:
        none = estimate_memory(m.workload, m.candidate, Coefficients(transient_layers=0.0)).terms
        one = estimate_memory(m.workload, m.candidate, Coefficients(transient_layers=1.0)).terms
        static = sum(none[k] for k in _STATIC)
        rows.append((none["activations"] + none["backward_peak"], one["backward_peak"] - none["backward_peak"],
                     m.peak_bytes - static))
    scale, workspace = _solve2(rows)
    return Coefficients(activation_scale=scale, transient_layers=workspace / scale if scale else 0.0)


def fit_time(measurements: list[Measurement], base: TimeCoefficients | None = None) -> TimeCoefficients:
    """Throughput scale and per-layer overhead that best explain the measured step times."""
    base = base or TimeCoefficients()
    unit = dataclasses.replace(base, flops_scale=1.0, overhead_per_layer=1.0)
    rows = []
    for m in measurements:
        terms = estimate_time(m.workload, m.candidate, m.cluster, unit).terms
        flop_time = sum(terms.get(k, 0.0) for k in _COMPUTE)
        comm = sum(v for k, v in terms.items() if k not in _COMPUTE and k != "overhead")
        rows.append((flop_time, terms["overhead"], m.step_time - comm))
    inverse_scale, overhead = _solve2(rows)
    return dataclasses.replace(base, flops_scale=1.0 / inverse_scale if inverse_scale else base.flops_scale,
                               overhead_per_layer=overhead)


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties); 1.0 for fewer than two points."""
    if len(xs) < 2:
        return 1.0

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 1.0
