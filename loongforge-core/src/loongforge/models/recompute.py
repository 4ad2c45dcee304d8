"""``model.recompute`` -> megatron ``TransformerConfig`` recompute settings, checked before any model exists.

Why our own check: megatron validates these fields with bare ``assert``/``ValueError`` deep inside
``TransformerConfig.__post_init__`` (after process groups exist) and does not know which modules our CPU
path supports; here a bad setting fails with its config key. Megatron does the recomputing itself: ``full``
checkpoints whole layers in ``TransformerBlock._checkpointed_forward``, ``selective`` wraps the named
submodules (``core_attn`` goes through ``SelfAttention._checkpointed_attention_forward``, which calls our
:class:`~loongforge.devices.sdpa_attention.SDPAttention` with the same arguments as the plain path).
"""

from __future__ import annotations

from typing import Any

from loongforge.errors import ConfigError

GRANULARITIES = ("full", "selective")
METHODS = ("uniform", "block")
#: Selective modules that work without Transformer Engine. Left out: ``moe_act`` (needs grouped GEMM),
#: ``mla_up_proj`` (multi-latent attention) and ``layernorm``: megatron 0.16's ``CheckpointWithoutOutput`` sets
#: ``fp8 = fp8 is not None`` (True for its default False) and then calls Transformer Engine's
#: ``FP8GlobalStateManager``, a NameError without TE.
SELECTIVE_MODULES = ("core_attn", "mlp", "moe", "shared_experts")


def recompute_kwargs(recompute: Any, layers_per_stage: int, source: str = "config") -> dict[str, Any]:
    """``TransformerConfig`` keyword arguments for a :class:`~loongforge.config.schema.RecomputeConfig` (None: {}).

    ``layers_per_stage`` is the number of layers one model chunk holds (``num_layers / (pp * vpp)``); a
    ``block`` recompute cannot cover more than that.
    """
    if recompute is None:
        return {}
    key = f"{source}: model.recompute"
    if recompute.granularity not in GRANULARITIES:
        raise ConfigError(f"{key}.granularity must be one of {', '.join(GRANULARITIES)}, got "
                          f"'{recompute.granularity}'")
    if recompute.granularity == "selective":
        if recompute.method is not None or recompute.num_layers is not None:
            raise ConfigError(f"{key}: method and num_layers apply to granularity full only (selective "
                              "recomputes modules of every layer)")
        unknown = [m for m in recompute.modules if m not in SELECTIVE_MODULES]
        if unknown or not recompute.modules:
            raise ConfigError(f"{key}.modules must name some of {', '.join(SELECTIVE_MODULES)}, got "
                              f"{recompute.modules}")
        return {"recompute_granularity": "selective", "recompute_modules": list(recompute.modules)}
    method = recompute.method or "uniform"
    if method not in METHODS:
        raise ConfigError(f"{key}.method must be one of {', '.join(METHODS)}, got '{method}'")
    default = 1 if method == "uniform" else layers_per_stage
    num_layers = default if recompute.num_layers is None else recompute.num_layers
    if not 1 <= num_layers <= layers_per_stage:
        raise ConfigError(f"{key}.num_layers must be between 1 and the {layers_per_stage} layers of a pipeline "
                          f"stage, got {num_layers}")
    return {"recompute_granularity": "full", "recompute_method": method, "recompute_num_layers": num_layers}
