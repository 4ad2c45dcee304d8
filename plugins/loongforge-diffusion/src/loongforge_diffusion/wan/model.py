"""``WanModel``: the Wan 2.1 / 2.2 video DiT in plain torch modules, built from a :class:`WanFlavor`.

It predicts the flow-matching velocity for a noisy video latent given the timestep (in ``[0, 1000]``, one per
sample or, for Wan 2.2 TI2V, one per token), text-encoder states and, for Wan 2.1 I2V, CLIP image tokens.
Weights convert one-to-one with diffusers' ``WanTransformer3DModel`` (see ``diffusers_adapter``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from loongforge_diffusion.wan.block import WanBlock, modulate
from loongforge_diffusion.wan.embeddings import ImageProjection, PatchEmbed3D, TextProjection, TimeEmbedding
from loongforge_diffusion.wan.flavors import WanFlavor
from loongforge_diffusion.wan.norms import FloatLayerNorm
from loongforge_diffusion.wan.rope import rope_table


class Head(nn.Module):
    """Final AdaLN (shift and scale from the time embedding plus a learned table) and the projection back to
    ``out_channels * prod(patch_size)`` values per token."""

    def __init__(self, dim: int, out_features: int, eps: float) -> None:
        super().__init__()
        self.norm = FloatLayerNorm(dim, eps=eps, elementwise_affine=False)
        self.proj = nn.Linear(dim, out_features)
        self.modulation = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        shift, scale = (self.modulation + temb.unsqueeze(2)).unbind(2)
        return self.proj(modulate(self.norm, x, shift, scale))


def unpatchify(tokens: torch.Tensor, grid: tuple[int, int, int], patch: tuple[int, int, int]) -> torch.Tensor:
    """``(B, f*h*w, pt*ph*pw*C)`` with channels last inside a patch -> ``(B, C, f*pt, h*ph, w*pw)``."""
    f, h, w = grid
    pt, ph, pw = patch
    x = tokens.reshape(tokens.shape[0], f, h, w, pt, ph, pw, -1)
    x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)
    return x.reshape(x.shape[0], x.shape[1], f * pt, h * ph, w * pw)


class WanModel(nn.Module):
    """``recompute=True`` keeps only each block's input during the forward and recomputes the block in the
    backward (activation checkpointing): activation memory drops from all blocks' intermediates to one block's,
    at the price of a second forward; gradients are bitwise the same."""

    def __init__(self, flavor: WanFlavor, *, recompute: bool = False) -> None:
        super().__init__()
        self.flavor = flavor
        self.recompute = recompute
        #: Ranks each block's heads are split over (set by ``wan.tensor_parallel.parallelize_wan``).
        self.tensor_parallel = 1
        d = flavor.dim
        with_image = flavor.image_dim is not None
        self.patch_embed = PatchEmbed3D(flavor.in_channels, d, flavor.patch_size)
        self.time_embed = TimeEmbedding(flavor.freq_dim, d)
        self.text_embed = TextProjection(flavor.text_dim, d)
        self.image_embed = ImageProjection(flavor.image_dim, d) if with_image else None
        self.blocks = nn.ModuleList(
            WanBlock(d, flavor.ffn_dim, flavor.num_heads, flavor.eps, cross_attn_norm=flavor.cross_attn_norm,
                     with_image=with_image)
            for _ in range(flavor.num_layers)
        )
        self.head = Head(d, flavor.out_channels * flavor.patch_volume, flavor.eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The reference's initialisation for training from scratch (:func:`init_from_scratch`): the first
        prediction is 0, so the first loss is simply ``E|eps - x0|^2``."""
        init_from_scratch(self, [self.head])

    def forward(self, video: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                image_context: torch.Tensor | None = None, *, cp: Any = None) -> torch.Tensor:
        """Velocity for ``video (B, in_channels, T, H, W)``.

        :param timestep: ``(B,)`` or ``(B, tokens)`` in ``[0, 1000]``; tokens = ``(T/pt) * (H/ph) * (W/pw)``.
        :param context: ``(B, L, text_dim)`` text-encoder states.
        :param image_context: ``(B, M, image_dim)`` CLIP image tokens (I2V flavors with an image branch).
        :param cp: a ``loongforge_diffusion.parallel.ContextParallel`` group: the ranks split the tokens and each
            gets only its rows ``(B, tokens/cp, out_channels * patch_volume)`` back (for a loss on local tokens).
        :return: ``(B, out_channels, T, H, W)``.
        """
        if cp is not None:
            # Imported here: the parallel package builds on this module.
            from loongforge_diffusion.parallel.forward import local_rows

            return local_rows(self, video, timestep, context, image_context, cp)
        patch = self.flavor.patch_size
        grid = tuple(n // p for n, p in zip(video.shape[2:], patch, strict=True))
        rope = rope_table(self.flavor.head_dim, grid, self.flavor.rope_theta, video.device)
        timestep = timestep if timestep.ndim == 2 else timestep[:, None]
        tokens = self.forward_tokens(self.patch_embed(video), timestep, context, image_context, rope)
        return unpatchify(tokens, grid, patch)

    def forward_tokens(self, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                       image_context: torch.Tensor | None, rope: torch.Tensor, layout: Any = None) -> torch.Tensor:
        """Embedded video tokens ``x (B, S, dim)`` -> head outputs ``(B, S, out_channels * patch_volume)``.

        The part shared by the plain forward and the packed / context-parallel ones
        (``loongforge_diffusion.parallel``), which embed and place the tokens themselves.

        :param timestep: ``(B, 1)`` or ``(B, S)``, one per token of ``x``.
        :param rope: ``(S, head_dim // 2, 2)`` rotations (cos, sin) of exactly the tokens in ``x``.
        :param layout: which tokens attend to which, see ``attention.attend``; ``None`` for one whole video.
        """
        temb, time_mod = self.time_embed(timestep)
        context = self.text_embed(context)
        if self.image_embed is not None and image_context is not None:
            image_context = self.image_embed(image_context)
        for block in self.blocks:
            if self.recompute and torch.is_grad_enabled():
                x = checkpoint(block, x, context, image_context, time_mod, rope, layout, use_reentrant=False)
            else:
                x = block(x, context, image_context, time_mod, rope, layout)
        return self.head(x, temb)


@torch.no_grad()
def init_from_scratch(model: nn.Module, heads: list[nn.Module]) -> None:
    """Wan's initialisation for training from scratch, for any model built of Wan's parts (``patch_embed``,
    ``text_embed``, ``time_embed`` and output ``heads``, as :class:`WanModel` and the embodied plugin's world-action
    model are): Xavier-uniform linear and patch weights with zero biases, N(0, 0.02) for the text and time MLPs,
    and zero output projections, so every head's first prediction is 0."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            nn.init.zeros_(module.bias)
    nn.init.xavier_uniform_(model.patch_embed.proj.weight.flatten(1))
    nn.init.zeros_(model.patch_embed.proj.bias)
    for mlp in (model.text_embed.fc1, model.text_embed.fc2, model.time_embed.mlp_in, model.time_embed.mlp_out):
        nn.init.normal_(mlp.weight, std=0.02)
    for head in heads:
        nn.init.zeros_(head.proj.weight)
