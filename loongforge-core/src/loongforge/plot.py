"""``loongforge plot RUN_DIR [RUN_DIR ...] --out curves.png``: training curves of one or several runs in one PNG,
for people who do not run TensorBoard (and for notes and reports).

Why the JSONL and not the trackers' files: every run writes ``metrics.jsonl`` (one line per step, the exact values,
whichever trackers it used), so any two runs compare, across engines and versions. One subplot per metric (x =
step, whole steps), one colour per run, labelled by the run directory's name; a validation metric (``val_loss``) is
drawn dashed on its training metric's axes when both are plotted. Per-step values are averaged over the logging
interval, as the step lines and the trackers show them (``--every``; the run's ``logging.interval`` by default);
validation values are drawn as recorded. A run that recorded nothing for a subplot says so in its legend and on the
console. A step recorded twice (trained again after a ``rewind``) is drawn with its newest value; missing values (a
NaN loss is written as ``null``) are gaps.
matplotlib (the ``plot`` extra) is imported only when a plot is drawn, with the Agg backend, so no display is
needed. Torch-free.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import yaml

from loongforge.errors import LoongForgeError

#: Plotted when ``--metrics`` is not given, those that at least one run recorded: the loss, the validation loss,
#: the learning rate, the gradient norm and one throughput (tokens/s where the runs have it, else samples/s).
DEFAULT_METRICS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s")
#: Inches of one subplot and pixels per inch: a PNG is ``columns x 6.4 x 100`` by ``rows x 3.6 x 100`` pixels.
SUBPLOT_INCHES, DPI = (6.4, 3.6), 100
#: Subplots side by side before a new row starts.
COLUMNS = 2

Curves = dict[str, dict[int, float]]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Draw training curves from the metrics.jsonl of one or several runs into one PNG: a subplot "
                          "per metric (x = step), a line per run. Needs matplotlib: "
                          "pip install 'loongforge-core[plot]'.")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run.output_dir of a run (holds metrics.jsonl)")
    parser.add_argument("--out", required=True, help="the PNG to write, e.g. curves.png")
    parser.add_argument("--metrics", help="comma-separated metric names from metrics.jsonl (default: "
                                          f"{','.join(DEFAULT_METRICS)}, those recorded; samples_per_s when no "
                                          "run has tokens_per_s); val_X shares X's subplot when both are drawn")
    parser.add_argument("--every", type=int, metavar="N",
                        help="average per-step values over N steps, as the step lines and trackers do (default: each "
                             "run's logging.interval, read from its newest checkpoint; 1 draws every step)")


def run(args: argparse.Namespace) -> int:
    if args.every is not None and args.every < 1:
        raise LoongForgeError(f"--every must be >= 1, got {args.every}")
    runs = {}
    for label, path in _labels(args.runs).items():
        curves = read_curves(path)
        runs[label] = interval_means(curves, args.every or logging_interval(path))
    metrics = _chosen(args.metrics, runs)
    panels = panels_of(metrics)
    for label, curves in runs.items():
        missing = [metric for metric in metrics if metric not in curves]
        if missing:
            print(f"{label}: recorded no {', '.join(missing)}")
    out = plot_runs(runs, panels, Path(args.out))
    print(f"wrote {out}: {', '.join('+'.join(panel) for panel in panels)} of {len(runs)} run(s)")
    return 0


def logging_interval(run_dir: Path) -> int:
    """``logging.interval`` of the run in ``run_dir`` (its newest checkpoint's config.yaml), 1 when none is found."""
    configs = sorted(run_dir.glob("checkpoints/step-*/config.yaml"))
    if not configs:
        return 1
    try:
        recorded = yaml.safe_load(configs[-1].read_text(encoding="utf-8")) or {}
        interval = (recorded.get("logging") or {}).get("interval")
    except (OSError, yaml.YAMLError, AttributeError):
        return 1
    return interval if isinstance(interval, int) and interval >= 1 else 1


def interval_means(curves: Curves, every: int) -> Curves:
    """Each per-step metric averaged over windows of ``every`` steps (1-N, N+1-2N, ...), each mean drawn at its
    window's last recorded step; validation metrics (``val_*``, recorded at evaluations only) unchanged."""
    if every == 1:
        return curves
    averaged: Curves = {}
    for metric, points in curves.items():
        if metric.startswith("val_"):
            averaged[metric] = points
            continue
        windows: dict[int, list[tuple[int, float]]] = {}
        for step, value in points.items():
            windows.setdefault((step - 1) // every, []).append((step, value))
        averaged[metric] = {max(step for step, _ in window): sum(value for _, value in window) / len(window)
                            for window in windows.values()}
    return averaged


def panels_of(metrics: list[str]) -> list[tuple[str, ...]]:
    """The subplots: each metric alone, except that ``val_X`` joins ``X`` when both are drawn."""
    return [(metric, f"val_{metric}") if f"val_{metric}" in metrics else (metric,) for metric in metrics
            if not (metric.startswith("val_") and metric[4:] in metrics)]


def read_curves(run_dir: Path) -> Curves:
    """``{metric: {step: value}}`` of every number in ``run_dir/metrics.jsonl`` (nulls and flags left out)."""
    if not run_dir.is_dir():
        raise LoongForgeError(f"{run_dir}: not a run directory (give run.output_dir of a training run)")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise LoongForgeError(f"{path}: not found (runs write it unless logging.jsonl is false)")
    curves: Curves = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # the torn last line of a killed run
        step = row.get("step") if isinstance(row, dict) else None
        if not isinstance(step, int):
            continue
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                curves.setdefault(key, {})[step] = float(value)
    if not curves:
        raise LoongForgeError(f"{path}: no steps recorded")
    return curves


def plot_runs(runs: dict[str, Curves], panels: list[tuple[str, ...]], out: Path) -> Path:
    """Draw ``panels`` (the metrics of each subplot) of ``runs`` (label -> curves) into the PNG ``out``."""
    try:
        import matplotlib
    except ImportError:
        raise LoongForgeError("loongforge plot needs matplotlib: pip install 'loongforge-core[plot]'") from None
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    columns = min(COLUMNS, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, squeeze=False,
                                figsize=(SUBPLOT_INCHES[0] * columns, SUBPLOT_INCHES[1] * rows), dpi=DPI)
    try:
        for ax, panel in zip(axes.flat, panels, strict=False):
            for index, (label, curves) in enumerate(runs.items()):
                for metric in panel:
                    points = sorted(curves.get(metric, {}).items())
                    name = label if metric == panel[0] else f"{label} ({metric})"
                    if not points:
                        ax.plot([], [], color=f"C{index}", label=f"{name}: not recorded")
                        continue
                    steps, values = zip(*points, strict=True)
                    ax.plot(steps, values, label=name, color=f"C{index}", linestyle="-" if metric == panel[0] else
                            "--", marker="." if len(points) < 30 else None)
            ax.set_title(" / ".join(panel))
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
        figure.tight_layout()
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            figure.savefig(out, format="png")
        except OSError as exc:
            raise LoongForgeError(f"{out}: cannot write the PNG ({exc.strerror or exc})") from None
    finally:
        plt.close(figure)
    return out


def _labels(paths: list[str]) -> dict[str, Path]:
    """Each run labelled by its directory's name, or by the path as given where two runs share a name."""
    names = [Path(path).resolve().name or path for path in paths]
    labels: dict[str, Path] = {}
    for path, name in zip(paths, names, strict=True):
        label = name if names.count(name) == 1 else path
        if label in labels:
            raise LoongForgeError(f"{path}: given twice")
        labels[label] = Path(path)
    return labels


def _chosen(requested: str | None, runs: dict[str, Curves]) -> list[str]:
    """The metrics to draw: ``--metrics`` (each recorded by at least one run) or the recorded defaults."""
    recorded = {metric for curves in runs.values() for metric in curves}
    if requested is None:
        chosen = [metric for metric in DEFAULT_METRICS if metric in recorded]
        if "tokens_per_s" not in recorded and "samples_per_s" in recorded:
            chosen.append("samples_per_s")
        return chosen or sorted(recorded)
    chosen = [name.strip() for name in requested.split(",") if name.strip()]
    if not chosen:
        raise LoongForgeError("--metrics: give at least one metric name, e.g. --metrics loss,lr")
    unknown = [name for name in chosen if name not in recorded]
    if unknown:
        raise LoongForgeError(f"--metrics: no run recorded {', '.join(unknown)}; recorded: "
                              f"{', '.join(sorted(recorded))}")
    return list(dict.fromkeys(chosen))
