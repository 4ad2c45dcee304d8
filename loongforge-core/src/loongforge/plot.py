"""``loongforge plot RUN_DIR [RUN_DIR ...] --out curves.png``: training curves of one or several runs in one PNG,
for people who do not run TensorBoard (and for notes and reports).

Why the JSONL and not the trackers' files: every run writes ``metrics.jsonl`` (one line per step, the exact values,
whichever trackers it used), so any two runs compare, across engines and versions. One subplot per metric (x =
step), one line per run, labelled by the run directory's name. A step recorded twice (trained again after a
``rewind``) is drawn with its newest value; missing values (a NaN loss is written as ``null``) are gaps.
matplotlib (the ``plot`` extra) is imported only when a plot is drawn, with the Agg backend, so no display is
needed. Torch-free.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

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
                                          "run has tokens_per_s)")


def run(args: argparse.Namespace) -> int:
    runs = {label: read_curves(Path(path)) for label, path in _labels(args.runs).items()}
    metrics = _chosen(args.metrics, runs)
    out = plot_runs(runs, metrics, Path(args.out))
    print(f"wrote {out}: {', '.join(metrics)} of {len(runs)} run(s)")
    return 0


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


def plot_runs(runs: dict[str, Curves], metrics: list[str], out: Path) -> Path:
    """Draw ``metrics`` of ``runs`` (label -> curves) into the PNG ``out``; return its path."""
    try:
        import matplotlib
    except ImportError:
        raise LoongForgeError("loongforge plot needs matplotlib: pip install 'loongforge-core[plot]'") from None
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    columns = min(COLUMNS, len(metrics))
    rows = math.ceil(len(metrics) / columns)
    figure, axes = plt.subplots(rows, columns, squeeze=False,
                                figsize=(SUBPLOT_INCHES[0] * columns, SUBPLOT_INCHES[1] * rows), dpi=DPI)
    try:
        for ax, metric in zip(axes.flat, metrics, strict=False):
            for label, curves in runs.items():
                points = sorted(curves.get(metric, {}).items())
                if points:
                    steps, values = zip(*points, strict=True)
                    ax.plot(steps, values, label=label, marker="." if len(points) < 30 else None)
            ax.set_title(metric)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
        for ax in list(axes.flat)[len(metrics):]:
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
