"""Multimodal conversations -> token ids with Qwen2-VL's vision tokens, through core's chat templates and masks.

Every image becomes ``<|vision_start|>`` + ``<|image_pad|>`` x N + ``<|vision_end|>`` (videos ``<|video_pad|>``),
N = ``t*h*w / merge**2`` of its patch grid: the model later writes the vision tower's outputs over the pad
tokens in order, so N must be exact. How it reuses core's SFT path (template, incremental reply masks, final
``eos``): messages carry each image as the text marker :data:`IMAGE_MARKER` (Qwen's own rendering of an image
part); a tokenizer wrapper encodes a marker as its three special ids; after
:func:`loongforge.data.sft.tokenize_conversation` the single pad of each image is repeated N times. Vision
tokens are never loss targets.

Tokenizers: :class:`VisionByteTokenizer` is core's byte tokenizer plus the four vision tokens (no files, the
default for tests and the shapes quickstart); a Hugging Face tokenizer works when each vision token is one id
in its vocabulary (Qwen2-VL's tokenizer directories).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from loongforge.data.chat_template import ChatTemplate, Message
from loongforge.data.errors import DataError
from loongforge.data.sft import ChatSample, tokenize_conversation
from loongforge.data.tokenizers import ByteTokenizer, Tokenizer

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
IMAGE_MARKER = VISION_START + IMAGE_PAD + VISION_END
VIDEO_MARKER = VISION_START + VIDEO_PAD + VISION_END
_MARKERS = re.compile(f"({re.escape(IMAGE_MARKER)}|{re.escape(VIDEO_MARKER)})")


@dataclass(frozen=True)
class VisionTokenIds:
    """Ids of the four vision tokens in one tokenizer's vocabulary; -1 for one the model has none of (a model without
    videos, LLaVA-OneVision's images without start/end markers)."""

    vision_start: int
    vision_end: int
    image_pad: int
    video_pad: int


class VisionByteTokenizer(ByteTokenizer):
    """Core's byte tokenizer (0-255 bytes, bos 256, eos 257, pad 258) plus the four vision tokens.

    Default ids: image pad 259, vision start 260, vision end 261, video pad 262 (those of the plugin's
    ``vlm-tiny`` flavor); pass ``vision_tokens`` to match another model's ids (e.g. the tiny Qwen flavors' 380-383).
    Still a :class:`ByteTokenizer`, so core picks its byte chat template; ``decode`` drops the vision ids.
    """

    DEFAULT_IDS = VisionTokenIds(vision_start=260, vision_end=261, image_pad=259, video_pad=262)

    def __init__(self, vision_tokens: VisionTokenIds | None = None) -> None:
        self.vision_tokens = vision_tokens or self.DEFAULT_IDS
        ids = list(vars(self.vision_tokens).values())
        if len(set(ids)) != 4 or min(ids) <= self.pad_id:
            raise DataError(f"vision token ids must be 4 distinct ids above {self.pad_id}, got {self.vision_tokens}")
        self.vocab_size = max(ids) + 1
        default = self.vision_tokens == self.DEFAULT_IDS
        self.name = "byte-vision" if default else "byte-vision:" + ",".join(map(str, ids))

    def __repr__(self) -> str:
        return "VisionByteTokenizer()" if self.vision_tokens == self.DEFAULT_IDS else \
            f"VisionByteTokenizer({self.vision_tokens})"


def vision_token_ids(tokenizer: Tokenizer) -> VisionTokenIds:
    """The vision token ids of ``tokenizer``: its ``vision_tokens`` attribute, or each token encoded to one id."""
    known = getattr(tokenizer, "vision_tokens", None)
    if isinstance(known, VisionTokenIds):
        return known
    ids = {}
    for field, token in (("vision_start", VISION_START), ("vision_end", VISION_END), ("image_pad", IMAGE_PAD),
                         ("video_pad", VIDEO_PAD)):
        encoded = tokenizer.encode(token)
        if len(encoded) != 1:
            raise DataError(f"tokenizer {tokenizer.name!r} has no single token for {token} (encodes to "
                            f"{len(encoded)} ids); use tokenizer 'byte-vision' or a Qwen2-VL tokenizer directory")
        ids[field] = encoded[0]
    return VisionTokenIds(**ids)


class MarkerTokenizer:
    """Wraps a tokenizer so that each image/video marker in the text encodes to start, one pad, end (the markers the
    model has): what core's chat tokenization is given, before :func:`expand_vision_tokens` repeats each pad."""

    def __init__(self, base: Tokenizer, vision: VisionTokenIds) -> None:
        self._base, self._vision = base, vision
        self.name, self.vocab_size = base.name, base.vocab_size
        self.bos_id, self.eos_id, self.pad_id = base.bos_id, base.eos_id, base.pad_id

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _MARKERS.split(text):
            if piece == IMAGE_MARKER or piece == VIDEO_MARKER:
                pad = self._vision.image_pad if piece == IMAGE_MARKER else self._vision.video_pad
                ids += [i for i in (self._vision.vision_start, pad, self._vision.vision_end) if i >= 0]
            elif piece:
                ids += self._base.encode(piece)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._base.decode(ids)


def vision_mask(ids: np.ndarray, vision: VisionTokenIds) -> np.ndarray:
    """Where ``ids`` holds a vision token (four comparisons: much cheaper than ``np.isin`` on short arrays)."""
    return (ids == vision.vision_start) | (ids == vision.vision_end) | (ids == vision.image_pad) | \
        (ids == vision.video_pad)


def count_markers(messages: Sequence[Message]) -> tuple[int, int]:
    """``(images, videos)`` marked in the messages' text."""
    text = "".join(m["content"] for m in messages)
    return text.count(IMAGE_MARKER), text.count(VIDEO_MARKER)


def timestamp_videos(messages: Sequence[Message], times: Sequence[Sequence[float]]) -> list[Message]:
    """The messages with the ``k``-th video marker written as Qwen3-VL's processor writes video ``k``: for each
    temporal patch its time, ``<1.5 seconds>``, then a marker of its own (so each patch's tokens form one run)."""
    pending = iter(times)

    def expand(match: re.Match) -> str:
        if match.group(0) != VIDEO_MARKER:
            return match.group(0)
        return "".join(f"<{t:.1f} seconds>{VIDEO_MARKER}" for t in next(pending))

    return [{**m, "content": _MARKERS.sub(expand, m["content"])} for m in messages]


def tokenize_multimodal(messages: Sequence[Message], tokenizer: Tokenizer, template: ChatTemplate,
                        image_tokens: Sequence[int], video_tokens: Sequence[int], where: str) -> ChatSample:
    """Token ids and reply mask of a conversation whose messages hold image/video markers.

    ``image_tokens[i]`` (``video_tokens[i]``) is the number of LLM tokens of the ``i``-th image (video) in
    reading order; the counts must equal the markers (the caller checks, so a mismatch is reported per sample).
    """
    vision = vision_token_ids(tokenizer)
    sample = tokenize_conversation(messages, MarkerTokenizer(tokenizer, vision), template, where)
    return expand_vision_tokens(sample, vision, image_tokens, video_tokens, where)


def expand_vision_tokens(sample: ChatSample, vision: VisionTokenIds, image_tokens: Sequence[int],
                         video_tokens: Sequence[int], where: str) -> ChatSample:
    """A sample tokenized through :class:`MarkerTokenizer` with each image's (video's) single pad repeated
    ``image_tokens[i]`` (``video_tokens[i]``) times; vision tokens are never targets."""
    repeats = np.ones(len(sample.ids), dtype=np.int64)
    for pad, counts in ((vision.image_pad, image_tokens), (vision.video_pad, video_tokens)):
        slots = np.flatnonzero(sample.ids == pad)
        if len(slots) != len(counts):
            raise DataError(f"{where}: {len(slots)} {'image' if pad == vision.image_pad else 'video'} "
                            f"placeholder(s) rendered, {len(counts)} given")
        repeats[slots] = counts
    ids = np.repeat(sample.ids, repeats)
    return ChatSample(ids, np.repeat(sample.supervised, repeats) & ~vision_mask(ids, vision))
