"""The batch ``loongforge diff`` replays through a VLM (``VLMFlavor.replay_batch``): its random text with one small
image placed at the start of every sequence, so the vision tower and projector compute and a fault there is named
at the module where it begins, not only by the parameter that moved.

The image is the smallest the encoder takes -- a Qwen ViT's ``2m x 2m`` patches (``m`` the merge size: ``4``
tokens), a fixed-size tower's one image (its tiles, when it tiles) -- of random pixels from the replay's generator,
with the markers and the placeholder count the data pipeline would write
(:func:`loongforge_vlm.data.processor.processor_for`). Random text ids that are vision ids are replaced, so the only
placeholders are the ones placed here.
"""

from __future__ import annotations

from typing import Any

import torch
from loongforge.errors import InteropError

from loongforge_vlm.data.processor import processor_for


def replay_batch(flavor: Any, batch: dict[str, Any], generator: torch.Generator) -> dict[str, Any]:
    tokens = batch["tokens"].clone()
    rows, length = tokens.shape
    merge = flavor.projector.merge if flavor.projector is not None else None
    processor = processor_for(flavor.encoder, merge_size=merge)
    qwen = hasattr(flavor.encoder, "spatial_merge_size")
    grid = (1, 2 * flavor.spatial_merge_size, 2 * flavor.spatial_merge_size) if qwen else processor.grid(1, 1)
    markers = [i for i in (flavor.vision_start_token_id, flavor.vision_end_token_id) if i is not None]
    vision = [flavor.image_token_id] * processor.num_tokens(grid)
    placed = [*markers[:1], *vision, *markers[1:]]
    if len(placed) + 2 > length:
        raise InteropError(f"--seq-length {length} leaves no room for the replayed image's {len(placed)} tokens "
                           f"and text around them; use --seq-length {len(placed) + 8} or more")
    special = {i for i in (flavor.image_token_id, flavor.video_token_id, *markers) if i is not None}
    for token in special:
        tokens[tokens == token] = 0
    tokens[:, 1 : 1 + len(placed)] = torch.tensor(placed)
    labels = batch["labels"].clone()
    labels[:, :-1] = tokens[:, 1:]
    items = grid[0] * grid[1] * grid[2] if qwen else grid[0]  # patch rows, or tiles of a fixed-size tower
    extra = {"pixel_values": torch.randn(rows * items, *processor.pixel_shape, generator=generator),
             "image_grid_thw": torch.tensor([grid] * rows)}
    return {**batch, "tokens": tokens, "labels": labels, **extra}
