"""The reference side of ``loongforge diff --reference``: a Hugging Face directory run in the library its family
declares (:class:`~loongforge.models.family.ReferenceImplementation`), and LoongForge's trace renamed into that
library's names so the two compare tensor by tensor.

Parameters and gradients are renamed by the family's conversion (reshapes, slices and concatenations, linear, so
gradients map as values do); forward outputs by the family's module pairs, brought to the reference's layout
(batch first, the unpadded vocabulary). Outputs of reference modules without a pair are not compared.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from loongforge.diffing.trace import Trace, trace_loss


def trace_reference(reference: Any, path: Path, batch: Mapping[str, torch.Tensor]) -> Trace:
    """``reference`` (a :class:`~loongforge.models.family.ReferenceImplementation`) loaded from ``path`` and traced
    on ``batch`` with its own loss."""
    model = reference.load(path)
    return trace_loss(model, lambda: reference.loss(model, batch))


def in_reference_names(trace: Trace, reference: Any) -> Trace:
    """LoongForge's ``trace`` under ``reference``'s names: every paired module's output in the order our forward pass
    computed them (so the first that parts is where a fault begins), every parameter and gradient (a parameter that
    got no gradient counts as a zero one)."""
    outputs = {}
    pairs = {pair.ours: pair for pair in reference.module_pairs()}
    for name, output in trace.outputs.items():  # forward order, whatever order the pairs are declared in
        pair = pairs.get(name)
        if pair is None:
            continue  # a module without a counterpart; a paired reference module we never ran shows as its own
        if pair.seq_first:
            output = output.transpose(0, 1)
        if pair.width is not None:
            output = output[..., : pair.width]
        outputs[pair.theirs] = output.contiguous()
    grads = {name: trace.grads.get(name, torch.zeros_like(value)) for name, value in trace.params.items()}
    return Trace(params=reference.parameters(trace.params), outputs=outputs, grads=reference.parameters(grads),
                 loss=trace.loss)


def paired_outputs(trace: Trace, reference: Any) -> Trace:
    """The reference's ``trace`` with only the outputs of modules that have a LoongForge counterpart, and a zero
    gradient for each parameter that got none (as :func:`in_reference_names` counts LoongForge's: a parameter
    outside the loss, such as a last block's unused text stream, is then equal on both sides)."""
    paired = {pair.theirs for pair in reference.module_pairs()}
    grads = {name: trace.grads.get(name, torch.zeros_like(value)) for name, value in trace.params.items()}
    return Trace(params=trace.params, outputs={name: t for name, t in trace.outputs.items() if name in paired},
                 grads=grads, loss=trace.loss)


@contextlib.contextmanager
def objective_only() -> Iterator[None]:
    """Megatron's MoE balancing loss contributes no gradient inside: it is a term of LoongForge's training
    objective that a reference model's own loss does not have, and it would make every router gradient part."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    before = MoEAuxLossAutoScaler.main_loss_backward_scale
    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(0.0)
    try:
        yield
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = before
