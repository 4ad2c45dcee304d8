"""Position ids of a mixed text + vision sequence: Qwen2-VL's 3D M-RoPE ids, or plain 1D ids.

M-RoPE gives every token a (temporal, height, width) position. Text tokens carry the same running index in all
three rows. A run of image or video placeholder tokens is laid out on its merged grid: frame ``f``, row ``r``,
column ``c`` gets ``(start + f * interval, start + r, start + c)``, where ``start`` is the running index and
``interval`` is 1 for images and Qwen2.5-VL's ``tokens_per_second * seconds_per_grid`` for videos; the text
after it resumes at ``start + max(rows, columns)``. Qwen3-VL writes each video frame group as its own run after
a text timestamp (``<1.5 seconds>``): with ``timestamped_videos`` every ``(t, h, w)`` video row counts as ``t``
images of ``(1, h, w)``, so a frame's time reaches the model through its timestamp's text, not its temporal
index. Padding (``attention_mask == 0``) is skipped and gets position 0, so left and right padding give the
real tokens the positions of the unpadded sample. The same rule as transformers' ``Qwen2VLModel.get_rope_index``
/ ``Qwen2_5_VLModel.get_rope_index`` / ``Qwen3VLModel.get_rope_index``; placeholder runs are matched to the
``grid_thw`` rows in order, across the whole batch.
"""

from __future__ import annotations

import torch
from loongforge.errors import LoongForgeError


class _Grids:
    """The ``grid_thw`` rows of one modality, consumed in order over the batch."""

    def __init__(self, kind: str, grid_thw: torch.Tensor | None, merge: int, intervals: list[torch.Tensor]) -> None:
        self.kind = kind
        self.rows = [] if grid_thw is None else [tuple(int(v) for v in row) for row in grid_thw.tolist()]
        self.merge = merge
        self.intervals = intervals
        self.next = 0

    def take(self, sample: int) -> tuple[tuple[int, int, int], torch.Tensor | int]:
        if self.next >= len(self.rows):
            raise LoongForgeError(f"sample {sample}: more {self.kind} placeholder runs than {self.kind}s in the batch "
                                  f"({len(self.rows)} grid_thw rows)")
        t, h, w = self.rows[self.next]
        interval = self.intervals[self.next] if self.intervals else 1
        self.next += 1
        return (t, h // self.merge, w // self.merge), interval


def _vision_positions(grid: tuple[int, int, int], start: int, interval: torch.Tensor | int) -> torch.Tensor:
    """``(3, t*h*w)`` positions of one image/video laid out frame-major, then row-major; frame ``f`` sits at
    ``int(f * interval)``."""
    t, h, w = grid
    frames = (torch.arange(t) * interval).long()
    ids = torch.stack(torch.meshgrid(frames, torch.arange(h), torch.arange(w), indexing="ij")).reshape(3, -1)
    return ids + start


def _runs(types: list[int]) -> list[tuple[int, int]]:
    """``(type, length)`` of each maximal run of equal token types."""
    runs: list[tuple[int, int]] = []
    for value in types:
        if runs and runs[-1][0] == value:
            runs[-1] = (value, runs[-1][1] + 1)
        else:
            runs.append((value, 1))
    return runs


def mrope_position_ids(
    input_ids: torch.Tensor,
    *,
    spatial_merge_size: int,
    image_token_id: int,
    video_token_id: int | None = None,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | list[float] | None = None,
    tokens_per_second: float | None = None,
    timestamped_videos: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(position_ids (3, B, S), deltas (B, 1))`` for ``input_ids`` ``(B, S)``.

    ``deltas`` is the highest position + 1 minus the sample's real length (what generation adds to the next
    token's index). Adjacent placeholder runs of several images (no text between) are split by their grids;
    a run whose length is not a whole number of images is an error naming the sample.
    """
    batch, length = input_ids.shape
    if timestamped_videos and video_grid_thw is not None:  # one (1, h, w) grid per frame group
        video_grid_thw = video_grid_thw.repeat_interleave(video_grid_thw[:, 0], dim=0)
        video_grid_thw[:, 0] = 1
    videos = 0 if video_grid_thw is None else video_grid_thw.shape[0]
    intervals: list[torch.Tensor] = []
    if tokens_per_second is not None:  # multiplied in float32, as the reference does
        seconds = torch.ones(videos) if second_per_grid_ts is None else torch.as_tensor(second_per_grid_ts)
        intervals = list(seconds.float().cpu() * tokens_per_second)
    grids = {1: _Grids("image", image_grid_thw, spatial_merge_size, []),
             2: _Grids("video", video_grid_thw, spatial_merge_size, intervals)}
    position_ids = torch.zeros(3, batch, length, dtype=torch.long)
    deltas = torch.zeros(batch, 1, dtype=torch.long)
    for b in range(batch):
        keep = torch.ones(length, dtype=torch.bool) if attention_mask is None else attention_mask[b].bool().cpu()
        ids = input_ids[b].cpu()[keep]
        types = torch.zeros_like(ids)
        types[ids == image_token_id] = 1
        if video_token_id is not None:
            types[ids == video_token_id] = 2
        pieces, current = [], 0
        for kind, run in _runs(types.tolist()):
            if kind == 0:
                pieces.append(torch.arange(current, current + run).expand(3, -1))
                current += run
                continue
            while run > 0:
                grid, interval = grids[kind].take(b)
                pieces.append(_vision_positions(grid, current, interval))
                run -= grid[0] * grid[1] * grid[2]
                current += max(grid[1], grid[2])
            if run < 0:
                raise LoongForgeError(f"sample {b}: a run of {grids[kind].kind} placeholder tokens does not match the "
                                      f"{grids[kind].kind} grid_thw (it ends {-run} token(s) short of a whole "
                                      f"{grids[kind].kind})")
        positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
        position_ids[:, b, keep] = positions
        deltas[b, 0] = (int(positions.max()) + 1 if positions.numel() else 0) - positions.shape[1]
    return position_ids.to(input_ids.device), deltas.to(input_ids.device)


def text_position_ids(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``(B, S)`` 1D positions: 0, 1, ... over the real tokens (padding gets 0)."""
    if attention_mask is None:
        return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    keep = attention_mask.long()
    return ((keep.cumsum(-1) - 1) * keep).clamp(min=0)
