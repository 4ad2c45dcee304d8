"""The prompt of a Pi0.5-style policy as token ids: the task text's bytes, then the state discretised into bins
(Pi0's prompt is the bytes alone; its state stays continuous, zero-padded).

Pi0.5 writes the normalised state (in [-1, 1]) into the language prompt as 256 bin indices; here the bins are
their own ids after the bytes instead of digit strings, so a prompt has a fixed length (``text_len`` bytes,
``max_state_dim`` state tokens). Id 0 is padding: short texts and state dimensions a robot lacks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


def text_tokens(task: str, text_len: int) -> torch.Tensor:
    """(text_len,) ids of the task text's UTF-8 bytes, cut or padded with :data:`PAD` (Pi0's whole prompt)."""
    ids = torch.zeros(text_len, dtype=torch.long)
    data = task.encode("utf-8")[:text_len]
    ids[:len(data)] = torch.tensor(list(data), dtype=torch.long) + 1
    return ids


def _missing_dims(state: torch.Tensor, max_state_dim: int) -> int:
    """How many padding slots follow the state's dimensions (dimensions the robot lacks)."""
    if state.shape[-1] > max_state_dim:
        raise ValueError(f"the state has {state.shape[-1]} dimensions, the flavor takes at most {max_state_dim} "
                         "(raise model.overrides.max_state_dim)")
    return max_state_dim - state.shape[-1]


def padded_state(state: torch.Tensor, max_state_dim: int) -> torch.Tensor:
    """(max_state_dim,) float32: the state's dimensions, then zeros."""
    return F.pad(state.float(), (0, _missing_dims(state, max_state_dim)))


def prompt_tokens(task: str, state: torch.Tensor, *, text_len: int, max_state_dim: int,
                  state_bins: int) -> torch.Tensor:
    """(text_len + max_state_dim,) ids of one frame: ``task`` bytes (cut/padded), then one id per state dim."""
    bins = F.pad(1 + BYTES + discretise(state, state_bins), (0, _missing_dims(state, max_state_dim)), value=PAD)
    return torch.cat([text_tokens(task, text_len), bins])
