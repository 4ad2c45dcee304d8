"""LeRobot 0.4.4's ``PI05Policy`` (and its ``PI05Pytorch``) built tiny, offline, in float32, from its config alone.

LeRobot hard-codes the sizes of Pi0.5: ``get_gemma_config`` knows only ``gemma_2b`` / ``gemma_300m``, the SigLIP
tower is PaliGemma's default So400m, the projector width is 2048 and the vocabulary 257152. To build a CPU-sized
reference the harness replaces ``modeling_pi05.get_gemma_config`` with tiny variants (still 8 query heads, which
``compute_layer_complete`` hard-codes in a reshape, and 1 key/value head) and
``modeling_pi05.PaliGemmaForConditionalGeneration`` with a factory that writes the tiny SigLIP sizes over the
config LeRobot prepared (So400m's, projection width 2048).
The vocabulary stays 257152. Every parameter is then re-drawn from a seeded generator (the adaRMS projections are
zero-initialised upstream, which would hide the time conditioning from the comparison).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers_shim
from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

transformers_shim.install()

from lerobot.configs.types import FeatureType, PolicyFeature  # noqa: E402
from lerobot.policies.pi05 import modeling_pi05  # noqa: E402
from lerobot.policies.pi05.configuration_pi05 import PI05Config  # noqa: E402

#: The reference's camera keys, in the order our ``images`` tensor stacks them.
CAMERAS = ("observation.images.base", "observation.images.wrist")


@dataclass(frozen=True)
class TinySizes:
    """The reference's sizes (the parity test builds our flavor with the same ones)."""

    width: int = 64
    depth: int = 2
    mlp_dim: int = 128
    expert_width: int = 32
    expert_mlp_dim: int = 64
    heads: int = 8            # hard-coded by LeRobot
    kv_heads: int = 1
    head_dim: int = 16
    vision_width: int = 32
    vision_mlp_dim: int = 64
    vision_depth: int = 2
    vision_heads: int = 2
    patch_size: int = 4
    image_size: int = 16
    cameras: int = 2
    text_len: int = 12
    chunk_size: int = 5
    max_state_dim: int = 8
    max_action_dim: int = 8
    action_dim: int = 6       # the robot's (the policy's loss and chunks cut the padding off)
    vocab: int = 257152       # hard-coded by LeRobot


def _patch_sizes(sizes: TinySizes) -> None:
    variants = {
        "gemma_2b": modeling_pi05.GemmaConfig(sizes.width, sizes.depth, sizes.mlp_dim, sizes.heads, sizes.kv_heads,
                                              sizes.head_dim),
        "gemma_300m": modeling_pi05.GemmaConfig(sizes.expert_width, sizes.depth, sizes.expert_mlp_dim, sizes.heads,
                                                sizes.kv_heads, sizes.head_dim),
    }

    def paligemma(config: PaliGemmaConfig) -> PaliGemmaForConditionalGeneration:
        vision = config.vision_config
        vision.hidden_size, vision.intermediate_size = sizes.vision_width, sizes.vision_mlp_dim
        vision.num_hidden_layers, vision.num_attention_heads = sizes.vision_depth, sizes.vision_heads
        vision.patch_size, vision.projection_dim = sizes.patch_size, sizes.width
        return PaliGemmaForConditionalGeneration(config)

    modeling_pi05.get_gemma_config = variants.__getitem__
    modeling_pi05.PaliGemmaForConditionalGeneration = paligemma


def build_reference(sizes: TinySizes, seed: int = 0) -> modeling_pi05.PI05Policy:
    """A float32 ``PI05Policy`` with ``sizes`` and two cameras (:data:`CAMERAS`), every parameter drawn from
    N(0, 0.05) with ``seed`` (norm weights around 0, i.e. scale ~1), in eval mode."""
    _patch_sizes(sizes)
    camera = PolicyFeature(type=FeatureType.VISUAL, shape=(3, sizes.image_size, sizes.image_size))
    config = PI05Config(dtype="float32", chunk_size=sizes.chunk_size, n_action_steps=sizes.chunk_size,
                        max_state_dim=sizes.max_state_dim, max_action_dim=sizes.max_action_dim,
                        image_resolution=(sizes.image_size, sizes.image_size), device="cpu",
                        input_features={key: camera for key in CAMERAS[:sizes.cameras]},
                        output_features={"action": PolicyFeature(type=FeatureType.ACTION,
                                                                 shape=(sizes.action_dim,))})
    model = modeling_pi05.PI05Policy(config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return model
