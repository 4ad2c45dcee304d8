"""How each part of a VLM trains: ``model: {encoder: {name: siglip-tiny, lr: 1e-4, freeze: true}, ...}``.

Why per part: the parts of a vision-language model come from different places and want different treatment -- a
pretrained vision tower kept frozen or trained with a small learning rate, a fresh projector trained hard, the
language backbone somewhere between -- and the classic recipe (LLaVA) first aligns the projector alone, then
unfreezes the rest. These options sit in the part's own mapping beside its name and flavor fields, are typed and
range-checked by core like any section (``loongforge check`` refuses a negative ``lr`` naming the key), and become
core's :class:`~loongforge.models.parameter_groups.ParameterGroup` s, which core applies to the optimizer and the
schedule. Torch-free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from loongforge.config.sections import build_section, ranged
from loongforge.errors import ConfigError
from loongforge.models.parameter_groups import ParameterGroup


@dataclass(frozen=True)
class PartOptions:
    """Options of one part (``model.<role>.<option>``); unset values follow ``optimizer:``."""

    #: Peak learning rate of this part (``optimizer.lr`` when unset); it follows the run's warmup and decay.
    lr: float | None = ranged(None, low=0)
    #: Final learning rate (unset: ``lr`` times the run's ``optimizer.min_lr / optimizer.lr``).
    min_lr: float | None = ranged(None, low=0)
    #: Decoupled weight decay (``optimizer.weight_decay`` when unset; biases and norms never decay).
    weight_decay: float | None = ranged(None, low=0)
    #: Never train this part: no gradients, no optimizer state (its backward is skipped where nothing before it
    #: trains).
    freeze: bool = False
    #: Leave this part unchanged by steps 1..N (learning rate 0) and train it from step N+1: the staged recipe
    #: (align the projector, then unfreeze). Its gradients are computed from the start.
    unfreeze_at_step: int = ranged(0, low=0)
    #: Recompute the encoder's blocks in the backward (encoder only; the foundation's is ``model.recompute``).
    recompute: bool | None = None
    #: Heterogeneous data parallelism (encoder only): the decoder's tensor-parallel ranks each encode a share of the
    #: micro-batch's images (whole images, balanced by patches) and all-gather the features, instead of every rank
    #: encoding all of them. Saves (1 - 1/tp) of the encoder's compute per rank; no effect at tp 1.
    data_parallel_over_tp: bool = False
    #: Tensor parallelism inside the encoder (encoder only; a Qwen ViT): its attention heads and MLP split over the
    #: decoder's tensor-parallel group, so 1 or the run's ``parallel.tp`` (whole at ``parallel.tp`` 1).
    tp: int = ranged(1, low=1)

    def __post_init__(self) -> None:
        if self.freeze and self.unfreeze_at_step:
            raise ValueError("freeze and unfreeze_at_step exclude each other (freeze never trains the part; "
                             "unfreeze_at_step trains it from that step on)")
        if self.tp > 1 and self.data_parallel_over_tp:
            raise ValueError("tp > 1 and data_parallel_over_tp exclude each other (a tensor-parallel encoder already "
                             "splits every image over the tensor-parallel ranks)")


#: The keys of a part's mapping that are options, not flavor fields.
OPTION_KEYS: frozenset[str] = frozenset(f.name for f in dataclasses.fields(PartOptions))


def split_options(role: str, value: Any, where: Any) -> tuple[Any, PartOptions | None]:
    """A part's config value without its options, and the options (``None`` when it sets none). A mapping that
    held options alone leaves ``None`` as the value: the part itself is not replaced."""
    if not isinstance(value, dict) or not OPTION_KEYS & set(value):
        return value, None
    options = build_section(PartOptions, {k: v for k, v in value.items() if k in OPTION_KEYS}, where,
                            key=f"model.{role}")
    if options.recompute is not None and role != "encoder":
        raise ConfigError(f"{where}: model.{role}.recompute: only the encoder recomputes as a part (the foundation's "
                          "is model.recompute)")
    for option in ("data_parallel_over_tp", "tp"):
        if getattr(options, option) != getattr(PartOptions, option) and role != "encoder":
            raise ConfigError(f"{where}: model.{role}.{option}: an encoder option (the foundation's parallelism is "
                              "parallel:)")
    rest = {k: v for k, v in value.items() if k not in OPTION_KEYS}
    return (rest or None), options


def parameter_groups(roles: dict[str, tuple[str, ...]], options: tuple[tuple[str, PartOptions], ...]
                     ) -> tuple[ParameterGroup, ...]:
    """One group per part, in the order of ``roles`` (role -> parameter-name patterns; a sub-part listed before the
    part that contains it), each with the part's options."""
    given = dict(options)
    groups = []
    for role, patterns in roles.items():
        part = given.get(role, PartOptions())
        groups.append(ParameterGroup(name=role, patterns=patterns, key=f"model.{role}", lr=part.lr,
                                     min_lr=part.min_lr, weight_decay=part.weight_decay, frozen=part.freeze,
                                     unfreeze_at_step=part.unfreeze_at_step))
    return tuple(groups)
