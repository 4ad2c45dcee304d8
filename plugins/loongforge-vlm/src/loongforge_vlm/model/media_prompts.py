"""Prompts with images for ``loongforge generate --image``: the VLM family's side of core's media contract.

Core hands over the prompts, the image paths and how to render a prompt (:class:`loongforge.models.media.
MediaRequest`); this module answers what the model needs (:class:`loongforge.models.media.MediaPrompts`), with the
same pieces training uses, so a prompt here is laid out exactly like a training sample:

- each image is read with Pillow and processed by the encoder's own processor
  (:func:`loongforge_vlm.data.kind.processor_for_vlm`), with the pixel bounds and normalisation of the
  ``preprocessor_config.json`` beside the model when there is one (a Hugging Face directory, a converted
  checkpoint's ``hf_source``), as transformers' processor reads them;
- every image goes where the user's text holds an ``<image>`` placeholder (or a ``{"type": "image"}`` part of a
  chat message), else all of them before the text of the last user turn, the way the data records read them
  (:func:`loongforge_vlm.data.records.content_text`); then the prompt is rendered (the chat template in chat mode);
- the marker's single image token is repeated once per feature (:func:`loongforge_vlm.data.tokens.
  expand_vision_tokens`), with the model's own vision token ids (so any tokenizer whose vocabulary the model
  shares works, a Hugging Face InternVL one as well as a Qwen one or ``byte-vision``);
- an M-RoPE model's positions and rope deltas come from :func:`loongforge_vlm.model.position_ids.
  mrope_position_ids`: after the prompt, a new token sits at its index plus the delta, as in transformers.
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

from loongforge_vlm.data.processor import NORMALIZATIONS, ImageProcessor, VisionProcessor
from loongforge_vlm.data.records import RecordError, content_text
from loongforge_vlm.data.tokens import IMAGE_MARKER, MarkerTokenizer, VisionTokenIds, expand_vision_tokens
from loongforge_vlm.model.position_ids import mrope_position_ids

#: The processor settings file transformers writes beside a model.
PREPROCESSOR_CONFIG = "preprocessor_config.json"


def media_prompts(flavor: Any, request: MediaRequest) -> MediaPrompts:
    """The prompts of ``request`` with its images, ready for ``flavor``'s model (see the module docstring)."""
    paths = list(request.files.get("image", ()))
    processor = _processor(flavor, request.model_dir)
    pixels, grids = [], []
    for path in paths:
        image_pixels, grid = processor.image(read_image(path))
        pixels.append(torch.from_numpy(image_pixels))
        grids.append(grid)
    counts = [processor.num_tokens(grid) for grid in grids]
    vision = _token_ids(flavor)
    marker_tokenizer = MarkerTokenizer(request.tokenizer, vision)
    texts, ids = [], []
    for number, prompt in enumerate(request.prompts, 1):
        text = request.render(_placed(prompt, len(paths), f"prompt {number}"))
        encoded = np.asarray(marker_tokenizer.encode(text), dtype=np.int64)
        sample = ChatSample(encoded, np.zeros(len(encoded), dtype=bool))
        texts.append(text)
        ids.append(expand_vision_tokens(sample, vision, counts, [], f"prompt {number}").ids.tolist())
    per_prompt = {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.tensor(grids, dtype=torch.long)}
    inputs: dict[str, Any] = {key: torch.cat([value] * len(ids)) for key, value in per_prompt.items()}
    inputs["media_columns"] = max(map(len, ids))  # the left-padded prompts; what the model writes after is text
    if not flavor.uses_mrope:
        return MediaPrompts(texts, ids, inputs)
    positions, offsets = [], []
    for row in ids:
        prompt_positions, delta = mrope_position_ids(
            torch.tensor([row]), spatial_merge_size=flavor.spatial_merge_size, image_token_id=flavor.image_token_id,
            video_token_id=flavor.video_token_id, image_grid_thw=per_prompt["image_grid_thw"])
        positions.append(prompt_positions[:, 0])
        offsets.append(int(delta))
    return MediaPrompts(texts, ids, inputs, positions, offsets)


def read_image(path: Path) -> Image.Image:
    """The decoded image at ``path``; an unreadable or non-image file is one line naming it."""
    try:
        with Image.open(path) as image:
            image.load()
            return image.copy()
    except (OSError, UnidentifiedImageError) as exc:
        raise LoongForgeError(f"image file {path}: cannot be read as an image ({exc})") from None


def _placed(prompt: Any, images: int, where: str) -> Any:
    """``prompt`` (text or chat messages) with one image marker per image: at its ``<image>`` placeholders (image
    parts in a message), else all before the text of the last user turn."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    turns = [index for index, message in enumerate(messages) if message.get("role") == "user"]
    if not turns:
        raise LoongForgeError(f"{where}: has no user turn to put the images in")
    for index, message in enumerate(messages):
        try:
            message["content"] = content_text(message.get("content"), index, [], [])
        except RecordError as exc:
            raise LoongForgeError(f"{where}: {exc}") from None
    placed = sum(message["content"].count(IMAGE_MARKER) for message in messages)
    if placed == 0:
        messages[turns[-1]]["content"] = IMAGE_MARKER * images + messages[turns[-1]]["content"]
    elif placed != images:
        raise LoongForgeError(f"{where}: holds {placed} <image> placeholder(s) for {images} image file(s); give one "
                              "--image per placeholder, or none to put them all before the text")
    return messages[0]["content"] if isinstance(prompt, str) else messages


def _token_ids(flavor: Any) -> VisionTokenIds:
    """The model's own marker ids: start, image, end (a model without a video token never sees its id, -1)."""
    if flavor.vision_start_token_id is None or flavor.vision_end_token_id is None:
        raise LoongForgeError("this vlm flavor names no vision start/end token ids, which prompts with images need")
    video = -1 if flavor.video_token_id is None else flavor.video_token_id
    return VisionTokenIds(flavor.vision_start_token_id, flavor.vision_end_token_id, flavor.image_token_id, video)


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
