"""Forward passes of a ``WanModel`` over a token layout: context-parallel shards and packed videos.

Both go through one function: patchify, keep this rank's rows of the patches, RoPE table and per-token
timesteps, embed them, and run the model's blocks with a :class:`TokenLayout`. The result stays sharded for a
loss on local tokens; :func:`context_parallel_forward` and :func:`packed_forward` gather it into videos.
"""

from __future__ import annotations

import torch

from loongforge_diffusion.parallel.collectives import gather_tokens
from loongforge_diffusion.parallel.group import ContextParallel
from loongforge_diffusion.parallel.layout import TokenLayout, spans
from loongforge_diffusion.parallel.tokens import embed_patches, grid_of, patchify
from loongforge_diffusion.wan.model import WanModel, unpatchify
from loongforge_diffusion.wan.rope import rope_table


def layout_forward(model: WanModel, patches: torch.Tensor, timestep: torch.Tensor, rope: torch.Tensor,
                   context: torch.Tensor, image_context: torch.Tensor | None, layout: TokenLayout) -> torch.Tensor:
    """Head outputs for this rank's tokens of ``layout``.

    :param patches: ``(B, S, patch rows)`` of the whole sequence; ``timestep`` ``(B, 1)`` or ``(B, S)``;
        ``rope`` ``(S, head_dim // 2, 2)``; contexts as the layout packs them.
    """
    if layout.cp is not None:
        layout.cp.check(model.flavor.num_heads // model.tensor_parallel, layout.tokens)  # this rank's heads
        patches, rope = layout.cp.local(patches, 1), layout.cp.local(rope, 0)
        timestep = timestep if timestep.shape[1] == 1 else layout.cp.local(timestep, 1)
    x = embed_patches(model.patch_embed, patches)
    return model.forward_tokens(x, timestep, context, image_context, rope, layout)


def _rope(model: WanModel, grid: tuple[int, int, int], device: torch.device) -> torch.Tensor:
    return rope_table(model.flavor.head_dim, grid, model.flavor.rope_theta, device)


def local_prediction(model: WanModel, video: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                     image_context: torch.Tensor | None, cp: ContextParallel) -> torch.Tensor:
    """This rank's rows ``(B, S/cp, out_channels * patch_volume)`` of ``model(video, ...)``'s tokens.

    Goes through ``model``'s own call, so a data-parallel wrapper around it (DDP, FSDP2) sees the forward."""
    return model(video, timestep, context, image_context, cp=cp)


def local_rows(model: WanModel, video: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
               image_context: torch.Tensor | None, cp: ContextParallel) -> torch.Tensor:
    """What ``WanModel.forward(..., cp=cp)`` computes: see :func:`local_prediction`."""
    patch = model.flavor.patch_size
    grid = grid_of(video.shape[2:], patch)
    patches = patchify(video, patch)
    timestep = timestep if timestep.ndim == 2 else timestep[:, None]
    layout = TokenLayout(videos=(patches.shape[1],), cp=cp)
    return layout_forward(model, patches, timestep, _rope(model, grid, video.device), context, image_context,
                          layout)


def context_parallel_forward(model: WanModel, video: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                             image_context: torch.Tensor | None = None, *, cp: ContextParallel) -> torch.Tensor:
    """``model(video, timestep, context, image_context)`` computed by the ranks of ``cp`` together; every rank
    gets the whole output. All ranks must pass the same inputs."""
    tokens = gather_tokens(local_prediction(model, video, timestep, context, image_context, cp), cp.group)
    return unpatchify(tokens, grid_of(video.shape[2:], model.flavor.patch_size), model.flavor.patch_size)


def packed_forward(model: WanModel, videos: list[torch.Tensor], timesteps: list[torch.Tensor],
                   contexts: list[torch.Tensor], image_contexts: list[torch.Tensor] | None = None, *,
                   cp: ContextParallel | None = None) -> list[torch.Tensor]:
    """Several videos of different sizes as one token sequence, each exactly as ``model`` would see it alone.

    :param videos: ``(B, C, T_i, H_i, W_i)`` each (the same B); ``timesteps`` ``(B,)`` or ``(B, tokens_i)``;
        ``contexts`` ``(B, L_i, text_dim)``; ``image_contexts`` ``(B, M_i, image_dim)`` for I2V flavors.
    :return: each video's prediction, ``(B, out_channels, T_i, H_i, W_i)``.
    """
    if not len(videos) == len(timesteps) == len(contexts):
        raise ValueError(f"packed_forward: {len(videos)} videos, {len(timesteps)} timesteps, {len(contexts)} contexts")
    patch = model.flavor.patch_size
    grids = [grid_of(v.shape[2:], patch) for v in videos]
    patches = [patchify(v, patch) for v in videos]
    lengths = tuple(p.shape[1] for p in patches)
    per_token = [t[:, None].expand(-1, n) if t.ndim == 1 else t for t, n in zip(timesteps, lengths, strict=True)]
    layout = TokenLayout(videos=lengths, texts=tuple(c.shape[1] for c in contexts),
                         images=None if image_contexts is None else tuple(c.shape[1] for c in image_contexts), cp=cp)
    tokens = layout_forward(
        model, torch.cat(patches, dim=1), torch.cat(per_token, dim=1),
        torch.cat([_rope(model, g, videos[0].device) for g in grids]), torch.cat(contexts, dim=1),
        None if image_contexts is None else torch.cat(image_contexts, dim=1), layout,
    )
    if cp is not None:
        tokens = gather_tokens(tokens, cp.group)
    return [unpatchify(tokens[:, a:b], grid, patch) for (a, b), grid in zip(spans(lengths), grids, strict=True)]
