"""Small builders for the image-text data tests: PNG bytes, jsonl sets with image files, tar shards."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
from loongforge_vlm.data.processor import VisionProcessor
from loongforge_vlm.data.tokens import VisionByteTokenizer
from PIL import Image

#: 28x28 .. 56x56 pixels: 1 to 4 LLM tokens per image, so rows stay short.
PROCESSOR = VisionProcessor(min_pixels=28 * 28, max_pixels=56 * 56)
TOKENIZER = VisionByteTokenizer()


def png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def write_jsonl(path: Path, lines: list[dict | str], files: dict[str, bytes]) -> Path:
    """``lines`` (records, or raw text for broken lines) to ``path``; ``files`` relative to its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (path.parent / name).parent.mkdir(parents=True, exist_ok=True)
        (path.parent / name).write_bytes(data)
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def ask(question: str, answer: str, images: int = 1) -> list[dict]:
    """A user turn with ``images`` image parts and a question, and the assistant's answer."""
    content = [{"type": "image"}] * images + [{"type": "text", "text": question}]
    return [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
