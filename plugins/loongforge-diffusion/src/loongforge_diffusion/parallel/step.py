"""The flow-matching training step under context parallelism; its loss is the single-process loss.

Every rank of the group draws the step's noise levels, noise and caption dropout for the *whole* batch from
its generator (which must be in the same state on all ranks, as it is when each is seeded alike and steps
alike), then scores only its own tokens: the squared error summed over local tokens is divided by each
sample's global token count, and the partial losses are summed over the group. The returned value is the
global loss on every rank; back-propagating it leaves each rank with its share of the gradient, and
:func:`~loongforge_diffusion.parallel.collectives.all_reduce_gradients` over the group completes it.
"""

from __future__ import annotations

import torch

from loongforge_diffusion.flow_matching import FlowMatchingConfig
from loongforge_diffusion.parallel.collectives import sum_partials
from loongforge_diffusion.parallel.forward import local_prediction
from loongforge_diffusion.parallel.group import ContextParallel
from loongforge_diffusion.parallel.tokens import patchify
from loongforge_diffusion.training import Generators, flavor_of, step_inputs
from loongforge_diffusion.wan.model import WanModel


def context_parallel_step(model: WanModel, batch: dict[str, torch.Tensor], generator: Generators,
                          cp: ContextParallel, config: FlowMatchingConfig = FlowMatchingConfig(), *,
                          context_dropout: float = 0.0, clean_first_frame: bool = False) -> torch.Tensor:
    """``training.flow_matching_step`` computed by the ranks of ``cp`` together (same arguments, same batch on
    every rank; ``model`` may be wrapped by DDP or FSDP2). Call ``all_reduce_gradients(model, cp.group)`` after
    the backward, unless a data-parallel wrapper over the same ranks averages the gradients already (as in
    ``loongforge train``, which scales the loss by cp for that)."""
    inputs = step_inputs(model, batch, generator, config, context_dropout=context_dropout,
                         clean_first_frame=clean_first_frame)
    patch = flavor_of(model).patch_size
    prediction = local_prediction(model, inputs.model_input, inputs.timestep, inputs.context, inputs.image_context,
                                  cp)
    target = cp.local(patchify(inputs.target, patch), 1)
    mask = cp.local(patchify(inputs.mask, patch), 1)  # (B, s, patch volume): one channel
    channels = inputs.target.shape[1]
    squared = ((prediction.float() - target.float()) ** 2).unflatten(-1, (-1, channels)).sum(-1)
    partial = (squared * mask).flatten(1).sum(dim=1) / (inputs.mask.flatten(1).sum(dim=1) * channels)
    return sum_partials((partial * inputs.weight).mean(), cp.group)
