"""A step's speed in the units people compare training runs by: samples/s, tokens/s, model TFLOP/s per device and
model-FLOPs utilisation (MFU).

MFU is model FLOPs over the device's dense peak (the PaLM paper's definition): the FLOPs the model needs for one
step -- the model family's own count (:meth:`~loongforge.models.family.ModelFamily.flops_per_token`, by default from
its ``decoder_terms``, the numbers the layout planner's time model uses: the matmuls, attention's two products, the
output layer; plus parts outside the decoder such as a VLM's vision tower) with activation recompute left out, so
that recomputing costs MFU rather than inflating it -- divided by the step time, the devices and the backend's
:meth:`~loongforge.devices.base.DeviceBackend.dense_peak_flops`. Engines or families that do not count their FLOPs
(the task engine's diffusion and policy models) report samples/s only; a backend without a peak figure for the
precision gets ``tflops`` but no ``mfu``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loongforge.planner.memory import Workload
    from loongforge.train.trainer import Trainer


def model_flops_per_step(workload: Workload, samples: int) -> float | None:
    """Training FLOPs (forward and backward, no recompute) of ``samples`` sequences of ``workload``: the family's
    :meth:`~loongforge.models.family.ModelFamily.flops_per_token` and its parts' FLOPs per sample; ``None`` when the
    family does not count its FLOPs."""
    per_token = workload.model.flops_per_token(workload.seq_length)
    if per_token is None:
        return None
    parts = sum(component.flops_per_sample(workload) for component in workload.components)
    return samples * (workload.seq_length * per_token + parts)


@dataclass(frozen=True)
class StepSpeed:
    """What turns one step's seconds into its speed metrics (the same for every step of a run)."""

    samples_per_step: int
    tokens_per_step: int | None = None
    #: Model FLOPs of one step over all ranks; ``None`` where the engine does not count them.
    flops_per_step: float | None = None
    #: Ranks the step ran on (the FLOPs are shared by all of them).
    devices: int = 1
    #: One device's dense peak FLOP/s in the training precision; ``None``: no ``mfu``.
    peak_flops: float | None = None

    @classmethod
    def of(cls, trainer: Trainer) -> StepSpeed:
        """The run's figures: the engine's counts, the world size and, where FLOPs are counted, the backend's peak
        (asked once here: the CPU measures it)."""
        import torch.distributed as dist

        engine = trainer.engine
        flops = engine.flops_per_step
        peak = trainer.backend.dense_peak_flops(trainer.config.training.precision) if flops else None
        return cls(samples_per_step=engine.samples_per_step, tokens_per_step=engine.tokens_per_step,
                   flops_per_step=flops, devices=dist.get_world_size() if dist.is_initialized() else 1,
                   peak_flops=peak)

    def metrics(self, steps: int, seconds: float) -> dict[str, Any]:
        """``samples_per_s`` always, ``tokens_per_s``, ``tflops`` (model TFLOP/s per device) and ``mfu`` (a
        fraction of the peak) where known, over ``steps`` steps that took ``seconds`` (all zero for no time)."""
        rate = steps / seconds if seconds > 0 else 0.0  # steps per second (0 when no step was timed)
        out: dict[str, Any] = {"samples_per_s": rate * self.samples_per_step}
        if self.tokens_per_step is not None:
            out["tokens_per_s"] = rate * self.tokens_per_step
        if self.flops_per_step:
            per_device = rate * self.flops_per_step / self.devices
            out["tflops"] = per_device / 1e12
            if self.peak_flops:
                out["mfu"] = per_device / self.peak_flops
        return out
