"""Image-text conversations from jsonl or WebDataset sources -> checked, tokenized samples with their patches.

Construction indexes every record once: it parses the conversation, decodes each image fully (so a truncated
or corrupt file is found now, not mid-run; ``verify_images=False`` reads only the headers, for large sets whose
images are known to be sound, and a damaged one then stops the run when it is loaded), checks that the
placeholders match the images, computes each image's patch grid and tokenizes with the exact number of image
tokens. A sample that fails any check is
skipped and counted (:mod:`loongforge_vlm.data.skips`) or, with ``strict=True``, raises. Only token ids and
grids are kept in memory; ``dataset[i]`` decodes and processes the images again, so memory does not grow with
the image data. Indices are stable, so the order is a seeded permutation and resuming is a sample count.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from loongforge.data.chat_template import Message, chat_template_for
from loongforge.data.contracts import SampleDataset
from loongforge.data.errors import DataError
from loongforge.data.sft import ChatSample
from loongforge.data.tokenizers import Tokenizer
from PIL import Image, UnidentifiedImageError

from loongforge_vlm.data.processor import ImageProcessor, VisionProcessor
from loongforge_vlm.data.records import RecordError, Video, parse_record
from loongforge_vlm.data.skips import SkipReport
from loongforge_vlm.data.sources import MediaError
from loongforge_vlm.data.tokens import count_markers, timestamp_videos, tokenize_multimodal, vision_token_ids
from loongforge_vlm.data.video import FrameSampling, SampledVideo, VideoError, load_video

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VisionSample:
    """One conversation: token ids, reply mask, and the patch rows + grids of its images and videos in order."""

    ids: np.ndarray  # int64 [n]
    supervised: np.ndarray  # bool [n]
    pixel_values: np.ndarray  # float32 [sum t*h*w over images, patch_dim] (Qwen) or [images, C, S, S]
    image_grid_thw: np.ndarray  # int64 [images, 3]
    pixel_values_videos: np.ndarray  # float32 [sum t*h*w over videos, patch_dim]
    video_grid_thw: np.ndarray  # int64 [videos, 3]
    second_per_grid_ts: np.ndarray  # float32 [videos]: seconds one temporal patch spans (Qwen2.5-VL's M-RoPE)
    where: str


class SampleProblem(Exception):
    """Why a record cannot become a sample: ``reason`` is a :class:`~loongforge_vlm.data.skips.SkipReport`
    category (``malformed``, ``mismatch``, ``corrupt``), ``where`` names the record or file, ``detail`` says what is
    wrong. The image-text kind counts it as a skip (or raises it, strict); the pair kinds stop on it."""

    def __init__(self, reason: str, where: str, detail: str) -> None:
        super().__init__(f"{where}: {detail}")
        self.reason, self.where, self.detail = reason, where, detail


@dataclass(frozen=True)
class Media:
    """A record's images (names) and videos (files, frame directories or frame names, sampled by ``sampling``),
    read through its source.

    Shared by the conversation and pair kinds: indexing counts each one's LLM tokens (:meth:`image_tokens`, and
    :meth:`sampled_videos` through :func:`video_runs`, decoding every frame), loading turns them into a sample's
    pixel fields (:meth:`load`)."""

    images: tuple[str, ...]
    videos: tuple[Video, ...]
    sampling: FrameSampling = FrameSampling()

    def image_tokens(self, processor: ImageProcessor, source: Any, index: int, *, full: bool = True) -> list[int]:
        """LLM tokens of each image."""
        processor = processor.for_sample(len(self.images))
        return [processor.num_tokens(_grid(processor, source, index, name, full)) for name in self.images]

    def sampled_videos(self, processor: ImageProcessor, source: Any, index: int, *,
                       full: bool = True) -> list[SampledVideo]:
        """Each video's kept frames and times (:mod:`loongforge_vlm.data.video`); a video that cannot be read or
        has too few frames is a ``corrupt`` :class:`SampleProblem` naming it."""
        sampling = replace(self.sampling, rule=getattr(processor, "frame_sampling", "qwen2"))
        tp = getattr(processor, "temporal_patch_size", 1)
        try:
            return [load_video(video, lambda name: _read(source, index, name),
                               lambda name: decode_image(source, index, name, full=full),
                               lambda name: source.listing(index, name), sampling, tp) for video in self.videos]
        except VideoError as exc:
            raise SampleProblem("corrupt", exc.where, f"{exc.reason} (a video of {source.where(index)})") from None

    def load(self, processor: ImageProcessor, source: Any, index: int, *, verified: bool) -> dict[str, np.ndarray]:
        """The pixel fields of a :class:`VisionSample`. An image that was read when the dataset was indexed and is
        unreadable now stops the run in one line (``verified``: it was decoded fully then, not only its header)."""
        per_image = processor.for_sample(len(self.images))
        try:
            images = [per_image.image(decode_image(source, index, name)[1]) for name in self.images]
            sampled = self.sampled_videos(processor, source, index)
        except SampleProblem as problem:
            checked = "decoded" if verified else "had a readable header (verify_images=False)"
            raise DataError(f"{problem.where}: {problem.detail} (it {checked} when the dataset was indexed)") from None
        videos = [processor.video(video.frames) for video in sampled]
        shape = processor.pixel_shape
        return {"pixel_values": _rows(images, shape), "image_grid_thw": _grids(images),
                "pixel_values_videos": _rows(videos, shape), "video_grid_thw": _grids(videos),
                "second_per_grid_ts": np.asarray([v.seconds_per_patch for v in sampled], dtype=np.float32)}


@dataclass(frozen=True)
class _Entry:
    """What the index keeps of one accepted record."""

    source: int
    index: int
    where: str
    chat: ChatSample
    media: Media


class VisionChatDataset(SampleDataset):
    """Checked image-text samples of one or more sources (:mod:`loongforge_vlm.data.sources`), in source order."""

    def __init__(self, sources: Sequence[Any], tokenizer: Tokenizer, processor: ImageProcessor | None = None, *,
                 strict: bool = False, verify_images: bool = True) -> None:
        if not sources:
            raise DataError("an image-text dataset needs at least one source")
        self.sources = list(sources)
        self.tokenizer = tokenizer
        self.processor = processor or VisionProcessor()
        self.vision_tokens = vision_token_ids(tokenizer)
        self.skipped = SkipReport(strict=strict)
        self.verify_images = verify_images
        self._template = chat_template_for(tokenizer)
        self.entries: list[_Entry] = []
        seen = 0
        for source_index, source in enumerate(self.sources):
            for index in range(len(source)):
                seen += 1
                try:
                    self.entries.append(self._index(source_index, index))
                except SampleProblem as problem:
                    self.skipped.skip(problem.reason, problem.where, problem.detail)
        self.num_records = seen
        if self.skipped.total:
            logger.warning(self.skipped.summary(seen))
        if not self.entries:
            raise DataError(f"no usable samples among {seen} record(s)" +
                            (f" ({self.skipped.summary(seen)})" if seen else ""))

    def _index(self, source_index: int, index: int) -> _Entry:
        source = self.sources[source_index]
        where = source.where(index)
        try:
            record = parse_record(source.raw(index))
        except RecordError as exc:
            raise SampleProblem("malformed", where, str(exc)) from None
        images = record.images or source.default_images(index)
        if record.videos and not self.processor.supports_video:
            raise DataError(f"{where}: has videos, but the vision tower's processor takes only images")
        marked_images, marked_videos = count_markers(record.messages)
        if (marked_images, marked_videos) != (len(images), len(record.videos)):
            raise SampleProblem("mismatch", where, f"{marked_images} image and {marked_videos} video placeholder(s) "
                                f"for {len(images)} image(s) and {len(record.videos)} video(s)")
        media = Media(tuple(images), tuple(record.videos), record.sampling)
        image_tokens = media.image_tokens(self.processor, source, index, full=self.verify_images)
        sampled = media.sampled_videos(self.processor, source, index, full=self.verify_images)
        messages, per_video = video_runs(record.messages, self.processor, sampled)
        try:
            chat = tokenize_multimodal(messages, self.tokenizer, self._template, image_tokens, per_video, where)
        except DataError as exc:
            raise SampleProblem("malformed", where, str(exc).removeprefix(f"{where}: ")) from None
        return _Entry(source_index, index, where, chat, media)

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i: int) -> VisionSample:
        entry = self.entries[i]
        pixels = entry.media.load(self.processor, self.sources[entry.source], entry.index,
                                  verified=self.verify_images)
        return VisionSample(ids=entry.chat.ids, supervised=entry.chat.supervised, **pixels, where=entry.where)

    def split_samples(self, data: Any) -> tuple[Any, Any]:
        """Training and validation rows for a core ``DataConfig`` (``seq_length``, ``pack``, ``valid_fraction``);
        see :func:`loongforge_vlm.data.batching.split_rows`."""
        from loongforge_vlm.data.batching import split_rows

        return split_rows(self, data.seq_length, pack=data.pack, valid_fraction=data.valid_fraction)


def _grid(processor: ImageProcessor, source: Any, index: int, name: str, full: bool) -> tuple[int, int, int]:
    """Patch grid of an image, after decoding it (fully unless ``full`` is false)."""
    where, image = decode_image(source, index, name, full=full)
    try:
        return processor.grid(*image.size)
    except ValueError as exc:
        raise SampleProblem("corrupt", where, str(exc)) from None


def video_runs(messages: Sequence[Message], processor: ImageProcessor,
               sampled: Sequence[SampledVideo]) -> tuple[list[Message], list[int]]:
    """The messages as the tower's processor writes its videos, and the LLM tokens of each video placeholder run
    in order: one run per video, or (``timestamped_videos``, Qwen3-VL) each temporal patch's time as text and a run
    of its own. Training samples, preference pairs and generation prompts all render videos through this."""
    counts = video_tokens(processor, sampled)
    if not sampled or not getattr(processor, "timestamped_videos", False):
        return list(messages), counts
    runs = [count // len(video.times) for count, video in zip(counts, sampled, strict=True) for _ in video.times]
    return timestamp_videos(messages, [video.times for video in sampled]), runs


def video_tokens(processor: ImageProcessor, sampled: Sequence[SampledVideo]) -> list[int]:
    """LLM tokens of each sampled video."""
    counts = []
    for video in sampled:
        try:
            counts.append(processor.num_tokens(processor.grid(*video.frames[0].size, len(video.frames))))
        except ValueError as exc:
            raise SampleProblem("corrupt", video.where, str(exc)) from None
    return counts


def _read(source: Any, index: int, name: str) -> tuple[str, bytes]:
    """A media file's location and bytes; a missing or unreadable one is a ``corrupt`` :class:`SampleProblem`."""
    try:
        return source.media(index, name)
    except MediaError as exc:
        raise SampleProblem("corrupt", exc.where, exc.reason) from None


def decode_image(source: Any, index: int, name: str, *, full: bool = True) -> tuple[str, Image.Image]:
    """Where the image is and the image, decoded fully (else only its header is read); an unreadable or damaged
    one is a ``corrupt`` :class:`SampleProblem` naming the file."""
    try:
        where, data = source.media(index, name)
    except MediaError as exc:
        raise SampleProblem("corrupt", exc.where, exc.reason) from None
    try:
        image = Image.open(io.BytesIO(data))
        if full:
            image.load()
        return where, image
    except UnidentifiedImageError:  # its message names a BytesIO object: different on every read
        raise SampleProblem("corrupt", where, "cannot be decoded (not an image Pillow reads)") from None
    except Exception as exc:  # Pillow raises many types for a damaged file; all mean the same here
        raise SampleProblem("corrupt", where, f"cannot be decoded ({type(exc).__name__}: {exc})") from None


def _rows(items: list[tuple[np.ndarray, tuple[int, int, int]]], shape: tuple[int, ...]) -> np.ndarray:
    return np.concatenate([rows for rows, _ in items]) if items else np.zeros((0, *shape), dtype=np.float32)


def _grids(items: list[tuple[np.ndarray, tuple[int, int, int]]]) -> np.ndarray:
    return np.asarray([grid for _, grid in items], dtype=np.int64).reshape(len(items), 3)
