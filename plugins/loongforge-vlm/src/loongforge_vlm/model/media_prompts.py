"""Prompts with images and videos for ``loongforge generate --image/--video``: the VLM family's side of core's
media contract.

Core hands over the prompts, the image and video paths and how to render a prompt (:class:`loongforge.models.media.
MediaRequest`); this module answers what the model needs (:class:`loongforge.models.media.MediaPrompts`), with the
same pieces training uses, so a prompt here is laid out exactly like a training sample:

- each image is read with Pillow and processed by the encoder's own processor
  (:func:`loongforge_vlm.data.kind.processor_for_vlm`), with the pixel bounds and normalisation of the
  ``preprocessor_config.json`` beside the model when there is one (a Hugging Face directory, a converted
  checkpoint's ``hf_source``), as transformers' processor reads them;
- each video (a GIF, an mp4-style clip when PyAV is installed, or a directory of frame images in name order) is
  decoded and its frames sampled by the tower's rule at the data records' defaults, 2 frames per second (a frame
  directory: all its frames, taken at 2 per second) (:func:`loongforge_vlm.data.video.load_video`), then processed
  like the images; a Qwen3-VL video is written as a time per temporal patch (``<0.5 seconds>``), each patch its own
  run, as in training (:func:`loongforge_vlm.data.dataset.video_runs`);
- images go where the user's text holds ``<image>`` placeholders (``{"type": "image"}`` parts of a chat message) and
  videos where it holds ``<video>``, else all images then all videos before the text of the last user turn, the
  way the data records read them (:func:`loongforge_vlm.data.records.content_text`); then the prompt is rendered
  (the chat template in chat mode);
- each marker's single image (video) token is repeated once per feature (:func:`loongforge_vlm.data.tokens.
  expand_vision_tokens`), with the model's own vision token ids (so any tokenizer whose vocabulary the model
  shares works, a Hugging Face InternVL one as well as a Qwen one or ``byte-vision``);
- an M-RoPE model's positions and rope deltas come from :func:`loongforge_vlm.model.position_ids.
  mrope_position_ids` (Qwen2.5-VL's videos spaced by ``second_per_grid_ts``): after the prompt, a new token sits at
  its index plus the delta, as in transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from loongforge.data.sft import ChatSample
from loongforge.errors import LoongForgeError
from loongforge.models.media import MediaPrompts, MediaRequest
from PIL import Image, UnidentifiedImageError

from loongforge_vlm.data.dataset import SampleProblem, video_runs
from loongforge_vlm.data.processor import NORMALIZATIONS, ImageProcessor, VisionProcessor
from loongforge_vlm.data.records import RecordError, content_text
from loongforge_vlm.data.sources import IMAGE_EXTENSIONS
from loongforge_vlm.data.tokens import IMAGE_MARKER, VIDEO_MARKER, MarkerTokenizer, VisionTokenIds, expand_vision_tokens
from loongforge_vlm.data.video import FrameSampling, SampledVideo, VideoError, load_video
from loongforge_vlm.model.position_ids import mrope_position_ids

#: The processor settings file transformers writes beside a model.
PREPROCESSOR_CONFIG = "preprocessor_config.json"


def media_prompts(flavor: Any, request: MediaRequest) -> MediaPrompts:
    """The prompts of ``request`` with its images and videos, ready for ``flavor``'s model (see the module
    docstring)."""
    processor = _processor(flavor, request.model_dir)
    paths = request.files.get("image", ())
    images = [processor.for_sample(len(paths)).image(read_image(path)) for path in paths]
    sampled = [read_video(path, processor) for path in request.files.get("video", ())]
    videos = [processor.video(video.frames) for video in sampled]
    image_counts = [processor.num_tokens(grid) for _, grid in images]
    vision = _token_ids(flavor)
    marker_tokenizer = MarkerTokenizer(request.tokenizer, vision)
    texts, ids = [], []
    for number, prompt in enumerate(request.prompts, 1):
        where = f"prompt {number}"
        messages = _placed(prompt, len(images), len(videos), where)
        try:
            messages, video_counts = video_runs(messages, processor, sampled)
        except SampleProblem as problem:
            raise LoongForgeError(f"video file {problem.where}: {problem.detail}") from None
        text = request.render(messages[0]["content"] if isinstance(prompt, str) else messages)
        encoded = np.asarray(marker_tokenizer.encode(text), dtype=np.int64)
        sample = ChatSample(encoded, np.zeros(len(encoded), dtype=bool))
        texts.append(text)
        ids.append(expand_vision_tokens(sample, vision, image_counts, video_counts, where).ids.tolist())
    per_prompt = _inputs(images, videos, sampled)
    inputs: dict[str, Any] = {key: torch.cat([value] * len(ids)) for key, value in per_prompt.items()}
    inputs["media_columns"] = max(map(len, ids))  # the left-padded prompts; what the model writes after is text
    if not flavor.uses_mrope:
        return MediaPrompts(texts, ids, inputs)
    positions, offsets = [], []
    for row in ids:
        prompt_positions, delta = mrope_position_ids(
            torch.tensor([row]), spatial_merge_size=flavor.spatial_merge_size, image_token_id=flavor.image_token_id,
            video_token_id=flavor.video_token_id, image_grid_thw=per_prompt.get("image_grid_thw"),
            video_grid_thw=per_prompt.get("video_grid_thw"), second_per_grid_ts=per_prompt.get("second_per_grid_ts"),
            tokens_per_second=flavor.tokens_per_second, timestamped_videos=flavor.timestamped_videos)
        positions.append(prompt_positions[:, 0])
        offsets.append(int(delta))
    return MediaPrompts(texts, ids, inputs, positions, offsets)


Processed = list[tuple[np.ndarray, tuple[int, int, int]]]


def _inputs(images: Processed, videos: Processed, sampled: list[SampledVideo]) -> dict[str, torch.Tensor]:
    """One prompt's forward inputs for its images and videos (only the kinds it has)."""
    inputs: dict[str, torch.Tensor] = {}
    if images:
        inputs["pixel_values"] = torch.cat([torch.from_numpy(pixels) for pixels, _ in images])
        inputs["image_grid_thw"] = torch.tensor([grid for _, grid in images], dtype=torch.long)
    if videos:
        inputs["pixel_values_videos"] = torch.cat([torch.from_numpy(pixels) for pixels, _ in videos])
        inputs["video_grid_thw"] = torch.tensor([grid for _, grid in videos], dtype=torch.long)
        inputs["second_per_grid_ts"] = torch.tensor([video.seconds_per_patch for video in sampled])
    return inputs


def read_image(path: Path) -> Image.Image:
    """The decoded image at ``path``; an unreadable or non-image file is one line naming it."""
    try:
        with Image.open(path) as image:
            image.load()
            return image.copy()
    except (OSError, UnidentifiedImageError) as exc:
        raise LoongForgeError(f"image file {path}: cannot be read as an image ({exc})") from None


def read_video(path: Path, processor: ImageProcessor) -> SampledVideo:
    """The video at ``path`` (a video file or a directory of frames) decoded and sampled by the processor's rule at
    the records' default rate; what cannot be a video is one line naming the file."""
    if not processor.supports_video:
        raise LoongForgeError(f"video file {path}: this model's vision encoder takes images only")
    sampling = FrameSampling(rule=getattr(processor, "frame_sampling", "qwen2"))
    try:
        return load_video(str(path), _read_bytes, lambda name: (name, read_image(Path(name))), _frame_names,
                          sampling, getattr(processor, "temporal_patch_size", 1))
    except VideoError as exc:
        raise LoongForgeError(f"video file {exc.where}: {exc.reason}") from None


def _read_bytes(name: str) -> tuple[str, bytes]:
    try:
        return name, Path(name).read_bytes()
    except OSError as exc:
        raise VideoError(name, f"cannot be read ({type(exc).__name__})") from None


def _frame_names(name: str) -> list[str] | None:
    """The frame images of a directory in name order (``None``: not a directory)."""
    folder = Path(name)
    if not folder.is_dir():
        return None
    return [str(p) for p in sorted(folder.iterdir()) if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS]


def _placed(prompt: Any, images: int, videos: int, where: str) -> list[dict[str, Any]]:
    """``prompt`` (text or chat messages) as messages with one marker per image and video: at its ``<image>`` /
    ``<video>`` placeholders (parts in a message), else all images then all videos before the text of the last user
    turn."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    turns = [index for index, message in enumerate(messages) if message.get("role") == "user"]
    if not turns:
        raise LoongForgeError(f"{where}: has no user turn to put the images and videos in")
    for index, message in enumerate(messages):
        try:
            message["content"] = content_text(message.get("content"), index, [], [])
        except RecordError as exc:
            raise LoongForgeError(f"{where}: {exc}") from None
    placed = [sum(message["content"].count(marker) for message in messages) for marker in (IMAGE_MARKER, VIDEO_MARKER)]
    if placed == [0, 0]:
        messages[turns[-1]]["content"] = IMAGE_MARKER * images + VIDEO_MARKER * videos + messages[turns[-1]]["content"]
        return messages
    for kind, count, given in (("image", placed[0], images), ("video", placed[1], videos)):
        if count != given:
            raise LoongForgeError(f"{where}: holds {count} <{kind}> placeholder(s) for {given} {kind} file(s); give "
                                  f"one --{kind} per placeholder, or no placeholders to put all files before the text")
    return messages


def _token_ids(flavor: Any) -> VisionTokenIds:
    """The model's own marker ids: start, image, end, video; -1 for one it has none of (no video token; no start/end
    markers: LLaVA-OneVision's image tokens stand bare in the text)."""
    start, end, video = (-1 if i is None else i for i in (flavor.vision_start_token_id, flavor.vision_end_token_id,
                                                          flavor.video_token_id))
    return VisionTokenIds(start, end, flavor.image_token_id, video)


def _processor(flavor: Any, model_dir: Path | None) -> ImageProcessor:
    """The encoder's processor, with the pixel bounds and normalisation of ``model_dir``'s preprocessor config for
    a Qwen ViT (a config that disagrees with the encoder's patching is one line naming the file)."""
    from loongforge_vlm.data.kind import processor_for_vlm

    path = None if model_dir is None else model_dir / PREPROCESSOR_CONFIG
    processor = processor_for_vlm(flavor)
    if path is None or not path.is_file() or not isinstance(processor, VisionProcessor):
        return processor
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise LoongForgeError(f"{path}: not a preprocessor config ({exc})") from None
    for key, expected in (("patch_size", processor.patch_size), ("merge_size", processor.merge_size),
                          ("temporal_patch_size", processor.temporal_patch_size)):
        if config.get(key, expected) != expected:
            raise LoongForgeError(f"{path}: {key} {config[key]} differs from the model's vision encoder ({expected})")
    size = config.get("size") or {}
    settings = {"min_pixels": config.get("min_pixels", size.get("shortest_edge", processor.min_pixels)),
                "max_pixels": config.get("max_pixels", size.get("longest_edge", processor.max_pixels))}
    if "image_mean" in config or "image_std" in config:
        wanted = (list(config.get("image_mean", [])), list(config.get("image_std", [])))
        names = [name for name, known in NORMALIZATIONS.items()
                 if all(len(a) == len(b) and np.allclose(a, b, rtol=0, atol=1e-7)
                        for a, b in zip(known, wanted, strict=True))]
        if not names:
            raise LoongForgeError(f"{path}: image_mean/image_std {wanted} is none of the known normalisations "
                                  f"({', '.join(NORMALIZATIONS)})")
        settings["normalization"] = names[0]
    return processor_for_vlm(flavor, **settings)
