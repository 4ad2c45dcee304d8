"""Which GEMM library the CPU backend's linear layers use, decided without building the oneDNN operator.

Split from :mod:`loongforge.devices.megatron_cpu.gemm` (which defines the operator with ``torch.library``, and so
imports ``torch._dynamo``: a second on top of torch) so that ``loongforge doctor`` can say what a run would choose
at the cost of importing torch alone. The rule itself is explained in that module's docstring.
"""

from __future__ import annotations

import os

#: Environment variable choosing the GEMM library: ``auto`` (by processor vendor), ``onednn`` or ``aten``.
GEMM_VARIABLE = "LOONGFORGE_CPU_GEMM"
CHOICES = ("auto", "onednn", "aten")


def onednn_linear_available() -> bool:
    """This torch build has oneDNN and its linear kernel (``torch.ops.mkldnn._linear_pointwise``)."""
    import torch

    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The x86 vendor string of this machine (``AuthenticAMD``, ``GenuineIntel``, ...), or None off x86/Linux."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as lines:
            for line in lines:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        return None
    return None


def automatic_kernel(vendor: str | None) -> str:
    """oneDNN on x86 processors MKL does not tune for (every x86 vendor but Intel), torch's ``mm`` elsewhere."""
    return "onednn" if vendor is not None and vendor != "GenuineIntel" else "aten"


def requested_kernel() -> str:
    """``LOONGFORGE_CPU_GEMM`` (default ``auto``); a value outside :data:`CHOICES` is an error."""
    choice = os.environ.get(GEMM_VARIABLE, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{GEMM_VARIABLE}={choice!r}: use one of {', '.join(CHOICES)}")
    return choice


def planned_kernel() -> str:
    """What a run's linear layers would use here, in words (for ``loongforge doctor``)."""
    choice = requested_kernel()
    if not onednn_linear_available():
        return "aten mm (this torch build has no oneDNN linear kernel)"
    if choice != "auto":
        return f"{choice} ({GEMM_VARIABLE}={choice})"
    vendor = cpu_vendor()
    return (f"{automatic_kernel(vendor)} (auto for {vendor or 'an unknown vendor'}; {GEMM_VARIABLE}=onednn|aten "
            "to choose)")
