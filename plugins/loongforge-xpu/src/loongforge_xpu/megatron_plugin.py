"""Kunlun's megatron-core patch entry point, gated by ``XMLIR_MEGATRON_CORE_XPU_PLUGIN``.

Kunlun ships its megatron-core adaptations as the ``xpu_plugin`` package; ``init_megatron_core_xpu_plugin()``
installs them. The reference LoongForge repository calls it from ``loongforge/utils/xpu_init.py`` and from
Loong-Megatron's ``initialize_megatron`` when ``XMLIR_MEGATRON_CORE_XPU_PLUGIN`` is one of ``true``, ``1`` or
``True`` (exactly those spellings), and prints a notice instead of failing when ``xpu_plugin`` is missing.
This module keeps that contract and applies the patches once per process, before any model is built.
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Mapping

GATE = "XMLIR_MEGATRON_CORE_XPU_PLUGIN"
#: The spellings the reference ``xpu_init.py`` accepts; anything else (``yes``, ``TRUE``, ``0``) is off.
GATE_ON_VALUES = frozenset({"true", "1", "True"})
PATCH_MODULE = "xpu_plugin"
PATCH_ENTRY_POINT = "init_megatron_core_xpu_plugin"

_outcome: str | None = None


def gate_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the gate variable asks for Kunlun's megatron patches."""
    env = os.environ if environ is None else environ
    return env.get(GATE) in GATE_ON_VALUES


def describe_patches(environ: Mapping[str, str], patch_module_installed: bool) -> str:
    """What a training run started from ``environ`` will do about the patches, for ``loongforge doctor``.

    ``environ`` is the environment *as training sees it* -- after ``configure_env`` filled in its defaults, which
    turn the gate on when it is unset -- so an unset gate reads as on, not as the "off" a look at the raw
    environment would report.
    """
    value = environ.get(GATE)
    if not gate_enabled(environ):
        return f"off: {GATE}={value!r} (only {', '.join(sorted(GATE_ON_VALUES))} turn them on)"
    set_by = f"{GATE}={value}" + ("" if GATE in os.environ else ", configure_env's default")
    if not patch_module_installed:
        return (f"requested ({set_by}) but '{PATCH_MODULE}' is not installed: training runs without Kunlun's fused "
                f"megatron-core kernels; install Kunlun's {PATCH_MODULE} package")
    return f"on ({set_by}): applied when training starts"


def apply_megatron_xpu_plugin() -> str:
    """Run ``xpu_plugin.init_megatron_core_xpu_plugin()`` if the gate is on; at most once per process.

    Returns what happened -- ``"applied"``, ``"disabled"`` (gate off) or ``"missing"`` (gate on but
    ``xpu_plugin`` not installed: a warning, not a crash, because the models still train on Kunlun's
    CUDA-compatible torch without the extra fused paths). Later calls return the first call's outcome.
    """
    global _outcome
    if _outcome is not None:
        return _outcome
    if not gate_enabled():
        _outcome = "disabled"
        return _outcome
    try:
        module = importlib.import_module(PATCH_MODULE)
    except ImportError:
        warnings.warn(
            f"{GATE} is on but the '{PATCH_MODULE}' module is not installed; training without Kunlun's "
            f"megatron-core patches (install Kunlun's xpu_plugin, or set {GATE}=0 to silence this)",
            stacklevel=2,
        )
        _outcome = "missing"
        return _outcome
    getattr(module, PATCH_ENTRY_POINT)()
    _outcome = "applied"
    return _outcome
