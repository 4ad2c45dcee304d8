"""``WanFlavor``: the hyperparameters of one Wan DiT size, and the table of named flavors.

Torch-free, because the plugin's collector hook registers these objects and ``loongforge list`` must stay
instant. The real sizes carry the published Wan 2.1 / 2.2 hyperparameters (the ``config.json`` of the
Wan-AI ``*-Diffusers`` repositories); ``wan-tiny`` is a CPU flavor whose head dim 16 is one where a
``head_dim // 3`` RoPE split would disagree with Wan's ``2 * (head_dim // 6)`` one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from loongforge.errors import ConfigError
from loongforge.models.family import ModelFamily
from loongforge.models.flavor import replace_fields
from loongforge.models.listing import size_label

from loongforge_diffusion.options import WanTaskOptions

#: Tasks a flavor is trained for. ``t2v`` text only; ``i2v`` adds an encoded image (extra input channels and,
#: in Wan 2.1, CLIP image tokens with their own key/value projections); ``ti2v`` (Wan 2.2 5B) conditions on
#: the first latent frame through per-token timesteps instead of extra channels.
TASKS: tuple[str, ...] = ("t2v", "i2v", "ti2v")


@dataclass(frozen=True)
class WanFlavor(ModelFamily):
    """One Wan DiT. ``image_dim`` is set only for models with the CLIP image branch (Wan 2.1 I2V).

    ``expert_boundary`` is set for Wan 2.2 A14B, which is two models of this shape: the high-noise expert
    serves noise levels ``sigma >= expert_boundary`` and the low-noise expert the rest.
    """

    #: Trained by the task engine: ``make_task`` supplies the training step (core builds no megatron chunks).
    engine: ClassVar[str] = "task"
    #: The ``task:`` section this model's training takes (checked by core before the run).
    task_options: ClassVar[type | None] = WanTaskOptions

    task: str
    dim: int
    ffn_dim: int
    num_heads: int
    num_layers: int
    in_channels: int
    out_channels: int
    patch_size: tuple[int, int, int] = (1, 2, 2)
    text_dim: int = 4096
    text_len: int = 512
    freq_dim: int = 256
    eps: float = 1e-6
    cross_attn_norm: bool = True
    image_dim: int | None = None
    rope_theta: float = 10000.0
    rope_max_seq_len: int = 1024
    per_token_timesteps: bool = False
    expert_boundary: float | None = None
    sample_shift: float = 5.0
    version: str = "2.1"

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ConfigError(f"wan flavor: task must be one of {TASKS}, got {self.task!r}")
        for name in ("dim", "ffn_dim", "num_heads", "num_layers", "in_channels", "out_channels", "text_dim",
                     "freq_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"wan flavor: {name} must be positive, got {getattr(self, name)}")
        if self.dim % self.num_heads:
            raise ConfigError(f"wan flavor: dim ({self.dim}) is not divisible by num_heads ({self.num_heads})")
        if self.head_dim % 2 or self.head_dim < 6:
            raise ConfigError(f"wan flavor: head dim {self.head_dim} must be even and >= 6 for the 3D RoPE")
        if self.expert_boundary is not None and not 0.0 < self.expert_boundary < 1.0:
            raise ConfigError(f"wan flavor: expert_boundary must lie in (0, 1), got {self.expert_boundary}")
        if self.expert_boundary is not None and self.per_token_timesteps:
            raise ConfigError("wan flavor: expert_boundary (two experts by noise level) needs one timestep per "
                              "sample; per_token_timesteps (TI2V) gives the clean first frame its own")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def patch_volume(self) -> int:
        return math.prod(self.patch_size)

    def reference_implementation(self) -> Any:
        """diffusers' own transformer (:class:`loongforge_diffusion.reference.DiffusersTransformer`), for
        ``loongforge diff --reference``; none for two experts (diffusers has no one module holding both: diff each
        expert's exported folder)."""
        if self.expert_boundary is not None:
            return None
        from loongforge_diffusion.reference import DiffusersTransformer

        return DiffusersTransformer(self)

    def make_task(self, config: Any) -> Any:
        """What ``loongforge train`` runs for this flavor (the core trainer's task; see ``run_task``)."""
        from loongforge_diffusion.run_task import WanRunTask

        return WanRunTask(self, config)

    def check_task(self, config: Any, options: Any) -> list[str]:
        """Its data opened as training opens it, a sample held to the patch size
        (:func:`loongforge_diffusion.preflight.check_video_task`)."""
        from loongforge_diffusion.preflight import check_video_task

        return check_video_task(self, config, options)

    def task_terms(self, config: Any, sample_shape: tuple[int, ...] | None = None) -> Any:
        """The planner's statement of this DiT for one sample (:func:`loongforge_diffusion.wan.sizing.wan_terms`):
        ``sample_shape`` is latent frames x height x width, else the config's data."""
        from loongforge.config.plugin_sections import task_options

        from loongforge_diffusion.wan.sizing import wan_terms

        return wan_terms(self, task_options(self, config), config.source, sample_shape, config.training.compile)

    def num_params(self, *, include_embeddings: bool = True) -> int:
        """The model family's parameter count (:func:`num_params`, twice for two experts; a DiT has no token
        embeddings to leave out)."""
        return num_params(self) * (1 if self.expert_boundary is None else 2)

    def with_overrides(self, **overrides: Any) -> WanFlavor:
        """A copy with some fields changed (``num_layers=2`` for a smoke run); unknown names are errors."""
        return replace_fields(self, overrides, what="wan flavor")


def num_params(flavor: WanFlavor) -> int:
    """Parameter count of one model (one expert), computed from the shapes so listings need no torch."""
    d, f = flavor.dim, flavor.ffn_dim

    def linear(i: int, o: int) -> int:
        return i * o + o

    count = linear(flavor.in_channels * flavor.patch_volume, d)  # patch embedding
    count += linear(flavor.freq_dim, d) + linear(d, d) + linear(d, 6 * d)  # time MLP + modulation
    count += linear(flavor.text_dim, d) + linear(d, d)  # text projection
    if flavor.image_dim is not None:
        count += 2 * flavor.image_dim + linear(flavor.image_dim, flavor.image_dim) + linear(flavor.image_dim, d)
        count += 2 * d
    block = 2 * (4 * linear(d, d) + 2 * d)  # self- and cross-attention with q/k RMSNorm
    block += linear(d, f) + linear(f, d) + 6 * d  # FFN + modulation table
    block += 2 * d if flavor.cross_attn_norm else 0
    block += 2 * linear(d, d) + d if flavor.image_dim is not None else 0  # image key/value + its k norm
    count += flavor.num_layers * block
    count += linear(d, flavor.out_channels * flavor.patch_volume) + 2 * d  # head
    return count


_WAN21_14B = dict(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40)

FLAVORS: dict[str, WanFlavor] = {
    "wan-tiny": WanFlavor(task="t2v", dim=64, ffn_dim=128, num_heads=4, num_layers=2, in_channels=3, out_channels=3,
                          text_dim=32, text_len=8, freq_dim=32, rope_max_seq_len=64, sample_shift=3.0),
    # wan-tiny as two experts split like Wan 2.2 T2V-A14B: the CPU flavor of the mixture (tests, tutorials)
    "wan-tiny-experts": WanFlavor(task="t2v", dim=64, ffn_dim=128, num_heads=4, num_layers=2, in_channels=3,
                                  out_channels=3, text_dim=32, text_len=8, freq_dim=32, rope_max_seq_len=64,
                                  sample_shift=3.0, expert_boundary=0.875, version="2.2"),
    "wan2.1-t2v-1.3b": WanFlavor(task="t2v", dim=1536, ffn_dim=8960, num_heads=12, num_layers=30, in_channels=16,
                                 out_channels=16),
    "wan2.1-t2v-14b": WanFlavor(task="t2v", in_channels=16, out_channels=16, **_WAN21_14B),
    "wan2.1-i2v-14b": WanFlavor(task="i2v", in_channels=36, out_channels=16, image_dim=1280, **_WAN21_14B),
    "wan2.2-ti2v-5b": WanFlavor(task="ti2v", dim=3072, ffn_dim=14336, num_heads=24, num_layers=30, in_channels=48,
                                out_channels=48, per_token_timesteps=True, version="2.2"),
    "wan2.2-t2v-a14b": WanFlavor(task="t2v", in_channels=16, out_channels=16, expert_boundary=0.875,
                                 sample_shift=12.0, version="2.2", **_WAN21_14B),
    "wan2.2-i2v-a14b": WanFlavor(task="i2v", in_channels=36, out_channels=16, expert_boundary=0.9, version="2.2",
                                 **_WAN21_14B),
}

#: Hugging Face ids (original and diffusers layouts) accepted as aliases of the flavor names.
HF_IDS: dict[str, tuple[str, ...]] = {
    "wan2.1-t2v-1.3b": ("Wan-AI/Wan2.1-T2V-1.3B", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"),
    "wan2.1-t2v-14b": ("Wan-AI/Wan2.1-T2V-14B", "Wan-AI/Wan2.1-T2V-14B-Diffusers"),
    "wan2.1-i2v-14b": ("Wan-AI/Wan2.1-I2V-14B-480P", "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
                       "Wan-AI/Wan2.1-I2V-14B-720P", "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers"),
    "wan2.2-ti2v-5b": ("Wan-AI/Wan2.2-TI2V-5B", "Wan-AI/Wan2.2-TI2V-5B-Diffusers"),
    "wan2.2-t2v-a14b": ("Wan-AI/Wan2.2-T2V-A14B", "Wan-AI/Wan2.2-T2V-A14B-Diffusers"),
    "wan2.2-i2v-a14b": ("Wan-AI/Wan2.2-I2V-A14B", "Wan-AI/Wan2.2-I2V-A14B-Diffusers"),
}


def describe(flavor: WanFlavor) -> str:
    """One line for ``loongforge list``."""
    count = num_params(flavor)
    size = size_label(count)
    each = "" if flavor.expert_boundary is None else f"2 experts (split at sigma {flavor.expert_boundary}) of "
    parts = [f"Wan {flavor.version} {flavor.task.upper()} DiT", f"{each}{size} params", f"{flavor.num_layers} layers",
             f"d{flavor.dim}", f"{flavor.num_heads} heads"]
    if flavor.per_token_timesteps:
        parts.append("per-token timesteps")
    return ", ".join(parts)
