"""The ``loongforge diff`` command: resolve the two sides, compare their metrics and replay one batch through
both models, print where they part (exit status 0: identical within the tolerance; 1: they part).

A side is a run directory (its ``metrics.jsonl`` and, when it has one, its newest checkpoint), a LoongForge
checkpoint or checkpoint root, or a Hugging Face directory. Models are built at TP=PP=1 in fp32 whatever layout or
dtype they were saved in (megatron's dist-checkpoints reshard on load), so a tp=2 run and a tp=1 run compare
directly.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loongforge.commands import add_trust_code_option
from loongforge.diffing.compare import (
    GRADIENT,
    OUTPUT,
    PARAMETER,
    Difference,
    compare_metrics,
    compare_tensors,
    first_beyond,
    read_metrics,
)
from loongforge.errors import InteropError

#: The tolerance both comparisons use unless ``--rtol`` says otherwise: above what reduction order moves in fp32
#: (different layouts of one run agree to ~1e-6 after a few steps), below any real change.
DEFAULT_RTOL = 1e-4


@dataclass(frozen=True)
class Side:
    """One argument of the command: ``run`` (a directory with metrics.jsonl) and/or ``model`` (what holds weights)."""

    label: str
    path: Path
    run: Path | None
    model: Path | None


def resolve_side(label: str, text: str) -> Side:
    path = Path(text).expanduser()
    if not path.exists():
        raise InteropError(f"{path}: no such run, checkpoint or Hugging Face directory")
    if (path / "metrics.jsonl").is_file():
        checkpoints = path / "checkpoints"
        return Side(label, path, path, checkpoints if (checkpoints / "latest").exists() else None)
    return Side(label, path, None, path)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Find where two runs, checkpoints or Hugging Face directories part: the first step whose "
                          "loss or gradient norm differs (runs), and the first parameter, module output and gradient "
                          "that differ when both models replay one batch (models, built at tp=1 in fp32 whatever "
                          "their layout). Exit status 0: identical within --rtol; 1: they part.")
    parser.add_argument("a", metavar="RUN_A", help="run directory, LoongForge checkpoint (or root), or HF directory")
    parser.add_argument("b", metavar="RUN_B", help="the same kinds, compared with RUN_A")
    parser.add_argument("--rtol", type=float, default=DEFAULT_RTOL,
                        help=f"largest relative difference that still counts as equal (default {DEFAULT_RTOL:g})")
    parser.add_argument("--seq-length", type=int, default=32, help="tokens per sequence of the replayed batch")
    parser.add_argument("--batch", type=int, default=2, help="sequences in the replayed batch")
    parser.add_argument("--seed", type=int, default=0, help="seed of the replayed batch's random tokens")
    parser.add_argument("--top", type=int, default=8, help="largest differences listed per kind (default 8)")
    parser.add_argument("--reference", choices=("A", "B"), type=str.upper,
                        help="run that side (a Hugging Face directory) in the library its family comes from "
                             "(transformers for LLMs and Qwen VLMs, diffusers for DiTs, LeRobot for the "
                             "PaliGemma-exact Pi0.5) and compare module by module under that library's names")
    for side in ("a", "b"):
        parser.add_argument(f"--device-{side}", metavar="NAME",
                            help=f"replay RUN_{side.upper()} on this device backend (a registered name or an import "
                                 "path), in a process of its own (default: the CPU, in this process)")
        parser.add_argument(f"--tp-{side}", type=int, default=1, metavar="N",
                            help=f"replay RUN_{side.upper()} at tensor-parallel size N (N local processes, shards "
                                 "gathered), so a fault that shows only when the model is split is named at its "
                                 "module; at most one side above 1 (default 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    add_trust_code_option(parser, checkpoint="either side")


def run(args: argparse.Namespace) -> int:
    if not args.rtol >= 0 or args.seq_length < 2 or args.batch < 1 or args.top < 0 or min(args.tp_a, args.tp_b) < 1:
        raise InteropError("--rtol must be >= 0, --seq-length >= 2, --batch >= 1, --top >= 0 and --tp-a/--tp-b >= 1")
    if args.tp_a > 1 and args.tp_b > 1:
        raise InteropError("--tp-a and --tp-b: at most one side replays split (the other's one-process outputs say "
                           "how to reassemble its shards)")
    a, b = resolve_side("A", args.a), resolve_side("B", args.b)
    report: dict[str, Any] = {"a": str(a.path), "b": str(b.path), "rtol": args.rtol}
    parted = False
    if a.run is not None and b.run is not None:
        parting = compare_metrics(read_metrics(a.run), read_metrics(b.run), args.rtol)
        report["metrics"] = asdict(parting)
        parted |= parting.step is not None
    if a.model is not None and b.model is not None:
        models = _compare_models(a, b, args)
        report["models"] = models
        parted |= models["first"] is not None or bool(models["settings"])
    if "metrics" not in report and "models" not in report:
        raise InteropError(f"nothing to compare: {a.path} and {b.path} are not both runs (metrics.jsonl) nor both "
                           "hold a model (a checkpoint or a Hugging Face directory)")
    print(json.dumps(report, indent=1, default=_jsonable) if args.json else _render(report, args.top))
    return 1 if parted else 0


def _compare_models(a: Side, b: Side, args: argparse.Namespace) -> dict[str, Any]:
    """Trace both models on the same batch and compare parameters, forward outputs and gradients."""
    from loongforge.diffing.task_trace import is_task_checkpoint

    tasks = [is_task_checkpoint(side.model) for side in (a, b)]
    if args.reference is not None and tasks["AB".index(args.reference)]:
        raise InteropError(f"--reference {args.reference}: {(a, b)['AB'.index(args.reference)].path} is a "
                           "LoongForge checkpoint; the reference library reads its own directories")
    if args.reference is not None and tasks[1 - "AB".index(args.reference)]:
        tasks = [True, True]  # a task model against its reference library's directory
    elif any(tasks) and not all(tasks):
        task_side = (a, b)[tasks.index(True)]
        raise InteropError(f"{task_side.path} holds a task model (trained by the task engine) and the other side does "
                           "not: `loongforge diff` compares two models of one kind")
    if all(tasks) and (_placed(args, 0) or _placed(args, 1)):
        raise InteropError("--device-a/-b and --tp-a/-b replay megatron models (LLMs, VLMs); "
                           f"{a.path} and {b.path} hold task models, replayed on the CPU in this process")
    traces, labels, settings = _task_traces(a, b, args) if all(tasks) else _decoder_traces(a, b, args)
    kinds = {PARAMETER: compare_tensors(PARAMETER, traces[0].params, traces[1].params),
             OUTPUT: compare_tensors(OUTPUT, traces[0].outputs, traces[1].outputs),
             GRADIENT: compare_tensors(GRADIENT, traces[0].grads, traces[1].grads)}
    firsts = {kind: first_beyond(found, args.rtol) for kind, found in kinds.items()}
    # a step computes with the weights first, then the forward pass, then the backward pass
    first = next((firsts[kind] for kind in (PARAMETER, OUTPUT, GRADIENT) if firsts[kind] is not None), None)
    return {
        "models": labels,
        "settings": settings,
        "loss": [trace.loss for trace in traces],
        "first": first, "first_by_kind": firsts,
        "largest": {kind: sorted(found, key=lambda d: -_order(d.rel))[: args.top] for kind, found in kinds.items()},
        "compared": {kind: len(found) for kind, found in kinds.items()},
    }


def _decoder_traces(a: Side, b: Side, args: argparse.Namespace) -> tuple[list[Any], list[str], list[str]]:
    """Megatron models (LLMs, VLMs; checkpoints or Hugging Face directories): ``--batch`` sequences of
    ``--seq-length`` random tokens (``--seed``) through both, built at tp=1 in fp32."""
    from loongforge.models.hf_format import model_differences

    if args.reference is not None:
        return _reference_traces((a, b), "AB".index(args.reference), args)
    sources = [_open(side, args.trust_code) for side in (a, b)]
    batch = _replay_batch(sources[0].family, min(source.family.decoder.vocab_size for source in sources), (), args)
    labels = [f"{source.family.family_name} ({source.path}{_where(args, i)})" for i, source in enumerate(sources)]
    traces = _placed_traces(sources, batch, args, objective_only=False)
    return traces, labels, model_differences(sources[1].family, sources[0].family)


def _replay_batch(family: Any, vocab: int, avoided: Any, args: argparse.Namespace) -> dict[str, Any]:
    """``--batch`` sequences of ``--seq-length`` random tokens below ``vocab`` and outside ``avoided`` (``--seed``),
    with what else ``family`` replays (:meth:`ModelFamily.replay_batch`)."""
    import torch

    allowed = torch.tensor([token for token in range(vocab) if token not in set(avoided)])
    generator = torch.Generator().manual_seed(args.seed)
    tokens = allowed[torch.randint(0, len(allowed), (args.batch, args.seq_length + 1), generator=generator)]
    return family.replay_batch(
        {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
         "position_ids": torch.arange(args.seq_length).unsqueeze(0).expand(args.batch, -1)}, generator)


def _one_side(args: argparse.Namespace, index: int) -> argparse.Namespace:
    """``args`` with side ``index``'s placement as side A's (for tracing that side alone)."""
    side = "ab"[index]
    return argparse.Namespace(**{**vars(args), "device_a": getattr(args, f"device_{side}"),
                                 "tp_a": getattr(args, f"tp_{side}"), "device_b": None, "tp_b": 1})


def _placed(args: argparse.Namespace, index: int) -> bool:
    """Whether side ``index`` replays somewhere else than the CPU in this process."""
    return getattr(args, f"device_{'ab'[index]}") is not None or getattr(args, f"tp_{'ab'[index]}") > 1


def _where(args: argparse.Namespace, index: int) -> str:
    device, tp = getattr(args, f"device_{'ab'[index]}"), getattr(args, f"tp_{'ab'[index]}")
    return "".join([f", on {device}" if device else "", f", tp={tp}" if tp > 1 else ""])


def _placed_traces(sources: list[Any], batch: dict[str, Any], args: argparse.Namespace, *,
                   objective_only: bool) -> list[Any]:
    """Every side's trace: in this process, or by :mod:`loongforge.diffing.worker` on its device and
    tensor-parallel size -- one-process sides first, whose output shapes say how to reassemble split ones."""
    from loongforge.diffing.reference import objective_only as silenced

    order = sorted(range(len(sources)), key=lambda i: getattr(args, f"tp_{'ab'[i]}"))
    traces: dict[int, Any] = {}
    for i in order:
        if not _placed(args, i):
            traces[i] = _trace(sources[i], batch, silenced if objective_only else contextlib.nullcontext)
            continue
        shapes = {name: list(t.shape) for trace in traces.values() for name, t in trace.outputs.items()}
        traces[i] = _worker_trace(sources[i], batch, args, i, shapes, objective_only)
    return [traces[i] for i in range(len(sources))]


def _worker_trace(source: Any, batch: dict[str, Any], args: argparse.Namespace, index: int,
                  shapes: dict[str, list[int]], objective_only: bool) -> Any:
    """Side ``index`` traced by :mod:`loongforge.diffing.worker` in processes of its own (torchrun at tp > 1)."""
    import subprocess
    import sys
    import tempfile

    from safetensors.torch import save_file

    from loongforge.diffing.worker import read_trace
    from loongforge.testing.runs import quiet_env

    device = getattr(args, f"device_{'ab'[index]}") or "cpu"
    tp = getattr(args, f"tp_{'ab'[index]}")
    with tempfile.TemporaryDirectory(prefix="loongforge-diff-") as scratch:
        work = Path(scratch)
        save_file({key: value.contiguous() for key, value in batch.items()}, str(work / "batch.safetensors"))
        (work / "shapes.json").write_text(json.dumps(shapes), encoding="utf-8")
        launcher = [sys.executable] if tp == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     f"--nproc-per-node={tp}"]
        command = [*launcher, "-m", "loongforge.diffing.worker", str(source.path), str(work / "trace.safetensors"),
                   "--device", device, "--tp", str(tp), "--batch", str(work / "batch.safetensors"),
                   "--full-shapes", str(work / "shapes.json"),
                   *(["--objective-only"] if objective_only else []), *(["--trust-code"] if args.trust_code else [])]
        done = subprocess.run(command, capture_output=True, text=True, env=quiet_env())
        if done.returncode != 0:
            raise InteropError(f"replaying {source.path} on {device} at tp={tp} failed: {_cause(done.stderr)}")
        return read_trace(work / "trace.safetensors")


def _cause(stderr: str) -> str:
    """The line of a failed worker's output that says why: its last exception (torchrun wraps it in pages of its
    own), else its last line."""
    import re

    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    causes = [line for line in lines if re.match(r"^(\[rank\d+\]: )?[\w.]*(Error|Exception): ", line)]
    return (causes or lines or ["no output"])[-1]


def _reference_traces(sides: tuple[Side, Side], index: int,
                      args: argparse.Namespace) -> tuple[list[Any], list[str], list[str]]:
    """Side ``index`` (a Hugging Face directory) run by the library the other side's family declares, that side
    by LoongForge renamed into the library's names (:mod:`loongforge.diffing.reference`). The directory is read by
    the library alone; its settings are compared when an installed family reads it too."""
    from loongforge.diffing.reference import in_reference_names, paired_outputs, trace_reference
    from loongforge.interop.model_source import is_hf_directory
    from loongforge.models.hf_format import model_differences

    theirs, ours_side = sides[index], sides[1 - index]
    if not is_hf_directory(theirs.model):
        raise InteropError(f"--reference {'AB'[index]}: {theirs.path} is not a Hugging Face directory (the "
                           "reference library reads those)")
    if _placed(args, index) or max(args.tp_a, args.tp_b) > 1:
        raise InteropError(f"--reference {'AB'[index]}: the reference library runs side {'AB'[index]} on the CPU "
                           "in one process, and the LoongForge side is compared in one process too "
                           "(--device-a/-b places it; compare a split replay with an unsplit one first)")
    ours = _open(ours_side, args.trust_code)
    reference = ours.family.reference_implementation()
    if reference is None:
        raise InteropError(f"{ours.path}: {ours.family.family_name} declares no reference implementation "
                           "(ModelFamily.reference_implementation), so --reference cannot run it")
    read = _read_family(theirs.model)  # None: no installed family reads the directory (only its library does)
    vocab = min(family.decoder.vocab_size for family in (ours.family, read) if family is not None)
    batch = _replay_batch(ours.family, vocab, reference.avoided_tokens(theirs.model), args)
    trace = _placed_traces([ours], batch, _one_side(args, 1 - index), objective_only=True)[0]
    try:
        renamed = in_reference_names(trace, reference)
    except KeyError as missing:
        raise InteropError(f"{ours.path}: its {ours.family.family_name} model has no tensor {missing} that "
                           f"{reference.library}'s names are made from") from None
    reference_trace = paired_outputs(trace_reference(reference, theirs.model, batch), reference)
    traces = [reference_trace, renamed] if index == 0 else [renamed, reference_trace]
    labels = [f"{ours.family.family_name} ({ours.path}{_where(args, 1 - index)})"] * 2
    labels[index] = f"{ours.family.family_name} in {reference.library} ({theirs.path})"
    settings = [] if read is None else model_differences(*((read, ours.family) if index == 1 else (ours.family, read)))
    return traces, labels, settings


def _read_family(path: Path) -> Any:
    """The model an installed family reads the Hugging Face directory ``path`` as, or ``None`` when none reads
    its architecture."""
    from loongforge.claims import hf_config_names
    from loongforge.models.hf_format import read_hf_model
    from loongforge.plugins import get_host

    arch, model_type = hf_config_names(str(path))
    key = arch if arch is not None else model_type
    return read_hf_model(path).family if key in get_host().registry("hf_architecture") else None


def _task_traces(a: Side, b: Side, args: argparse.Namespace) -> tuple[list[Any], list[str], list[str]]:
    """Task models (diffusion, policies): the first ``--batch`` samples of each side's task data through its task's
    deterministic loss, every random draw seeded from ``--seed`` (:mod:`loongforge.diffing.task_trace`)."""
    from loongforge.diffing.task_trace import task_settings, trace_task_checkpoint

    if args.reference is not None:
        return _task_reference_traces((a, b), "AB".index(args.reference), args)
    traced = [trace_task_checkpoint(side.model, samples=args.batch, seed=args.seed, trust_code=args.trust_code)
              for side in (a, b)]
    return ([trace for trace, _, _ in traced], [label for _, label, _ in traced],
            task_settings(traced[0][2], traced[1][2]))


def _task_reference_traces(sides: tuple[Side, Side], index: int,
                           args: argparse.Namespace) -> tuple[list[Any], list[str], list[str]]:
    """A task checkpoint's model and its family's reference library's model of the directory on side ``index``,
    both through the checkpoint task's deterministic loss with the same draws, compared under the library's
    names."""
    from loongforge.diffing.reference import in_reference_names, paired_outputs
    from loongforge.diffing.task_trace import task_replay
    from loongforge.diffing.trace import trace_loss

    theirs, ours = sides[index], sides[1 - index]
    replay = task_replay(ours.model, samples=args.batch, seed=args.seed, trust_code=args.trust_code)
    reference = replay.family.reference_implementation()
    if reference is None:
        raise InteropError(f"{ours.path}: {replay.family.family_name} declares no reference implementation "
                           "(ModelFamily.reference_implementation), so --reference cannot run it")
    renamed = in_reference_names(trace_loss(replay.model, lambda: replay.loss(replay.model, replay.generators())),
                                 reference)
    model = reference.load(theirs.path)
    inputs = {"task": replay.task, "batch": replay.batch, "generators": replay.generators()}
    reference_trace = paired_outputs(trace_loss(model, lambda: reference.loss(model, inputs)), reference)
    traces = [reference_trace, renamed] if index == 0 else [renamed, reference_trace]
    labels = [replay.label, replay.label]
    labels[index] = f"{replay.family.family_name} in {reference.library} ({theirs.path})"
    return traces, labels, []


def _open(side: Side, trust_code: bool) -> Any:
    from loongforge.interop.model_source import open_model_source

    return open_model_source(side.model, trust_code=trust_code, command="`loongforge diff`")


def _trace(source: Any, batch: dict[str, Any], objective_only: Any = contextlib.nullcontext) -> Any:
    """``source``'s model built at tp=1 in fp32 and traced on ``batch``, inside ``objective_only()`` (entered
    once the model is built: building resets megatron's loss scales)."""
    from loongforge.diffing.trace import trace_model
    from loongforge.interop.world import standalone_world
    from loongforge.models.chunks import build_standalone

    with standalone_world() as backend:
        model = source.load(build_standalone(source.family, backend, "fp32"))
        with objective_only():
            inputs = {key: value for key, value in batch.items() if key in source.family.extra_inputs}
            return trace_model(model, batch["tokens"], batch["position_ids"], batch["labels"], **inputs)


def _order(value: float) -> float:
    return math.inf if math.isnan(value) else value


def _jsonable(value: Any) -> Any:
    if isinstance(value, Difference):
        return asdict(value)
    raise TypeError(type(value).__name__)


def _render(report: dict[str, Any], top: int) -> str:
    """The human report: what was compared, where each comparison parts, the largest differences."""
    lines = [f"A: {report['a']}", f"B: {report['b']}", f"tolerance: relative {report['rtol']:g}"]
    metrics = report.get("metrics")
    if metrics is not None:
        if metrics["step"] is None:
            lines.append(f"metrics: identical over the {metrics['common_steps']} steps both logged")
        else:
            x, y = metrics["values"]
            lines.append(f"metrics: part at step {metrics['step']} ({metrics['key']} {x!r} vs {y!r}), "
                         f"of {metrics['common_steps']} steps both logged")
    models = report.get("models")
    if models is not None:
        lines.append(f"models: {models['models'][0]} vs {models['models'][1]}")
        lines += [f"  setting differs: {line}" for line in models["settings"]]
        lines.append(f"  loss on the replayed batch: {models['loss'][0]!r} vs {models['loss'][1]!r}")
        for kind, first in models["first_by_kind"].items():
            count = models["compared"][kind]
            lines.append(f"  {kind}s ({count}): " + ("identical" if first is None else f"first part at {first.name} "
                         f"(max abs {first.max_abs:.3g}, relative {first.rel:.3g}"
                         f"{', ' + first.why if first.why else ''})"))
        if top:
            for kind, largest in models["largest"].items():
                shown = [d for d in largest if d.rel > 0]
                if shown:
                    lines.append(f"  largest {kind} differences:  relative     max abs  name")
                    lines += [f"    {d.rel:10.3g}  {d.max_abs:10.3g}  {d.name}" for d in shown]
        first = models["first"]
        lines.append("verdict: " + ("identical" if first is None and not models["settings"]
                                    else f"they part at the {first.describe()}" if first is not None
                                    else "same tensors, different settings"))
    return "\n".join(lines)
