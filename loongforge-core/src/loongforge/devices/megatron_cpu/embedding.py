"""Tied input/output embeddings across pipeline stages on CPU.

With ``share_embeddings_and_output_weights`` and more than one pipeline stage, megatron gives the last stage
its own copy of the embedding and all-reduces the two copies once at construction
(``LanguageModule.setup_embeddings_and_output_layer``), moving the weight with ``weight.data.cuda()`` first.
That is a tensor method, which the module-level torch views cannot redirect, so every tied model at pp > 1
failed to build on CPU.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def _cuda_is_identity_for_cpu_tensors() -> Iterator[None]:
    """While active, ``cpu_tensor.cuda()`` returns the tensor itself (scoped to one constructor call)."""
    original = torch.Tensor.cuda

    def cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self if self.device.type == "cpu" else original(self, *args, **kwargs)

    torch.Tensor.cuda = cuda  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


def patch_tied_embedding_setup() -> None:
    """Let ``setup_embeddings_and_output_layer`` all-reduce CPU embedding copies (idempotent)."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    setup = LanguageModule.setup_embeddings_and_output_layer
    if getattr(setup, "_loongforge_cpu", False):
        return

    @functools.wraps(setup)
    def setup_embeddings_and_output_layer(self: Any) -> None:
        with _cuda_is_identity_for_cpu_tensors():
            setup(self)

    setup_embeddings_and_output_layer._loongforge_cpu = True  # type: ignore[attr-defined]
    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer  # type: ignore[method-assign]
