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
from dataclasses import dataclass
from typing import Any

import numpy as np
from loongforge.data.chat_template import chat_template_for
from loongforge.data.contracts import SampleDataset
from loongforge.data.errors import DataError
from loongforge.data.sft import ChatSample
from loongforge.data.tokenizers import Tokenizer
from PIL import Image, UnidentifiedImageError

from loongforge_vlm.data.processor import ImageProcessor, VisionProcessor
from loongforge_vlm.data.records import RecordError, parse_record
from loongforge_vlm.data.skips import SkipReport
from loongforge_vlm.data.sources import MediaError
from loongforge_vlm.data.tokens import count_markers, tokenize_multimodal, vision_token_ids

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
    """A record's images (names) and videos (frame names, sampled at ``fps``), read through its source.

    Shared by the conversation and pair kinds: indexing counts each one's LLM tokens (:meth:`token_counts`,
    decoding every frame), loading turns them into a sample's pixel fields (:meth:`load`)."""

    images: tuple[str, ...]
    videos: tuple[tuple[str, ...], ...]
    fps: float

    def token_counts(self, processor: ImageProcessor, source: Any, index: int, *,
                     full: bool = True) -> tuple[list[int], list[int]]:
        """LLM tokens of each image and each video, in order (every frame decoded fully unless ``full`` is
        false); raises :class:`SampleProblem` for an unreadable image."""
        images = [processor.num_tokens(_grid(processor, source, index, [name], full)) for name in self.images]
        videos = [processor.num_tokens(_grid(processor, source, index, frames, full)) for frames in self.videos]
        return images, videos

    def load(self, processor: ImageProcessor, source: Any, index: int, *, verified: bool) -> dict[str, np.ndarray]:
        """The pixel fields of a :class:`VisionSample`. An image that was read when the dataset was indexed and is
        unreadable now stops the run in one line (``verified``: it was decoded fully then, not only its header)."""
        try:
            images = [processor.image(decode_image(source, index, name)[1]) for name in self.images]
            videos = [processor.video([decode_image(source, index, n)[1] for n in frames]) for frames in self.videos]
        except SampleProblem as problem:
            checked = "decoded" if verified else "had a readable header (verify_images=False)"
            raise DataError(f"{problem.where}: {problem.detail} (it {checked} when the dataset was indexed)") from None
        shape = processor.pixel_shape
        return {"pixel_values": _rows(images, shape), "image_grid_thw": _grids(images),
                "pixel_values_videos": _rows(videos, shape), "video_grid_thw": _grids(videos),
                "second_per_grid_ts": np.full(len(videos), getattr(processor, "temporal_patch_size", 1) / self.fps,
                                              dtype=np.float32)}


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
        media = Media(tuple(images), tuple(tuple(v) for v in record.videos), record.fps)
        image_tokens, video_tokens = media.token_counts(self.processor, source, index, full=self.verify_images)
        try:
            chat = tokenize_multimodal(record.messages, self.tokenizer, self._template, image_tokens, video_tokens,
                                       where)
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


def _grid(processor: ImageProcessor, source: Any, index: int, frames: Sequence[str],
          full: bool) -> tuple[int, int, int]:
    """Patch grid of an image (one frame) or video, after decoding every frame (fully unless ``full`` is false)."""
    decoded = [decode_image(source, index, name, full=full) for name in frames]
    sizes = {image.size for _, image in decoded}
    if len(sizes) != 1:
        raise SampleProblem("corrupt", decoded[0][0], f"video frames differ in size: {sorted(sizes)}")
    width, height = sizes.pop()
    try:
        return processor.grid(width, height, len(frames))
    except ValueError as exc:
        raise SampleProblem("corrupt", decoded[0][0], str(exc)) from None


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
