"""The ``loongforge certify`` command: certify a device backend against the CPU reference on every installed
certification recipe (see :mod:`loongforge.certify.device`), print the certificate, write it as JSON; exit status 0
when every check holds."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from loongforge.certify.device import CHECKS, TOLERANCES, certify_device


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Train each installed certification recipe (loongforge list certification_recipes) on a "
                          "device backend and on the CPU reference and compare them step by step, module by module, "
                          "across resumes and parallel layouts; print a certificate (exit status 0: certified, 1: a "
                          "check failed).")
    subject = parser.add_mutually_exclusive_group(required=True)
    subject.add_argument("--device", help="the device backend to certify (a registered name, or package.module:Class)")
    subject.add_argument("--family", nargs="+", metavar="MODEL",
                         help="instead: hold registered model flavors to the model-family conformance suite (build "
                              "through the device's layers, every parameter trains, save/load, Hugging Face export "
                              "against transformers)")
    parser.add_argument("--recipes", nargs="+", metavar="RECIPE",
                        help="certification recipes to train (default: every installed one)")
    parser.add_argument("--steps", type=int, default=6, help="training steps of each run (default 6)")
    parser.add_argument("--precision", default="fp32", choices=sorted(TOLERANCES),
                        help="training precision, with its tolerances (default fp32)")
    parser.add_argument("--layouts", nargs="*", metavar="LAYOUT",
                        help="parallel layouts to run where a recipe has them (tp2, pp2, dp2, ep2, ...; default: "
                             "each recipe's own; none: one process only)")
    parser.add_argument("--checks", nargs="+", default=list(CHECKS), choices=CHECKS, metavar="CHECK",
                        help=f"which kinds of check to run, of {', '.join(CHECKS)} (default: all; a partial run "
                             "certifies only what it ran)")
    parser.add_argument("--workdir", type=Path,
                        help="keep the runs here (a reference of the same recipe already there is reused); default: "
                             "a temporary directory")
    parser.add_argument("--output", type=Path, help="write the certificate as JSON to this file")
    parser.add_argument("--fail-fast", action="store_true", help="stop at the first check that fails")


def run(args: argparse.Namespace) -> int:
    from loongforge.devices.selection import select_backend
    from loongforge.plugins import get_host

    host = get_host()
    registry = host.registry("certification_recipe")
    recipes = {name: registry.load(name, where="--recipes") for name in args.recipes or registry.names()}
    with tempfile.TemporaryDirectory(prefix="loongforge-certify-") as scratch:
        workdir = args.workdir or Path(scratch)
        if args.family:
            from loongforge.certify.family import certify_families

            certificate = certify_families(args.family, recipes, workdir)
        else:
            select_backend(args.device, host.registry("device"), source="--device")  # before any training
            certificate = certify_device(args.device, recipes, workdir, steps=args.steps, precision=args.precision,
                                         layouts=None if args.layouts is None else tuple(args.layouts),
                                         checks=tuple(args.checks), fail_fast=args.fail_fast)
    print(certificate.render())
    if args.output:
        certificate.write(args.output)
        print(f"certificate: {args.output}")
    return 0 if certificate.passed else 1

