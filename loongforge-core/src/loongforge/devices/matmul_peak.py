"""A measured dense-matmul rate, the peak MFU is taken against where no datasheet figure exists (the CPU).

A CPU's datasheet peak (cores x clock x SIMD width x FMA ports) is rarely what its vector units sustain under a
hypervisor, at the clock the host grants, with the threads a run was given; the best rate of a few square GEMMs at
the run's own thread count is what "100% of this machine" can honestly mean. The benchmark peers use the same probe,
so the MFU a training log shows and the one a benchmark prints are comparable.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def measured_matmul_peak(dtype: torch.dtype = torch.float32, threads: int | None = None, size: int = 512,
                         repeats: int = 40) -> float:
    """The best rate (FLOP/s) of ``repeats`` ``size``-square ``dtype`` matmuls on the CPU at ``threads`` threads
    (``None``: the process's current count), ~0.1 s on two cores in fp32. Many small products rather than a few
    large ones: the best of many is the least disturbed by a noisy host, and at two threads a 512 product already
    runs at the 1024 and 2048 rate. In fp32 the best of torch's ``mm`` and oneDNN's kernel, which the CPU backend's
    linear layers may use instead (:mod:`loongforge.devices.megatron_cpu.gemm`): the peak is the faster library's."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(0)
        a = torch.randn(size, size, generator=generator).to(dtype)
        b = torch.randn(size, size, generator=generator).to(dtype)
        best = float("inf")
        for product in _products(a, b):
            product()  # first call: the library's buffers and thread team
            for _ in range(repeats):
                start = time.perf_counter()
                product()
                best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return 2 * size**3 / best


def _products(a: torch.Tensor, b: torch.Tensor) -> list[Callable[[], torch.Tensor]]:
    """``a @ b`` by each GEMM library a CPU run may use for ``a``'s dtype."""
    from loongforge.devices.megatron_cpu.gemm import onednn_product

    products: list[Callable[[], torch.Tensor]] = [lambda: torch.mm(a, b)]
    if a.dtype == torch.float32 and onednn_product is not None:
        weight = b.t().contiguous()
        products.append(lambda: onednn_product(a, weight))
    return products
