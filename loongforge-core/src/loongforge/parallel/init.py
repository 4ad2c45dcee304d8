"""Initial weights that do not depend on the parallel layout.

Why: megatron draws each stage's weights from the RNG in construction order and offsets the seed per
pipeline stage, so a model built at pp=2 (or with virtual stages) starts from different weights than at
pp=1, and a parity test, or a user switching layouts, cannot compare runs. Here every weight matrix is
re-drawn from its own generator, seeded by ``(seed, global parameter name)``, on the full (unsharded) shape
with megatron's init functions; each rank keeps its tensor-parallel slice, cut the way megatron's CPU
initialisation cuts it (``partition_dim``/``partition_stride``). MoE experts are named by their *global*
expert index and cut over the expert-tensor-parallel group, so ep=1 and ep=2 start from the same experts.
Vectors (norm weights, biases) are constants at construction and are left alone. The cost is one full-size
tensor at a time, the same as megatron's ``use_cpu_initialization``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

#: Parameters that megatron initialises with ``output_layer_init_method`` (the residual-branch projections).
_OUTPUT_PROJECTIONS = ("linear_proj.weight", "linear_fc2.weight")
_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def name_seed(seed: int, name: str) -> int:
    """A 63-bit seed derived from the run seed and a global parameter name (stable across processes)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def global_parameters(chunk: Any) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``(global name, parameter)`` for one unwrapped model chunk.

    Decoder layers are numbered by their global index (``layer.layer_number - 1``), so a layer has one name
    whatever stage or virtual stage holds it. An untied copy of the embedding on the last stage (tied
    embeddings with pp > 1) is named after the embedding it mirrors. Experts held by this expert-parallel
    rank are numbered from ``ep_rank * experts_per_rank`` (megatron's order).
    """
    from megatron.core import parallel_state

    experts = getattr(getattr(chunk, "config", None), "num_moe_experts", None)
    expert_offset = 0
    if experts:
        ep = parallel_state.get_expert_model_parallel_world_size()
        expert_offset = parallel_state.get_expert_model_parallel_rank() * (experts // ep)
    layers = getattr(getattr(chunk, "decoder", None), "layers", [])
    offsets = {str(i): layer.layer_number - 1 for i, layer in enumerate(layers)}
    tied = getattr(chunk, "share_embeddings_and_output_weights", False)
    for name, param in chunk.named_parameters():
        match = _LOCAL_LAYER.match(name)
        if match:
            name = f"decoder.layers.{offsets[match.group(1)]}.{name[match.end():]}"
        elif tied and name == "output_layer.weight":
            name = "embedding.word_embeddings.weight"
        expert = _LOCAL_EXPERT.search(name)
        if expert:
            global_index = int(expert.group(1)) + expert_offset
            name = f"{name[:expert.start(1)]}{global_index}{name[expert.end(1):]}"
        yield name, param


def _init_method(config: Any, name: str) -> Callable[[torch.Tensor], Any]:
    if name == "embedding.word_embeddings.weight":
        return config.embedding_init_method
    if name.endswith(_OUTPUT_PROJECTIONS):
        return config.output_layer_init_method
    return config.init_method


def local_slice(full: torch.Tensor, param: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This tensor-parallel rank's piece of ``full``, as megatron's ``_initialize_affine_weight_cpu`` cuts it."""
    if not getattr(param, "tensor_model_parallel", False) or world == 1:
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    pieces = torch.split(full, param.shape[dim] // stride, dim=dim)
    return torch.cat(pieces[rank::world], dim=dim)


def full_shape(param: torch.Tensor, world: int) -> tuple[int, ...]:
    """The unsharded shape of a (possibly tensor-parallel) parameter."""
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= world
    return tuple(shape)


@torch.no_grad()
def initialize_layout_independent(chunks: list[Any], seed: int) -> int:
    """Re-draw every weight matrix of ``chunks`` (unwrapped megatron modules) from ``(seed, global name)``.

    Call after the chunks are built and before DDP wraps them. Returns the number of tensors drawn.
    """
    from megatron.core import parallel_state

    dense = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size())
    expert = (parallel_state.get_expert_tensor_parallel_rank(), parallel_state.get_expert_tensor_parallel_world_size())
    drawn = 0
    for chunk in chunks:
        for name, param in global_parameters(chunk):
            if param.dim() < 2:
                continue
            rank, world = expert if _LOCAL_EXPERT.search(name) else dense
            full = torch.empty(full_shape(param, world), dtype=torch.float32)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(name_seed(seed, name))
                _init_method(chunk.config, name)(full)
            param.copy_(local_slice(full, param, rank, world).to(param.dtype))
            drawn += 1
    return drawn
