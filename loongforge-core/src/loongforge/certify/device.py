"""Certifying a device backend: each certification recipe (:mod:`loongforge.certify.recipes`, one per kind of model
the installation trains) trained on the backend and on the CPU reference, compared.

A recipe is a few steps of a tiny model, so each run takes seconds on a CPU. Every run goes through ``loongforge
train`` in a process of its own: a backend's megatron patches are global to a process, and a broken backend must not
leak into the reference. The checks of each recipe, cheapest first (``--fail-fast`` stops at the first that fails;
``modules`` and ``weights`` trace megatron decoders only):

1. ``train (1 process)``: the per-step loss and gradient norm of the backend's run against the reference's;
2. ``modules (one batch)``: the reference's final weights loaded on the backend and on the CPU, one batch through
   each with a hook on every module; the first module whose forward output or parameter gradient parts is named
   (a kernel that is wrong in one direction only, or only for one module, is found here even when the loss hides it);
3. ``final weights``: every parameter of the backend's final checkpoint against the reference's;
4. ``resume on device``: the backend's run resumed from its half-way checkpoint must repeat its second half bit for
   bit (RNG, optimizer and data state restored);
5. ``checkpoint to cpu``: the CPU resumed from the backend's half-way checkpoint must continue as the reference
   does (the checkpoint is portable);
6. ``layout NAME``, for each of the recipe's layouts (its defaults, or those of ``--layouts`` it has): the backend at
   that layout against the one-process reference (collectives, pipeline sends, gradient reduction).

Tolerances are relative (``max |a - b| / max |a|``) and per precision: fp32 runs on two devices agree to rounding
(different layouts of one run to ~1e-6 after a few steps), so :data:`TOLERANCES` sits well above that and far
below any real error; bf16 rounds each product to 8 bits of mantissa.
"""

from __future__ import annotations

import functools
import json
import statistics
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from loongforge.certify.certificate import Certificate, Check, installed_versions
from loongforge.certify.recipes import CertificationRecipe
from loongforge.errors import LoongForgeError
from loongforge.testing.runs import quiet_env

#: precision -> (metrics tolerance, module tolerance): relative, see the module docstring.
TOLERANCES = {"fp32": (1e-4, 1e-4), "bf16": (2e-2, 5e-2)}
#: The kinds of check, in the order they run (see the module docstring): ``--checks`` picks some.
CHECKS = ("train", "modules", "weights", "resume", "portability", "layouts")
REFERENCE_DEVICE = "cpu"


class CertifyError(LoongForgeError):
    """The certification could not be set up (not: a check failed, which the certificate reports)."""


@dataclass(frozen=True)
class Run:
    """One finished training run: its directory and per-step metrics (``None``: it failed, ``error`` says how)."""

    path: Path
    metrics: dict[int, dict] | None
    error: str = ""

    def checkpoint(self, step: int) -> Path:
        return self.path / "checkpoints" / f"step-{step:07d}"


def certify_device(device: str, recipes: Mapping[str, CertificationRecipe], workdir: Path, *, steps: int = 6,
                   precision: str = "fp32", layouts: tuple[str, ...] | None = None, checks: tuple[str, ...] = CHECKS,
                   fail_fast: bool = False, progress: Callable[[str], None] = print) -> Certificate:
    """Certify ``device`` on each recipe (each in ``workdir/NAME``); ``layouts``: the layout names to run where a
    recipe has them (``None``: each recipe's defaults)."""
    unknown = [name for name in checks if name not in CHECKS]
    if unknown or not checks:
        raise CertifyError(f"unknown check(s) {', '.join(unknown)}; known: {', '.join(CHECKS)}" if unknown
                           else "no check selected (--checks)")
    if precision not in TOLERANCES:
        raise CertifyError(f"precision '{precision}' is not certified; use one of {', '.join(TOLERANCES)}")
    if steps < 2:
        raise CertifyError("--steps must be at least 2 (the resume checks continue from the half-way checkpoint)")
    if not recipes:
        raise CertifyError("no certification recipe to train (none registered, or --recipes chose none)")
    if layouts is not None:
        known = {name for recipe in recipes.values() for name in recipe.layouts}
        missing = [name for name in layouts if name not in known]
        if missing:
            raise CertifyError(f"no recipe has layout(s) {', '.join(missing)}; known: {', '.join(sorted(known))}")
    chosen = tuple(kind for kind in CHECKS if kind in checks)  # cheapest first, whatever the order given
    certificate = Certificate(device, precision, {name: recipe.description for name, recipe in recipes.items()},
                              steps, scope=chosen, complete=chosen == CHECKS and layouts is None,
                              versions=installed_versions())
    for name, recipe in recipes.items():
        single = RecipeCertification(device, name, recipe, workdir / name, steps=steps, precision=precision,
                                     layouts=recipe.chosen_layouts(layouts), checks=chosen, progress=progress)
        passed = single.run(certificate, fail_fast=fail_fast)
        if fail_fast and not passed:
            break
    return certificate


class RecipeCertification:
    """The runs and checks of one recipe, in ``workdir`` (a reference already there for the same recipe is reused,
    so certifying several backends trains it once)."""

    def __init__(self, device: str, name: str, recipe: CertificationRecipe, workdir: Path, *, steps: int,
                 precision: str, layouts: tuple[str, ...], checks: tuple[str, ...],
                 progress: Callable[[str], None]) -> None:
        self.device, self.name, self.recipe, self.workdir = device, name, recipe, workdir
        self.steps, self.half, self.precision = steps, max(1, steps // 2), precision
        self.layouts, self.progress = layouts, progress
        self.checks = checks
        self.metrics_tolerance, self.module_tolerance = TOLERANCES[precision]
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.recipe_path = self.workdir / "recipe.yaml"
        self.reused_reference = False
        self.recipe_path.write_text(yaml.safe_dump(recipe.run_config(steps, precision), sort_keys=False),
                                    encoding="utf-8")

    def run(self, certificate: Certificate, *, fail_fast: bool) -> bool:
        """Add this recipe's checks to ``certificate``; whether they all held."""
        reference = self._reference()
        for stale in self.workdir.glob("trace-*.safetensors"):  # traces of another device (or reference) than this
            if stale.name != "trace-reference-on-cpu.safetensors" or not self.reused_reference:
                stale.unlink()
        if reference.metrics is None:
            raise CertifyError(f"the CPU reference run of recipe '{self.name}' failed, nothing can be certified: "
                               f"{reference.error}")
        candidate = functools.cache(lambda: self._train("device", self.device))  # only the checks that need it
        checks: dict[str, list[Callable[[], Check]]] = {
            "train": [lambda: self._compare_runs("train (1 process)", candidate(), reference)],
            "modules": [lambda: self._modules(reference)],
            "weights": [lambda: self._final_weights(candidate(), reference)],
            "resume": [lambda: self._resume_on_device(candidate())],
            "portability": [lambda: self._checkpoint_to_cpu(candidate(), reference)],
            "layouts": [lambda name=name: self._layout(name, reference) for name in self.layouts],
        }
        passed = True
        for check in (check for kind in self.checks for check in checks[kind]):
            result = check()
            certificate.checks.append(result)
            self.progress(f"[certify] {self.name}: {result.name}: {'pass' if result.passed else 'FAIL'} "
                          f"({result.detail})")
            passed &= result.passed
            if fail_fast and not result.passed:
                break
        if "train" in self.checks and candidate().metrics is not None:
            certificate.speed_vs_reference[self.name] = (_steps_per_second(candidate())
                                                         / _steps_per_second(reference))
        return passed

    # -- runs ------------------------------------------------------------------------------------------------------

    def _reference(self) -> Run:
        """The CPU run every check compares with; reused when ``workdir`` holds one of this very recipe."""
        path = self.workdir / "reference"
        recorded = path / "recipe.yaml"
        if recorded.is_file() and recorded.read_text(encoding="utf-8") == self.recipe_path.read_text(encoding="utf-8"):
            metrics = _read_metrics(path)
            if metrics is not None and len(metrics) == self.steps:
                self.progress(f"[certify] {self.name}: reference: reusing {path}")
                self.reused_reference = True
                return Run(path, metrics)
        run = self._train("reference", REFERENCE_DEVICE)
        if run.metrics is not None:
            recorded.write_text(self.recipe_path.read_text(encoding="utf-8"), encoding="utf-8")
        return run

    def _train(self, name: str, device: str, *overrides: str, nproc: int = 1) -> Run:
        path = self.workdir / name
        if path.exists():
            _remove(path)
        command = [sys.executable, "-m", "loongforge.cli", "train", str(self.recipe_path), f"run.output_dir={path}",
                   *overrides, "--device", device]
        if nproc > 1:
            command += ["--nproc", str(nproc)]
        processes = f" ({nproc} processes)" if nproc > 1 else ""
        self.progress(f"[certify] {self.name}: training {name} on {device}{processes}")
        done = subprocess.run(command, capture_output=True, text=True, env=quiet_env())
        if done.returncode != 0:
            return Run(path, None, _last_line(done.stderr) or f"exit status {done.returncode}")
        return Run(path, _read_metrics(path))

    # -- checks ----------------------------------------------------------------------------------------------------

    def _compare_runs(self, name: str, run: Run, reference: Run, steps: range | None = None,
                      tolerance: float | None = None) -> Check:
        """Per-step loss and gradient norm of ``run`` against ``reference`` over ``steps`` (default: all)."""
        tolerance = self.metrics_tolerance if tolerance is None else tolerance
        if run.metrics is None:
            return Check(self.name, name, False, float("inf"), tolerance, f"the run failed: {run.error}")
        steps = steps or range(1, self.steps + 1)
        worst, parting = 0.0, ""
        for step in steps:
            mine, theirs = run.metrics.get(step), reference.metrics.get(step)
            if mine is None:
                return Check(self.name, name, False, float("inf"), tolerance, f"step {step} is missing from {run.path}")
            for key in ("loss", "grad_norm"):
                gap = _relative(mine[key], theirs[key])
                if gap > tolerance and not parting:
                    parting = f"parts at step {step}: {key} {mine[key]!r} vs reference {theirs[key]!r}"
                worst = max(worst, gap)
        held = f"loss and grad norm within tolerance over steps {steps.start}-{steps.stop - 1}"
        return Check(self.name, name, not parting, worst, tolerance, parting or held)

    def _modules(self, reference: Run) -> Check:
        """One batch through the reference's final weights on the backend and on the CPU, module by module."""
        name = "modules (one batch)"
        checkpoint = reference.checkpoint(self.steps)
        traces = [self._trace("reference-on-cpu", checkpoint, REFERENCE_DEVICE),
                  self._trace("reference-on-device", checkpoint, self.device)]
        failed = next((trace for trace in traces if isinstance(trace, str)), None)
        if failed is not None:
            return Check(self.name, name, False, float("inf"), self.module_tolerance, failed)
        from loongforge.diffing.compare import GRADIENT, OUTPUT, PARAMETER
        from loongforge.diffing.worker import compare_traces

        worst, first = compare_traces(*traces, self.module_tolerance, kinds=(PARAMETER, OUTPUT, GRADIENT))
        detail = f"first parts at the {first.describe()}" if first else "every module output and gradient agrees"
        return Check(self.name, name, first is None, worst, self.module_tolerance, detail)

    def _final_weights(self, run: Run, reference: Run) -> Check:
        """Every parameter of the backend's final checkpoint against the reference's (both read on the CPU)."""
        name = "final weights"
        if run.metrics is None:
            return Check(self.name, name, False, float("inf"), self.module_tolerance, f"the run failed: {run.error}")
        traces = [self._trace("reference-on-cpu", reference.checkpoint(self.steps), REFERENCE_DEVICE),
                  self._trace("device-run-on-cpu", run.checkpoint(self.steps), REFERENCE_DEVICE)]
        failed = next((trace for trace in traces if isinstance(trace, str)), None)
        if failed is not None:
            return Check(self.name, name, False, float("inf"), self.module_tolerance, failed)
        from loongforge.diffing.compare import PARAMETER
        from loongforge.diffing.worker import compare_traces

        worst, first = compare_traces(*traces, self.module_tolerance, kinds=(PARAMETER,))
        detail = f"first parts at the {first.describe()}" if first else "every parameter agrees"
        return Check(self.name, name, first is None, worst, self.module_tolerance, detail)

    def _trace(self, label: str, checkpoint: Path, device: str) -> Path | str:
        """``checkpoint`` traced on ``device`` (:mod:`loongforge.diffing.worker`), once per label: the file,
        or why it could not be made."""
        out = self.workdir / f"trace-{label}.safetensors"
        if out.is_file():
            return out
        command = [sys.executable, "-m", "loongforge.diffing.worker", str(checkpoint), str(out),
                   "--device", device, "--precision", self.precision]
        done = subprocess.run(command, capture_output=True, text=True, env=quiet_env())
        if done.returncode != 0:
            return f"tracing {checkpoint.name} on {device} failed: {_last_line(done.stderr)}"
        return out

    def _resume_on_device(self, run: Run) -> Check:
        name = "resume on device"
        if run.metrics is None:
            return Check(self.name, name, False, float("inf"), 0.0, f"the run failed: {run.error}")
        resumed = self._train("device-resumed", self.device, f"checkpoint.resume={run.checkpoint(self.half)}")
        return self._compare_runs(name, resumed, run, range(self.half + 1, self.steps + 1), 0.0)

    def _checkpoint_to_cpu(self, run: Run, reference: Run) -> Check:
        name = "checkpoint to cpu"
        if run.metrics is None:
            return Check(self.name, name, False, float("inf"), self.metrics_tolerance, f"the run failed: {run.error}")
        resumed = self._train("cpu-from-device", REFERENCE_DEVICE,
                              f"checkpoint.resume={run.checkpoint(self.half)}")
        return self._compare_runs(name, resumed, reference, range(self.half + 1, self.steps + 1))

    def _layout(self, layout: str, reference: Run) -> Check:
        chosen = self.recipe.layouts[layout]
        run = self._train(f"layout-{layout}", self.device, *chosen.overrides, "checkpoint.interval=0",
                          "checkpoint.save_at_end=false", nproc=chosen.processes)
        return self._compare_runs(f"layout {layout}", run, reference)


def _read_metrics(path: Path) -> dict[int, dict] | None:
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        return None
    rows = [json.loads(line) for line in metrics.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {row["step"]: row for row in rows if "loss" in row}


def _relative(value: float, reference: float) -> float:
    gap = abs(value - reference)
    if gap != gap:  # NaN on one side
        return float("inf")
    return gap / abs(reference) if reference else (0.0 if gap == 0 else float("inf"))


def _steps_per_second(run: Run) -> float:
    """Steady-state speed: the median step time without the first step (start-up, first allocations)."""
    times = [row["step_time"] for step, row in sorted(run.metrics.items()) if step > 1 and "step_time" in row]
    return 1.0 / statistics.median(times) if times else float("nan")


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path)
