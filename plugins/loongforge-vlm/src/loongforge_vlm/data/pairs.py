"""Image preference pairs for ``training.phase: dpo``: a prompt with images, a chosen and a rejected response.

Input: one pair per jsonl line (or per WebDataset sample's json), core's preference line
(:mod:`loongforge.data.preference`: ``prompt`` a string or messages, ``chosen``/``rejected`` strings or messages
starting with an assistant message, optional ``tools``) with the media of an image-text record
(:mod:`loongforge_vlm.data.records`: ``image`` or ``images``, ``videos`` + ``fps``; names relative to the jsonl
file, or members of the tar sample)::

    {"image": "img-1.png", "prompt": "<image>\\nWhat colour is the shape?", "chosen": "red", "rejected": "blue"}

The prompt says where each image goes: ``<image>`` (``<video>``) in a string, or ``{"type": "image"}`` parts in a
message's content (a part may name its file under ``image``). A prompt without any placeholder gets its images (then
videos) before the text of its first user message, each as ``<image>\\n`` -- the layout of VLM preference sets that
keep the image beside the prompt. Responses are text.

Why through core: the plugin only lifts the media out of the record (the prompt's image parts become the marker
text of :mod:`loongforge_vlm.data.tokens`), then core's pair code checks and renders the pair -- the same rules, chat
template and response masks as text pairs -- through a tokenizer that encodes each marker as the vision tokens, and
each image's one pad is repeated to its patch count. So both sides hold the same prompt tokens and images, and the
loss mask covers the response tokens only (never a vision token).

Unlike image-text SFT data, which skips and counts bad samples, a bad pair stops loading with one line naming its
file and line (or shard and key) and what is wrong: a preference set is small and curated, and a pair silently left
out changes what "held-out accuracy" measures. Pairs whose responses or images do not fit ``data.seq_length`` are
left out with one warning.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from loongforge.data.chat_dataset import hold_out
from loongforge.data.chat_template import chat_template_for
from loongforge.data.contracts import PreferencePairs
from loongforge.data.errors import DataError
from loongforge.data.preference import PreferencePair, pair_from_record, tokenize_pair
from loongforge.data.preference_dataset import PAIR_INDEX
from loongforge.data.sft import ChatSample
from loongforge.data.tokenizers import Tokenizer

from loongforge_vlm.data.batching import collate, row_cut
from loongforge_vlm.data.dataset import Media, SampleProblem, VisionSample, video_runs
from loongforge_vlm.data.processor import ImageProcessor, VisionProcessor
from loongforge_vlm.data.records import RecordError, content_text, parse_media
from loongforge_vlm.data.tokens import (
    IMAGE_MARKER,
    VIDEO_MARKER,
    MarkerTokenizer,
    count_markers,
    expand_vision_tokens,
    vision_token_ids,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PairMedia:
    """A pair record with its media lifted out: the record core's pair reader takes (markers in the prompt's
    text), and the images and videos the markers stand for."""

    record: dict[str, Any]
    media: Media


def lift_media(raw: Any, default_images: Sequence[str] = ()) -> PairMedia:
    """The prompt's image/video placeholders and parts as marker text, the media names beside; raises
    :class:`~loongforge_vlm.data.records.RecordError` (without the location)."""
    if not isinstance(raw, dict):
        raise RecordError("expected an object with prompt, chosen, rejected and an image")
    images, videos, sampling = parse_media(raw)
    part_images: list[str] = []
    part_videos: list[list[str]] = []
    prompt = raw.get("prompt")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": content_text(prompt, 0, part_images, part_videos)}]
    elif isinstance(prompt, list):
        prompt = [{**m, "content": content_text(m["content"], i, part_images, part_videos)}
                  if isinstance(m, dict) and isinstance(m.get("content"), (str, list)) else m
                  for i, m in enumerate(prompt)]
    images = images or part_images or list(default_images)
    videos = videos or part_videos
    if isinstance(prompt, list) and count_markers([m for m in prompt if isinstance(m, dict)
                                                   and isinstance(m.get("content"), str)]) == (0, 0):
        prompt = _media_first(prompt, len(images), len(videos))
    return PairMedia({**raw, "prompt": prompt}, Media(tuple(images), tuple(videos), sampling))


def _media_first(prompt: list[Any], images: int, videos: int) -> list[Any]:
    """``prompt`` with ``images`` image and ``videos`` video markers (each on its own line) before the text of its
    first user message."""
    if not images and not videos:
        return prompt
    first = next((i for i, m in enumerate(prompt) if isinstance(m, dict) and m.get("role") == "user"), None)
    if first is None:
        raise RecordError("the prompt has images but no user message to put them in")
    lead = f"{IMAGE_MARKER}\n" * images + f"{VIDEO_MARKER}\n" * videos
    return [*prompt[:first], {**prompt[first], "content": lead + prompt[first]["content"]}, *prompt[first + 1:]]


@dataclass(frozen=True)
class VisionPair:
    """One checked pair: where it is read from, its media and both sides tokenized (core's
    :class:`~loongforge.data.preference.PreferencePair`, vision tokens expanded)."""

    source: int
    index: int
    where: str
    media: Media
    tokens: PreferencePair


class VisionPairDataset(PreferencePairs):
    """Checked image preference pairs of one or more sources (:mod:`loongforge_vlm.data.sources`), in source order.

    Like :class:`~loongforge_vlm.data.dataset.VisionChatDataset` it keeps token ids and patch grids only and decodes
    a pair's images again when a batch needs them (once for both sides)."""

    def __init__(self, sources: Sequence[Any], tokenizer: Tokenizer, processor: ImageProcessor | None = None) -> None:
        if not sources:
            raise DataError("an image preference dataset needs at least one .jsonl file or shard in data.paths")
        self.sources = list(sources)
        self.tokenizer = tokenizer
        self.processor = processor or VisionProcessor()
        self.vision_tokens = vision_token_ids(tokenizer)
        self._template = chat_template_for(tokenizer)
        self.pairs = [self._index(s, i) for s, source in enumerate(self.sources) for i in range(len(source))]
        if not self.pairs:
            raise DataError(f"no image preference pairs in {', '.join(source.name for source in self.sources)}")

    def _index(self, source_index: int, index: int) -> VisionPair:
        """One record checked and tokenized; every problem is a one-line :class:`DataError` naming it."""
        source = self.sources[source_index]
        where = source.where(index)
        try:
            lifted = lift_media(source.raw(index), source.default_images(index))
        except RecordError as exc:
            raise DataError(f"{where}: {exc}") from None
        pair = pair_from_record(lifted.record, where)
        media = lifted.media
        marked = count_markers(pair.prompt)
        if marked != (len(media.images), len(media.videos)):
            raise DataError(f"{where}: {marked[0]} image and {marked[1]} video placeholder(s) in the prompt for "
                            f"{len(media.images)} image(s) and {len(media.videos)} video(s)")
        if media.videos and not self.processor.supports_video:
            raise DataError(f"{where}: has videos, but the vision tower's processor takes only images")
        try:
            image_tokens = media.image_tokens(self.processor, source, index)
            prompt, video_tokens = video_runs(pair.prompt, self.processor,
                                              media.sampled_videos(self.processor, source, index))
        except SampleProblem as problem:
            raise DataError(f"{where}: {problem}") from None
        pair = replace(pair, prompt=prompt)  # videos written as the tower's processor writes them (timestamps)
        sides = tokenize_pair(pair, MarkerTokenizer(self.tokenizer, self.vision_tokens), self._template, where)

        def expand(side: ChatSample, name: str) -> ChatSample:
            return expand_vision_tokens(side, self.vision_tokens, image_tokens, video_tokens, f"{where}: {name}")

        tokens = PreferencePair(expand(sides.chosen, "chosen"), expand(sides.rejected, "rejected"))
        return VisionPair(source_index, index, where, media, tokens)

    def __len__(self) -> int:
        return len(self.pairs)

    def samples(self, i: int) -> tuple[VisionSample, VisionSample]:
        """Pair ``i``'s chosen and rejected sample, sharing the pixels of its images (decoded once)."""
        pair = self.pairs[i]
        pixels = pair.media.load(self.processor, self.sources[pair.source], pair.index, verified=True)
        return tuple(VisionSample(ids=side.ids, supervised=side.supervised, **pixels, where=pair.where)
                     for side in (pair.tokens.chosen, pair.tokens.rejected))

    def split_samples(self, data: Any) -> tuple[VisionPairRows, VisionPairRows | None]:
        """Training and validation pairs for a core ``DataConfig``: the pairs whose two sides fit a row of
        ``seq_length`` tokens (vision tokens whole, some response token within it), the last ``valid_fraction`` of
        them held out."""
        if data.pack:
            raise DataError("data.pack does not apply to preference pairs (one response per row)")
        keep, left_out = [], []
        for i, pair in enumerate(self.pairs):
            why = [cut for side in (pair.tokens.chosen, pair.tokens.rejected)
                   if isinstance(cut := row_cut(side.ids, side.supervised, data.seq_length, self.vision_tokens), str)]
            (left_out if why else keep).append((i, pair.where, why))
        if left_out:
            _, where, why = left_out[0]
            logger.warning("%d of %d image preference pair(s) do not fit data.seq_length %d and are left out (first: "
                           "%s: %s)", len(left_out), len(self.pairs), data.seq_length, where, why[0])
        if not keep:
            raise DataError(f"{self.sources[0].name}: no pair fits a row of {data.seq_length} tokens (raise "
                            "data.seq_length)")
        train, valid = hold_out([i for i, _, _ in keep], data.valid_fraction, self.sources[0].name, "pair(s)")
        return (VisionPairRows(self, train, data.seq_length),
                VisionPairRows(self, valid, data.seq_length) if valid else None)


class VisionPairRows:
    """Rows of ``seq_length`` tokens over some pairs of a :class:`VisionPairDataset`, one side each;
    ``batch(indices)`` is a micro-batch of ``2 x len(indices)`` rows (chosen first) with the images of every row in
    row order, and ``pair_index`` (the core :class:`~loongforge.data.contracts.PreferencePairs` layout)."""

    def __init__(self, dataset: VisionPairDataset, pair_indices: Sequence[int], seq_length: int) -> None:
        self.dataset = dataset
        self.pair_indices = list(pair_indices)
        self.seq_length = seq_length

    def __len__(self) -> int:
        return len(self.pair_indices)

    def batch(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        cut = self.seq_length + 1
        pairs = [self.dataset.samples(self.pair_indices[int(i)]) for i in indices]
        rows = [[replace(pair[side], ids=pair[side].ids[:cut], supervised=pair[side].supervised[:cut])]
                for side in (0, 1) for pair in pairs]
        batch = collate(rows, self.seq_length, self.dataset.tokenizer.pad_id)
        batch[PAIR_INDEX] = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        return batch
