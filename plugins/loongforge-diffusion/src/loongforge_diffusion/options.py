"""The diffusion tasks' ``task:`` sections as typed dataclasses (``task_options`` of the Wan and Qwen-Image flavors).

Torch-free, because the flavors name these classes and are registered (and listed) without torch; core validates a
config's ``task:`` against them before a run starts (unknown keys with did-you-mean, types, the checks in
``__post_init__``), and the tasks read the typed values. Every default is the one the tasks always had.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from loongforge.config.sections import path_field, ranged
from loongforge.errors import ConfigError

SAMPLING = ("uniform", "logit-normal")
#: Seeds are below this, as ``run.seed`` is: a sample's generator is seeded with ``seed * 1_000_003 + index``, which
#: must stay within the 64 bits torch's generators take.
SEED_LIMIT = 2**31
#: Generated squares are a CPU test and tutorial set: at most this many samples (the data order is a permutation of
#: them, drawn whole each epoch), frames and pixels of side (a sample is rendered whole: 128 x 256 x 256 RGB floats
#: are 100 MB).
MAX_SAMPLES, MAX_FRAMES, MAX_SIDE = 2**24, 128, 256
#: Samples drawn after training are one batch (at most this many), in at most this many Euler steps (the models
#: are trained on 1000 noise levels).
MAX_SAMPLED, MAX_STEPS = 1024, 1000
WEIGHTING = ("none", "cosmap")
#: Samplers by name (:func:`loongforge_diffusion.sampling.integrate`): Euler on our own schedule (from s = 1), and
#: UniPC and DPM-Solver++(2M) on diffusers' schedules (:mod:`loongforge_diffusion.multistep`).
SAMPLERS = ("euler", "unipc", "dpm++")


def check_sampler(name: str) -> None:
    """``task.sample.sampler`` names a sampler of :mod:`loongforge_diffusion.sampling`."""
    if name not in SAMPLERS:
        raise ConfigError(f"task.sample.sampler must be one of {', '.join(SAMPLERS)}, got {name!r}")


@dataclass(frozen=True)
class FlowMatchingConfig:
    """``task.flow_matching``: the rectified-flow objective (see :mod:`loongforge_diffusion.flow_matching`)."""

    shift: float = ranged(1.0, low=0, low_open=True)
    sampling: str = "uniform"
    logit_mean: float = ranged(0.0)
    logit_std: float = ranged(1.0, low=0, low_open=True)
    weighting: str = "none"
    sigma_range: tuple[float, float] = (0.0, 1.0)

    def __post_init__(self) -> None:
        if self.sampling not in SAMPLING:
            raise ConfigError(f"flow matching: sampling must be one of {SAMPLING}, got {self.sampling!r}")
        if self.weighting not in WEIGHTING:
            raise ConfigError(f"flow matching: weighting must be one of {WEIGHTING}, got {self.weighting!r}")
        if self.shift <= 0 or self.logit_std <= 0:
            raise ConfigError("flow matching: shift and logit_std must be positive")
        low, high = self.sigma_range
        if not 0.0 <= low < high <= 1.0:
            raise ConfigError(f"flow matching: sigma_range must satisfy 0 <= low < high <= 1, got {self.sigma_range}")


@dataclass(frozen=True)
class EMAOptions:
    """``task.ema``: an average of the trained weights that samples use."""

    decay: float = ranged(0.999, low=0, high=1, high_open=True)
    warmup: bool = True


@dataclass(frozen=True)
class WanLoRAOptions:
    """``task.lora`` (Wan): adapters on the named block layers, base weights frozen; ``alpha`` null = ``rank``."""

    rank: int = ranged(16, low=1)
    alpha: float | None = ranged(None, low=0, low_open=True)
    dropout: float = ranged(0.0, low=0, high=1, high_open=True)
    targets: list[str] = field(default_factory=lambda: ["self_attn", "cross_attn", "ffn"])


@dataclass(frozen=True)
class WanSampleOptions:
    """``task.sample`` (Wan): videos sampled for held-out captions after training (``videos: 0`` skips it)."""

    videos: int = ranged(16, low=0, high=MAX_SAMPLED)
    steps: int = ranged(20, low=1, high=MAX_STEPS)
    guidance: float = ranged(3.0, low=0)
    seed: int = ranged(0, low=0, high=SEED_LIMIT, high_open=True)
    #: ``euler``, ``unipc`` or ``dpm++`` (:data:`SAMPLERS`).
    sampler: str = "euler"

    def __post_init__(self) -> None:
        check_sampler(self.sampler)


@dataclass(frozen=True)
class WanTaskOptions:
    """``task:`` of a Wan flavor (see :mod:`loongforge_diffusion.run_task` for what each option does)."""

    #: A .pt of moving squares, a latent cache directory, or null (moving squares generated on the fly).
    data: str | None = path_field()
    samples: int = ranged(2048, low=1, high=MAX_SAMPLES)
    frames: int = ranged(4, low=1, high=MAX_FRAMES)
    side: int = ranged(16, low=1, high=MAX_SIDE)
    speed: int = ranged(2, low=0)
    data_seed: int = ranged(0, low=0, high=SEED_LIMIT, high_open=True)
    context_dropout: float = ranged(0.1, low=0, high=1)
    flow_matching: FlowMatchingConfig = field(default_factory=FlowMatchingConfig)
    sample: WanSampleOptions = field(default_factory=WanSampleOptions)
    #: Weights to start from: a LoongForge checkpoint of this task or a released Wan DiT directory.
    init: str | None = path_field()
    lora: WanLoRAOptions | None = None
    ema: EMAOptions | None = None
    recompute: bool = False
    #: Wan 2.2 A14B (a flavor with ``expert_boundary``): ``both`` experts on the device, or ``one``: only the expert
    #: serving the current noise level, the other in host memory with its optimizer state and EMA average
    #: (:mod:`loongforge_diffusion.wan.residency`; one process only).
    experts_resident: Literal["both", "one"] = "both"
    #: Wan 2.2 A14B training: the steps of each window of this many train the experts the steps' own draws pick, but
    #: grouped (high first in odd windows, low first in even ones), so that the expert changes at most once per
    #: window and ``experts_resident: one`` swaps that rarely; 1 trains each step's draw in place.
    expert_window: int = ranged(1, low=1)


@dataclass(frozen=True)
class QwenImageSampleOptions:
    """``task.sample`` (Qwen-Image): images sampled for held-out captions after training (``images: 0`` skips)."""

    images: int = ranged(16, low=0, high=MAX_SAMPLED)
    steps: int = ranged(20, low=1, high=MAX_STEPS)
    guidance: float = ranged(3.0, low=0)
    shift: float = ranged(1.0, low=0, low_open=True)
    seed: int = ranged(0, low=0, high=SEED_LIMIT, high_open=True)
    #: ``euler``, ``unipc`` or ``dpm++`` (:data:`SAMPLERS`).
    sampler: str = "euler"

    def __post_init__(self) -> None:
        check_sampler(self.sampler)


@dataclass(frozen=True)
class QwenImageTaskOptions:
    """``task:`` of a Qwen-Image flavor (see :mod:`loongforge_diffusion.qwen_image.run_task`)."""

    samples: int = ranged(2048, low=1, high=MAX_SAMPLES)
    side: int = ranged(16, low=1, high=4 * MAX_SIDE)  # one frame: 4x the side of a video's
    data_seed: int = ranged(0, low=0, high=SEED_LIMIT, high_open=True)
    context_dropout: float = ranged(0.1, low=0, high=1)
    flow_matching: FlowMatchingConfig = field(default_factory=FlowMatchingConfig)
    sample: QwenImageSampleOptions = field(default_factory=QwenImageSampleOptions)
    #: A LoongForge checkpoint of this task or a diffusers QwenImageTransformer2DModel directory.
    init: str | None = path_field()
    ema: EMAOptions | None = None
    recompute: bool = False
