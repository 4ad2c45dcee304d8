"""One image-text record (a jsonl line or a WebDataset sample's json) -> messages with markers + media names.

Accepted shapes, so common VLM data loads as is:

- the conversation under ``messages`` or ``conversations``; each turn ``{"role", "content"}`` or LLaVA's
  ``{"from": "human"|"gpt"|"system", "value"}``;
- ``content`` a string, where ``<image>`` / ``<video>`` stand for the next image / video, or a list of parts
  ``{"type": "text", "text"}``, ``{"type": "image"}``, ``{"type": "video"}`` (a part may name its file under
  ``image`` / ``video`` when the record has no top-level list);
- media under ``images`` (list) or ``image`` (one name), videos under ``videos`` (list) or ``video`` (one). A
  video is a video file (``.gif``, or ``.mp4``/``.webm``/``.mkv``/``.mov``/``.avi`` when PyAV is installed),
  a directory of frame images (name order), or a list of frame image names. ``fps`` (default 2, the rate the
  Qwen processors sample at) is the rate frames are sampled from a file at, and the rate a frame list or
  directory was taken at; ``num_frames`` instead keeps that many evenly spaced frames
  (:mod:`loongforge_vlm.data.video`). Names are resolved by the source (relative to the jsonl, or a member of
  the tar sample).

The record must have at least one assistant turn; whether markers and media agree is checked later, per sample,
so a mismatch is counted rather than fatal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loongforge.data.chat_template import Message

from loongforge_vlm.data.tokens import IMAGE_MARKER, VIDEO_MARKER
from loongforge_vlm.data.video import DEFAULT_FPS, FrameSampling

#: A video: a file or frame directory name, or its frame names.
Video = str | tuple[str, ...]

_ROLES = {"system": "system", "user": "user", "assistant": "assistant", "human": "user", "gpt": "assistant"}
_TEXT_PLACEHOLDERS = {"<image>": IMAGE_MARKER, "<video>": VIDEO_MARKER}


class RecordError(ValueError):
    """A record that cannot be read as a conversation (the message says why, without the location)."""


@dataclass(frozen=True)
class Record:
    """A conversation with one marker per image/video, the names of its images and videos, and how its videos'
    frames are sampled."""

    messages: list[Message]
    images: list[str]
    videos: list[Video]
    sampling: FrameSampling = FrameSampling()


def parse_record(raw: Any) -> Record:
    """Normalise one raw record (see the module docstring); raises :class:`RecordError`."""
    if not isinstance(raw, dict):
        raise RecordError("record is not a JSON object")
    turns = raw.get("messages", raw.get("conversations"))
    if not isinstance(turns, list) or not turns:
        raise RecordError("needs a non-empty 'messages' (or 'conversations') list")
    images, videos, sampling = parse_media(raw)
    part_images: list[str] = []
    part_videos: list[Video] = []
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
    return Record(messages, images or part_images, videos or part_videos, sampling)


def parse_media(raw: dict[str, Any]) -> tuple[list[str], list[Video], FrameSampling]:
    """The record's top-level media: image names (``images`` or ``image``), videos (``videos`` or ``video``) and
    their frame sampling (``fps``, ``num_frames``)."""
    images = _names(raw.get("images", raw.get("image", [])), "images")
    videos = raw["videos"] if "videos" in raw else [raw["video"]] if "video" in raw else []
    if not isinstance(videos, list):
        raise RecordError("'videos' must be a list of videos (file names, directories or frame lists)")
    fps = raw.get("fps", DEFAULT_FPS)
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0:
        raise RecordError(f"'fps' must be a positive number, got {fps!r}")
    count = raw.get("num_frames")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise RecordError(f"'num_frames' must be a positive integer, got {count!r}")
    return images, [_video(v) for v in videos], FrameSampling(fps=float(fps), num_frames=count)


def _video(value: Any) -> Video:
    """One video: a file or directory name, or a non-empty list of frame names."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value:
        return tuple(_names(value, "video frames"))
    raise RecordError(f"a video must be a file name, a directory or a non-empty list of frame names, got {value!r:.80}")


def _names(value: Any, what: str) -> list[str]:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise RecordError(f"'{what}' must be a file name or a list of file names")
    return list(names)


def content_text(content: Any, index: int, images: list[str], videos: list[Video]) -> str:
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
            if part.get("video") is not None:
                videos.append(_video(part["video"]))
        else:
            raise RecordError(f"turn {index} has a part that is not text, image or video: {part!r:.80}")
    return "".join(text)
