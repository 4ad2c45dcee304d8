"""One model, one batch, one device and tensor-parallel size: what every module computed, written to a file.

Run in a process of its own -- a backend's patches are global to a process, and tensor parallelism needs a world of
that many processes -- as ``python -m loongforge.diffing.worker MODEL OUT --device NAME`` (``loongforge certify``),
or under ``torch.distributed.run`` with ``--tp N`` (``loongforge diff --tp-b N``). The model is built from the
device's spec provider at that tensor-parallel size, filled from a checkpoint or Hugging Face directory (resharded
on loading), and traced by :func:`loongforge.diffing.trace.trace_model` on a batch from ``--batch`` (a safetensors
file) or, without one, a fixed batch of random tokens (seed 0), so two files made on two devices or layouts
compare tensor by tensor. A task model's checkpoint (a DiT, a policy) replays its own first samples through its
task's deterministic loss instead (:mod:`loongforge.diffing.task_trace`), in one process.

At tensor-parallel size N every rank traces its shards; rank 0 assembles them as one process would hold them
(:func:`gather_outputs`): parameters and gradients through the checkpoint's own shard map
(:func:`loongforge.interop.sharding.gather_full_state`), each column-parallel output by its weight's rows, other
split outputs along the dimension ``--full-shapes`` (the shapes a one-process trace produced) says they were split.
A module whose ranks disagree on an output every rank should hold whole keeps rank 0's: the place a faulty
reduction shows.

The file holds ``param/NAME``, ``output/NAME`` and ``grad/NAME`` tensors (fp32) and the loss in its metadata:
safetensors rather than pickle, so reading a trace runs no code.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from loongforge.diffing.compare import GRADIENT, OUTPUT, PARAMETER, Difference, compare_tensors, first_beyond
from loongforge.diffing.trace import Trace

#: The default replayed batch: sequences x tokens of random ids from this seed.
BATCH, SEQUENCE, SEED = 2, 32, 0
#: File key prefix of each kind of tensor.
PREFIXES = {PARAMETER: "param/", OUTPUT: "output/", GRADIENT: "grad/"}
#: Keys of a replayed batch that are not the model's extra inputs.
TEXT_KEYS = ("tokens", "labels", "position_ids")


def default_batch(vocab_size: int) -> dict[str, torch.Tensor]:
    """The fixed text certify replays: :data:`BATCH` sequences of :data:`SEQUENCE` random tokens (the family's
    :meth:`~loongforge.models.family.ModelFamily.replay_batch` adds what else it takes)."""
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, vocab_size, (BATCH, SEQUENCE + 1), generator=generator)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
            "position_ids": torch.arange(SEQUENCE).unsqueeze(0).expand(BATCH, -1)}


def trace_source(model_path: Path, *, device: str, precision: str, tp: int, batch: dict[str, torch.Tensor] | None,
                 full_shapes: dict[str, list[int]] | None = None, objective_only: bool = False,
                 trust_code: bool = False) -> Trace | None:
    """The trace of the model at ``model_path`` on ``device`` at tensor-parallel size ``tp`` (the world's size),
    assembled on rank 0 (other ranks get ``None``)."""
    from loongforge.devices.selection import select_backend
    from loongforge.diffing.task_trace import is_task_checkpoint, trace_task_checkpoint
    from loongforge.diffing.trace import trace_model
    from loongforge.interop.model_source import open_model_source
    from loongforge.interop.world import standalone_world
    from loongforge.models.chunks import ChunkBuild
    from loongforge.models.decoder_model import ParallelSettings
    from loongforge.plugins import get_host

    backend, _ = select_backend(device, get_host().registry("device"), source="--device")
    if is_task_checkpoint(model_path):  # its own data, its own deterministic loss, one process
        backend.apply_patches()
        return trace_task_checkpoint(model_path, samples=BATCH, seed=SEED, trust_code=trust_code,
                                     device=backend.device(0))[0]
    source = open_model_source(model_path, trust_code=trust_code, command="`loongforge diff`")
    if batch is None:
        batch = source.family.replay_batch(default_batch(source.family.decoder.vocab_size),
                                           torch.Generator().manual_seed(SEED))
    with standalone_world(backend, tp_size=tp) as world_backend:
        build = ChunkBuild(backend=world_backend, params_dtype=precision, parallel=ParallelSettings(tp=tp), seed=None)
        model = source.load(source.family.build_chunk(build))
        place = world_backend.device(0)
        inputs = {key: value.to(place) for key, value in batch.items() if key in source.family.extra_inputs}
        with _objective_only() if objective_only else contextlib.nullcontext():
            trace = trace_model(model, batch["tokens"].to(place), batch["position_ids"].to(place),
                                batch["labels"].to(place), **inputs)
        if tp == 1:
            return trace
        return gather_trace(model, trace, tp, full_shapes or {})


def _objective_only() -> Any:
    from loongforge.diffing.reference import objective_only

    return objective_only()


def gather_trace(model: Any, trace: Trace, tp: int, full_shapes: dict[str, list[int]]) -> Trace | None:
    """Collective: every rank's shards of ``trace`` assembled into one process's tensors on rank 0."""
    import torch.distributed as dist

    from loongforge.interop.sharding import gather_full_state, row_blocks

    params = gather_full_state([model])
    with _parameters_holding_gradients(model):
        grads = gather_full_state([model])
    shared = (trace.outputs, row_blocks(model))
    everything: list[Any] | None = [None] * tp if dist.get_rank() == 0 else None
    dist.gather_object(shared, everything, dst=0)
    if everything is None:
        return None
    outputs = gather_outputs([outputs for outputs, _ in everything], [rows for _, rows in everything], full_shapes)
    return Trace(params=_floats(params), outputs=outputs, grads=_floats(grads), loss=trace.loss)


def _floats(state: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    return {name: tensor.float() for name, tensor in (state or {}).items() if not name.endswith("_extra_state")}


@contextlib.contextmanager
def _parameters_holding_gradients(model: Any) -> Iterator[None]:
    """Each parameter's data swapped for its gradient (zeros where it got none), so the checkpoint's shard map
    gathers gradients exactly as it gathers weights."""
    swapped = []
    for parameter in model.parameters():
        gradient = parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
        swapped.append((parameter, parameter.data))
        parameter.data = gradient.detach()
    try:
        yield
    finally:
        for parameter, data in swapped:
            parameter.data = data


def gather_outputs(ranks: list[dict[str, torch.Tensor]], rows: list[dict[str, tuple[int, list[tuple[int, int]]]]],
                   full_shapes: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """One process's outputs from every rank's (in rank 0's order; see the module docstring for the rules)."""
    outputs = {}
    for name, first in ranks[0].items():
        shards = [outputs_of_rank.get(name, first) for outputs_of_rank in ranks]
        width = rows[0].get(name)
        if width is not None and first.shape[-1] == sum(stop - start for start, stop in width[1]):
            outputs[name] = _place_columns(shards, [rank_rows[name][1] for rank_rows in rows], width[0])
            continue
        split = _split_dimension(list(first.shape), full_shapes.get(name), len(ranks))
        outputs[name] = first if split is None else torch.cat(shards, dim=split)
    return outputs


def _place_columns(shards: list[torch.Tensor], blocks: list[list[tuple[int, int]]], full: int) -> torch.Tensor:
    out = shards[0].new_empty((*shards[0].shape[:-1], full))
    for shard, rank_blocks in zip(shards, blocks, strict=True):
        offset = 0
        for start, stop in rank_blocks:
            out[..., start:stop] = shard[..., offset : offset + stop - start]
            offset += stop - start
    return out


def _split_dimension(local: list[int], full: list[int] | None, tp: int) -> int | None:
    """The dimension a shard of shape ``local`` was cut from ``full`` along (the last, if several fit)."""
    if full is None or len(full) != len(local) or full == local:
        return None
    fits = [d for d, (n, m) in enumerate(zip(local, full, strict=True)) if m == n * tp
            and all(a == b for e, (a, b) in enumerate(zip(local, full, strict=True)) if e != d)]
    return fits[-1] if fits else None


def write_trace(trace: Trace, out: Path) -> None:
    from safetensors.torch import save_file

    tensors = {f"{PREFIXES[PARAMETER]}{name}": value for name, value in trace.params.items()}
    tensors |= {f"{PREFIXES[OUTPUT]}{name}": value for name, value in trace.outputs.items()}
    tensors |= {f"{PREFIXES[GRADIENT]}{name}": value for name, value in trace.grads.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    # safetensors sorts its keys; the order the model computed them in is what "first" means, so it is kept too
    save_file({key: value.contiguous() for key, value in tensors.items()}, str(out),
              metadata={"loss": repr(trace.loss), "order": json.dumps(list(tensors))})


def read_trace(path: Path) -> Trace:
    """A trace file as a :class:`Trace`, its tensors in the order they were computed."""
    from safetensors import safe_open

    trace = Trace()
    kinds = {prefix: getattr(trace, attribute) for prefix, attribute in
             ((PREFIXES[PARAMETER], "params"), (PREFIXES[OUTPUT], "outputs"), (PREFIXES[GRADIENT], "grads"))}
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
        for key in json.loads(metadata["order"]):
            prefix = key[: key.index("/") + 1]
            kinds[prefix][key[len(prefix):]] = handle.get_tensor(key)
    trace.loss = float(metadata["loss"])
    return trace


def compare_traces(a: Path, b: Path, tolerance: float, *, kinds: tuple[str, ...] = (PARAMETER, OUTPUT, GRADIENT),
                   ) -> tuple[float, Difference | None]:
    """The largest relative difference between two trace files over ``kinds``, and the first difference beyond
    ``tolerance`` in the order a step computes them (parameters, then forward outputs, then gradients)."""
    sides = [read_trace(path) for path in (a, b)]
    tensors = {PARAMETER: "params", OUTPUT: "outputs", GRADIENT: "grads"}
    worst, first = 0.0, None
    for kind in kinds:
        found = compare_tensors(kind, *(getattr(side, tensors[kind]) for side in sides))
        worst = max([worst, *(d.rel if not math.isnan(d.rel) else math.inf for d in found)])
        first = first or first_beyond(found, tolerance)
    return worst, first


def _read_batch(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", required=True)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--batch", type=Path, help="safetensors file of the batch (default: certify's fixed one)")
    parser.add_argument("--full-shapes", type=Path, help="JSON: module -> output shape of a one-process trace")
    parser.add_argument("--objective-only", action="store_true", help="MoE balancing loss without gradient")
    parser.add_argument("--trust-code", action="store_true")
    args = parser.parse_args(argv)
    shapes = json.loads(args.full_shapes.read_text(encoding="utf-8")) if args.full_shapes else None
    trace = trace_source(args.model, device=args.device, precision=args.precision, tp=args.tp,
                         batch=_read_batch(args.batch) if args.batch else None, full_shapes=shapes,
                         objective_only=args.objective_only, trust_code=args.trust_code)
    if trace is not None:
        write_trace(trace, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
