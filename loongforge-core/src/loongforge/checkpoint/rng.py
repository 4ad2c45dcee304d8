"""Capture and restore every random stream a step draws from, for bit-exact resume.

Five streams matter: Python's ``random``, NumPy's global generator, torch's CPU generator, the device
backend's generator, and megatron's named tracker states (``model-parallel-rng`` and friends, which drive
dropout inside tensor-parallel regions). States are stored as tensors, ints and tuples only, so they load
with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng_state(backend: Any) -> dict[str, Any]:
    """All RNG states of this process."""
    from megatron.core import tensor_parallel

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
        "device": backend.get_rng_state(),
        "megatron_tracker": {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
    }


def restore_rng_state(state: dict[str, Any], backend: Any) -> None:
    """Restore what :func:`capture_rng_state` returned (from the same backend and rank)."""
    from megatron.core import tensor_parallel

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["kind"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    backend.set_rng_state(state["device"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])
