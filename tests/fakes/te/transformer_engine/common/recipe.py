"""FAKE transformer_engine.common.recipe -- NOT NVIDIA's package.

Only the recipe class names, as listed in NVIDIA/TransformerEngine ``docs/api/common.rst`` and used by
megatron-core's ``fp8_utils.get_fp8_recipe``; tests delete some to model older TE versions.
"""


class DelayedScaling:
    """FAKE."""


class Float8CurrentScaling:
    """FAKE."""


class Float8BlockScaling:
    """FAKE."""


class MXFP8BlockScaling:
    """FAKE."""
