"""Torch-native data parallelism for task models (diffusion DiTs, VLA policies): DDP, ZeRO-1, FSDP2, HSDP.

Megatron's strategy splits decoder layers; models that are plain ``torch.nn.Module`` trees get PyTorch's own tools,
chosen with ``parallel.strategy``:

* ``ddp`` -- :class:`torch.nn.parallel.DistributedDataParallel` (``ddp_bucket_mb``, ``ddp_static_graph``, and
  ``ddp_comm_hook: bf16|fp16`` to compress gradients on the wire);
* ``zero1`` -- DDP plus :class:`torch.distributed.optim.ZeroRedundancyOptimizer`: each rank keeps the AdamW
  state of its share of the parameters (fp32 master weights stay fp32);
* ``fsdp2`` -- ``fully_shard`` on every unit the planner picks, then on the root: parameters, gradients and
  optimizer state sharded over all ranks;
* ``hsdp`` -- ``fully_shard`` on a 2-D mesh: shards within groups of ``fsdp_shard_size`` ranks, replicas across.

Any of them combines with ``parallel.cp`` (context parallelism) for tasks that split one sample's sequence
over ranks (``use_context_parallel`` in :mod:`loongforge.tasks`): groups of ``cp`` ranks see the same samples, so
the data-parallel size is ``world / cp``. ``fsdp2`` also combines with ``parallel.tp`` for tasks that split their
blocks' weights with DTensor (``use_tensor_parallel``): ranks are laid out ``(dp, cp, tp)``, tp innermost (the
chattiest, so neighbours), the task splits its blocks over the ``tp`` dimension of a 2-D mesh and ``fully_shard``
shards over the other (the ``dp x cp`` ranks holding the same tensor-parallel slice); the ``tp`` ranks of a group
train the same samples, so the data-parallel size is ``world / (cp * tp)``.

The FSDP planner shards every element of the model's ``nn.ModuleList`` s (transformer blocks) that holds
parameters, splitting a block further when its parameters mix dtypes (one ``fully_shard`` unit must be one
dtype), and leaves modules the forward never runs out of the units (found by one dry forward). Everything
gathers to full tensors on rank 0 for checkpoints, so a checkpoint loads at any world size and strategy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from loongforge.errors import ConfigError
from loongforge.parallel.strategy import ParallelStrategy

KINDS = ("ddp", "zero1", "fsdp2", "hsdp")
_COMM_HOOKS = ("bf16", "fp16")


@dataclass(frozen=True)
class TorchLayout:
    """A validated torch-native layout: the kind, the world size, (HSDP) ranks per sharding group, the
    context-parallel size (ranks that split each sample's sequence) and the tensor-parallel size (ranks that split
    each block's weights); ranks are ordered ``(dp, cp, tp)``, tp innermost."""

    kind: str
    world_size: int
    shard_size: int
    cp: int = 1
    tp: int = 1

    @property
    def replicas(self) -> int:
        return self.world_size // self.shard_size

    @property
    def dp(self) -> int:
        """Data-parallel size: how many different sample shards one step trains."""
        return self.world_size // (self.cp * self.tp)

    def dp_rank(self, rank: int) -> int:
        """The data-parallel index of global ``rank``: which sample shard it trains."""
        return rank // (self.cp * self.tp)

    def describe(self) -> str:
        kind = (f"hsdp: {self.replicas} replicas x {self.shard_size}-way sharding" if self.kind == "hsdp"
                else f"{self.kind} over {self.world_size} rank(s)")
        split = [f"{name} {size}" for name, size in (("tensor parallel", self.tp), ("context parallel", self.cp))
                 if size > 1]
        return kind + (f", {', '.join(split)} (data parallel {self.dp})" if split else "")


class TorchNativeStrategy(ParallelStrategy):
    """One of :data:`KINDS`; registered under its kind's name as a parallel strategy."""

    engine: ClassVar[str] = "task"

    def __init__(self, kind: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown torch-native strategy {kind!r}")
        self.kind = kind

    def validate(self, parallel: Any, world_size: int, source: str) -> TorchLayout:
        """Refuse megatron-only sizes and impossible HSDP, context- or tensor-parallel groups (one line naming the
        key)."""
        for key in ("pp", "ep"):
            if getattr(parallel, key) != 1:
                raise ConfigError(f"{source}: parallel.{key}={getattr(parallel, key)} needs parallel.strategy "
                                  f"megatron; '{self.kind}' splits data (and, with cp, sequences) only")
        if parallel.tp != 1 and self.kind != "fsdp2":
            raise ConfigError(f"{source}: parallel.tp={parallel.tp} with '{self.kind}': task models split weights "
                              "over tensor-parallel ranks under parallel.strategy fsdp2 only")
        if parallel.tp < 1 or parallel.cp < 1 or world_size % (parallel.cp * parallel.tp):
            raise ConfigError(f"{source}: parallel.cp={parallel.cp} x parallel.tp={parallel.tp} must divide the "
                              f"number of processes ({world_size})")
        if parallel.cp_mode != "ulysses" or parallel.cp_a2a_size is not None:
            raise ConfigError(f"{source}: parallel.cp_mode {parallel.cp_mode} / cp_a2a_size choose the megatron "
                              f"strategy's attention exchange; with '{self.kind}' the task model splits sequences "
                              "its own way (leave them unset)")
        if parallel.ddp_comm_hook is not None and parallel.ddp_comm_hook not in _COMM_HOOKS:
            raise ConfigError(f"{source}: parallel.ddp_comm_hook must be one of {', '.join(_COMM_HOOKS)} or null, "
                              f"got {parallel.ddp_comm_hook!r}")
        shard = world_size
        if self.kind == "hsdp":
            shard = parallel.fsdp_shard_size or 0
            if shard < 1 or world_size % shard or shard == world_size:
                raise ConfigError(f"{source}: hsdp needs parallel.fsdp_shard_size dividing the world size {world_size} "
                                  f"and smaller than it (replicas x shards), got {parallel.fsdp_shard_size}")
        elif parallel.fsdp_shard_size not in (None, world_size) and self.kind == "fsdp2":
            raise ConfigError(f"{source}: parallel.fsdp_shard_size is for hsdp; fsdp2 shards over all "
                              f"{world_size} ranks")
        return TorchLayout(self.kind, world_size, shard, parallel.cp, parallel.tp)

    # -- groups and wrapping -------------------------------------------------------------------------------------
    @staticmethod
    def context_parallel_group(layout: TorchLayout) -> Any:
        """This rank's context-parallel group: the ``cp`` ranks of one data-parallel index and one tensor-parallel
        index (consecutive ranks when tp is 1). Collective (every rank creates every group, as ``new_group``
        requires)."""
        mine = None
        span = layout.cp * layout.tp
        for first in range(layout.world_size):
            if (first % span) // layout.tp:  # not the cp-index-0 rank of its group
                continue
            ranks = list(range(first, first - first % span + span, layout.tp))
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = group
        return mine

    def wrap(self, model: nn.Module, layout: TorchLayout, parallel: Any, *, sample_batch: Any = None,
             run_forward: Any = None, bf16: bool = False, sparse_parameters: bool = False,
             tensor_parallel: Any = None) -> nn.Module:
        """The model ready for data-parallel training (parameters must already be on the device).

        ``sparse_parameters``: some steps leave parameters unused (:attr:`loongforge.tasks.TaskBase.sparse_parameters`);
        DDP finds them each step and leaves their gradients ``None``. ``tensor_parallel(model, mesh)`` (layouts with
        tp > 1): splits the model's weights over the 1-D tensor-parallel ``mesh`` in place, before sharding."""
        if self.kind in ("ddp", "zero1"):
            check_static_graph(parallel, sparse_parameters)
            ddp = nn.parallel.DistributedDataParallel(
                model, bucket_cap_mb=parallel.ddp_bucket_mb, static_graph=parallel.ddp_static_graph,
                find_unused_parameters=sparse_parameters)
            if parallel.ddp_comm_hook:
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                hook = default_hooks.bf16_compress_hook if parallel.ddp_comm_hook == "bf16" \
                    else default_hooks.fp16_compress_hook
                ddp.register_comm_hook(dist.group.WORLD, hook)
            return ddp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        device_type = next(model.parameters()).device.type
        if self.kind == "hsdp":
            mesh = init_device_mesh(device_type, (layout.replicas, layout.shard_size),
                                    mesh_dim_names=("replicate", "shard"))
        elif layout.tp > 1:
            both = init_device_mesh(device_type, (layout.world_size // layout.tp, layout.tp),
                                    mesh_dim_names=("shard", "tp"))
            tensor_parallel(model, both["tp"])
            mesh = both["shard"]
        else:
            mesh = init_device_mesh(device_type, (layout.world_size,))
        # Only the root casts the model's floating-point inputs to bf16: a unit's inputs are what the model computed
        # before it, in the dtype the model chose (a Wan block's RoPE table is float32, which its complex rotation
        # needs; cast per unit, as the policy does by default, it reached the block in bf16 and the step failed).
        root = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
        inner = dataclasses.replace(root, cast_forward_inputs=False)
        for unit in fsdp_units(model, run_forward):
            fully_shard(unit, mesh=mesh, mp_policy=inner, shard_placement_fn=shard_placement)
        fully_shard(model, mesh=mesh, mp_policy=root, shard_placement_fn=shard_placement)
        return model

    def optimizer(self, params: list[nn.Parameter], **adamw: Any) -> torch.optim.Optimizer:
        if self.kind == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **adamw)
        return torch.optim.AdamW(params, **adamw)

    # -- full state for checkpoints -----------------------------------------------------------------------------
    def full_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict] | None:
        """``(model state, optimizer state)`` with full tensors on rank 0 (None on other ranks). Collective."""
        if self.kind in ("fsdp2", "hsdp"):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            model_state, optim_state = get_state_dict(model, optimizer, options=options)
            return (model_state, optim_state) if dist.get_rank() == 0 else None
        if self.kind == "zero1":
            optimizer.consolidate_state_dict(to=0)
        module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        if dist.get_rank() != 0:
            return None
        return module.state_dict(), optimizer.state_dict()

    def load_full_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                        optim_state: dict) -> None:
        """Load full tensors (every rank passes the same ones) into the wrapped model and its optimizer."""
        if self.kind in ("fsdp2", "hsdp"):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

            set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                           options=StateDictOptions(full_state_dict=True))
            return
        module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        module.load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)


def check_static_graph(parallel: Any, sparse_parameters: bool) -> None:
    """``parallel.ddp_static_graph`` promises DDP one fixed set of used parameters, which a task whose steps each
    train a part of the model (:attr:`loongforge.tasks.TaskBase.sparse_parameters`) breaks; one line. Called by
    :meth:`TorchNativeStrategy.wrap` and by such a task's pre-flight (``loongforge check``)."""
    if sparse_parameters and parallel.ddp_static_graph:
        raise ConfigError("parallel.ddp_static_graph assumes every step uses the same parameters; this model's "
                          "steps each train a part of it (set parallel.ddp_static_graph: false)")


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_`` for parameters that may live on different device meshes: under fsdp2 with
    tensor parallelism a split weight is a DTensor on the 2-D (shard, tp) mesh and a replicated one on the shard mesh
    only, and torch's one-call version cannot stack their norms. Each mesh's gradients give one norm (reduced over
    that mesh, so a replicated slice counts once); the global norm is their root sum of squares. Returns it."""
    from torch.distributed.tensor import DTensor

    by_mesh: dict[Any, list[nn.Parameter]] = {}
    for param in (p for p in parameters if p.grad is not None):
        by_mesh.setdefault(param.device_mesh if isinstance(param, DTensor) else None, []).append(param)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group]) for group in by_mesh.values()]
    norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
    total = norms[0] if len(norms) == 1 else torch.stack(norms).square().sum().sqrt()
    for group in by_mesh.values():  # torch's foreach kernels take one mesh at a time
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return float(total)


def shard_placement(param: nn.Parameter) -> Any:
    """The dimension ``fully_shard`` splits ``param`` along: 0, except for a weight tensor parallelism already split
    along 0 with a ``_StridedShard`` (a fused projection whose ranks each hold their heads' rows of every part,
    ``[q_r; k_r; v_r]``). FSDP2's own split of dim 0 cannot be composed with that one -- gathered back to full
    tensors (checkpoints) the rows come out permuted -- so such a weight is sharded along dim 1 instead."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    strided = isinstance(param, DTensor) and any(isinstance(p, _StridedShard) and p.dim == 0 for p in param.placements)
    return Shard(1 if strided else 0)


def fsdp_units(model: nn.Module, run_forward: Any = None) -> list[nn.Module]:
    """The modules to ``fully_shard`` before the root (see the module docstring), children before parents."""
    ran: set[int] | None = None
    if run_forward is not None:
        ran = set()
        handles = [m.register_forward_hook(lambda mod, *_: ran.add(id(mod))) for m in model.modules()]
        try:
            with torch.no_grad():
                run_forward(model)
        finally:
            for handle in handles:
                handle.remove()
    units: list[nn.Module] = []
    for module_list in (m for m in model.modules() if isinstance(m, nn.ModuleList)):
        for block in module_list:
            if ran is not None and id(block) not in ran:
                continue
            units.extend(_single_dtype_units(block))
    return units


def _single_dtype_units(block: nn.Module) -> list[nn.Module]:
    """``[block]`` when its parameters share one dtype, else its children split the same way."""
    dtypes = {p.dtype for p in block.parameters()}
    if not dtypes:
        return []
    if len(dtypes) == 1:
        return [block]
    return [unit for child in block.children() for unit in _single_dtype_units(child)]


#: Registered instances (``loongforge list strategies``).
DDP = TorchNativeStrategy("ddp")
ZERO1 = TorchNativeStrategy("zero1")
FSDP2 = TorchNativeStrategy("fsdp2")
HSDP = TorchNativeStrategy("hsdp")
