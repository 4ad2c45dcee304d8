"""Adam state in a layout-independent form: per model parameter, shaped and sharded like the parameter.

Why our own format: megatron-core 0.16's distributed-optimizer checkpoint formats do not work on CPU
(``fully_sharded_model_space`` keeps flattened ranges the CPU path cannot save; ``fully_reshardable`` gathers
with CUDA tensors and its load fails on Adam's ``step``), and its formats for the distributed and the plain
optimizer differ, so a checkpoint could not move between them. Here both optimizers write the same thing:

* for every model parameter, ``exp_avg`` and ``exp_avg_sq`` (and the fp32 main copy ``param`` when the model
  is not fp32) as tensors of the parameter's local shape, described by the parameter's own ``ShardedTensor``
  (key prefixed with ``optimizer.state.<name>``), so ``dist_checkpointing`` reshards them across tp/pp/vpp
  exactly as it reshards the weights, and data-parallel replicas are written once (MoE experts: megatron's
  expert ``ShardedTensor`` keys carry the global expert index, so their state moves between ep sizes too);
* the Adam step count, one integer (every parameter is stepped every step).

The distributed optimizer holds one contiguous range of each parameter per data-parallel rank: on save the
ranges are summed into whole parameters over the data-parallel group (the ranges are disjoint, so an
all-reduce of zero-padded pieces is an all-gather); on load every rank cuts its own range from the loaded
parameter, so no communication is needed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from loongforge.errors import LoongForgeError

MOMENTS = ("exp_avg", "exp_avg_sq")


def _sub_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _main_params(opt: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(model param, main param)`` pairs of a non-distributed megatron optimizer."""
    if hasattr(opt, "float16_groups"):  # Float16OptimizerWithFloat16Params: fp32 copies of bf16/fp16 params
        for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups, strict=True):
            yield from zip(model_group, main_group, strict=True)
        for group in opt.fp32_from_fp32_groups:
            yield from ((p, p) for p in group)
    else:  # FP32Optimizer: the model params are the main params
        for group in opt.optimizer.param_groups:
            yield from ((p, p) for p in group["params"])


def _state_keys(param: torch.Tensor) -> tuple[str, ...]:
    """What is stored per parameter: the moments, plus the fp32 main copy when it differs from the weight."""
    return MOMENTS if param.dtype == torch.float32 else ("param", *MOMENTS)


def ensure_adam_state(optimizer: Any, step: int) -> None:
    """Give every main parameter Adam state (zeros where the optimizer has not stepped yet) at ``step``."""
    for opt in _sub_optimizers(optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            for main in group["params"]:
                state = inner.state[main]
                if not state:
                    state["exp_avg"] = torch.zeros_like(main, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(main, dtype=torch.float32)
                state["step"] = torch.tensor(float(step), dtype=torch.float32)


def adam_step(optimizer: Any) -> int:
    """Steps taken by ``optimizer`` (the same on every rank; a rank owning no parameter asks the others)."""
    local = 0
    for opt in _sub_optimizers(optimizer):
        for state in opt.optimizer.state.values():
            if "step" in state:
                local = max(local, int(state["step"]))
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = torch.tensor([local], dtype=torch.int64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        local = int(value.item())
    return local


def _gather_distributed(opt: DistributedOptimizer, params: list[torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """Whole-parameter state from each data-parallel rank's ranges (one all-reduce per state key)."""
    out: dict[int, dict[str, torch.Tensor]] = {id(p): {} for p in params}
    for key in sorted({k for p in params for k in _state_keys(p)}):
        owners = [p for p in params if key in _state_keys(p)]
        flat = torch.zeros(sum(p.numel() for p in owners), dtype=torch.float32)
        offset = 0
        for p in owners:
            if p in opt.model_param_group_index_map:
                span = opt._get_model_param_range_map(p)["param"]
                main, state = _distributed_main(opt, p)
                source = main if key == "param" else state[key]
                flat[offset + span.start : offset + span.end] = source.detach().view(-1)
            offset += p.numel()
        if dist.get_world_size(opt.data_parallel_group) > 1:
            dist.all_reduce(flat, group=opt.data_parallel_group)
        offset = 0
        for p in owners:
            out[id(p)][key] = flat[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
    return out


def _distributed_main(opt: DistributedOptimizer, param: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """This rank's main-parameter shard of ``param`` and its Adam state."""
    group_index, group_order = opt.model_param_group_index_map[param]
    main = opt.optimizer.param_groups[group_index]["params"][group_order]
    return main, opt.optimizer.state[main]


def _owners(optimizer: Any) -> dict[int, Any]:
    """id(model param) -> the sub-optimizer that updates it."""
    owner: dict[int, Any] = {}
    for opt in _sub_optimizers(optimizer):
        if isinstance(opt, DistributedOptimizer):
            for buffer in opt.buffers:
                owner.update({id(p): opt for p in buffer.param_index_map})
        else:
            owner.update({id(model): opt for model, _ in _main_params(opt)})
    return owner


def _local_states(optimizer: Any, params: list[torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """Every parameter's state, shaped like the parameter (collective over data-parallel groups)."""
    owner = _owners(optimizer)
    states: dict[int, dict[str, torch.Tensor]] = {}
    for opt in _sub_optimizers(optimizer):
        mine = [p for p in params if owner.get(id(p)) is opt]
        if isinstance(opt, DistributedOptimizer):
            states.update(_gather_distributed(opt, mine))
            continue
        mains = {id(model): main for model, main in _main_params(opt)}
        for p in mine:
            main = mains[id(p)]
            state = opt.optimizer.state[main]
            states[id(p)] = {
                key: (main if key == "param" else state[key]).detach().view(p.shape) for key in _state_keys(p)
            }
    return states


def _named_params(model_chunks: list[Any]) -> list[tuple[str, torch.Tensor]]:
    """Trainable parameters only: frozen ones (``model.freeze``, LoRA base weights) have no optimizer state."""
    return [
        (f"{i}/{name}", p)
        for i, chunk in enumerate(model_chunks)
        for name, p in chunk.named_parameters()
        if p.requires_grad
    ]


def optimizer_sharded_state(
    optimizer: Any, model_chunks: list[Any], model_state: dict[str, Any], *, is_loading: bool
) -> dict[str, dict[str, Any]]:
    """``{chunk/param name: {state key: ShardedTensor}}`` for ``dist_checkpointing``; on save every rank must call
    this (it gathers the distributed optimizer's ranges), on load it holds empty tensors to be filled."""
    sharded, _ = extract_sharded_tensors_and_factories(model_state)
    by_param = {
        id(sh.data): sh for sh in nested_values(sharded) if isinstance(sh, (ShardedTensor, ShardedTensorFactory))
    }
    named = _named_params(model_chunks)
    if not is_loading:
        ensure_adam_state(optimizer, adam_step(optimizer))
        states = _local_states(optimizer, [p for _, p in named])
    out: dict[str, dict[str, Any]] = {}
    for name, p in named:
        if id(p) not in by_param:
            raise LoongForgeError(f"parameter {name} has no entry in the model's sharded state dict")
        out[name] = {
            key: make_sharded_optimizer_tensor(
                by_param[id(p)],
                torch.empty(p.shape, dtype=torch.float32) if is_loading else states[id(p)][key],
                prefix=f"optimizer.state.{key}",
            )
            for key in _state_keys(p)
        }
    return out


@torch.no_grad()
def load_optimizer_state(
    optimizer: Any, model_chunks: list[Any], loaded: dict[str, dict[str, torch.Tensor]], step: int
) -> None:
    """Put loaded per-parameter state (what :func:`optimizer_sharded_state` described) into ``optimizer``."""
    ensure_adam_state(optimizer, step)
    owner = _owners(optimizer)
    mains: dict[int, torch.Tensor] = {}
    for opt in _sub_optimizers(optimizer):
        if not isinstance(opt, DistributedOptimizer):
            mains.update({id(model): main for model, main in _main_params(opt)})
    for name, p in _named_params(model_chunks):
        opt, values = owner[id(p)], loaded[name]
        if isinstance(opt, DistributedOptimizer):
            if p not in opt.model_param_group_index_map:
                continue  # another data-parallel rank holds all of this parameter
            span = opt._get_model_param_range_map(p)["param"]
            main, state = _distributed_main(opt, p)
            pieces = {key: value.reshape(-1)[span.start : span.end] for key, value in values.items()}
        else:
            main = mains[id(p)]
            state = opt.optimizer.state[main]
            pieces = {key: value.view(main.shape) for key, value in values.items()}
        for key, value in pieces.items():
            (main if key == "param" else state[key]).copy_(value)
