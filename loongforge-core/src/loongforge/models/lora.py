"""LoRA adapters and parameter freezing for megatron-core GPT models (``model.lora``, ``model.freeze``).

Why a forward hook instead of replacing the linear modules: the adapter lives *inside* the adapted module
(``...linear_qkv.lora.weight_a``/``weight_b``) and the base module, its class and its parameter names stay as
they are. So everything keyed by parameter names keeps working unchanged: megatron's ``sharded_state_dict``
(the adapter's tensors are saved and resumed like any weight), Hugging Face loading before the adapters are
added, and the HF exporter after :func:`merge_lora_state_dict` folded them away.

The update is ``y = W x + (alpha / rank) * B A dropout(x)`` with ``B = 0`` at the start, so a freshly adapted
model computes exactly what the base model did. ``A`` is drawn from a generator seeded by the run seed and the
parameter's layer-independent name, so the adapters do not depend on the pipeline or tensor layout.

Tensor parallelism: an adapter is split the way megatron splits its base weight, so that ``B A`` is always the
local shard of the full update and merging works shard by shard.

Targets are named by the layer's module name (``linear_qkv``, ``linear_fc1``, MLA's ``linear_kv_up_proj``, Gated
DeltaNet's ``in_proj`` ...): any of megatron's tensor-parallel linears (local or Transformer Engine) in the model,
whichever family built it; its split is read from the module. The default (``targets: null``) is every such
linear of the attention blocks (``self_attention``): a family's own attention gets adapters with no list to keep.

* Column-parallel targets (``linear_qkv``, ``linear_fc1``: the output features are split) keep ``A`` whole
  (``[rank, in]``, replicated) and split ``B`` by output rows (``[out / tp, rank]``, like the weight; for a
  gated ``linear_fc1`` that is ``[gate slice; up slice]``). Each rank's ``B`` sees only its output slice, so
  the gradient reaching ``A x`` is a partial sum: it is all-reduced over the tensor-parallel group
  (megatron's ``copy_to_tensor_model_parallel_region``) before it reaches ``A``, which makes ``A``'s gradient,
  and the gradient of the input, the full ones on every rank. With sequence parallelism the input is first
  all-gathered along the sequence; its gradient is then split back (not reduce-scattered: it is already full).
  Dropout is applied before that gather, so the replicated ``A x`` sees one mask on every rank.
* Row-parallel targets (``linear_proj``, ``linear_fc2``: the input features are split) split ``A`` by input
  columns (``[rank, in / tp]``, the input is the rank's shard already), all-reduce ``A x`` (megatron's
  ``reduce_from_tensor_model_parallel_region``) and keep ``B`` whole (``[out, rank]``, replicated); with
  sequence parallelism the output is cut to the rank's sequence slice like the base layer's.

So every replicated adapter tensor receives the whole gradient on every rank and stays identical across the
group with no extra gradient synchronisation (megatron all-reduces over tensor parallelism only layer norms
under sequence parallelism); the split tensors carry megatron's ``tensor_model_parallel`` attributes, so the
gradient norm counts each shard once and replicated tensors on one rank only, as for base weights. Checkpoints
store each split tensor as a tensor-parallel shard of the full one (the adapted module's ``sharded_state_dict``
is extended per instance), so ``dist_checkpointing`` reshards adapters and their Adam state between layouts.
MoE expert layers take adapters only without expert tensor parallelism (their communication is the token
dispatcher's, not the layer's).

Frozen parameters have ``requires_grad = False``; megatron's DDP gives them no gradient buffer and its
optimizer no state, so only the adapters (and any unfrozen weights) are trained and checkpointed with Adam
state. ``model.lora.base_dtype: bf16`` builds the model (and so the frozen base and its matmuls) in bf16 while
the adapters are fp32 parameters that compute in fp32 (QLoRA's split, without the 4-bit storage).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import math
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from loongforge.errors import ConfigError
from loongforge.models.parameter_groups import ParameterGroup, group_of

#: How megatron splits an adaptable linear layer at tensor parallelism (output features / input features).
COLUMN, ROW = "column", "row"
#: The module path component under which every family's attention lives (megatron's layer slot): the default
#: targets are the tensor-parallel linears below it.
ATTENTION = "self_attention"
ADAPTER = "lora"
#: ``model.lora.base_dtype`` values: the dtype the frozen base is built in.
BASE_DTYPES = ("bf16",)


class LoRAAdapter(nn.Module):
    """The low-rank update of one (tensor-parallel shard of a) linear layer: ``scaling * B(A(dropout(x)))``.

    ``weight_a``/``weight_b`` are this rank's pieces (see the module docstring for which one is split);
    ``split`` is :data:`COLUMN` or :data:`ROW`; ``tp_group`` the tensor-parallel group the base layer is split
    over; ``sequence_parallel`` whether its input (column) or output (row) is split along the sequence.
    """

    def __init__(self, weight_a: torch.Tensor, weight_b: torch.Tensor, *, split: str, scaling: float,
                 dropout: float, tp_group: Any, sequence_parallel: bool) -> None:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        self.weight_a = nn.Parameter(weight_a)
        self.weight_b = nn.Parameter(weight_b)
        self.split, self.scaling, self.tp_group = split, scaling, tp_group
        self.sequence_parallel = sequence_parallel
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        #: False inside :func:`adapters_disabled`: the layer computes its base output alone.
        self.enabled = True
        name, axis = self.split_tensor()
        set_tensor_model_parallel_attributes(getattr(self, name), True, axis, 1)

    def split_tensor(self) -> tuple[str, int]:
        """The name of the tensor that is split over tensor parallelism, and the axis it is split along."""
        return ("weight_b", 0) if self.split == COLUMN else ("weight_a", 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core import tensor_parallel as tpl

        x = x.to(self.weight_a.dtype)
        if self.split == COLUMN:
            # The input is the same on every rank (or, with sequence parallelism, this rank's sequence slice, run
            # under megatron's per-rank RNG stream): drop out first, then gather, so all ranks hold one tensor.
            x = self.dropout(x)
            if self.sequence_parallel:
                x = tpl.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False,
                                                             group=self.tp_group)
            down = tpl.copy_to_tensor_model_parallel_region(F.linear(x, self.weight_a), group=self.tp_group)
            return F.linear(down, self.weight_b) * self.scaling
        # The input is this rank's slice of the features, so its mask comes from the per-rank stream; megatron's
        # transformer block has already entered that stream for all its layers under sequence parallelism.
        per_rank = isinstance(self.dropout, nn.Dropout) and self.tp_group.size() > 1 and not self.sequence_parallel
        with tpl.get_cuda_rng_tracker().fork() if per_rank else contextlib.nullcontext():
            x = self.dropout(x)
        down = tpl.reduce_from_tensor_model_parallel_region(F.linear(x, self.weight_a), group=self.tp_group)
        up = F.linear(down, self.weight_b) * self.scaling
        return tpl.scatter_to_sequence_parallel_region(up, group=self.tp_group) if self.sequence_parallel else up


def _add_adapter_output(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    """Forward hook: megatron linears return ``(output, bias)``; add the adapter's update to ``output``."""
    adapter = getattr(module, ADAPTER)
    if not adapter.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + adapter(x).to(out.dtype), bias


@contextlib.contextmanager
def adapters_disabled(model_chunks: list[nn.Module]) -> Iterator[None]:
    """Inside the block every LoRA adapter of ``model_chunks`` is left out of the forward, so the chunks compute the
    base model: under ``model.lora`` that is the model training started from (DPO's reference) with no second copy
    of the weights. The adapters are back on afterwards, whatever happened inside."""
    adapters = [m for chunk in model_chunks for m in _unwrap(chunk).modules() if isinstance(m, LoRAAdapter)]
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.enabled = True


def _sharded_state_dict_with_adapter(module: nn.Module, gated: bool, prefix: str = "",
                                     sharded_offsets: tuple = (), metadata: dict | None = None) -> dict[str, Any]:
    """The adapted layer's own ``sharded_state_dict`` with its adapter's split tensor stated as a tensor-parallel
    shard (megatron's layer method lists only ``weight``/``bias`` as split and would store it as a replica).
    ``gated``: a SwiGLU ``linear_fc1``, whose shards megatron stores as separate gate and up pieces."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
    from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

    metadata = ensure_metadata_has_dp_cp_group(metadata)
    sharded = type(module).sharded_state_dict(module, prefix, sharded_offsets, metadata)
    adapter = getattr(module, ADAPTER)
    name, axis = adapter.split_tensor()
    key = f"{prefix}{ADAPTER}.{name}"
    entry = make_tp_sharded_tensor_for_checkpoint(getattr(adapter, name), key, axis, prepend_offsets=sharded_offsets,
                                                  tp_group=adapter.tp_group, dp_cp_group=metadata["dp_cp_group"])
    if gated:
        entry = apply_swiglu_sharded_factory(entry, sharded_offsets, metadata.get("singleton_local_shards", False))
    sharded[key] = entry
    return sharded


def _global_names(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, module)`` with TP=1/PP=1 names: on later pipeline stages the local layer index is replaced by the
    global one (``layer_number - 1``), so patterns and seeds mean the same on every layout."""
    layers = getattr(getattr(model, "decoder", None), "layers", [])
    numbers = {str(i): layer.layer_number - 1 for i, layer in enumerate(layers)}
    for name, module in model.named_modules():
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"] and len(parts) > 2:
            parts[2] = str(numbers[parts[2]])
        yield ".".join(parts), module


def _unwrap(module: nn.Module) -> nn.Module:
    while hasattr(module, "module"):
        module = module.module
    return module


def check_lora_settings(lora: Any, where: str, backend: Any = None, linears: tuple[str, ...] | None = None) -> None:
    """Raise ConfigError for ``model.lora`` settings that cannot work; with the run's device ``backend``, also
    for a ``base_dtype`` the device cannot compute in (asked through ``DeviceBackend.supports``); with the model's
    ``linears`` (``DecoderFlavor.lora_linears``), also for a target the model does not have."""
    if lora.rank < 1:
        raise ConfigError(f"{where}: model.lora.rank must be >= 1, got {lora.rank}")
    if lora.alpha <= 0:
        raise ConfigError(f"{where}: model.lora.alpha must be > 0, got {lora.alpha}")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"{where}: model.lora.dropout must be in [0, 1), got {lora.dropout}")
    if lora.targets is not None and (not lora.targets or not all(
            isinstance(t, str) and t.isidentifier() for t in lora.targets)):
        raise ConfigError(f"{where}: model.lora.targets must be null (the attention projections) or module names of "
                          f"linear layers, e.g. [linear_qkv, linear_proj, linear_fc1, linear_fc2]; got {lora.targets}")
    unknown = [t for t in lora.targets or () if linears is not None and t not in linears]
    if unknown:
        raise ConfigError(f"{where}: model.lora.targets: {', '.join(unknown)} name no linear layer of this model; its "
                          f"linears: {', '.join(linears or ())}")
    if lora.base_dtype is not None and lora.base_dtype not in BASE_DTYPES:
        raise ConfigError(f"{where}: model.lora.base_dtype must be {' or '.join(BASE_DTYPES)} (or null: the run's "
                          f"precision), got {lora.base_dtype!r}")
    if lora.base_dtype is not None and backend is not None and not backend.supports(lora.base_dtype):
        raise ConfigError(f"{where}: model.lora.base_dtype {lora.base_dtype} needs a device that computes in "
                          f"{lora.base_dtype}; device '{backend.name}' does not")


def base_params_dtype(lora: Any, run_dtype: str) -> str:
    """The dtype a model is built in: ``model.lora.base_dtype`` when set, else the run's parameter dtype."""
    return run_dtype if lora is None or lora.base_dtype is None else lora.base_dtype


def _split(module: nn.Module) -> str | None:
    """:data:`COLUMN` or :data:`ROW` for one of megatron's tensor-parallel linears (local, or Transformer Engine's,
    which state a ``parallel_mode``); ``None`` for anything else: a column-parallel layer that gathers its own
    output (an adapter on its split rows would not match it), and Transformer Engine's ``duplicated`` linears (MLA's
    down-projections there; with megatron's local linears they are column-parallel and take adapters)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    mode = getattr(module, "parallel_mode", None)
    if (isinstance(module, ColumnParallelLinear) or mode == COLUMN) and not getattr(module, "gather_output", False):
        return COLUMN
    if isinstance(module, RowParallelLinear) or mode == ROW:
        return ROW
    return None


def _targets(model_chunks: list[nn.Module], lora: Any) -> list[tuple[str, nn.Module, str]]:
    """``(TP=1/PP=1 name, module, split)`` of every layer ``lora.targets`` names (every attention linear when it is
    null); a named target that no rank has is a one-line error listing the linears the model has."""
    named, hits = lora.targets, torch.zeros(len(lora.targets or ()), dtype=torch.int64)
    linears: set[str] = set()
    found = []
    for chunk in model_chunks:
        for name, module in _global_names(_unwrap(chunk)):
            split = _split(module)
            if split is None or name.endswith("output_layer"):
                continue
            leaf = name.rsplit(".", 1)[-1]
            linears.add(leaf)
            if named is None and ATTENTION in name.split("."):
                found.append((name, module, split))
            elif named is not None and leaf in named:
                hits[named.index(leaf)] += 1
                found.append((name, module, split))
    if named is not None and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(hits)
    missing = [t for t, n in zip(named or (), hits.tolist(), strict=True) if n == 0]
    if missing or (named is None and not found):  # every pipeline stage holds layers, so attention
        raise ConfigError(f"model.lora.targets: {', '.join(missing) or 'the attention projections'} name no linear "
                          f"layer of this model; its tensor-parallel linears: {', '.join(sorted(linears))}")
    return found


def add_lora(model_chunks: list[nn.Module], lora: Any, seed: int) -> list[str]:
    """Add an adapter to every target linear layer of this rank's chunks (at their tensor-parallel layout);
    freeze nothing. Returns the adapted layers' TP=1/PP=1 names. Megatron's parallel state must be initialised.

    What loading a LoRA checkpoint into a plain model needs (add, load, :func:`merge_lora`); training adds
    freezing on top (:func:`apply_lora`).
    """
    from megatron.core import parallel_state

    dense_group = parallel_state.get_tensor_model_parallel_group()
    expert_group = parallel_state.get_expert_tensor_parallel_group()
    adapted = []
    for name, module, split in _targets(model_chunks, lora):
        target = name.rsplit(".", 1)[-1]
        expert = ".experts." in name  # routed experts (not shared_experts): split over the expert TP group
        config = module.config  # the megatron TransformerConfig the layer was built with (local and TE linears)
        tp_group = expert_group if expert else dense_group
        tp_rank, tp_size = tp_group.rank(), tp_group.size()
        if expert and tp_size > 1:
            raise ConfigError(f"model.lora: adapters on MoE expert layers ({name}) need expert tensor "
                              "parallelism 1 (parallel.etp: 1), or leave linear_fc1/linear_fc2 out of "
                              "model.lora.targets")
        out_local, in_local = module.weight.shape
        in_features = in_local * tp_size if split == ROW else in_local
        dtype = torch.float32 if lora.base_dtype is not None else module.weight.dtype
        # A is drawn whole (nn.Linear's kaiming-uniform bound, as in the LoRA paper's reference code), then
        # cut like the layer's input, so every tensor layout starts from the same adapters.
        generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
        bound = 1.0 / math.sqrt(in_features)
        weight_a = torch.empty(lora.rank, in_features).uniform_(-bound, bound, generator=generator)
        if split == ROW:
            weight_a = weight_a.chunk(tp_size, dim=1)[tp_rank].contiguous()
        adapter = LoRAAdapter(
            weight_a.to(dtype), torch.zeros(out_local, lora.rank, dtype=dtype), split=split,
            scaling=lora.alpha / lora.rank, dropout=lora.dropout, tp_group=tp_group,
            sequence_parallel=config.sequence_parallel and not expert and tp_size > 1,
        )
        module.add_module(ADAPTER, adapter)
        module.register_forward_hook(_add_adapter_output, with_kwargs=True)
        gated = target == "linear_fc1" and config.gated_linear_unit
        module.sharded_state_dict = functools.partial(_sharded_state_dict_with_adapter, module, gated)
        adapted.append(name)
    return adapted


def apply_lora(model_chunks: list[nn.Module], lora: Any, seed: int) -> list[str]:
    """Freeze every parameter, then add an adapter to every target linear layer; return the adapted names."""
    for chunk in model_chunks:
        for param in chunk.parameters():
            param.requires_grad_(False)
    return add_lora(model_chunks, lora, seed)


def train_only(model_chunks: list[nn.Module], patterns: tuple[str, ...], where: str) -> None:
    """Freeze every parameter whose TP=1/PP=1 name matches none of ``patterns`` (each must match some parameter on
    some rank, as :func:`freeze_parameters` requires of its own)."""
    hits = torch.zeros(len(patterns), dtype=torch.int64)
    for chunk in model_chunks:
        for module_name, module in _global_names(_unwrap(chunk)):
            for param_name, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{param_name}" if module_name else param_name
                matched = [i for i, pattern in enumerate(patterns) if fnmatch.fnmatchcase(name, pattern)]
                hits[matched] += 1
                if not matched:
                    param.requires_grad_(False)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(hits)
    unmatched = [p for p, n in zip(patterns, hits.tolist(), strict=True) if n == 0]
    if unmatched:
        raise ConfigError(f"{where}: the model's training phase trains '{unmatched[0]}', which matches no parameter")


def freeze_parameters(model_chunks: list[nn.Module], patterns: list[str], where: str) -> int:
    """Freeze parameters whose TP=1/PP=1 names match a glob pattern; return how many this rank froze.

    Every pattern must match some parameter on some rank (a typo would otherwise silently train everything).
    """
    hits = torch.zeros(len(patterns), dtype=torch.int64)
    frozen = 0
    for chunk in model_chunks:
        for module_name, module in _global_names(_unwrap(chunk)):
            for param_name, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{param_name}" if module_name else param_name
                matched = [i for i, pattern in enumerate(patterns) if fnmatch.fnmatchcase(name, pattern)]
                if matched:
                    hits[matched] += 1
                    frozen += int(param.requires_grad)
                    param.requires_grad_(False)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(hits)
    unmatched = [p for p, n in zip(patterns, hits.tolist(), strict=True) if n == 0]
    if unmatched:
        raise ConfigError(f"{where}: model.freeze pattern '{unmatched[0]}' matches no parameter "
                          "(names look like embedding.word_embeddings.weight, decoder.layers.0.mlp.linear_fc1.weight)")
    return frozen


def freeze_groups(model_chunks: list[nn.Module], groups: Sequence[ParameterGroup]) -> None:
    """Freeze the parameters whose group (:func:`~loongforge.models.parameter_groups.group_of`, by TP=1/PP=1 name)
    is ``frozen``: a model family's frozen parts."""
    for chunk in model_chunks:
        for module_name, module in _global_names(_unwrap(chunk)):
            for param_name, param in module.named_parameters(recurse=False):
                group = group_of(f"{module_name}.{param_name}" if module_name else param_name, groups)
                if group is not None and group.frozen:
                    param.requires_grad_(False)


def _count_parameters(model_chunks: list[nn.Module]) -> tuple[int, int]:
    """``(trainable, total)`` parameters of the whole model over all ranks, each counted once: a tensor-parallel
    shard on its rank, a tensor-parallel replica (a norm, a replicated adapter tensor), a data-parallel replica and
    a tied output layer (a copy of the embedding) on one rank only -- megatron's own tests for each
    (``param_is_not_tensor_parallel_duplicate``, ``param_is_not_shared``; expert weights, which megatron's DDP
    tells apart by ``allreduce = False``, have their own data-parallel group)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    dense_owner = parallel_state.get_data_parallel_rank() == 0
    expert_owner = parallel_state.get_expert_data_parallel_rank() == 0
    counts = torch.zeros(2, dtype=torch.int64)
    for chunk in model_chunks:
        for param in chunk.parameters():
            owner = dense_owner if getattr(param, "allreduce", True) else expert_owner
            if owner and param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param):
                counts += torch.tensor([param.numel() if param.requires_grad else 0, param.numel()])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    trainable, total = counts.tolist()
    return trainable, total


def apply_adapters(model_chunks: list[nn.Module], config: Any, trained: tuple[str, ...] = (),
                   groups: Sequence[ParameterGroup] = ()) -> None:
    """``model.lora`` then ``model.freeze`` on this rank's model chunks, before DDP and the optimizer exist; with
    ``trained`` (the family's :meth:`~loongforge.models.family.ModelFamily.trained_parameters`), every parameter
    matching none of those patterns is frozen first, and the family's frozen ``groups`` then."""
    where = config.source
    if trained:
        train_only(model_chunks, trained, where)
    freeze_groups(model_chunks, groups)
    if config.model.lora is not None:
        check_lora_settings(config.model.lora, where)
        apply_lora(model_chunks, config.model.lora, config.run.seed)
    if config.model.freeze:
        freeze_parameters(model_chunks, config.model.freeze, where)
    trainable, total = _count_parameters(model_chunks)
    if trainable == 0:
        raise ConfigError(f"{where}: model.lora/model.freeze leave no parameter to train")
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[loongforge] trainable parameters: {trainable:,} of {total:,} ({trainable / total:.2%})", flush=True)


def _merged(weight: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``weight + scaling * B @ A`` summed in fp32 and rounded once to ``weight``'s dtype (a bf16 base from
    ``model.lora.base_dtype`` with fp32 adapters), the same in both merges so their exports are bitwise equal."""
    return (weight.float() + (weight_b.float() @ weight_a.float()) * scaling).to(weight.dtype)


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and remove it (in place); returns ``model``, now a plain model
    whose parameters and state-dict keys are those of a model built without LoRA."""
    for module in list(_unwrap(model).modules()):
        adapter = module._modules.get(ADAPTER)
        if isinstance(adapter, LoRAAdapter):
            module.weight.copy_(_merged(module.weight, adapter.weight_a, adapter.weight_b, adapter.scaling))
            del module._modules[ADAPTER]
            vars(module).pop("sharded_state_dict", None)  # the layer's own method again
            for key, hook in list(module._forward_hooks.items()):
                if hook is _add_adapter_output:
                    del module._forward_hooks[key]
                    module._forward_hooks_with_kwargs.pop(key, None)
    return model


def merge_lora_state_dict(state: dict[str, torch.Tensor], lora: Any) -> dict[str, torch.Tensor]:
    """A plain state dict from one with adapters: ``X.weight + alpha/rank * X.lora.weight_b @ X.lora.weight_a``.

    Works on full (TP=1/PP=1) megatron names, e.g. what :func:`loongforge.interop.sharding.gather_full_state`
    returns, so the Hugging Face exporter writes an ordinary checkpoint. ``lora`` is the run's ``model.lora``.
    """
    scaling = lora.alpha / lora.rank
    suffix_a, suffix_b = f".{ADAPTER}.weight_a", f".{ADAPTER}.weight_b"
    merged = {k: v for k, v in state.items() if not (k.endswith(suffix_a) or k.endswith(suffix_b))}
    for key, weight_a in state.items():
        if key.endswith(suffix_a):
            base = key[: -len(suffix_a)]
            weight = state[f"{base}.weight"]
            merged[f"{base}.weight"] = _merged(weight, weight_a, state[base + suffix_b], scaling)
    return merged
