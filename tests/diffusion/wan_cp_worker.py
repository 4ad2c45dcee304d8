"""Worker for ``test_wan_context_parallel``: run under ``torchrun --nproc-per-node 2`` (gloo, CPU).

Every rank builds the same tiny model and inputs, computes the single-process reference itself (no
communication), then the same quantities with context parallelism over both ranks; rank 0 writes the
measured differences as JSON to the path given as the only argument.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from loongforge.errors import ConfigError
from loongforge_diffusion.parallel import (
    ContextParallel,
    all_reduce_gradients,
    context_parallel_forward,
    context_parallel_step,
    packed_forward,
)
from loongforge_diffusion.training import flow_matching_step
from loongforge_diffusion.wan.model import WanModel
from wan_reference import rel_l2, tiny_flavor

VIDEO = (2, 4, 3, 4, 6)  # batch, channels, frames, height, width: 18 tokens, shards split a frame in half


def build(task: str) -> WanModel:
    """A model with every weight perturbed: the zero-initialised head would otherwise zero all other gradients."""
    torch.manual_seed(0)
    flavor = tiny_flavor(task, 16)
    flavor = flavor.with_overrides(in_channels=4) if task == "ti2v" else flavor  # TI2V conditions by frame, not channel
    model = WanModel(flavor)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model


def make_batch(task: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    batch = {"video": torch.randn(VIDEO, generator=generator), "context": torch.randn(2, 7, 16, generator=generator)}
    if task != "ti2v":
        batch["condition"] = torch.randn(2, 1, *VIDEO[2:], generator=generator)
    if task == "i2v":
        batch["image_context"] = torch.randn(2, 5, 24, generator=generator)
    return batch


def grads(model: WanModel) -> dict[str, torch.Tensor]:
    out = {name: param.grad.clone() for name, param in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def worst(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max(rel_l2(ours[name], ref[name]) for name in ref)


def check_task(task: str, cp: ContextParallel) -> dict:
    model, batch = build(task), make_batch(task)
    ti2v = task == "ti2v"
    step = dict(context_dropout=0.5, clean_first_frame=ti2v)
    model_input = batch["video"] if ti2v else torch.cat([batch["video"], batch["condition"]], dim=1)
    tokens = VIDEO[2] * (VIDEO[3] // 2) * (VIDEO[4] // 2)
    timestep = torch.linspace(0, 999, 2 * tokens).reshape(2, tokens) if ti2v else torch.tensor([3.0, 700.0])
    args = (model_input, timestep, batch["context"], batch.get("image_context"))
    with torch.no_grad():
        forward = rel_l2(context_parallel_forward(model, *args, cp=cp), model(*args))

    ref_loss = flow_matching_step(model, batch, torch.Generator().manual_seed(3), **step)
    ref_loss.backward()
    ref_grads = grads(model)
    loss = context_parallel_step(model, batch, torch.Generator().manual_seed(3), cp, **step)
    loss.backward()
    local_norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
    all_reduce_gradients(model, cp.group)
    cp_grads = grads(model)
    model.recompute = True
    context_parallel_step(model, batch, torch.Generator().manual_seed(3), cp, **step).backward()
    all_reduce_gradients(model, cp.group)
    recomputed = grads(model)
    full_norm = torch.cat([g.flatten() for g in ref_grads.values()]).norm().item()
    return {
        "forward": forward,
        "loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
        "grads": worst(cp_grads, ref_grads),
        "zero_grads": sorted(name for name, g in ref_grads.items() if g.norm() == 0),
        "local_over_full_norm": local_norm / full_norm,
        "recompute_bitwise": all(torch.equal(recomputed[n], cp_grads[n]) for n in cp_grads),
    }


def check_packed(cp: ContextParallel) -> float:
    """Three videos (12 + 2 + 12 tokens: the shard boundary cuts the middle one) of an I2V model, packed under cp=2."""
    model = build("i2v")
    generator = torch.Generator().manual_seed(2)
    videos = [torch.randn(1, 5, *shape, generator=generator) for shape in ((3, 4, 4), (1, 2, 4), (2, 4, 6))]
    timesteps = [torch.tensor([t]) for t in (10.0, 500.0, 990.0)]
    contexts = [torch.randn(1, n, 16, generator=generator) for n in (7, 3, 5)]
    images = [torch.randn(1, n, 24, generator=generator) for n in (5, 2, 4)]
    with torch.no_grad():
        packed = packed_forward(model, videos, timesteps, contexts, images, cp=cp)
        alone = [model(*args) for args in zip(videos, timesteps, contexts, images, strict=True)]
    return max(rel_l2(p, a) for p, a in zip(packed, alone, strict=True))


def error_messages(cp: ContextParallel) -> list[str]:
    messages = []
    for task, shape in (("t2v", (1, 5, 3, 2, 6)), ("three-heads", (1, 5, 2, 2, 2))):
        model = WanModel(tiny_flavor("t2v", 16).with_overrides(dim=48, num_heads=3) if task == "three-heads"
                         else tiny_flavor("t2v", 16))
        try:
            context_parallel_forward(model, torch.zeros(shape), torch.tensor([1.0]), torch.zeros(1, 2, 16), cp=cp)
        except ConfigError as exc:
            messages.append(str(exc))
    return messages


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cp = ContextParallel.from_world(2)
    results = {task: check_task(task, cp) for task in ("t2v", "i2v", "ti2v")}
    results["packed"] = check_packed(cp)
    results["errors"] = error_messages(cp)
    results["data_parallel"] = cp.data_parallel()
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
