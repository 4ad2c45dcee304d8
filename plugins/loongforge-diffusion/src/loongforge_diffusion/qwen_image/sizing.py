"""A Qwen-Image MMDiT's sizes for the layout planner (:class:`loongforge.models.task_terms.TaskTerms`).

The blocks run over one joint sequence: the image's ``N`` patch tokens and the caption's ``L`` text tokens, each
through its own stream's weights, meeting in one attention. Its task splits neither sequences nor weights, so the
planner chooses among DDP, ZeRO-1, FSDP2 and HSDP, with and without per-block recompute (``task.recompute``).

Activations are the bytes autograd saves, counted once per storage on the eager CPU build
(``tests/diffusion/test_wan_planner.py`` holds them to the count): per token of one block ``104 d + 12 h + 16``
in fp32 and ``66 d + 11 h + 18`` in bf16 (FSDP2's mixed precision; ``d`` the width, ``h`` the heads; the FFN is
``4 d`` wide), and per sample ``72 d`` / ``40 d`` (the modulation vectors of both streams). Outside the blocks a
token keeps the input projection's input, the head's tensors and a RoPE rotation (``4 x head_dim``). The backward's
transient gradients are taken as Wan's (three fp32 vectors per token).
"""

from __future__ import annotations

from typing import Any

from loongforge.errors import ConfigError
from loongforge.models.listing import count_of_shapes
from loongforge.models.task_terms import BlockActivations, TaskTerms

#: Text tokens a planned sample's caption takes (diffusers' ``QwenImagePipeline`` default ``max_sequence_length``).
PLANNED_TEXT_TOKENS = 512
#: Caption tokens of the generated still squares (colour and size).
SQUARES_TEXT_TOKENS = 2


def qwen_image_terms(flavor: Any, side: int, source: str, sample_shape: tuple[int, ...] | None) -> TaskTerms:
    """The planner's statement for ``flavor`` on one image: ``sample_shape`` (the model's input grid before its
    ``patch_size`` patching -- a real model's latent height x width, 166 x 166 for 1328 px -- and a 512-token caption)
    or the config's still squares of ``side`` pixels."""
    from loongforge_diffusion.qwen_image.flavors import FFN_MULT, num_params, parameter_shapes

    if sample_shape is not None:
        if len(sample_shape) != 2:
            raise ConfigError(f"{source}: a Qwen-Image sample shape is height x width, got {sample_shape}")
        (height, width), text = sample_shape, PLANNED_TEXT_TOKENS
    else:
        (height, width), text = (side, side), SQUARES_TEXT_TOKENS
    p = flavor.patch_size
    if height % p or width % p:
        raise ConfigError(f"{source}: an image of {height}x{width} does not divide into {p}x{p} patches")
    image = (height // p) * (width // p)
    tokens = image + text
    d, h = flavor.dim, flavor.num_heads
    block = count_of_shapes({name: shape for name, shape in parameter_shapes(flavor).items()
                             if name.startswith("blocks.0.")})
    outside = num_params(flavor) - flavor.num_layers * block
    matmul = (4 + 2 * FFN_MULT) * d * d  # per token in its stream: qkv, out, the FFN
    block_flops = 2 * tokens * matmul + 2 * 2 * 6 * d * d + 4 * tokens * tokens * d  # + both modulations, attention
    outside_flops = 2 * image * (flavor.in_channels + flavor.patch_out) * d + 2 * text * flavor.text_dim * d

    def activations(dtype: str) -> BlockActivations:
        fp32 = dtype == "fp32"
        width = 4 if fp32 else 2
        return BlockActivations(
            replicated_per_token=(104 * d + 12 * h + 16) if fp32 else (66 * d + 11 * h + 18), split_per_token=0.0,
            split_per_sample=(72 if fp32 else 40) * d, backward_per_token=12 * d, recompute_per_token=width * d,
            outside_per_token=width * flavor.in_channels + (12 if fp32 else 10) * d + 4 * flavor.head_dim)

    return TaskTerms(
        blocks=flavor.num_layers, block_split_params=0.0, block_replicated_params=block, outside_params=outside,
        tokens=tokens, heads=h, hidden=d, block_forward_flops=flavor.num_layers * block_flops,
        outside_forward_flops=outside_flops, activations={dtype: activations(dtype) for dtype in ("fp32", "bf16")},
        recompute_option="task.recompute", sample=f"{height}x{width} input, {image} image tokens, {text} text tokens")

