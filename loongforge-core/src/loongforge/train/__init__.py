"""Training: run orchestration (:mod:`.run`), the loop (:mod:`.trainer`), metrics, progress and sampling.

Kept torch-free at import time so ``import loongforge.train`` stays cheap; the submodules import torch and
megatron-core when a run is actually built.
"""

from __future__ import annotations
