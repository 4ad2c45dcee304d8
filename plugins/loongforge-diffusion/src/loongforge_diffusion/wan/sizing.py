"""A Wan DiT's sizes for the layout planner (:class:`loongforge.models.task_terms.TaskTerms`).

Parameters follow :func:`loongforge_diffusion.wan.flavors.num_params`, split as :mod:`~loongforge_diffusion.wan.
tensor_parallel` splits them: the projections into and out of heads and the FFN's columns over tp, the fused
projections' biases, the row-parallel outputs' biases, the modulation table and the cross-attention norm whole.

Activations are the bytes autograd saves, counted once per storage on the eager CPU build
(``tests/diffusion/test_wan_sizing.py`` holds these formulas to the count): per token of one block, with ``d`` the
width, ``f`` the FFN width and ``h`` the heads,

=========  ====================  ================================  ==========================================
dtype      whole on tp ranks     split by tp                       per sample (context of ``L`` tokens)
=========  ====================  ================================  ==========================================
fp32       ``40 d + 36``         ``48 d + 8 f + 8 h``              ``20 d L + 4 L``
bf16       ``34 d + 36``         ``40 d + 4 f + 8 h``              ``19 d L + 4 L``
=========  ====================  ================================  ==========================================

The whole part is the three norms' inputs (kept in fp32 as Wan computes them) and statistics, the modulated and
residual tensors and the inputs of the column-parallel projections; the split part is q/k/v with their norms and
rotations, both attentions' outputs and log-sum-exps, and the FFN's hidden activations. Wan 2.1 I2V's image branch
adds ``8 d + 4 h`` (fp32) or ``4 d + 4 h`` (bf16) split bytes per token and its ``M`` CLIP tokens' keys and values
per sample. Outside the blocks a token keeps the patch embedding's input, the head's tensors (``12 d + 9`` fp32,
``10 d + 9`` bf16) and a RoPE rotation (``4 x head_dim``, complex64 whatever the dtype). A recomputed block keeps its
input (``d`` values in the compute dtype).

A block's backward adds transient gradients beyond the saved tensors: three fp32 vectors per token (``12 d``, the
residual stream's gradients, which Wan keeps in fp32). This term is fitted to profiler-measured peaks of CPU runs
(one process fp32; two-process FSDP2 bf16 with cp 2, mbs 1 and 2), not counted; Ulysses' exchanges add nothing
measurable once their buffers are freed as the exchange ends. ``tests/diffusion/test_wan_planner.py`` holds the
whole prediction to measured peaks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from loongforge.errors import ConfigError
from loongforge.models.task_terms import BlockActivations, TaskTerms

#: CLIP image tokens Wan 2.1 I2V attends to (ViT-H/14 at 224 px: 16 x 16 patches and the class token).
CLIP_TOKENS = 257
_BYTES = {"fp32": 4, "bf16": 2}


def latent_shape(flavor: Any, options: Any, source: str) -> tuple[tuple[int, int, int], int]:
    """``((frames, height, width), context tokens)`` of one sample of the config's data: a latent cache's index, a
    written moving-squares file's videos, or the generated squares' ``task.frames``/``task.side``."""
    if options.data is None:
        return (options.frames, options.side, options.side), 3
    path = Path(options.data)
    index = path / "index.json"
    if index.is_file():
        shapes = json.loads(index.read_text())["shapes"]
        return tuple(shapes["video"][1:]), shapes["context"][0]
    from loongforge.data.errors import DataError

    from loongforge_diffusion.data.written import read_written

    try:
        stored = read_written(path)
    except DataError as exc:
        raise ConfigError(f"{source}: task.data: {exc}; or plan a shape with --sample-shape") from None
    return tuple(stored["video"].shape[2:]), stored["context"].shape[1]


def run_limits(options: Any, compile_mode: Any, experts: int) -> dict[str, Any]:
    """What the run's options rule out of the layouts (each refused by the pre-flight), with a note each: an EMA
    of sharded parameters (FSDP2/HSDP), LoRA and compilation with tensor parallelism; ``experts_resident: one`` is
    one process holding one expert on the device."""
    strategies, notes, tensor_parallel, models = ["ddp", "zero1", "fsdp2", "hsdp"], [], True, experts
    if options is None:
        return {"strategies": tuple(strategies), "notes": (), "tensor_parallel": True, "models": models}
    if options.ema is not None:
        strategies = ["ddp", "zero1"]
        notes.append("task.ema: fsdp2 and hsdp left out (an EMA of sharded parameters is not supported yet)")
    for key, on in (("task.lora", options.lora is not None), ("training.compile", bool(compile_mode))):
        if on and tensor_parallel:
            tensor_parallel = False
            notes.append(f"{key}: tensor parallelism left out (not supported with it yet)")
    if options.experts_resident == "one":
        strategies, models = [], 1
        notes.append("task.experts_resident: one: one process, the serving expert on the device, the other in host "
                     "memory")
    return {"strategies": tuple(strategies), "notes": tuple(notes), "tensor_parallel": tensor_parallel,
            "models": models}


def wan_terms(flavor: Any, options: Any, source: str, sample_shape: tuple[int, ...] | None,
              compile_mode: Any = False) -> TaskTerms:
    """The planner's statement for ``flavor`` trained on one sample of ``sample_shape`` (latent frames, height,
    width; the text context then ``text_len`` tokens, as the encoders pad it) or of the config's data, within what
    the run's ``task:`` options (``None``: the defaults) and ``training.compile`` allow (:func:`run_limits`)."""
    if sample_shape is not None:
        if len(sample_shape) != 3:
            raise ConfigError(f"{source}: a Wan sample shape is latent frames x height x width, got {sample_shape}")
        grid, context = tuple(sample_shape), flavor.text_len
    else:
        grid, context = latent_shape(flavor, options, source)
    if any(n % p for n, p in zip(grid, flavor.patch_size, strict=True)):
        raise ConfigError(f"{source}: latents {'x'.join(map(str, grid))} do not divide into patches "
                          f"{'x'.join(map(str, flavor.patch_size))}")
    tokens = math.prod(n // p for n, p in zip(grid, flavor.patch_size, strict=True))
    d, f, h = flavor.dim, flavor.ffn_dim, flavor.num_heads
    image = CLIP_TOKENS if flavor.image_dim is not None else 0
    split = 8 * d * d + d + d * f + f + f * d + 4 * d  # projections (cross q's bias too), FFN, q/k norms
    whole = 3 * d + d + 2 * d + d + d + 6 * d + (2 * d if flavor.cross_attn_norm else 0)  # biases, modulation
    if image:
        split, whole = split + 2 * d * d + d, whole + 2 * d
    from loongforge_diffusion.wan.flavors import num_params

    outside = num_params(flavor) - flavor.num_layers * (split + whole)
    matmul = 8 * d * d + 2 * d * f  # per token: qkv, out, cross q and out, the FFN
    block_flops = 2 * tokens * matmul + 4 * (context + image) * d * d + 4 * tokens * tokens * d \
        + 4 * tokens * (context + image) * d
    patch = flavor.in_channels * flavor.patch_volume
    outside_flops = 2 * tokens * (patch * d + d * flavor.out_channels * flavor.patch_volume) \
        + 2 * context * (flavor.text_dim * d + d * d)

    def activations(dtype: str) -> BlockActivations:
        width = _BYTES[dtype]
        fp32 = dtype == "fp32"
        split_tok = (48 * d + 8 * f if fp32 else 40 * d + 4 * f) + 8 * h
        per_sample = (20 if fp32 else 19) * d * context + 4 * context
        if image:
            split_tok += (8 if fp32 else 4) * d + 4 * h
            per_sample += (16 if fp32 else 14) * d * image + 4 * image
        return BlockActivations(
            replicated_per_token=(40 if fp32 else 34) * d + 36, split_per_token=split_tok,
            split_per_sample=per_sample, recompute_per_token=width * d, backward_per_token=12 * d,
            outside_per_token=width * patch + (12 if fp32 else 10) * d + 9 + 4 * flavor.head_dim)

    limits = run_limits(options, compile_mode, 2 if flavor.expert_boundary is not None else 1)
    return TaskTerms(
        blocks=flavor.num_layers, block_split_params=split, block_replicated_params=whole, outside_params=outside,
        tokens=tokens, heads=h, hidden=d, block_forward_flops=flavor.num_layers * block_flops,
        outside_forward_flops=outside_flops, activations={dtype: activations(dtype) for dtype in _BYTES},
        models_per_step=1, context_parallel=True, tp_divides=(f,), recompute_option="task.recompute", **limits,
        sample=f"{'x'.join(map(str, grid))} latents, {tokens} tokens, {context} text tokens")
