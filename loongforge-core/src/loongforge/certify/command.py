"""The ``loongforge certify`` command: certify a device backend against the CPU reference (see
:mod:`loongforge.certify.device`), print the certificate, write it as JSON; exit status 0 when every check holds."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from loongforge.certify.device import CHECKS, DEFAULT_LAYOUTS, LAYOUTS, TOLERANCES, DeviceCertification, Recipe


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Train a short recipe on a device backend and on the CPU reference and compare them step by "
                          "step, module by module, across resumes and parallel layouts; print a certificate (exit "
                          "status 0: certified, 1: a check failed).")
    parser.add_argument("--device", required=True,
                        help="the device backend to certify (a registered name, or package.module:factory)")
    parser.add_argument("--model", default=Recipe.model, help=f"model flavor to train (default {Recipe.model})")
    parser.add_argument("--steps", type=int, default=Recipe.steps, help=f"training steps (default {Recipe.steps})")
    parser.add_argument("--precision", default=Recipe.precision, choices=sorted(TOLERANCES),
                        help=f"training precision, with its tolerances (default {Recipe.precision})")
    parser.add_argument("--layouts", nargs="*", default=list(DEFAULT_LAYOUTS), choices=sorted(LAYOUTS),
                        metavar="LAYOUT", help=f"parallel layouts to certify, of {', '.join(LAYOUTS)} (default: "
                        f"{' '.join(DEFAULT_LAYOUTS)}; none: one process only)")
    parser.add_argument("--checks", nargs="+", default=list(CHECKS), choices=CHECKS, metavar="CHECK",
                        help=f"which kinds of check to run, of {', '.join(CHECKS)} (default: all; a partial run "
                             "certifies only what it ran)")
    parser.add_argument("--workdir", type=Path,
                        help="keep the runs here (a reference of the same recipe already there is reused); default: "
                             "a temporary directory")
    parser.add_argument("--output", type=Path, help="write the certificate as JSON to this file")
    parser.add_argument("--fail-fast", action="store_true", help="stop at the first check that fails")


def run(args: argparse.Namespace) -> int:
    recipe = Recipe(model=args.model, steps=args.steps, precision=args.precision)
    with tempfile.TemporaryDirectory(prefix="loongforge-certify-") as scratch:
        certification = DeviceCertification(args.device, recipe, args.workdir or Path(scratch),
                                             layouts=tuple(args.layouts), checks=tuple(args.checks),
                                             fail_fast=args.fail_fast)
        certificate = certification.run()
    print(certificate.render())
    if args.output:
        certificate.write(args.output)
        print(f"certificate: {args.output}")
    return 0 if certificate.passed else 1
