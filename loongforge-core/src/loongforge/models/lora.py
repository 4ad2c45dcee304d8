"""LoRA adapters and parameter freezing for megatron-core GPT models (``model.lora``, ``model.freeze``).

Why a forward hook instead of replacing the linear modules: the adapter lives *inside* the adapted module
(``...linear_qkv.lora.weight_a``/``weight_b``) and the base module, its class and its parameter names stay as
they are. So everything keyed by parameter names keeps working unchanged: megatron's ``sharded_state_dict``
(the adapter's tensors are saved and resumed like any weight), Hugging Face loading before the adapters are
added, and the HF exporter after :func:`merge_lora_state_dict` folded them away.

The update is ``y = W x + (alpha / rank) * B A dropout(x)`` with ``B = 0`` at the start, so a freshly adapted
model computes exactly what the base model did. ``A`` is drawn from a generator seeded by the run seed and the
parameter's layer-independent name, so the adapters do not depend on the pipeline layout.

Frozen parameters have ``requires_grad = False``; megatron's DDP gives them no gradient buffer and its
optimizer no state, so only the adapters (and any unfrozen weights) are trained and checkpointed with Adam state.

Scope: tensor parallelism 1 (the adapters are stored unsharded); any pipeline or data parallel layout.
"""

from __future__ import annotations

import fnmatch
import math
import zlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from loongforge.errors import ConfigError

#: Linear layers of a megatron transformer layer that can carry an adapter.
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
ADAPTER = "lora"


class LoRAAdapter(nn.Module):
    """The low-rank update of one linear layer: ``delta(x) = scaling * B(A(dropout(x)))``."""

    def __init__(self, in_features: int, out_features: int, *, rank: int, alpha: float, dropout: float,
                 dtype: torch.dtype, generator: torch.Generator) -> None:
        super().__init__()
        self.weight_a = nn.Parameter(torch.empty(rank, in_features, dtype=dtype))
        self.weight_b = nn.Parameter(torch.zeros(out_features, rank, dtype=dtype))
        self.scaling = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        # nn.Linear's default (kaiming-uniform, a=sqrt(5)) bound, as in the LoRA paper's reference code.
        bound = 1.0 / math.sqrt(in_features)
        with torch.no_grad():
            self.weight_a.copy_(torch.empty(rank, in_features).uniform_(-bound, bound, generator=generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(self.dropout(x), self.weight_a), self.weight_b) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """``scaling * B @ A``, the change to the base weight (shape ``[out, in]``)."""
        return (self.weight_b @ self.weight_a) * self.scaling


def _add_adapter_output(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    """Forward hook: megatron linears return ``(output, bias)``; add the adapter's update to ``output``."""
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + getattr(module, ADAPTER)(x).to(out.dtype), bias


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


def check_lora_settings(lora: Any, tp: int, where: str) -> None:
    """Raise ConfigError for ``model.lora`` settings that cannot work."""
    if lora.rank < 1:
        raise ConfigError(f"{where}: model.lora.rank must be >= 1, got {lora.rank}")
    if lora.alpha <= 0:
        raise ConfigError(f"{where}: model.lora.alpha must be > 0, got {lora.alpha}")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"{where}: model.lora.dropout must be in [0, 1), got {lora.dropout}")
    unknown = [t for t in lora.targets if t not in TARGETS]
    if unknown or not lora.targets:
        raise ConfigError(f"{where}: model.lora.targets must name some of {', '.join(TARGETS)}; got {lora.targets}")
    if tp != 1:
        raise ConfigError(f"{where}: model.lora needs parallel.tp 1 (adapters are not tensor-parallel yet), got {tp}")


def apply_lora(model_chunks: list[nn.Module], lora: Any, seed: int) -> list[str]:
    """Add an adapter to every target linear layer and freeze every other parameter; return the adapted names."""
    adapted = []
    for chunk in model_chunks:
        model = _unwrap(chunk)
        for param in model.parameters():
            param.requires_grad_(False)
        for name, module in list(_global_names(model)):
            if name.rsplit(".", 1)[-1] not in lora.targets or not hasattr(module, "weight"):
                continue
            out_features, in_features = module.weight.shape
            generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            adapter = LoRAAdapter(in_features, out_features, rank=lora.rank, alpha=lora.alpha,
                                  dropout=lora.dropout, dtype=module.weight.dtype, generator=generator)
            module.add_module(ADAPTER, adapter)
            module.register_forward_hook(_add_adapter_output, with_kwargs=True)
            adapted.append(name)
    return adapted


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


def apply_adapters(model_chunks: list[nn.Module], config: Any) -> None:
    """``model.lora`` then ``model.freeze`` on this rank's model chunks, before DDP and the optimizer exist."""
    from megatron.core import parallel_state

    where = config.source
    if config.model.lora is not None:
        check_lora_settings(config.model.lora, parallel_state.get_tensor_model_parallel_world_size(), where)
        apply_lora(model_chunks, config.model.lora, config.run.seed)
    if config.model.freeze:
        freeze_parameters(model_chunks, config.model.freeze, where)
    params = [p for c in model_chunks for p in c.parameters()]
    counts = torch.tensor([sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts)
    trainable, total = counts.tolist()
    if trainable == 0:
        raise ConfigError(f"{where}: model.lora/model.freeze leave no parameter to train")
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[loongforge] trainable parameters: {trainable:,} of {total:,} ({trainable / total:.2%})", flush=True)


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and remove it (in place); returns ``model``, now a plain model
    whose parameters and state-dict keys are those of a model built without LoRA."""
    for module in list(_unwrap(model).modules()):
        adapter = module._modules.get(ADAPTER)
        if isinstance(adapter, LoRAAdapter):
            module.weight.add_(adapter.delta_weight().to(module.weight.dtype))
            del module._modules[ADAPTER]
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
            weight_b = state[base + suffix_b]
            delta = (weight_b.float() @ weight_a.float()) * scaling
            merged[f"{base}.weight"] = (state[f"{base}.weight"].float() + delta).to(state[f"{base}.weight"].dtype)
    return merged
