"""The multi-token-prediction loss of a step, for the metrics (``mtp_loss``).

Megatron adds each MTP block's loss to training's gradient (``MTPLossAutoScaler``) and writes the unscaled loss of
every micro-batch into a process-wide tracker on the ranks that hold the blocks (the last pipeline stage). This reads
that tracker once per step, so the loss the blocks are trained on is visible beside the main loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper


def collect_mtp_loss(num_blocks: int, num_microbatches: int) -> float:
    """The step's MTP loss: each block's cross-entropy averaged over micro-batches and data-parallel ranks, then
    over the blocks; the tracker is reset. Every rank takes part in one all-reduce (the stages without the blocks
    add zeros; tensor-parallel ranks hold the same value and are counted once)."""
    tracker = MTPLossLoggingHelper.tracker
    values = torch.zeros(num_blocks, dtype=torch.float32)
    if "values" in tracker:
        values += tracker["values"].detach().float().cpu()
        tracker["values"].zero_()
    copies = 1
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values)
        copies = dist.get_world_size() // parallel_state.get_pipeline_model_parallel_world_size()
    return (values.sum() / (copies * num_microbatches * num_blocks)).item()


def discard_mtp_loss() -> None:
    """Forget what forward passes since the last :func:`collect_mtp_loss` tracked (an evaluation's)."""
    values = MTPLossLoggingHelper.tracker.get("values")
    if values is not None:
        values.zero_()
