"""``QwenImageFlavor``: the hyperparameters of one Qwen-Image MMDiT, and the table of named flavors.

Torch-free, because the plugin's collector hook registers these objects and ``loongforge list`` must stay
instant. ``qwen-image`` carries the published Qwen/Qwen-Image transformer config (the defaults of diffusers'
``QwenImageTransformer2DModel``: 60 layers, 24 heads of 128, RoPE axes 16/56/56). ``qwen-image-tiny`` is a CPU
flavor whose RoPE axes (4, 6, 6) are unequal and whose spatial axes have an odd number of rotary pairs, so an
implementation that swapped the frame and spatial axes or split the head evenly could not pass the parity test.

The parameter shapes are listed here (:func:`parameter_shapes`), torch-free, so that the size shown in
listings is computed rather than typed in, and so the diffusers converter can check every tensor's shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from loongforge.errors import ConfigError
from loongforge.models.family import ModelFamily
from loongforge.models.flavor import replace_fields
from loongforge.models.listing import count_of_shapes, size_label

from loongforge_diffusion.options import QwenImageTaskOptions

#: Width of the sinusoidal timestep encoding, epsilon of every norm and RoPE base: fixed by the reference model
#: (diffusers hard-codes them), so they are constants rather than flavor fields that could not be converted.
TIME_FREQ_DIM = 256
NORM_EPS = 1e-6
ROPE_THETA = 10000.0
#: The FFN hidden width is this multiple of the model width in both streams.
FFN_MULT = 4


@dataclass(frozen=True)
class QwenImageFlavor(ModelFamily):
    """One Qwen-Image MMDiT (double-stream blocks: an image and a text stream that meet in joint attention).

    ``in_channels`` counts the *packed* latent channels (VAE channels times ``patch_size ** 2``: the pipeline
    folds each 2x2 latent patch into one token before the model sees it), ``out_channels`` the VAE channels;
    the output has ``patch_size ** 2 * out_channels`` values per token. ``text_dim`` is the width of the text
    encoder states (Qwen2.5-VL-7B: 3584; diffusers calls it ``joint_attention_dim``). ``axes_dims`` splits each
    attention head between the frame, row and column axes of the rotary embedding and must sum to ``head_dim``.
    ``guidance_embeds`` mirrors diffusers' flag, which builds nothing for this model; it must stay off.
    """

    #: Trained by the task engine: ``make_task`` supplies the training step (core builds no megatron chunks).
    engine: ClassVar[str] = "task"
    #: The ``task:`` section this model's training takes (checked by core before the run).
    task_options: ClassVar[type | None] = QwenImageTaskOptions

    num_layers: int
    num_heads: int
    head_dim: int
    in_channels: int = 64
    out_channels: int = 16
    patch_size: int = 2
    text_dim: int = 3584
    axes_dims: tuple[int, int, int] = (16, 56, 56)
    guidance_embeds: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "head_dim", "in_channels", "out_channels", "patch_size", "text_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"qwen-image flavor: {name} must be positive, got {getattr(self, name)}")
        if len(self.axes_dims) != 3 or any(d <= 0 or d % 2 for d in self.axes_dims):
            raise ConfigError(f"qwen-image flavor: axes_dims must be three positive even widths, got {self.axes_dims}")
        if sum(self.axes_dims) != self.head_dim:
            raise ConfigError(f"qwen-image flavor: axes_dims {self.axes_dims} sum to {sum(self.axes_dims)}, "
                              f"not head_dim {self.head_dim}")
        if self.guidance_embeds:
            raise ConfigError("qwen-image flavor: guidance_embeds is not supported (Qwen-Image has no guidance "
                              "embedding; diffusers' flag builds nothing)")

    @property
    def dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def patch_out(self) -> int:
        """Output values per token: one ``patch_size x patch_size`` patch of ``out_channels`` latents."""
        return self.patch_size**2 * self.out_channels

    def reference_implementation(self) -> Any:
        """diffusers' own transformer (:class:`loongforge_diffusion.reference.DiffusersTransformer`), for
        ``loongforge diff --reference``."""
        from loongforge_diffusion.reference import DiffusersTransformer

        return DiffusersTransformer(self)

    def make_task(self, config: Any) -> Any:
        """What ``loongforge train`` runs for this flavor: text-to-image flow matching (see ``qwen_image.run_task``)."""
        from loongforge_diffusion.qwen_image.run_task import QwenImageRunTask

        return QwenImageRunTask(self, config)

    def check_task(self, config: Any, options: Any) -> list[str]:
        """The task made and its still squares generated as training makes them, held to the patch and the batch
        (:func:`loongforge_diffusion.preflight.check_image_task`)."""
        from loongforge_diffusion.preflight import check_image_task

        return check_image_task(self, config, options)

    def task_terms(self, config: Any, sample_shape: tuple[int, ...] | None = None) -> Any:
        """The planner's statement of this MMDiT for one image
        (:func:`loongforge_diffusion.qwen_image.sizing.qwen_image_terms`): ``sample_shape`` is the input grid's
        height x width, else the config's still squares."""
        from loongforge.config.plugin_sections import task_options

        from loongforge_diffusion.qwen_image.sizing import qwen_image_terms

        return qwen_image_terms(self, task_options(self, config).side, config.source, sample_shape)

    def num_params(self, *, include_embeddings: bool = True) -> int:
        """The model family's parameter count (:func:`num_params`; a DiT has no token embeddings to leave out)."""
        return num_params(self)

    def with_overrides(self, **overrides: Any) -> QwenImageFlavor:
        """A copy with some fields changed (``num_layers=2``); unknown names are errors."""
        return replace_fields(self, overrides, what="qwen-image flavor")


def _linear(prefix: str, fan_in: int, fan_out: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.weight": (fan_out, fan_in), f"{prefix}.bias": (fan_out,)}


def _stream(prefix: str, flavor: QwenImageFlavor) -> dict[str, tuple[int, ...]]:
    """One stream of one block: modulation, fused q/k/v, per-head q/k RMSNorm, output projection, FFN."""
    d = flavor.dim
    shapes = _linear(f"{prefix}.modulation", d, 6 * d)
    shapes.update(_linear(f"{prefix}.qkv", d, 3 * d))
    shapes.update({f"{prefix}.norm_q.weight": (flavor.head_dim,), f"{prefix}.norm_k.weight": (flavor.head_dim,)})
    shapes.update(_linear(f"{prefix}.out", d, d))
    shapes.update(_linear(f"{prefix}.ffn.fc1", d, FFN_MULT * d))
    shapes.update(_linear(f"{prefix}.ffn.fc2", FFN_MULT * d, d))
    return shapes


def parameter_shapes(flavor: QwenImageFlavor) -> dict[str, tuple[int, ...]]:
    """Every parameter of :class:`~loongforge_diffusion.qwen_image.model.QwenImageModel` and its shape."""
    d = flavor.dim
    shapes = _linear("image_in", flavor.in_channels, d)
    shapes["text_in.norm.weight"] = (flavor.text_dim,)
    shapes.update(_linear("text_in.proj", flavor.text_dim, d))
    shapes.update(_linear("time_embed.mlp_in", TIME_FREQ_DIM, d))
    shapes.update(_linear("time_embed.mlp_out", d, d))
    for index in range(flavor.num_layers):
        shapes.update(_stream(f"blocks.{index}.img", flavor))
        shapes.update(_stream(f"blocks.{index}.txt", flavor))
    shapes.update(_linear("head.modulation", d, 2 * d))
    shapes.update(_linear("head.proj", d, flavor.patch_out))
    return shapes


def num_params(flavor: QwenImageFlavor) -> int:
    return count_of_shapes(parameter_shapes(flavor))


FLAVORS: dict[str, QwenImageFlavor] = {
    "qwen-image-tiny": QwenImageFlavor(num_layers=2, num_heads=2, head_dim=16, in_channels=16, out_channels=4,
                                       text_dim=24, axes_dims=(4, 6, 6)),
    "qwen-image": QwenImageFlavor(num_layers=60, num_heads=24, head_dim=128),
}

#: Hugging Face ids accepted as aliases of the flavor names.
HF_IDS: dict[str, tuple[str, ...]] = {
    "qwen-image": ("Qwen/Qwen-Image",),
}


def describe(flavor: QwenImageFlavor) -> str:
    """One line for ``loongforge list``."""
    count = num_params(flavor)
    size = size_label(count)
    axes = "/".join(map(str, flavor.axes_dims))
    return (f"Qwen-Image MMDiT (text-to-image), {size} params, {flavor.num_layers} double-stream layers, "
            f"d{flavor.dim}, {flavor.num_heads} heads of {flavor.head_dim}, RoPE axes {axes}")
