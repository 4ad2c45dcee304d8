"""Malformed ``task:`` settings for the recipes of task-engine models (diffusion, embodied), two ways:

- **from the declared ranges**: every number of the family's ``task_options`` dataclass (nested sections too) that
  declares a range (``loongforge.config.sections.ranged``) is set just outside each end of it, and every float to
  NaN and infinity -- so the fuzz set covers each option a family declares, and grows with them, without a list to
  keep (the family suite holds every number to declaring a range);
- **settings wrong for the model or the data** (:data:`RECIPE_BAD_SETTINGS`), which no range can say: frames the
  patch does not divide, fewer samples than a batch, cameras or widths the flavor does not take, ``model:`` keys only
  megatron models read, a freeze of everything, an evaluation with nothing held out.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Iterator
from typing import Any

from loongforge.config.numbers import union_members
from loongforge.config.sections import RANGE

#: Per recipe stem: (name, {key: value}) settings wrong together or for this model (the recipe's own data included).
RECIPE_BAD_SETTINGS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "diffusion-moving-squares": [
        ("frames-not-a-patch-multiple", {"task.frames": 3}),
        ("side-not-a-patch-multiple", {"model.overrides.patch_size": [2, 5, 5]}),
        ("fewer-samples-than-a-batch", {"task.samples": 8}),
        ("other-input-channels", {"model.overrides.in_channels": 4}),
        ("one-latent-frame-for-a-clean-first-frame", {"task.frames": 2, "model.overrides.per_token_timesteps": True}),
        ("lora-target-unknown", {"task.lora.targets": ["self_attn", "bogus"]}),
        ("freeze-everything", {"model.freeze": ["*"]}),
        ("megatron-lora", {"model.lora.rank": 8}),
        ("megatron-recompute", {"model.recompute.granularity": "full"}),
    ],
    "diffusion-squares-image": [
        ("side-not-a-patch-multiple", {"task.side": 7}),
        ("side-no-square-fits", {"task.side": 4}),
        ("fewer-samples-than-a-batch", {"task.samples": 16}),
        ("other-input-channels", {"model.overrides.in_channels": 3}),
        ("freeze-everything", {"model.freeze": ["**"]}),
        ("megatron-lora", {"model.lora.rank": 4}),
    ],
    "embodied-tiny": [
        ("camera-unknown", {"task.cameras": ["observation.images.wrist"]}),
        ("more-cameras-than-the-set", {"model.overrides.cameras": 2}),
        ("actions-wider-than-the-flavor", {"model.overrides.max_action_dim": 1}),
        ("states-wider-than-the-flavor", {"model.overrides.max_state_dim": 1}),
        ("every-episode-held-out", {"task.synthetic.episodes": 8}),
        ("fewer-frames-than-a-batch", {"task.synthetic.episodes": 9, "task.synthetic.length": 5}),
        ("evaluation-with-nothing-held-out", {"task.held_out_episodes": 0, "evaluation.interval": 10}),
        ("freeze-everything", {"model.freeze": ["*"]}),
    ],
    "embodied-metaworld-reach": [
        ("camera-the-flavor-does-not-take", {"task.cameras": ["observation.images.top"]}),
        ("states-wider-than-the-flavor", {"model.overrides.max_state_dim": 1}),
        ("fewer-frames-than-a-batch", {"training.micro_batch_size": 64}),
        ("evaluation-with-nothing-held-out", {"task.held_out_episodes": 0, "evaluation.interval": 10}),
        ("megatron-load", {"model.load": "task-data"}),
    ],
}


def range_values(options: type, key: str = "task") -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)``: for every number of the section dataclass ``options`` with a declared range, a value
    just below and just above it (where it has that end), and NaN and infinity for every float."""
    hints = typing.get_type_hints(options)
    for f in dataclasses.fields(options):
        path = f"{key}.{f.name}"
        alternatives = union_members(hints[f.name])
        span = f.metadata.get(RANGE)
        kind = next((a for a in alternatives if a in (int, float)), None)
        if span is not None and kind is not None:
            yield from ((path, value) for value in _outside(span, kind))
        if kind is float:
            yield from ((path, value) for value in (math.nan, math.inf))
        for nested in (a for a in alternatives if dataclasses.is_dataclass(a)):
            yield from range_values(nested, path)


def _outside(span: Any, kind: type) -> Iterator[Any]:
    step = 1 if kind is int else 0.5
    if span.low is not None:
        yield kind(span.low) if span.low_open else kind(span.low - step)
    if span.high is not None:
        yield kind(span.high) if span.high_open else kind(span.high + step)
