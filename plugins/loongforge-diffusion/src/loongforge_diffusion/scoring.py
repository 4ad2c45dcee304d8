"""Analytic scores for moving-squares videos: did the model draw the asked colour, motion and shape?

No learned judge: each score is a few lines of geometry on the frames, so a score of 1.0 means exactly what it
says and the scores of a noise video are near chance. Foreground is every pixel whose brightest channel is above
0 (the background is -1 in every channel, every palette colour has a channel at +1).

- ``colour``: the mean foreground colour's nearest palette entry is the asked one;
- ``direction``: the foreground centroid's displacement from first to last frame points the asked way
  (dominant axis and sign, and at least half a pixel); not scored for a one-frame video (a still image);
- ``square``: per frame, the IoU between the foreground and a square of the asked size centred on the
  foreground centroid, averaged over frames (a blob, a wrong size or scattered noise all score low).
"""

from __future__ import annotations

import torch

from loongforge_diffusion.data.moving_squares import DIRECTIONS, PALETTE, SIZES


def _centroid(mask: torch.Tensor) -> torch.Tensor | None:
    points = mask.nonzero().float()
    return points.mean(dim=0) if len(points) else None


def _square_iou(mask: torch.Tensor, side: int) -> float:
    centre = _centroid(mask)
    if centre is None:
        return 0.0
    limit = mask.shape[0] - side
    top, left = (min(max(round(float(c) - (side - 1) / 2), 0), limit) for c in centre)
    square = torch.zeros_like(mask)
    square[top:top + side, left:left + side] = True
    return float((mask & square).sum() / (mask | square).sum())


def _direction(masks: torch.Tensor) -> int | None:
    centres = [c for c in (_centroid(m) for m in masks) if c is not None]
    if len(centres) < 2:
        return None
    dy, dx = (centres[-1] - centres[0]).tolist()
    if max(abs(dy), abs(dx)) < 0.5:
        return None
    step = (int(dy > 0) * 2 - 1, 0) if abs(dy) > abs(dx) else (0, int(dx > 0) * 2 - 1)
    return list(DIRECTIONS.values()).index(step)


def score_video(video: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Scores of one ``(3, T, H, W)`` video against its ``(colour, direction, size)`` labels
    (a one-frame video, i.e. a still image, gets no direction score)."""
    masks = video.max(dim=0).values > 0
    palette = torch.tensor(list(PALETTE.values()))
    if masks.any():
        mean_colour = video.permute(1, 2, 3, 0)[masks].mean(dim=0)
        colour = int((palette - mean_colour).norm(dim=1).argmin())
    else:
        colour = None
    side = SIZES[int(labels[2])]
    scores = {"colour": float(colour == int(labels[0]))}
    if len(masks) > 1:  # one frame (a still image) shows no motion: no direction score
        scores["direction"] = float(_direction(masks) == int(labels[1]))
    scores["square"] = sum(_square_iou(m, side) for m in masks) / len(masks)
    return scores


def score_videos(videos: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Mean scores over a batch ``(B, 3, T, H, W)`` with labels ``(B, 3)``."""
    scores = [score_video(v, lab) for v, lab in zip(videos.detach().float().cpu(), labels.cpu(), strict=True)]
    return {key: sum(s[key] for s in scores) / len(scores) for key in scores[0]}
