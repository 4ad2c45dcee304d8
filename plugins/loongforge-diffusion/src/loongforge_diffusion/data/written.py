"""Reading a written moving-squares file (``loongforge make-data moving-squares OUT.pt``) back, checked whole.

Why a checked reader: ``task.data`` names a file a user (or a stranger) made, and training used to ``torch.load`` it
and index it blindly -- an empty, cut-short or text file, a ``.jsonl`` of captioned videos, or a torch file of
something else ended in a traceback at the first step. Here the file is loaded with ``weights_only=True`` (a file
that would run code is refused, never unpickled) and every tensor is held to the layout :func:`~loongforge_diffusion.
data.moving_squares.write` gives it, so each fault is one :class:`~loongforge.data.errors.DataError` naming the file
and, where one is at fault, the sample. The family's pre-flight (:mod:`loongforge_diffusion.preflight`) and training
open it through the same :class:`~loongforge_diffusion.data.moving_squares.TensorVideoDataset`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from loongforge.data.errors import DataError

#: The tensors a written file holds, with their layout: ``(N, 3, frames, side, side)`` videos in [-1, 1],
#: ``(N, L, text_dim)`` caption states and ``(N, 3)`` integer labels; and its ``geometry`` mapping.
TENSORS = {"video": 5, "context": 3, "labels": 2}
#: Suffixes of what ``task.data`` cannot read directly: captioned videos, which ``loongforge cache-latents`` encodes.
CLIP_SUFFIXES = (".jsonl", ".json", ".txt", ".mp4", ".mov", ".mkv", ".webm", ".avi")


def read_written(path: Path) -> dict[str, Any]:
    """The checked contents of the written file ``path``: its three tensors and ``geometry`` mapping."""
    if path.is_dir():
        raise DataError(f"{path}: a directory, but no latent cache (it has no index.json, which `loongforge "
                        "cache-latents` writes); task.data takes a cache or a `loongforge make-data moving-squares` "
                        "file")
    if path.suffix.lower() in CLIP_SUFFIXES:
        raise DataError(f"{path}: captioned videos are not training data as they are; encode them with `loongforge "
                        "cache-latents --videos` and name the cache in task.data")
    stored = _load(path)
    if not isinstance(stored, dict):
        raise DataError(f"{path}: holds a {type(stored).__name__}, not the mapping of video, context, labels and "
                        "geometry that `loongforge make-data moving-squares` writes")
    missing = [key for key in (*TENSORS, "geometry") if key not in stored]
    if missing:
        raise DataError(f"{path}: no '{missing[0]}' (a moving-squares file holds {', '.join(TENSORS)} and "
                        f"geometry; this one holds {', '.join(map(str, stored)) or 'nothing'})")
    tensors = {key: _tensor(path, key, stored[key], dims) for key, dims in TENSORS.items()}
    _check_layout(path, tensors)
    return {**tensors, "geometry": stored["geometry"]}


def _load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 -- torch's readers raise many types for damaged bytes; all mean the same
        said = str(exc)
        if "WeightsUnpickler error" in said:  # torch's refusal: what it would not unpickle, never run
            reason = said.split("WeightsUnpickler error:", 1)[1].strip().splitlines()[0]
            raise DataError(f"{path}: not a data file torch.load reads with weights_only ({reason}; nothing in it was "
                            "unpickled or run); write it with `loongforge make-data moving-squares`") from None
        first = said.strip().split(". ")[0].splitlines()[0][:160] if said.strip() else "empty, or cut short"
        raise DataError(f"{path}: cannot be read as training reads it ({type(exc).__name__}: {first}); write it with "
                        "`loongforge make-data moving-squares`") from None


def _tensor(path: Path, key: str, value: Any, dims: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != dims:
        shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise DataError(f"{path}: '{key}' must be a tensor of {dims} dimensions, got {shape}")
    return value


def _check_layout(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    video, context, labels = tensors["video"], tensors["context"], tensors["labels"]
    counts = {key: value.shape[0] for key, value in tensors.items()}
    if len(set(counts.values())) != 1:
        raise DataError(f"{path}: the tensors hold different numbers of samples: {counts}")
    if counts["video"] == 0:
        raise DataError(f"{path}: holds no sample")
    if video.shape[1] != 3 or video.shape[3] != video.shape[4] or not video.is_floating_point():
        raise DataError(f"{path}: 'video' must be (samples, 3, frames, side, side) floats, got {list(video.shape)} "
                        f"{video.dtype}")
    if labels.shape[1] != 3 or labels.is_floating_point() or labels.is_complex():
        raise DataError(f"{path}: 'labels' must be (samples, 3) integers, got {list(labels.shape)} {labels.dtype}")
    if not context.is_floating_point():
        raise DataError(f"{path}: 'context' must be floats, got {context.dtype}")
    for key in ("video", "context"):
        bad = (~torch.isfinite(tensors[key])).flatten(1).any(dim=1).nonzero()
        if len(bad):
            raise DataError(f"{path}: sample {int(bad[0])} has NaN or infinite values in '{key}'")
