"""One image-text record (a jsonl line or a WebDataset sample's json) -> messages with markers + media names.

Accepted shapes, so common VLM data loads as is:

- the conversation under ``messages`` or ``conversations``; each turn ``{"role", "content"}`` or LLaVA's
  ``{"from": "human"|"gpt"|"system", "value"}``;
- ``content`` a string, where ``<image>`` / ``<video>`` stand for the next image / video, or a list of parts
  ``{"type": "text", "text"}``, ``{"type": "image"}``, ``{"type": "video"}`` (a part may name its file under
  ``image`` / ``video`` when the record has no top-level list);
- media under ``images`` (list) or ``image`` (one name), videos under ``videos``: each video a list of frame
  image names, sampled at ``fps`` frames per second (default 2, the rate Qwen2-VL samples videos at). Names
  are resolved by the source (relative to the jsonl, or a member of the tar sample).

The record must have at least one assistant turn; whether markers and media agree is checked later, per sample,
so a mismatch is counted rather than fatal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loongforge.data.chat_template import Message

from loongforge_vlm.data.tokens import IMAGE_MARKER, VIDEO_MARKER

_ROLES = {"system": "system", "user": "user", "assistant": "assistant", "human": "user", "gpt": "assistant"}
_TEXT_PLACEHOLDERS = {"<image>": IMAGE_MARKER, "<video>": VIDEO_MARKER}
DEFAULT_FPS = 2.0


class RecordError(ValueError):
    """A record that cannot be read as a conversation (the message says why, without the location)."""


@dataclass(frozen=True)
class Record:
    """A conversation with one marker per image/video, and the names of its images and videos' frames."""

    messages: list[Message]
    images: list[str]
    videos: list[list[str]]
    fps: float = DEFAULT_FPS


def parse_record(raw: Any) -> Record:
    """Normalise one raw record (see the module docstring); raises :class:`RecordError`."""
    if not isinstance(raw, dict):
        raise RecordError("record is not a JSON object")
    turns = raw.get("messages", raw.get("conversations"))
    if not isinstance(turns, list) or not turns:
        raise RecordError("needs a non-empty 'messages' (or 'conversations') list")
    images, videos, fps = parse_media(raw)
    part_images: list[str] = []
    part_videos: list[list[str]] = []
    messages = []
    for index, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RecordError(f"turn {index} is not an object")
        role = _ROLES.get(turn.get("role", turn.get("from")))
        if role is None:
            raise RecordError(f"turn {index} needs a role of {', '.join(_ROLES)}")
        content = turn.get("content", turn.get("value"))
        messages.append({"role": role, "content": content_text(content, index, part_images, part_videos)})
    if not any(m["role"] == "assistant" for m in messages):
        raise RecordError("has no assistant turn (nothing to train on)")
    return Record(messages, images or part_images, videos or part_videos, fps)


def parse_media(raw: dict[str, Any]) -> tuple[list[str], list[list[str]], float]:
    """The record's top-level media: image names (``images`` or ``image``), videos' frame names and ``fps``."""
    images = _names(raw.get("images", raw.get("image", [])), "images")
    videos = raw.get("videos", [])
    if not isinstance(videos, list) or not all(isinstance(v, list) and v for v in videos):
        raise RecordError("'videos' must be a list of non-empty frame lists")
    fps = raw.get("fps", DEFAULT_FPS)
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0:
        raise RecordError(f"'fps' must be a positive number, got {fps!r}")
    return images, [_names(v, "video frames") for v in videos], float(fps)


def _names(value: Any, what: str) -> list[str]:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise RecordError(f"'{what}' must be a file name or a list of file names")
    return list(names)


def content_text(content: Any, index: int, images: list[str], videos: list[list[str]]) -> str:
    """Turn ``index``'s text with a marker per image/video (``<image>``/``<video>`` placeholders or parts); file
    names given inside parts are appended to ``images``/``videos``."""
    if isinstance(content, str):
        for placeholder, marker in _TEXT_PLACEHOLDERS.items():
            content = content.replace(placeholder, marker)
        return content
    if not isinstance(content, list):
        raise RecordError(f"turn {index} needs 'content' as a string or a list of parts")
    text = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        elif kind == "image":
            text.append(IMAGE_MARKER)
            if isinstance(part.get("image"), str):
                images.append(part["image"])
        elif kind == "video":
            text.append(VIDEO_MARKER)
            if isinstance(part.get("video"), list):
                videos.append(_names(part["video"], "video frames"))
        else:
            raise RecordError(f"turn {index} has a part that is not text, image or video: {part!r:.80}")
    return "".join(text)
