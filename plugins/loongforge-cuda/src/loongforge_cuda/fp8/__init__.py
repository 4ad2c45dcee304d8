"""Adaptive FP8: per-module BF16/FP8 choice from measured crossovers, with a CPU reference of blockwise FP8.

- :mod:`.blockwise` -- e4m3 quantisation (tensorwise, rowwise, 1x128 / 128x128 blockwise) and the GEMMs.
- :mod:`.policy` -- measurements -> per-module monotone thresholds; the policy JSON file.
- :mod:`.shapes`, :mod:`.selection` -- a model's GEMM modules and which of them run in FP8.
- :mod:`.runners`, :mod:`.measure` -- the benchmark tool (``loongforge fp8-measure``).
- :mod:`.optimization` -- the ``adaptive-fp8`` optimization that applies a policy to a run.
"""

from loongforge_cuda.fp8.policy import Policy, PolicyError, derive_policy, fp8_threshold, load_policy, save_policy

__all__ = ["Policy", "PolicyError", "derive_policy", "fp8_threshold", "load_policy", "save_policy"]
