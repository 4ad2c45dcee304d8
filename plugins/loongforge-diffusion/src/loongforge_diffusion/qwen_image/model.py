"""``QwenImageModel``: the Qwen-Image MMDiT in plain torch modules, built from a :class:`QwenImageFlavor`.

It predicts the flow-matching velocity of packed image latents (each token one ``2 x 2`` patch of VAE latents,
``in_channels`` values) from the noise level ``sigma`` in ``[0, 1]``, the text-encoder states and their padding
mask. The inputs mirror diffusers' ``QwenImageTransformer2DModel.forward`` so the two run side by side, and the
weights convert one-to-one (see ``diffusers_adapter``). :func:`pack_latents` / :func:`unpack_latents` fold VAE
latents into tokens and back in the pipeline's channel order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from loongforge_diffusion.qwen_image.block import JointBlock
from loongforge_diffusion.qwen_image.embeddings import TextInput, TimeEmbedding
from loongforge_diffusion.qwen_image.flavors import NORM_EPS, ROPE_THETA, QwenImageFlavor
from loongforge_diffusion.qwen_image.rope import Shape, rope_tables
from loongforge_diffusion.wan.block import modulate
from loongforge_diffusion.wan.norms import FloatLayerNorm


class Head(nn.Module):
    """Final AdaLN (scale and shift from the time embedding; no learned table) and the projection to
    ``patch_size ** 2 * out_channels`` values per image token."""

    def __init__(self, dim: int, out_features: int) -> None:
        super().__init__()
        self.modulation = nn.Linear(dim, 2 * dim)
        self.norm = FloatLayerNorm(dim, eps=NORM_EPS, elementwise_affine=False)
        self.proj = nn.Linear(dim, out_features)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.modulation(F.silu(temb)).unsqueeze(1).chunk(2, dim=-1)
        return self.proj(modulate(self.norm, x, shift, scale))


def sample_layout(img_shapes: Sequence, batch: int, tokens: int) -> tuple[Shape, ...]:
    """The ``(frames, rows, cols)`` token grids of one sample's images, from diffusers' ``img_shapes``: one entry
    per sample, each a grid or a list of grids (several images per sample). All samples must share the layout,
    because one RoPE table serves the batch; the grids must account for every image token."""
    if len(img_shapes) != batch:
        raise ValueError(f"img_shapes has {len(img_shapes)} entries for a batch of {batch}")
    layouts = []
    for entry in img_shapes:
        grids = [entry] if all(isinstance(n, int) for n in entry) else list(entry)
        layouts.append(tuple(tuple(int(n) for n in grid) for grid in grids))
    if any(layout != layouts[0] for layout in layouts):
        raise ValueError(f"img_shapes differ between samples ({sorted(set(layouts))}); one batch takes one layout")
    if any(len(grid) != 3 for grid in layouts[0]):
        raise ValueError(f"img_shapes entries must be (frames, rows, cols) grids, got {layouts[0]}")
    counted = sum(f * h * w for f, h, w in layouts[0])
    if counted != tokens:
        raise ValueError(f"img_shapes {layouts[0]} describe {counted} image tokens, hidden_states has {tokens}")
    return layouts[0]


def pack_latents(latents: torch.Tensor, patch_size: int = 2) -> torch.Tensor:
    """``(B, C, H, W)`` VAE latents -> ``(B, (H/p)(W/p), C*p*p)`` tokens, row-major, channels outermost in a
    token (the Qwen-Image pipeline's order)."""
    b, c, h, w = latents.shape
    p = patch_size
    x = latents.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // p) * (w // p), c * p * p)


def unpack_latents(tokens: torch.Tensor, rows: int, cols: int, patch_size: int = 2) -> torch.Tensor:
    """Inverse of :func:`pack_latents` for a ``rows x cols`` token grid."""
    b, _, packed = tokens.shape
    p = patch_size
    x = tokens.reshape(b, rows, cols, packed // (p * p), p, p).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, packed // (p * p), rows * p, cols * p)


class QwenImageModel(nn.Module):
    """``recompute=True`` keeps only each block's inputs during the forward and re-runs the block in the backward
    (activation checkpointing), as ``WanModel`` does: one block's intermediates instead of all of them, for a second
    forward; gradients are bitwise the same."""

    def __init__(self, flavor: QwenImageFlavor, *, recompute: bool = False) -> None:
        super().__init__()
        self.flavor = flavor
        self.recompute = recompute
        d = flavor.dim
        self.image_in = nn.Linear(flavor.in_channels, d)
        self.text_in = TextInput(flavor.text_dim, d)
        self.time_embed = TimeEmbedding(d)
        self.blocks = nn.ModuleList(JointBlock(d, flavor.num_heads, flavor.head_dim) for _ in range(flavor.num_layers))
        self.head = Head(d, flavor.patch_out)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialisation for training from scratch, adaLN-Zero as in DiT/SD3: Xavier-uniform linears with zero
        biases, N(0, 0.02) for the time MLP, zero modulation projections (every gate starts at 0, so each block
        starts as the identity) and a zero output projection (the first prediction is 0)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        for mlp in (self.time_embed.mlp_in, self.time_embed.mlp_out):
            nn.init.normal_(mlp.weight, std=0.02)
        for block in self.blocks:
            for stream in (block.img, block.txt):
                nn.init.zeros_(stream.modulation.weight)
        nn.init.zeros_(self.head.modulation.weight)
        nn.init.zeros_(self.head.proj.weight)

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_hidden_states_mask: torch.Tensor | None, timestep: torch.Tensor,
                img_shapes: Sequence) -> torch.Tensor:
        """Velocity for packed latents ``hidden_states (B, N, in_channels)``.

        :param encoder_hidden_states: ``(B, L, text_dim)`` text-encoder states.
        :param encoder_hidden_states_mask: ``(B, L)``, nonzero/True for real tokens; ``None`` attends to all.
        :param timestep: ``(B,)`` noise level in ``[0, 1]`` (the model scales it by 1000 itself).
        :param img_shapes: per sample, the ``(frames, rows, cols)`` token grid(s) of its image(s), as diffusers.
        :return: ``(B, N, patch_size ** 2 * out_channels)``.
        """
        batch, tokens = hidden_states.shape[:2]
        grids = sample_layout(img_shapes, batch, tokens)
        text_len = encoder_hidden_states.shape[1]
        # apply_rope takes (cos, sin) pairs: zero-copy real views of the complex tables
        image_rope, text_rope = map(torch.view_as_real, rope_tables(grids, text_len, self.flavor.axes_dims,
                                                                    ROPE_THETA, hidden_states.device))
        mask = None
        if encoder_hidden_states_mask is not None:
            image_keys = torch.ones(batch, tokens, dtype=torch.bool, device=hidden_states.device)
            mask = torch.cat([encoder_hidden_states_mask.bool(), image_keys], dim=1)[:, None, None, :]
        image = self.image_in(hidden_states)
        text = self.text_in(encoder_hidden_states)
        temb = self.time_embed(timestep.expand(batch) if timestep.ndim == 0 else timestep)
        for block in self.blocks:
            if self.recompute and torch.is_grad_enabled():
                image, text = checkpoint(block, image, text, temb, image_rope, text_rope, mask, use_reentrant=False)
            else:
                image, text = block(image, text, temb, image_rope, text_rope, mask)
        return self.head(image, temb)
