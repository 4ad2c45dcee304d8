"""The prompt of a Pi0.5-style policy as token ids: the task text's bytes, then the state discretised into bins.

Pi0.5 writes the normalised state (in [-1, 1]) into the language prompt as 256 bin indices; here the bins are
their own ids after the bytes instead of digit strings, so a prompt has a fixed length (``text_len`` bytes,
``max_state_dim`` state tokens). Id 0 is padding: short texts and state dimensions a robot lacks.
"""

from __future__ import annotations

import torch

PAD = 0
BYTES = 256


def vocab_size(state_bins: int) -> int:
    """Padding, the 256 byte values, then the state bins."""
    return 1 + BYTES + state_bins


def discretise(state: torch.Tensor, bins: int) -> torch.Tensor:
    """Bin indices in ``[0, bins)`` of a normalised state (values outside [-1, 1] go to the end bins), as
    Pi0.5's ``np.digitize(state, np.linspace(-1, 1, bins + 1)[:-1]) - 1``."""
    index = torch.floor((state.clamp(-1.0, 1.0) + 1.0) * (bins / 2.0)).long()
    return index.clamp(0, bins - 1)


def prompt_tokens(task: str, state: torch.Tensor, *, text_len: int, max_state_dim: int,
                  state_bins: int) -> torch.Tensor:
    """(text_len + max_state_dim,) ids of one frame: ``task`` bytes (cut/padded), then one id per state dim."""
    if state.shape[-1] > max_state_dim:
        raise ValueError(f"the state has {state.shape[-1]} dimensions, the flavor takes at most {max_state_dim} "
                         "(raise model.overrides.max_state_dim)")
    ids = torch.zeros(text_len + max_state_dim, dtype=torch.long)
    data = task.encode("utf-8")[:text_len]
    ids[:len(data)] = torch.tensor(list(data), dtype=torch.long) + 1
    ids[text_len:text_len + state.shape[-1]] = 1 + BYTES + discretise(state, state_bins)
    return ids
