"""Synthetic shapes: small rendered images with questions about colour, shape and count, so VLM tests and the
quickstart train on something learnable without downloading anything.

Each image shows 1-4 flat shapes (circle, square, triangle) in palette colours on a light background, one per
quadrant with at least two background pixels between them, drawn without anti-aliasing: every pixel is
either the background or exactly one palette colour, so answers can be re-checked from the pixels. Questions:

- ``colour``: all shapes share one colour ("What colour is the shape?" -> ``red``);
- ``shape``: all shapes share one kind ("What shape is it?" -> ``circle``);
- ``count``: any mix ("How many shapes are there?" -> ``3``).

Sample ``i`` is drawn from its own generator seeded with ``(seed, i)``, so it is the same whatever ``--count``
is, and whether it lands in the held-out split is decided by that generator too. Usage::

    loongforge make-data shapes OUT_DIR --count 2000 --seed 0           # write (progress per image)
    loongforge make-data shapes OUT_DIR --format wds --shard-size 500   # write WebDataset shards
    loongforge make-data shapes OUT_DIR --validate                      # check an existing set

With ``--format jsonl`` (the default) ``OUT_DIR`` then holds ``img-000001.png ...``, ``train.jsonl``,
``heldout.jsonl`` (one conversation per line, image paths relative to the file) and ``meta.json`` (the
generation arguments and the vocabulary). With ``--format wds`` the same samples go into uncompressed tar
shards ``train-000000.tar ...`` / ``heldout-000000.tar ...`` (``img-000001.json`` holding the record, whose
``image`` names the member extension ``png``, and ``img-000001.png``), listed in ``meta.json``; the shards'
bytes depend only on the arguments (fixed member times and owners).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from loongforge.data.errors import DataError
from PIL import Image, ImageDraw

#: Palette colours (name -> RGB), far apart so that no colour is mistaken for another.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 160, 50), "blue": (30, 70, 220), "yellow": (235, 200, 20),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
KINDS: tuple[str, ...] = ("colour", "shape", "count")
BACKGROUND: tuple[int, int, int] = (245, 245, 245)
MAX_SHAPES = 4
SPLITS: tuple[str, ...] = ("train", "heldout")
LAYOUTS: tuple[str, ...] = ("jsonl", "wds")
IMAGE_TOKEN = "<image>"
_FORMAT_VERSION = 1


@dataclass(frozen=True)
class Shape:
    """One drawn shape; ``box`` is ``(left, top, right, bottom)`` in pixels, inclusive."""

    shape: str
    colour: str
    box: tuple[int, int, int, int]


@dataclass(frozen=True)
class Sample:
    index: int
    split: str
    kind: str
    shapes: tuple[Shape, ...]
    question: str
    answer: str

    @property
    def image_name(self) -> str:
        return f"img-{self.index:06d}.png"

    def record(self) -> dict[str, Any]:
        """The jsonl line: the conversation, plus the question kind and the drawn shapes for per-kind scoring."""
        return {
            "image": self.image_name,
            "messages": [{"role": "user", "content": f"{IMAGE_TOKEN}\n{self.question}"},
                         {"role": "assistant", "content": self.answer}],
            "kind": self.kind,
            "shapes": [{"shape": s.shape, "colour": s.colour, "box": list(s.box)} for s in self.shapes],
        }


def _place(rng: np.random.Generator, size: int, quadrant: int) -> tuple[int, int, int, int]:
    """A square box inside one quadrant, at least one pixel from its edges (so two pixels between shapes)."""
    cell = size // 2
    side = int(rng.integers(cell // 2, cell - 1))
    left = (quadrant % 2) * cell + 1 + int(rng.integers(0, cell - 1 - side))
    top = (quadrant // 2) * cell + 1 + int(rng.integers(0, cell - 1 - side))
    return left, top, left + side - 1, top + side - 1


def make_sample(seed: int, index: int, *, size: int = 32, heldout_fraction: float = 0.1) -> Sample:
    """Sample ``index`` of the set generated with ``seed`` (independent of how many others there are)."""
    rng = np.random.default_rng([seed, index])
    split = SPLITS[1] if rng.random() < heldout_fraction else SPLITS[0]
    kind = KINDS[int(rng.integers(len(KINDS)))]
    count = int(rng.integers(1, MAX_SHAPES + 1))
    colour_names, shape_names = list(COLOURS), list(SHAPES)
    shared_colour = colour_names[int(rng.integers(len(colour_names)))]
    shared_shape = shape_names[int(rng.integers(len(shape_names)))]
    shapes = []
    for quadrant in rng.permutation(MAX_SHAPES)[:count]:
        shape = shared_shape if kind == "shape" else shape_names[int(rng.integers(len(shape_names)))]
        colour = shared_colour if kind == "colour" else colour_names[int(rng.integers(len(colour_names)))]
        shapes.append(Shape(shape, colour, _place(rng, size, int(quadrant))))
    plural = count > 1
    question, answer = {
        "colour": ("What colour are the shapes?" if plural else "What colour is the shape?", shared_colour),
        "shape": ("What shape are they?" if plural else "What shape is it?", shared_shape),
        "count": ("How many shapes are there?", str(count)),
    }[kind]
    return Sample(index, split, kind, tuple(shapes), question, answer)


def render(sample: Sample, size: int = 32) -> Image.Image:
    """The RGB image of a sample, drawn without anti-aliasing (every pixel is background or a palette colour)."""
    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for shape in sample.shapes:
        left, top, right, bottom = shape.box
        fill = COLOURS[shape.colour]
        if shape.shape == "circle":
            draw.ellipse(shape.box, fill=fill)
        elif shape.shape == "square":
            draw.rectangle(shape.box, fill=fill)
        else:
            draw.polygon([((left + right) / 2, top), (left, bottom), (right, bottom)], fill=fill)
    return image


def check_arguments(count: int, *, size: int, heldout_fraction: float, layout: str, shard_size: int) -> None:
    """Refuse arguments :func:`generate` cannot draw a set with, in one line naming the option."""
    if layout not in LAYOUTS:
        raise DataError(f"shapes: --format must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if shard_size <= 0:
        raise DataError(f"shapes: --shard-size must be positive, got {shard_size}")
    if count <= 0:
        raise DataError(f"shapes: --count must be positive, got {count}")
    if size < 16 or size % 2:
        raise DataError(f"shapes: --size must be even and >= 16 (four quadrants of shapes), got {size}")
    if not 0.0 <= heldout_fraction < 1.0:
        raise DataError(f"shapes: --heldout-fraction must lie in [0, 1), got {heldout_fraction}")


def _no_report(name: str) -> None:
    """The ``on_image`` of a generation nobody watches (a dataset made on first use)."""


def generate(out_dir: str | Path, count: int, seed: int, *, size: int = 32, heldout_fraction: float = 0.1,
             layout: str = "jsonl", shard_size: int = 1000,
             on_image: Callable[[str], None] = _no_report) -> dict[str, int]:
    """Write ``count`` samples (images + split jsonl files, or tar shards; ``meta.json``); returns split sizes.

    ``on_image(name)`` is called once each image is written (a progress display counts them)."""
    check_arguments(count, size=size, heldout_fraction=heldout_fraction, layout=layout, shard_size=shard_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    samples: dict[str, list[Sample]] = {split: [] for split in SPLITS}
    for index in range(1, count + 1):
        sample = make_sample(seed, index, size=size, heldout_fraction=heldout_fraction)
        samples[sample.split].append(sample)
    sizes = {split: len(split_samples) for split, split_samples in samples.items()}
    meta = {"format": "loongforge-vlm shapes", "version": _FORMAT_VERSION, "seed": seed, "count": count,
            "size": size, "heldout_fraction": heldout_fraction, "splits": sizes, "colours": COLOURS,
            "shapes": list(SHAPES), "kinds": list(KINDS), "layout": layout}
    if layout == "jsonl":
        for split, split_samples in samples.items():
            for sample in split_samples:
                render(sample, size).save(out / sample.image_name)
                on_image(sample.image_name)
            (out / f"{split}.jsonl").write_text("".join(json.dumps(s.record()) + "\n" for s in split_samples))
    else:
        meta["shards"] = {split: _write_shards(out, split, split_samples, size, shard_size, on_image)
                          for split, split_samples in samples.items()}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return sizes


def _write_shards(out: Path, split: str, samples: list[Sample], size: int, shard_size: int,
                  on_image: Callable[[str], None]) -> list[str]:
    """WebDataset shards of one split (``key.json`` + ``key.png`` per sample); returns the shard file names."""
    names = []
    for first in range(0, len(samples), shard_size):
        name = f"{split}-{first // shard_size:06d}.tar"
        with tarfile.open(out / name, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for sample in samples[first: first + shard_size]:
                key = Path(sample.image_name).stem
                image = io.BytesIO()
                render(sample, size).save(image, format="PNG")
                record = {**sample.record(), "image": "png"}
                _add_member(tar, f"{key}.json", json.dumps(record).encode())
                _add_member(tar, f"{key}.png", image.getvalue())
                on_image(f"{name}:{key}.png")
        names.append(name)
    return names


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """A member with fixed metadata, so the shard's bytes depend on its contents only."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tar.addfile(info, io.BytesIO(data))


def _check_record(record: Any) -> str | None:
    """What is wrong with one jsonl record's structure, or None."""
    if not isinstance(record, dict) or not isinstance(record.get("image"), str):
        return "has no 'image' string"
    messages = record.get("messages")
    if (not isinstance(messages, list) or len(messages) != 2
            or [m.get("role") if isinstance(m, dict) else None for m in messages] != ["user", "assistant"]):
        return "needs 'messages' = [user, assistant]"
    if not all(isinstance(m.get("content"), str) for m in messages):
        return "has a message whose 'content' is not a string"
    if messages[0]["content"].count(IMAGE_TOKEN) != 1:
        return f"user message must contain {IMAGE_TOKEN} exactly once"
    if not messages[1]["content"].strip():
        return "has an empty answer"
    return None


def _check_image(data: bytes | None, size: int | None) -> str | None:
    """What is wrong with one image file's bytes, or None (it must decode fully, as RGB of the set's size)."""
    if data is None:
        return "is missing"
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            mode, dims = image.mode, image.size
    except Exception as exc:  # Pillow raises many types for a damaged file; all mean the same here
        return f"cannot be decoded ({type(exc).__name__}: {exc})"
    if mode != "RGB":
        return f"is {mode}, expected RGB"
    if size is not None and dims != (size, size):
        return f"is {dims[0]}x{dims[1]}, expected {size}x{size}"
    return None


def validate(out_dir: str | Path) -> list[str]:
    """Every problem of a generated set, one line each naming the file (and the jsonl line); empty when sound.

    Checks that ``meta.json`` and both split files (or the shards it lists) exist, each record is a well-formed
    conversation, and each image it names exists and decodes fully as an RGB image of the recorded size
    (truncated or corrupt PNGs).
    """
    out = Path(out_dir)
    problems: list[str] = []
    meta: dict[str, Any] = {}
    try:
        meta = json.loads((out / "meta.json").read_text())
        size = meta["size"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        problems.append(f"{out / 'meta.json'}: unreadable ({type(exc).__name__}: {exc})")
        size = None
    if meta.get("layout") == "wds":
        return problems + _validate_shards(out, meta.get("shards", {}), size)
    for split in SPLITS:
        jsonl = out / f"{split}.jsonl"
        if not jsonl.is_file():
            problems.append(f"{jsonl}: missing")
            continue
        for number, line in enumerate(jsonl.read_text().splitlines(), start=1):
            where = f"{jsonl}:{number}"
            try:
                record = json.loads(line)
            except ValueError as exc:
                problems.append(f"{where}: not JSON ({exc})")
                continue
            wrong = _check_record(record)
            if wrong:
                problems.append(f"{where}: record {wrong}")
                continue
            image = out / record["image"]
            wrong = _check_image(image.read_bytes() if image.is_file() else None, size)
            if wrong:
                problems.append(f"{out / record['image']} (from {where}): {wrong}")
    return problems


def _validate_shards(out: Path, shards: dict[str, list[str]], size: int | None) -> list[str]:
    """The checks of :func:`validate` for a WebDataset layout, read with the plugin's shard reader."""
    from loongforge_vlm.data.records import RecordError
    from loongforge_vlm.data.sources import MediaError, WebDatasetSource

    problems: list[str] = []
    for split in SPLITS:
        names = shards.get(split, [])
        missing = [name for name in names if not (out / name).is_file()]
        problems += [f"{out / name}: missing" for name in missing]
        present = [str(out / name) for name in names if name not in missing]
        if not present:
            continue
        source = WebDatasetSource(present)
        for index in range(len(source)):
            where = source.where(index)
            try:
                record = source.raw(index)
            except RecordError as exc:
                problems.append(f"{where}: {exc}")
                continue
            wrong = _check_record(record)
            if wrong:
                problems.append(f"{where}: record {wrong}")
                continue
            try:
                image_where, data = source.media(index, record["image"])
            except MediaError as exc:
                image_where, data = exc.where, None
            wrong = _check_image(data, size)
            if wrong:
                problems.append(f"{image_where}: {wrong}")
    return problems


def make_data(args: argparse.Namespace) -> int:
    """``loongforge make-data shapes`` (options: :func:`loongforge_vlm.commands.configure_shapes`): write the set
    with a progress display per image, then validate it; 1 when it has problems (each printed on stderr)."""
    from loongforge.progress import job_progress

    if not args.validate:
        check_arguments(args.count, size=args.size, heldout_fraction=args.heldout_fraction, layout=args.format,
                        shard_size=args.shard_size)
        with job_progress(f"drawing shapes into {args.out_dir}", total=args.count, unit="image",
                          stderr=True) as progress:
            sizes = generate(args.out_dir, args.count, args.seed, size=args.size,
                             heldout_fraction=args.heldout_fraction, layout=args.format, shard_size=args.shard_size,
                             on_image=lambda name: progress.advance(note=name))
        print(f"wrote {sizes['train']} train + {sizes['heldout']} held-out samples to {args.out_dir}")
    problems = validate(args.out_dir)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print(f"{len(problems)} problem(s) in {args.out_dir}", file=sys.stderr)
        return 1
    print(f"{args.out_dir}: valid")
    return 0


if __name__ == "__main__":  # the old front-end: say where it went rather than exit 0 having done nothing
    raise SystemExit("python -m loongforge_vlm.data.shapes is now `loongforge make-data shapes OUT_DIR ...`")
