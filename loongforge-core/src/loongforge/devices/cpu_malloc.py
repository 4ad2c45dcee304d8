"""glibc malloc settings for CPU training: keep freed activation memory instead of handing it back every step.

A training step allocates and frees the same activations every step, a few MiB each. glibc serves blocks above
its mmap threshold with fresh ``mmap`` pages, and trims freed memory at the top of the heap back to the system;
either way the next step touches new pages and the kernel zero-fills them. On the tiny Llama benchmark that is
~8,000 page faults per step and 6-20% of the step time, for plain PyTorch as much as for megatron.

:func:`tune_glibc_malloc` sets the mmap threshold to glibc's own ceiling for its dynamic threshold (32 MiB on
64-bit) and the trim threshold to 1 GiB, with ``mallopt`` in this process (torchrun workers each call it for
themselves through ``CPUBackend.configure_env``). Peak RSS stays the peak of live memory; the freed pages are
simply reused. Allocator choices of the user win: nothing is changed when glibc's ``MALLOC_*_`` variables or
``GLIBC_TUNABLES`` are set, when another allocator is preloaded (jemalloc, tcmalloc, mimalloc via
``LD_PRELOAD``), when ``LOONGFORGE_CPU_MALLOC=system`` asks for glibc's defaults, or on a non-glibc system.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

#: glibc's ``mallopt`` parameters (``malloc.h``).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: Blocks up to this size come from the heap (glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit).
MMAP_THRESHOLD = 32 << 20
#: Free memory at the top of the heap is returned to the system only beyond this much.
TRIM_THRESHOLD = 1 << 30
#: The tuning in words (``loongforge doctor`` and :func:`tune_glibc_malloc` say it).
SETTINGS = f"mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold {TRIM_THRESHOLD >> 20} MiB"
#: Environment variables through which a user already chose the allocator's behaviour.
USER_CHOICE_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                         "MALLOC_MMAP_MAX_", "GLIBC_TUNABLES")
#: Set to ``system`` to keep glibc's defaults.
OPT_OUT_VARIABLE = "LOONGFORGE_CPU_MALLOC"


def _left_alone_because() -> str | None:
    """Why the allocator is left as it is, or None when it can be tuned."""
    if os.environ.get(OPT_OUT_VARIABLE, "").lower() == "system":
        return f"{OPT_OUT_VARIABLE}=system"
    chosen = [name for name in USER_CHOICE_VARIABLES if name in os.environ]
    if chosen:
        return f"{chosen[0]} is set"
    if os.environ.get("LD_PRELOAD", "").strip():
        return "LD_PRELOAD is set (another allocator may be preloaded)"
    if platform.libc_ver()[0] != "glibc":
        return "not a glibc system"
    return None


def planned_malloc() -> str:
    """What :func:`tune_glibc_malloc` would do in this environment (for ``loongforge doctor``), without doing it."""
    reason = _left_alone_because()
    if reason is not None:
        return f"left as configured ({reason})"
    return f"tuned at run start: {SETTINGS}"


def tune_glibc_malloc() -> str:
    """Apply the thresholds (idempotent) unless the user chose otherwise; says what was done, in one line."""
    reason = _left_alone_because()
    if reason is not None:
        return f"malloc: left as configured ({reason})"
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    applied = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD,
                                                                                  TRIM_THRESHOLD) == 1
    if not applied:
        return "malloc: glibc refused the thresholds; left as configured"
    return f"malloc: {SETTINGS}"
