"""One real training step of one transformer layer built from a device backend: the part of
:class:`~loongforge.testing.device_suite.DeviceBackendSuite` that fails a backend which cannot train.

The layer is core's decoder layer spec (:func:`loongforge.models.layer_spec.decoder_layer_spec`) filled from the
backend's ``spec_provider()``, configured with a tiny megatron ``TransformerConfig`` plus the backend's
``megatron_settings("fp32")``, inside a one-process world the backend sets up as a run would: ``apply_patches``,
``set_device(0)``, ``torch.distributed`` on the backend's ``dist_backend`` (a ``FileStore`` in a temporary
directory, world size 1), then megatron's ``initialize_model_parallel(1, 1)`` and model-parallel seeding. Forward,
backward and an optimizer step must give a finite loss, a gradient on every parameter and changed parameters.
Everything is torn down afterwards (also on failure), so the suite's other checks still run in the same process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loongforge.devices.base import DeviceBackend

#: The tiny layer: big enough for several heads and a gated MLP, small enough to step in well under a second.
HIDDEN, HEADS, FFN, SEQUENCE, BATCH = 32, 4, 64, 8, 2


@dataclass(frozen=True)
class StepResult:
    """What one step did: the losses before and after it, and the parameters it moved or left without a grad."""

    loss: float
    loss_after: float
    changed: tuple[str, ...]
    unchanged: tuple[str, ...]
    without_grad: tuple[str, ...]


@contextlib.contextmanager
def one_process_world(backend: DeviceBackend, store_dir: Path, *, dist_backend: str | None = None) -> Iterator[None]:
    """torch.distributed (world of one on ``dist_backend``, default the backend's own) and megatron's parallel
    state at TP=PP=1; both destroyed on exit."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if dist.is_initialized():
        raise AssertionError("a torch.distributed process group is already initialised in this process; the training "
                             "check needs a world of its own on the backend's dist_backend (destroy it first)")
    store = dist.FileStore(str(store_dir / "store"), 1)
    try:
        dist.init_process_group(dist_backend or backend.dist_backend, store=store, rank=0, world_size=1)
    except (RuntimeError, ValueError) as exc:
        raise AssertionError(f"torch.distributed cannot start a world on dist_backend={backend.dist_backend!r} "
                             f"declared by {type(backend).__name__}: {exc}") from exc
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def build_layer(backend: DeviceBackend, device: Any) -> Any:
    """One decoder layer from the backend's spec provider (every spec entry must be a buildable module)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from loongforge.models.layer_spec import decoder_layer_spec

    settings = backend.megatron_settings("fp32")
    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=True, **{"params_dtype": torch.float32,
                                                                 **settings.transformer_config_kwargs()},
    )
    spec = decoder_layer_spec(backend.spec_provider(), qk_layernorm=False)
    return build_module(spec, config=config, layer_number=1).to(device)


def train_one_step(backend: DeviceBackend, device: Any) -> StepResult:
    """Forward, backward and one AdamW step of :func:`build_layer` on ``device`` (inside a world)."""
    import torch

    layer = build_layer(backend, device)
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(SEQUENCE, BATCH, HIDDEN, generator=generator).to(device)
    target = torch.randn(SEQUENCE, BATCH, HIDDEN, generator=generator).to(device)
    before = {name: p.detach().clone() for name, p in layer.named_parameters()}
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)

    def loss_of() -> torch.Tensor:
        output, _ = layer(inputs, attention_mask=None)
        return torch.nn.functional.mse_loss(output.float(), target.float())

    loss = loss_of()
    loss.backward()
    without_grad = tuple(n for n, p in layer.named_parameters() if p.grad is None or not bool(p.grad.abs().sum() > 0))
    optimizer.step()
    with torch.no_grad():
        loss_after = loss_of()
    backend.synchronize()
    params = dict(layer.named_parameters())
    changed = tuple(n for n in before if not torch.equal(before[n], params[n].detach()))
    return StepResult(float(loss.detach().cpu()), float(loss_after.cpu()), changed,
                      tuple(n for n in before if n not in changed), without_grad)


def run_step(backend: DeviceBackend, store_dir: Path, *, on_device: bool = True) -> StepResult:
    """Set the backend up as a run does and train one step: on its own device and ``dist_backend``, or, with
    ``on_device=False`` (a backend wired to a FAKE vendor module), on CPU tensors in a gloo world with the CPU
    backend's megatron patches -- still with the backend's spec provider and megatron settings."""
    if on_device:
        backend.configure_env()
        backend.apply_patches()
        backend.set_device(0)
        device, dist_backend = backend.device(0), None
    else:
        from loongforge.devices.cpu import CPUBackend

        cpu = CPUBackend()
        cpu.apply_patches()
        device, dist_backend = cpu.device(0), cpu.dist_backend
    with one_process_world(backend, store_dir, dist_backend=dist_backend):
        return train_one_step(backend, device)


def main(argv: list[str] | None = None) -> int:
    """``python -m loongforge.testing.one_step MODULE:FACTORY STORE_DIR``: :func:`run_step` on ``FACTORY()`` in this
    fresh interpreter (so no other backend's patches are in effect), the result as one JSON line on stdout."""
    import dataclasses
    import json
    import sys

    from loongforge.registry import resolve_import_path

    factory, store_dir = argv if argv is not None else sys.argv[1:]
    result = run_step(resolve_import_path(factory)(), Path(store_dir))
    print(json.dumps(dataclasses.asdict(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
