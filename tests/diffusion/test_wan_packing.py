"""Packed videos: several videos of different sizes in one token sequence give each video's own result.

Each video attends only to itself, with its own RoPE positions from 0, its own timestep (one per video, or one
per token for TI2V) and its own text (and CLIP image) context; outputs and parameter gradients must equal those
of running each video alone (fp32, rel-L2 < 1e-5). Also: patch rows embedded by matrix product equal the
model's 3D convolution, and ``patchify`` inverts ``unpatchify``.
"""

from __future__ import annotations

import pytest
import torch
from loongforge_diffusion.parallel import packed_forward
from loongforge_diffusion.parallel.tokens import embed_patches, patchify
from loongforge_diffusion.wan.model import WanModel, unpatchify
from wan_reference import rel_l2, tiny_flavor

REL = 1e-5
SHAPES = ((3, 4, 6), (1, 2, 2), (2, 6, 4))  # (T, H, W): 18, 1 and 12 tokens with patch (1, 2, 2)
TEXT, IMAGE = (7, 3, 5), (5, 2, 4)


def _perturbed(task: str) -> WanModel:
    torch.manual_seed(0)
    model = WanModel(tiny_flavor(task, 16))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)  # the zero-initialised head would zero the other gradients
    return model


def _inputs(task: str) -> tuple[list, ...]:
    generator = torch.Generator().manual_seed(1)
    videos = [torch.randn(1, 5, *shape, generator=generator) for shape in SHAPES]
    tokens = [t * (h // 2) * (w // 2) for t, h, w in SHAPES]
    timesteps = [torch.rand(1, n, generator=generator) * 1000 if task == "ti2v" else torch.rand(1) * 1000
                 for n in tokens]
    contexts = [torch.randn(1, n, 16, generator=generator) for n in TEXT]
    images = [torch.randn(1, n, 24, generator=generator) for n in IMAGE] if task == "i2v" else [None] * 3
    return videos, timesteps, contexts, images


def _grads(model: WanModel) -> dict[str, torch.Tensor]:
    out = {name: param.grad.clone() for name, param in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("task", ["t2v", "i2v", "ti2v"])
def test_packed_forward_equals_each_video_alone(task):
    model = _perturbed(task)
    videos, timesteps, contexts, images = _inputs(task)
    weights = [torch.randn(1, 4, *shape, generator=torch.Generator().manual_seed(2)) for shape in SHAPES]

    packed = packed_forward(model, videos, timesteps, contexts, None if task != "i2v" else images)
    sum((out * w).sum() for out, w in zip(packed, weights, strict=True)).backward()
    packed_grads = _grads(model)
    alone = [model(*args) for args in zip(videos, timesteps, contexts, images, strict=True)]
    sum((out * w).sum() for out, w in zip(alone, weights, strict=True)).backward()
    alone_grads = _grads(model)

    for ours, ref in zip(packed, alone, strict=True):
        assert ours.shape == ref.shape and rel_l2(ours, ref) < REL
    assert all(g.norm() > 0 for g in alone_grads.values())
    assert max(rel_l2(packed_grads[n], alone_grads[n]) for n in alone_grads) < REL


def test_packed_video_does_not_see_its_neighbours():
    """Changing one video's pixels, timestep and caption leaves every other packed video's output unchanged."""
    model = _perturbed("t2v")
    videos, timesteps, contexts, _ = _inputs("t2v")
    with torch.no_grad():
        before = packed_forward(model, videos, timesteps, contexts)
        videos[1], timesteps[1], contexts[1] = videos[1] + 1, timesteps[1] + 100, contexts[1] * -1
        after = packed_forward(model, videos, timesteps, contexts)
    assert torch.equal(before[0], after[0]) and torch.equal(before[2], after[2])
    assert rel_l2(after[1], before[1]) > 1e-2


def test_patch_rows_embed_like_the_convolution_and_patchify_inverts_unpatchify():
    model = _perturbed("t2v")
    video = torch.randn(2, 5, 3, 4, 6)
    with torch.no_grad():
        assert rel_l2(embed_patches(model.patch_embed, patchify(video, (1, 2, 2))), model.patch_embed(video)) < REL
    x = torch.randn(2, 4, 4, 6, 8)
    assert torch.equal(unpatchify(patchify(x, (2, 2, 2)), (2, 3, 4), (2, 2, 2)), x)
