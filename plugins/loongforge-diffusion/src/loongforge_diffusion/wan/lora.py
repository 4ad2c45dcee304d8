"""LoRA for the Wan DiT: low-rank adapters on the linear layers of every block, base weights frozen.

``apply_lora`` swaps each targeted ``nn.Linear`` for a :class:`LoRALinear` that keeps the very same ``weight`` and
``bias`` parameters (so their names do not change) and adds ``lora_A``/``lora_B``; output =
``base(x) + (alpha / rank) * B(A(dropout(x)))``. ``B`` starts at zero, so the wrapped model computes exactly what
the base model computes until the first optimizer step. ``merge_lora`` folds the adapters into plain linears,
leaving a model whose state dict has exactly the base names (and converts to diffusers or original names).

Our fused projections (``qkv``, ``kv``, ``kv_img``) get one adapter pair *per projection* (q, k and v each
their own ``A`` and ``B``), stored stacked along a leading axis: the update is block-diagonal, each projection's
rows change only through its own adapter. That is exactly PEFT LoRA on diffusers' separate ``to_q``/``to_k``/
``to_v`` (or the original ``q``/``k``/``v``), with the same parameter count and capacity, so adapters move
between the layouts by splitting that axis. A single adapter on the fused output would instead share one ``A``
across q, k and v -- rank r for all three together rather than r each -- which no per-projection LoRA can load.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from loongforge.errors import ConfigError
from torch import nn

#: Linear layers inside a block that can take an adapter, and how many projections each one fuses.
TARGETS: dict[str, int] = {
    "self_attn.qkv": 3, "self_attn.out": 1,
    "cross_attn.q": 1, "cross_attn.kv": 2, "cross_attn.kv_img": 2, "cross_attn.out": 1,
    "ffn.fc1": 1, "ffn.fc2": 1,
}
#: Every one of them: attention q, k, v, o (self and cross, image keys/values where the model has them) and FFN.
DEFAULT_TARGETS: tuple[str, ...] = ("self_attn", "cross_attn", "ffn")


class LoRALinear(nn.Module):
    """A linear layer plus ``splits`` independent rank-``rank`` adapters, one per block of ``out / splits`` rows."""

    def __init__(self, base: nn.Linear, *, rank: int, alpha: float, dropout: float, splits: int) -> None:
        super().__init__()
        if base.out_features % splits:
            raise ConfigError(f"lora: {base.out_features} outputs do not split into {splits} projections")
        self.in_features, self.out_features, self.splits = base.in_features, base.out_features, splits
        self.weight, self.bias = base.weight, base.bias
        factory = {"dtype": base.weight.dtype, "device": base.weight.device}
        self.lora_A = nn.Parameter(torch.empty(splits, rank, base.in_features, **factory))
        self.lora_B = nn.Parameter(torch.zeros(splits, base.out_features // splits, rank, **factory))
        with torch.no_grad():
            for part in self.lora_A:  # the init nn.Linear gives its weight, per projection
                nn.init.kaiming_uniform_(part, a=math.sqrt(5))
        self.scaling = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def delta_weight(self) -> torch.Tensor:
        """The ``(out, in)`` update the adapters add to ``weight``: ``scaling * B_i @ A_i`` in row block i."""
        return (torch.bmm(self.lora_B, self.lora_A) * self.scaling).flatten(0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down = torch.einsum("...i,sri->...sr", self.dropout(x), self.lora_A)
        up = torch.einsum("...sr,sor->...so", down, self.lora_B).flatten(-2)
        return F.linear(x, self.weight, self.bias) + up * self.scaling

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, splits={self.splits}, "
                f"rank={self.lora_A.shape[1]}, scaling={self.scaling}")


def selected_targets(targets: Iterable[str]) -> set[str]:
    """Target names or their groups (``ffn`` = ``ffn.fc1`` and ``ffn.fc2``) -> names in :data:`TARGETS`."""
    chosen: set[str] = set()
    for target in targets:
        matches = {name for name in TARGETS if name == target or name.startswith(f"{target}.")}
        if not matches:
            raise ConfigError(f"lora: unknown target {target!r}; known: {', '.join(TARGETS)} "
                              "(or a group: self_attn, cross_attn, ffn)")
        chosen |= matches
    return chosen


def apply_lora(model: nn.Module, *, rank: int, alpha: float | None = None, dropout: float = 0.0,
               targets: Iterable[str] = DEFAULT_TARGETS) -> list[str]:
    """Freeze every parameter of ``model`` (a ``WanModel``) and wrap the targeted linear layers of each block.

    :param alpha: adapter scale numerator (``scaling = alpha / rank``); default ``rank``, i.e. scaling 1.
    :return: the names of the wrapped layers (``blocks.0.self_attn.qkv``, ...); absent layers (``kv_img`` in a
        model without an image branch) are skipped.
    """
    if rank <= 0 or not 0.0 <= dropout < 1.0:
        raise ConfigError(f"lora: rank must be positive and dropout in [0, 1); got rank={rank}, dropout={dropout}")
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ConfigError("lora: this model already has adapters; merge_lora(model) first to stack another set")
    chosen = selected_targets(targets)
    model.requires_grad_(False)
    wrapped = []
    for index, block in enumerate(model.blocks):
        for name in sorted(chosen):
            parent_name, attr = name.rsplit(".", 1)
            parent = block.get_submodule(parent_name)
            base = getattr(parent, attr)
            if base is None:
                continue
            if type(base) is not nn.Linear:
                raise ConfigError(f"lora: blocks.{index}.{name} is a {type(base).__name__}, not a plain nn.Linear; "
                                  "apply LoRA before tensor parallelism or other layer swaps")
            lora = LoRALinear(base, rank=rank, alpha=float(rank if alpha is None else alpha), dropout=dropout,
                              splits=TARGETS[name])
            setattr(parent, attr, lora)
            wrapped.append(f"blocks.{index}.{name}")
    return wrapped


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every :class:`LoRALinear` of ``model`` by a plain ``nn.Linear`` holding ``weight + delta``
    (summed in float32, stored in the weight's dtype); the merged weights stay frozen like the rest."""
    return _unwrap(model, lambda module: nn.Parameter(
        (module.weight.float() + module.delta_weight().float()).to(module.weight.dtype), requires_grad=False))


def strip_lora(model: nn.Module) -> nn.Module:
    """Replace every :class:`LoRALinear` of ``model`` by the plain ``nn.Linear`` it wraps (its adapters dropped):
    the base model a LoRA run started from and never changed."""
    return _unwrap(model, lambda module: module.weight)


def _unwrap(model: nn.Module, weight_of: Callable[[LoRALinear], nn.Parameter]) -> nn.Module:
    """Every :class:`LoRALinear` of ``model`` replaced by an ``nn.Linear`` with ``weight_of(it)`` and its bias."""
    for name, module in list(model.named_modules()):
        if not isinstance(module, LoRALinear):
            continue
        plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
        plain.weight = weight_of(module)
        if module.bias is not None:
            plain.bias = module.bias
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, plain)
    return model


def diffusers_lora_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters of ``model`` as the PEFT LoRA state dict diffusers' ``load_lora_weights`` reads for a Wan
    transformer: ``transformer.<diffusers module>.lora_A.weight`` (rank x in) and ``.lora_B.weight`` (out x rank)
    per projection, each fused adapter split along its projection axis (module docstring). The scaling
    ``alpha / rank`` is folded into ``lora_B``, since the file carries no alpha and diffusers then scales by 1."""
    from loongforge_diffusion.wan.diffusers_adapter import diffusers_module_names

    state: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoRALinear):
            continue
        for index, theirs in enumerate(diffusers_module_names(name)):
            prefix = f"transformer.{theirs}"
            state[f"{prefix}.lora_A.weight"] = module.lora_A[index].detach().clone()
            state[f"{prefix}.lora_B.weight"] = (module.lora_B[index] * module.scaling).detach().clone()
    if not state:
        raise ConfigError("the model has no LoRA adapters (the run set no task.lora)")
    return state
