"""Which GEMM modules of a model run in FP8, given a policy and the run's tokens per micro-batch.

The policy is keyed by module *kind* -- a module's path inside its transformer layer with layer and expert
indices dropped (``decoder.layers.7.mlp.linear_fc1`` -> ``mlp.linear_fc1``) -- because every layer of a kind
has the same GEMM shape and so the same BF16/FP8 crossover. Modules outside the transformer layers
(embedding, output layer) are not governed by the policy and stay as the run's precision leaves them.

:func:`plan_fp8` is a pure function of names, policy and token count, so the mapping is tested on CPU
against a real (tiny) megatron model's module names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from loongforge_cuda.fp8.policy import Policy, PolicyError

_IN_LAYER = re.compile(r"(?:^|\.)layers\.\d+\.(.+)$")


def module_kind(name: str) -> str | None:
    """The policy key of a module inside a transformer layer, or None for modules outside the layers.

    Index segments are dropped, and so is ``local_experts`` (megatron's SequentialMLP), so that an expert
    GEMM has the same kind whether the experts are grouped (TE) or sequential (local layers).
    """
    match = _IN_LAYER.search(name)
    if match is None:
        return None
    parts = [p for p in match.group(1).split(".") if not p.isdigit() and p != "local_experts"]
    return ".".join(parts)


def te_gemm_classes() -> tuple[type, ...]:
    """Transformer Engine's linear modules (megatron's TE layers subclass them); empty without TE."""
    try:
        import transformer_engine.pytorch as te
    except ImportError:
        return ()
    return tuple(getattr(te, n) for n in ("Linear", "LayerNormLinear", "GroupedLinear") if hasattr(te, n))


def gemm_classes() -> tuple[type, ...]:
    """Module classes whose forward is one (or, grouped, several) GEMM: megatron's tensor-parallel linears and
    Transformer Engine's linear modules."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return (ColumnParallelLinear, RowParallelLinear, *te_gemm_classes())


def named_gemm_modules(model: Any, classes: tuple[type, ...] | None = None) -> dict[str, Any]:
    """``{qualified name: module}`` of the GEMM modules inside the transformer layers of ``model`` (one module
    or a list of chunks; with several chunks names start with the chunk index)."""
    classes = classes or gemm_classes()
    chunks = model if isinstance(model, (list, tuple)) else [model]
    found = {}
    for index, chunk in enumerate(chunks):
        prefix = f"{index}." if len(chunks) > 1 else ""
        for name, module in chunk.named_modules():
            if isinstance(module, classes) and module_kind(name):
                found[prefix + name] = module
    return found


def gemm_shape(module: Any) -> tuple[int, int]:
    """``(in_features, out_features)`` of a GEMM module on this rank (tensor-parallel shards included)."""
    # Grouped GEMMs (TE GroupedLinear) hold one weight per expert: weight0, weight1, ...
    weight = getattr(module, "weight", None)
    weight = weight if weight is not None else module.weight0
    return int(weight.shape[1]), int(weight.shape[0])


def check_shapes(shapes: Mapping[str, tuple[int, int]], policy: Policy) -> None:
    """Raise :class:`PolicyError` when a module's GEMM shape differs from the one its policy entry was measured
    at (another model size or tensor-parallel degree: the crossover would not carry over)."""
    for name, (in_features, out_features) in shapes.items():
        kind = module_kind(name)
        entry = policy.module(kind)
        if (entry.in_features, entry.out_features) != (in_features, out_features):
            raise PolicyError(
                f"{policy.source}: modules.{kind} was measured at in_features={entry.in_features}, "
                f"out_features={entry.out_features} but {name} is {in_features} -> {out_features}; re-run "
                "loongforge fp8-measure with this model and tensor-parallel size"
            )


def plan_fp8(names: Iterable[str], policy: Policy, tokens_per_microbatch: int) -> dict[str, bool]:
    """``{module name: runs in FP8}`` for every name inside a transformer layer.

    A kind the policy lacks is an error naming the policy file (it was measured for another model).
    """
    if tokens_per_microbatch < 1:
        raise PolicyError(f"{policy.source}: tokens per micro-batch must be >= 1, got {tokens_per_microbatch}")
    plan = {}
    for name in names:
        kind = module_kind(name)
        if kind is not None:
            plan[name] = policy.module(kind).use_fp8(tokens_per_microbatch)
    return plan


def tokens_per_microbatch(config: Any) -> int:
    """Rows of a dense layer's GEMMs per micro-batch: ``micro_batch_size * seq_length`` over context-parallel
    ranks (each holds ``1/cp`` of every sequence). Sequence parallelism gathers the sequence back before the
    column-parallel GEMMs, so it does not change the count."""
    return config.training.micro_batch_size * config.data.seq_length // max(1, config.parallel.cp)
