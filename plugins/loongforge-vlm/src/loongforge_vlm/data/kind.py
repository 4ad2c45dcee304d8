"""What a run needs to build image-text data: the dataset kinds a config names (core's factory signature), and
the tokenizer and processor that match a VLM flavor.

``image_text_dataset``: ``paths`` may mix jsonl files and WebDataset shards: each ``.jsonl`` is one source;
anything else (``.tar`` files, brace or glob patterns) is read as shards. Sources keep the order given, so the
sample order is fixed. ``shapes_dataset``: the synthetic shapes set, generated on first use under the cache
directory (no downloads), so a quickstart config needs no data path. ``image_preference_dataset`` and
``shapes_pairs_dataset``: the same for image preference pairs (``training.phase: dpo``,
:mod:`loongforge_vlm.data.pairs`). ``energon_dataset``: Megatron-Energon dataset directories, read by energon.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from loongforge.data.cache import default_cache_dir
from loongforge.data.errors import DataError
from loongforge.data.tokenizers import Tokenizer

from loongforge_vlm.data import shape_pairs, shapes
from loongforge_vlm.data.dataset import VisionChatDataset
from loongforge_vlm.data.energon import EnergonSource
from loongforge_vlm.data.pairs import VisionPairDataset
from loongforge_vlm.data.processor import ImageProcessor, processor_for
from loongforge_vlm.data.sources import JsonlSource, WebDatasetSource
from loongforge_vlm.data.tokens import VisionByteTokenizer, VisionTokenIds, vision_token_ids


def sources_for(paths: Sequence[str | Path]) -> list[JsonlSource | WebDatasetSource]:
    """One source per jsonl file or shard pattern."""
    if not paths:
        raise DataError("image-text data needs data.paths: .jsonl files or WebDataset shards (a.tar, s-{000..009}.tar)")
    return [JsonlSource(p) if str(p).endswith(".jsonl") else WebDatasetSource(str(p)) for p in paths]


def image_text_dataset(
    paths: Sequence[str | Path],
    tokenizer: Tokenizer,
    *,
    text_key: str = "text",
    cache_dir: str | Path | None = None,
    progress: bool = False,
    processor: ImageProcessor | None = None,
    strict: bool = False,
    model: Any = None,
) -> VisionChatDataset:
    """Image-text conversations from jsonl files and/or WebDataset shards (``text_key``/``cache_dir`` unused:
    records are conversations and only token ids are kept). ``model``: the run's VLM flavor (core passes it),
    which picks the processor and must agree with the tokenizer's vision tokens."""
    processor = _matched(tokenizer, processor, model)
    return VisionChatDataset(sources_for(paths), tokenizer, processor, strict=strict)


def energon_dataset(
    paths: Sequence[str | Path],
    tokenizer: Tokenizer,
    *,
    text_key: str = "text",
    cache_dir: str | Path | None = None,
    progress: bool = False,
    processor: ImageProcessor | None = None,
    strict: bool = False,
    split: str = "train",
    model: Any = None,
) -> VisionChatDataset:
    """The ``split`` of Megatron-Energon dataset directories (``energon prepare``'d WebDataset shards of
    ``VQASample``, ``CaptioningSample`` or ``VidQASample``), read by energon (:mod:`loongforge_vlm.data.energon`)."""
    if not paths:
        raise DataError("energon data needs data.paths: directories prepared by 'energon prepare'")
    processor = _matched(tokenizer, processor, model)
    return VisionChatDataset([EnergonSource(p, split) for p in paths], tokenizer, processor, strict=strict)


def shapes_dataset(
    paths: Sequence[str | Path],
    tokenizer: Tokenizer,
    *,
    text_key: str = "text",
    cache_dir: str | Path | None = None,
    progress: bool = False,
    processor: ImageProcessor | None = None,
    strict: bool = False,
    count: int = 2000,
    seed: int = 0,
    split: str = "train",
    model: Any = None,
) -> VisionChatDataset:
    """The shapes set (``count`` samples of ``seed``; its ``split``), written under ``cache_dir/datasets`` once."""
    out = _generated("vlm-shapes", "image-text", paths, cache_dir, count, seed,
                     lambda scratch: shapes.generate(scratch, count, seed), shapes.validate)
    processor = _matched(tokenizer, processor, model)
    return VisionChatDataset([JsonlSource(out / f"{split}.jsonl")], tokenizer, processor, strict=strict)


def image_preference_dataset(
    paths: Sequence[str | Path],
    tokenizer: Tokenizer,
    *,
    text_key: str = "text",
    cache_dir: str | Path | None = None,
    progress: bool = False,
    processor: ImageProcessor | None = None,
    model: Any = None,
) -> VisionPairDataset:
    """Image preference pairs (``{"image", "prompt", "chosen", "rejected"}`` per line, see
    :mod:`loongforge_vlm.data.pairs`) from jsonl files and/or WebDataset shards, for ``training.phase: dpo``."""
    return VisionPairDataset(sources_for(paths), tokenizer, _matched(tokenizer, processor, model))


def shapes_pairs_dataset(
    paths: Sequence[str | Path],
    tokenizer: Tokenizer,
    *,
    text_key: str = "text",
    cache_dir: str | Path | None = None,
    progress: bool = False,
    processor: ImageProcessor | None = None,
    count: int = shape_pairs.DEFAULT_COUNT,
    seed: int = shape_pairs.DEFAULT_SEED,
    model: Any = None,
) -> VisionPairDataset:
    """The generated shapes preference pairs (``loongforge make-data shapes-pairs``' defaults), written under
    ``cache_dir/datasets`` once."""
    out = _generated("vlm-shapes-pairs", "image-preference", paths, cache_dir, count, seed,
                     lambda scratch: shape_pairs.write(scratch / shape_pairs.FILE, count, seed), shape_pairs.missing)
    pairs = JsonlSource(out / shape_pairs.FILE)
    return VisionPairDataset([pairs], tokenizer, _matched(tokenizer, processor, model))


def _generated(kind: str, own_files_kind: str, paths: Sequence[str | Path], cache_dir: str | Path | None, count: int,
               seed: int, write: Any, check: Any) -> Path:
    """The directory of generated dataset ``kind`` (``count`` samples of ``seed``) under ``cache_dir/datasets``,
    written by ``write(scratch)`` the first time; such a kind takes no paths (``own_files_kind`` reads a user's)."""
    if paths:
        raise DataError(f"dataset '{kind}' takes no paths (use '{own_files_kind}' for your own files)")
    out = Path(cache_dir or default_cache_dir()) / "datasets" / f"{kind}-{count}-{seed}"
    _generate_into(out, write, check)
    return out


def _matched(tokenizer: Tokenizer, processor: ImageProcessor | None, model: Any) -> ImageProcessor | None:
    """The processor for ``model`` (unless one is given), after checking that the tokenizer writes the model's
    vision token ids -- a mismatch would train the image features into the wrong positions."""
    if model is None or not hasattr(model, "image_token_id"):
        return processor
    vision = vision_token_ids(tokenizer)
    wanted = {"image pad": (vision.image_pad, model.image_token_id),
              "vision start": (vision.vision_start, model.vision_start_token_id),
              "vision end": (vision.vision_end, model.vision_end_token_id)}
    if model.video_token_id is not None:
        wanted["video pad"] = (vision.video_pad, model.video_token_id)
    wrong = [f"{name} {ours} (model: {theirs})" for name, (ours, theirs) in wanted.items()
             if theirs is not None and ours != theirs]
    if wrong:
        raise DataError(f"tokenizer '{tokenizer.name}' writes vision token ids that the model does not use: "
                        f"{', '.join(wrong)}")
    return processor or processor_for_vlm(model)


def _generate_into(out: Path, write: Callable[[Path], Any], problems: Callable[[Path], list[str]]) -> None:
    """Unless ``out`` holds a sound set (``problems(out)`` is empty), ``write`` one into a private folder and
    rename it into place, so concurrent ranks never see half a set (the set is a function of its arguments:
    whichever copy lands is the same)."""
    if not problems(out):
        return
    scratch = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    write(scratch)
    if out.exists() and problems(out):
        shutil.rmtree(out, ignore_errors=True)
    try:
        os.rename(scratch, out)
    except OSError:  # another process renamed its copy first
        shutil.rmtree(scratch, ignore_errors=True)


def byte_tokenizer_for(flavor: Any) -> VisionByteTokenizer:
    """The byte tokenizer with a VLM flavor's vision token ids (for tiny flavors trained from bytes); a flavor
    without a video token gets the id after its other vision tokens."""
    ids = (flavor.image_token_id, flavor.vision_start_token_id, flavor.vision_end_token_id)
    if None in ids:
        raise DataError(f"{type(flavor).__name__} has no vision start/end token ids; the byte tokenizer needs them")
    video = flavor.video_token_id if flavor.video_token_id is not None else max(ids) + 1
    return VisionByteTokenizer(VisionTokenIds(vision_start=ids[1], vision_end=ids[2], image_pad=ids[0],
                                              video_pad=video))


def processor_for_vlm(flavor: Any, **overrides: Any) -> ImageProcessor:
    """The image processor of a VLM flavor's encoder (a fixed-size tower merges as its projector does)."""
    projector = getattr(flavor, "projector", None)
    return processor_for(flavor.encoder, merge_size=getattr(projector, "merge", None), **overrides)
