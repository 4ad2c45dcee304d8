"""One checkpoint, one batch, one device: what every module computed, written to a safetensors file.

Run as ``python -m loongforge.certify.trace_worker CHECKPOINT OUT --device NAME`` by :mod:`loongforge.certify.device`,
in a process of its own (a backend's patches are global to a process). The model is built at tp=pp=1 from the
device's spec provider and settings, filled from the checkpoint, and traced by :func:`loongforge.diffing.trace.
trace_model` on a fixed batch of random tokens (seed 0), so two files made on two devices compare tensor by tensor.
The file holds ``param/NAME``, ``output/NAME`` and ``grad/NAME`` tensors (fp32) and the loss in its metadata:
safetensors rather than pickle, so reading a trace runs no code.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from loongforge.diffing.compare import GRADIENT, OUTPUT, PARAMETER, Difference, compare_tensors, first_beyond

#: The replayed batch: sequences x tokens of random ids from this seed.
BATCH, SEQUENCE, SEED = 2, 32, 0
#: File key prefix of each kind of tensor.
PREFIXES = {PARAMETER: "param/", OUTPUT: "output/", GRADIENT: "grad/"}


def trace_checkpoint(checkpoint: Path, out: Path, device: str, precision: str) -> None:
    from safetensors.torch import save_file

    from loongforge.devices.selection import select_backend
    from loongforge.diffing.trace import trace_model
    from loongforge.interop.model_source import open_model_source
    from loongforge.interop.world import standalone_world
    from loongforge.models.chunks import build_standalone
    from loongforge.plugins import get_host

    source = open_model_source(checkpoint, command="`loongforge certify`")
    backend, _ = select_backend(device, get_host().registry("device"), source="--device")
    with standalone_world(backend) as world_backend:
        model = source.load(build_standalone(source.family, world_backend, precision))
        generator = torch.Generator().manual_seed(SEED)
        tokens = torch.randint(0, source.family.decoder.vocab_size, (BATCH, SEQUENCE + 1), generator=generator)
        place = world_backend.device(0)
        positions = torch.arange(SEQUENCE).unsqueeze(0).expand(BATCH, -1)
        trace = trace_model(model, tokens[:, :-1].to(place), positions.to(place), tokens[:, 1:].to(place))
    tensors = {f"{PREFIXES[PARAMETER]}{name}": value for name, value in trace.params.items()}
    tensors |= {f"{PREFIXES[OUTPUT]}{name}": value for name, value in trace.outputs.items()}
    tensors |= {f"{PREFIXES[GRADIENT]}{name}": value for name, value in trace.grads.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    # safetensors sorts its keys; the order the model computed them in is what "first" means, so it is kept too
    save_file({key: value.contiguous() for key, value in tensors.items()}, str(out),
              metadata={"loss": repr(trace.loss), "order": json.dumps(list(tensors))})


def compare_traces(a: Path, b: Path, tolerance: float, *, kinds: tuple[str, ...] = (PARAMETER, OUTPUT, GRADIENT),
                   ) -> tuple[float, Difference | None]:
    """The largest relative difference between two trace files over ``kinds``, and the first difference beyond
    ``tolerance`` in the order a step computes them (parameters, then forward outputs, then gradients)."""
    sides = [_read_trace(path) for path in (a, b)]
    worst, first = 0.0, None
    for kind in kinds:
        prefix = PREFIXES[kind]
        found = compare_tensors(kind, *({key[len(prefix):]: value for key, value in side.items()
                                         if key.startswith(prefix)} for side in sides))
        worst = max([worst, *(d.rel if not math.isnan(d.rel) else math.inf for d in found)])
        first = first or first_beyond(found, tolerance)
    return worst, first


def _read_trace(path: Path) -> dict[str, torch.Tensor]:
    """A trace file's tensors in the order they were computed (its ``order`` metadata)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        order = json.loads(handle.metadata()["order"])
        return {key: handle.get_tensor(key) for key in order}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", required=True)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    args = parser.parse_args(argv)
    trace_checkpoint(args.checkpoint, args.out, args.device, args.precision)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
