"""Start-up time of the commands that do no training, next to the floor set by Python and by importing torch.

Each command runs as a fresh ``python -m loongforge.cli ...`` process ``--repeats`` times (after one warm-up that
fills the OS file cache) in a scratch directory; the table shows the median wall time, the ratio to a bare
``import torch`` (what any torch-based trainer's CLI pays before doing anything), and which heavy libraries the
command imported (from ``-X importtime``), since a command that imports none of them should cost about as much as
``python -c pass``. Usage::

    python benchmarks/startup.py                 # median of 5
    python benchmarks/startup.py --repeats 9 --json startup.json

The machine's load shows in every row alike; compare rows of one run, not runs on different days.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Libraries whose import dominates a start-up: each costs from half a second to seconds.
HEAVY = ("torch", "megatron.core", "transformers", "diffusers", "lerobot")
#: (label, argv after the interpreter): the floors first, then LoongForge's commands that train nothing.
COMMANDS = (
    ("python -c pass", ["-c", "pass"]),
    ("python -c 'import torch'", ["-c", "import torch"]),
    ("loongforge --help", ["-m", "loongforge.cli", "--help"]),
    ("loongforge list models", ["-m", "loongforge.cli", "list", "models"]),
    ("loongforge plugins", ["-m", "loongforge.cli", "plugins"]),
    ("loongforge check quickstart.yaml", ["-m", "loongforge.cli", "check", str(ROOT / "configs/quickstart.yaml")]),
    ("loongforge check sft-tiny.yaml", ["-m", "loongforge.cli", "check", str(ROOT / "configs/sft-tiny.yaml")]),
    ("loongforge plan quickstart.yaml", ["-m", "loongforge.cli", "plan", str(ROOT / "configs/quickstart.yaml"),
                                         "--devices", "8"]),
    ("loongforge make-data verifiable-tasks", ["-m", "loongforge.cli", "make-data", "verifiable-tasks", "t.jsonl"]),
    ("loongforge doctor", ["-m", "loongforge.cli", "doctor"]),
)


def _seconds(argv: list[str], cwd: str) -> float:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if result.returncode:
        raise SystemExit(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()[-400:]}")
    return elapsed


def _heavy_imports(argv: list[str], cwd: str) -> list[str]:
    """The :data:`HEAVY` libraries the command imports (their top-level entries in ``-X importtime``)."""
    result = subprocess.run([sys.executable, "-X", "importtime", *argv], cwd=cwd, capture_output=True, text=True)
    lines = [line for line in result.stderr.splitlines() if line.startswith("import time")]
    imported = {line.rsplit("|", 1)[-1].strip() for line in lines}
    return [name for name in HEAVY if name in imported]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per command (the median is shown)")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for label, argv in COMMANDS:
            _seconds(argv, scratch)  # warm-up: the file cache, .pyc files
            median = statistics.median(_seconds(argv, scratch) for _ in range(args.repeats))
            rows.append({"command": label, "median_s": round(median, 3), "imports": _heavy_imports(argv, scratch)})
    torch_floor = rows[1]["median_s"]
    print(f"{'command':40s} {'median s':>9s} {'/ import torch':>15s}  heavy imports")
    for row in rows:
        ratio = row["median_s"] / torch_floor
        print(f"{row['command']:40s} {row['median_s']:9.3f} {ratio:15.2f}  {', '.join(row['imports']) or '-'}")
    if args.json:
        args.json.write_text(json.dumps({"repeats": args.repeats, "rows": rows}, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
