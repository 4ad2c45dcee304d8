"""What the generators of shipped ``.jsonl`` sets share (``loongforge make-data preference-pairs`` and
``verifiable-tasks``): writing records as JSON lines, and the ``OUT --count --seed`` command line whose defaults
regenerate the shipped file byte for byte."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable
from pathlib import Path


def write_jsonl(out: str | Path, records: Iterable[dict]) -> Path:
    """``records`` as JSON lines in ``out`` (its folder made); return its path."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def add_generator_arguments(parser: argparse.ArgumentParser, *, unit: str, dataset: str, count: int,
                            seed: int) -> None:
    """``OUT``, ``--count`` (of ``unit``) and ``--seed``; the output is read by ``data.dataset=<dataset>``."""
    parser.add_argument("out", help=f"output .jsonl, read by data.dataset={dataset} data.paths=[OUT]")
    parser.add_argument("--count", type=int, default=count, help=f"{unit} (default {count})")
    parser.add_argument("--seed", type=int, default=seed, help=f"data seed (default {seed}: the shipped set)")


def run_generator(args: argparse.Namespace, write: Callable[[str, int, int], Path], what: str) -> int:
    """Write ``args.count`` generated ``what`` to ``args.out``; a count below 1 is one line."""
    from loongforge.errors import ConfigError

    if args.count < 1:
        raise ConfigError(f"--count {args.count}: must be at least 1")
    print(f"wrote {args.count} {what} to {write(args.out, args.count, args.seed)}")
    return 0
