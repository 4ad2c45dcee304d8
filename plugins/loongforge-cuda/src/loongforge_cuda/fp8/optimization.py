"""The ``adaptive-fp8`` optimization: FP8 only for the GEMM modules where the policy measured it faster.

A run in ``training.precision: fp8`` puts every transformer-layer GEMM in FP8 (megatron enters Transformer
Engine's ``fp8_autocast`` around each layer). Small GEMMs lose: quantising inputs and computing scales
costs more than the faster FP8 math saves. With this optimization each GEMM module whose policy threshold
the run's tokens per micro-batch do not reach runs its forward inside ``fp8_autocast(enabled=False)``
(TE records the choice for the backward pass too), so it computes in BF16; the rest stay in FP8::

    training: {precision: fp8, micro_batch_size: 2}
    device_options: {fp8_recipe: blockwise}
    optimizations:
      adaptive-fp8: {policy: fp8_policy.json}   # written by loongforge fp8-measure

Enabling it where there is no FP8 (CPU, no Transformer Engine, a precision other than fp8, an emulated
policy) fails with a one-line error saying why; it never quietly trains in another precision.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from loongforge import hookimpl
from loongforge.errors import ConfigError, LoongForgeError
from loongforge.optimizations import Optimization

from loongforge_cuda.fp8.policy import Policy, load_policy
from loongforge_cuda.fp8.selection import (
    check_shapes,
    gemm_shape,
    named_gemm_modules,
    plan_fp8,
    te_gemm_classes,
    tokens_per_microbatch,
)

NAME = "adaptive-fp8"


@dataclass(frozen=True)
class AdaptiveFP8Options:
    """``optimizations.adaptive-fp8``: the measured policy file, and optionally the tokens per micro-batch to plan
    for (default: the run's ``micro_batch_size * seq_length``)."""

    #: The JSON file written by ``loongforge fp8-measure`` (required).
    policy: str = ""
    tokens_per_microbatch: int | None = None

    def __post_init__(self) -> None:
        if not self.policy:
            raise ConfigError("policy is required: the JSON file written by loongforge fp8-measure")


def keep_in_bf16(modules: Mapping[str, Any], plan: Mapping[str, bool], bf16_context: Callable[[], Any]) -> list[str]:
    """Wrap the forward of every module the plan keeps out of FP8 in ``bf16_context()``; return their names.

    The wrapper is an instance attribute, so only these modules change and ``nn.Module.__call__`` (hooks,
    activation recompute) still runs around it.
    """
    wrapped = []
    for name, module in modules.items():
        if plan.get(name, True):
            continue
        forward = module.forward

        @functools.wraps(forward)
        def bf16_forward(*args: Any, _forward: Callable = forward, **kwargs: Any) -> Any:
            with bf16_context():
                return _forward(*args, **kwargs)

        module.forward = bf16_forward
        wrapped.append(name)
    return wrapped


def why_not_fp8(modules: Mapping[str, Any], policy: Policy, te_classes: tuple[type, ...] | None = None) -> str | None:
    """The one-line reason ``policy`` cannot be applied to these GEMM modules, or None when it can.

    FP8 needs the GEMMs on an NVIDIA GPU, built as Transformer Engine layers (megatron's local layers have no
    FP8 path), and timings measured on real hardware rather than in the CPU emulation.
    """
    if not modules:
        return f"{NAME}: the model has no GEMM modules inside transformer layers to choose FP8 for"
    devices = sorted({p.device.type for m in modules.values() for p in m.parameters()})
    if devices != ["cuda"]:
        return (f"{NAME} needs an NVIDIA GPU with FP8 (Transformer Engine); the model's GEMMs are on "
                f"{', '.join(devices)}")
    te_classes = te_gemm_classes() if te_classes is None else te_classes
    local = [name for name, m in modules.items() if not isinstance(m, te_classes)] if te_classes else list(modules)
    if local:
        return (f"{NAME} needs Transformer Engine layers (pip install 'loongforge-cuda[te]'); {local[0]} is "
                "megatron's local layer, which has no FP8 path")
    if policy.emulated:
        return (f"{policy.source} was measured in CPU emulation (key emulated: true), so its timings say nothing "
                "about this GPU: re-run loongforge fp8-measure on it")
    return None


def _te_bf16_context() -> AbstractContextManager:
    import transformer_engine.pytorch as te

    return te.fp8_autocast(enabled=False)


class AdaptiveFP8Optimization(Optimization):
    """Created from ``optimizations: {adaptive-fp8: {policy: <file>, tokens_per_microbatch: <int, optional>}}``."""

    name = NAME
    options_type = AdaptiveFP8Options

    def __init__(self, options: Mapping[str, Any] | None = None, *, source: str = "config") -> None:
        super().__init__(options, source=source)
        self.policy_path = self.options.policy
        self.tokens_override = self.options.tokens_per_microbatch
        self.policy: Policy | None = None
        self.tokens = 0
        self.fp8_modules: list[str] = []
        self.bf16_modules: list[str] = []

    @hookimpl
    def loongforge_configure(self, config: Any) -> None:
        """Check the run can use FP8 at all and load the policy, before any process group or model exists."""
        where = f"optimizations.{NAME} in {config.source}"
        if config.training.precision != "fp8":
            raise ConfigError(f"{where} needs training.precision: fp8 (it turns FP8 off per module where BF16 is "
                              f"faster), got {config.training.precision}")
        self.policy = load_policy(self.policy_path)
        requested = config.device_options.get("fp8_recipe", "auto")
        if requested not in ("auto", self.policy.recipe):
            raise ConfigError(_recipe_mismatch(self.policy, f"device_options.fp8_recipe is '{requested}'"))
        if config.device_options.get("fp8_param"):
            raise ConfigError(f"{where}: device_options.fp8_param keeps weights in FP8, which the modules kept in "
                              "BF16 would dequantize every step; turn fp8_param off")
        self.tokens = int(self.tokens_override or tokens_per_microbatch(config))

    @hookimpl
    def loongforge_modify_model(self, model: Any, config: Any) -> None:
        """Plan FP8 per GEMM module from the policy and keep the BF16 ones out of TE's FP8 autocast."""
        if self.policy is None:
            raise LoongForgeError(f"{NAME}: loongforge_configure was not called before the model was built")
        modules = named_gemm_modules(model)
        reason = why_not_fp8(modules, self.policy)
        if reason:
            raise LoongForgeError(reason)
        chunks = model if isinstance(model, (list, tuple)) else [model]
        recipe = str(getattr(chunks[0].config.fp8_recipe, "value", chunks[0].config.fp8_recipe))
        if recipe != self.policy.recipe:
            raise ConfigError(_recipe_mismatch(self.policy, f"this run resolved fp8_recipe '{recipe}'"))
        check_shapes({name: gemm_shape(m) for name, m in modules.items()}, self.policy)
        plan = plan_fp8(modules, self.policy, self.tokens)
        self.bf16_modules = keep_in_bf16(modules, plan, _te_bf16_context)
        self.fp8_modules = [name for name, fp8 in plan.items() if fp8]
        _say(f"{NAME}: {len(self.fp8_modules)} of {len(plan)} GEMM modules in FP8 at {self.tokens} tokens per "
             f"micro-batch (policy {self.policy.source}, measured on {self.policy.device})")


def _recipe_mismatch(policy: Policy, actual: str) -> str:
    """The crossover depends on the recipe (blockwise scaling costs more than tensorwise), so a policy only
    holds for the recipe it was measured with."""
    return (f"{policy.source} was measured with fp8_recipe '{policy.recipe}' but {actual}; set "
            f"device_options.fp8_recipe: {policy.recipe} or re-measure with --recipe")


def _say(message: str) -> None:
    """Print on the first rank only (every rank computes the same plan)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[loongforge] {message}", flush=True)
