"""What the ``cuda`` plugin adds to the ``loongforge`` command line: ``loongforge fp8-measure``, which times BF16
against FP8 for every GEMM module of a model on this GPU and writes the policy ``adaptive-fp8`` trains with.

Torch-free: the options are set up here (every command's are, whenever ``loongforge`` parses its arguments); the
measurement (:func:`loongforge_cuda.fp8.measure.run`) is imported when the command runs.
"""

from __future__ import annotations

import argparse

from loongforge.commands import CommandRegistry


def configure_fp8_measure(parser: argparse.ArgumentParser) -> None:
    """The options of ``loongforge fp8-measure``."""
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="model flavor name (its transformer layer's GEMMs are measured)")
    what.add_argument("--shape", action="append", help="kind=in_features,out_features[,tokens_scale] (repeatable)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the run (splits the GEMMs)")
    parser.add_argument("--tokens", help="comma-separated token counts per micro-batch (default: by device)")
    parser.add_argument("--recipe", default="auto", help="FP8 recipe: auto, blockwise, tensorwise, mxfp8, delayed")
    parser.add_argument("--device", default="auto", help="auto, cuda or cpu (cpu: FP8 emulated)")
    parser.add_argument("--min-speedup", type=float, default=1.0, help="FP8 must beat BF16 by this factor to win")
    parser.add_argument("--repeat", type=int, help="timed repetitions per point (median is kept)")
    parser.add_argument("--out", required=True, help="policy JSON file to write")


def register_commands(commands: CommandRegistry) -> None:
    commands.add("fp8-measure", help="time BF16 vs FP8 per GEMM module on this GPU and write the adaptive-fp8 policy",
                 configure=configure_fp8_measure, run="loongforge_cuda.fp8.measure:run")
