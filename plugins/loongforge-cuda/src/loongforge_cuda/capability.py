"""What an NVIDIA GPU can do, by compute capability and installed libraries -- pure functions, no CUDA calls.

Kept apart from the backend so every decision can be tested on a CPU machine with any ``(major, minor)``
and any set of Transformer Engine recipe classes.

Sources for the thresholds: bf16 tensor cores and flash-attn 2 need Ampere (sm80); FP8 tensor cores
arrive with Ada/Hopper (sm89/sm90); MXFP8 block scaling is Blackwell-only (sm100, see the ``fp8_recipe``
docstring in megatron-core's ``TransformerConfig``). megatron-core's ``fp8_utils.get_fp8_recipe`` maps
each recipe name to a Transformer Engine class in ``transformer_engine.common.recipe`` (listed in TE's
``docs/api/common.rst``); a TE without that class cannot run the recipe.
"""

from __future__ import annotations

import importlib
import importlib.util

#: Minimum compute capability for the features that depend on it.
MIN_CAPABILITY: dict[str, tuple[int, int]] = {"bf16": (8, 0), "flash_attn": (8, 0), "fp8": (8, 9)}

#: FP8 recipe (megatron ``fp8_recipe``) -> (minimum compute capability, Transformer Engine recipe class).
FP8_RECIPES: dict[str, tuple[tuple[int, int], str]] = {
    "delayed": ((8, 9), "DelayedScaling"),
    "tensorwise": ((8, 9), "Float8CurrentScaling"),
    "blockwise": ((9, 0), "Float8BlockScaling"),
    "mxfp8": ((10, 0), "MXFP8BlockScaling"),
}

#: ``fp8_recipe: auto`` takes the first usable of these: MXFP8 where the hardware scales blocks natively,
#: else per-tensor current scaling (no amax history to tune), else delayed scaling (oldest TE versions).
#: Blockwise (DeepSeek-V3 style 1x128/128x128 scales) is opt-in: it trades speed for range.
AUTO_FP8_ORDER: tuple[str, ...] = ("mxfp8", "tensorwise", "delayed")


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (``find_spec`` only reads the path)."""
    return importlib.util.find_spec(module) is not None


def te_recipe_classes() -> frozenset[str]:
    """Names of the FP8 recipe classes the installed Transformer Engine defines (empty without TE)."""
    if not installed("transformer_engine"):
        return frozenset()
    recipe = importlib.import_module("transformer_engine.common.recipe")
    return frozenset(cls for _, cls in FP8_RECIPES.values() if hasattr(recipe, cls))


def feature_supported(feature: str, capability: tuple[int, int], *, te: bool, flash_attn: bool) -> bool:
    """Whether ``feature`` works on a GPU of ``capability`` with these libraries installed.

    fp16, CUDA graphs, sequence parallelism and streams work on every GPU megatron-core supports; FP8 also needs
    Transformer Engine, flash-attn its package.
    """
    if feature in ("fp16", "cuda_graphs", "sequence_parallel", "streams"):
        return True
    if feature == "te":
        return te
    if feature == "flash_attn" and not flash_attn:
        return False
    if feature == "fp8" and not te:
        return False
    return capability >= MIN_CAPABILITY[feature]


def usable_fp8_recipes(capability: tuple[int, int], te_classes: frozenset[str]) -> list[str]:
    """The FP8 recipes this GPU and Transformer Engine can run, in :data:`FP8_RECIPES` order."""
    return [name for name, (minimum, cls) in FP8_RECIPES.items() if capability >= minimum and cls in te_classes]


def choose_fp8_recipe(requested: str, capability: tuple[int, int], te_classes: frozenset[str]) -> str:
    """Resolve ``requested`` (a recipe name or ``"auto"``) to a recipe this setup can run.

    Raises ``ValueError`` naming what is missing (the GPU generation or the TE version), so that a run
    asking for MXFP8 on a Hopper fails before the model is built rather than inside the first GEMM.
    """
    usable = usable_fp8_recipes(capability, te_classes)
    if requested == "auto":
        for name in AUTO_FP8_ORDER:
            if name in usable:
                return name
        raise ValueError(f"no FP8 recipe usable on sm{capability[0]}{capability[1]} with "
                         f"Transformer Engine recipes {sorted(te_classes) or '(none: TE not installed)'}")
    if requested not in FP8_RECIPES:
        raise ValueError(f"unknown fp8_recipe '{requested}'; known: auto, {', '.join(FP8_RECIPES)}")
    minimum, cls = FP8_RECIPES[requested]
    if capability < minimum:
        raise ValueError(f"fp8_recipe '{requested}' needs compute capability {minimum[0]}.{minimum[1]}+, "
                         f"this GPU is {capability[0]}.{capability[1]}; usable: {', '.join(usable) or '(none)'}")
    if cls not in te_classes:
        raise ValueError(f"fp8_recipe '{requested}' needs transformer_engine.common.recipe.{cls}, which the "
                         f"installed Transformer Engine lacks (upgrade transformer-engine)")
    return requested
