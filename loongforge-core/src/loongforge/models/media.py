"""Prompts with media files for generation: what a family makes of text plus images, videos or other files.

Why a family slot (:meth:`loongforge.models.family.ModelFamily.media_prompts`): core can read a path but not what a
model needs of it. Which placeholder tokens mark a picture in the text and how many features it becomes, which
extra forward inputs carry its pixels, and where the tokens after it sit in a position scheme with several axes
(Qwen2-VL's M-RoPE lays a picture out on a grid, so the text after it resumes past the picture's largest side, not
past its token count) are the model's own knowledge, as in training. The family answers with
:class:`MediaPrompts`; core's decoding (:mod:`loongforge.models.generate`) stays the same loop and KV cache for
every model, and only lays the answer out over its left-padded batch.

Torch-free, like :mod:`loongforge.models.family`: the tensors in a :class:`MediaPrompts` are the family's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class MediaPrompts:
    """A batch of prompts made ready for a model that reads media files.

    ``texts``: each prompt as the model is given it, one placeholder per file (what a completion is printed after).
    ``ids``: each prompt's token ids, with every media placeholder expanded to as many tokens as the model writes
    features into. ``inputs``: the keyword inputs of the model's forward for the whole batch (a VLM's
    ``pixel_values``...), the prompts' media in prompt order; core gives them to every forward that reads the
    prompts' tokens (the prefill, and each recomputation without a KV cache), never to a cached decoding step.
    ``positions``: per prompt, its position ids ``(axes, len(ids))`` (an integer tensor; M-RoPE has 3 axes), or
    ``None`` for plain ``0 .. len - 1`` on one axis. ``position_offsets``: per prompt, what a token written after
    it adds to its index -- the ``k``-th new token of a prompt of ``n`` ids sits at ``n + k + offset`` on every
    axis (M-RoPE's *rope delta*, highest prompt position + 1 - ``n``); empty: 0 for all.
    """

    texts: list[str]
    ids: list[list[int]]
    inputs: dict[str, Any] = field(default_factory=dict)
    positions: list[Any] | None = None
    position_offsets: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        count = len(self.ids)
        if len(self.texts) != count:
            raise ValueError(f"media prompts: {len(self.texts)} texts for {count} prompts")
        if self.positions is not None and len(self.positions) != count:
            raise ValueError(f"media prompts: {len(self.positions)} position tensors for {count} prompts")
        if self.position_offsets and len(self.position_offsets) != count:
            raise ValueError(f"media prompts: {len(self.position_offsets)} position offsets for {count} prompts")


@dataclass(frozen=True)
class MediaRequest:
    """What :meth:`~loongforge.models.family.ModelFamily.media_prompts` is asked: ``prompts`` (text, or in chat
    mode a conversation of ``{"role", "content"}`` messages) each to be given every file of ``files`` (kind ->
    paths in the order given, e.g. ``{"image": [a.png, b.png]}``), ``render`` (prompt -> the text to encode: the
    chat template in chat mode, else the text itself), the ``tokenizer`` the text is encoded with and
    ``model_dir``, the Hugging Face directory the model came from (a converted checkpoint's ``hf_source``), where a
    family finds its processor settings, or ``None``."""

    prompts: Sequence[Any]
    files: Mapping[str, Sequence[Path]]
    render: Any
    tokenizer: Any
    model_dir: Path | None = None
