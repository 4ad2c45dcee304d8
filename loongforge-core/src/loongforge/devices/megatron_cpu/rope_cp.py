"""RoPE's per-context-parallel-rank slice without CUDA.

megatron's ``get_pos_emb_on_this_cp_rank`` builds its chunk index with ``pin_memory=True`` and moves it with
``.cuda()``; neither exists on a CPU-only torch, and a torch view cannot catch a ``Tensor`` method. The
replacement selects the same chunks (``cp_rank`` and ``2*cp_size-1-cp_rank`` of ``2*cp_size``) on the
embedding's own device. It is installed where megatron looks the function up: ``rope_utils`` and the
modules that imported it by name.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Modules that call ``get_pos_emb_on_this_cp_rank`` through their own global name.
CALLERS = (
    "megatron.core.models.common.embeddings.rope_utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
)


def pos_emb_on_this_cp_rank(pos_emb: Any, seq_dim: int, cp_group: Any) -> Any:
    """This cp rank's two chunks of ``pos_emb`` along ``seq_dim`` (megatron's function, device-agnostic)."""
    import torch

    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    shape = pos_emb.shape
    chunks = pos_emb.view(*shape[:seq_dim], 2 * cp_size, -1, *shape[seq_dim + 1:]).index_select(seq_dim, index)
    return chunks.view(*shape[:seq_dim], -1, *shape[seq_dim + 1:])


def patch_rope_cp_slice() -> None:
    """Replace ``get_pos_emb_on_this_cp_rank`` in every module of :data:`CALLERS` that exists."""
    for name in CALLERS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "get_pos_emb_on_this_cp_rank"):
            module.get_pos_emb_on_this_cp_rank = pos_emb_on_this_cp_rank
