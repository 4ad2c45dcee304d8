"""Generated image preference pairs about the shapes images: what ``loongforge make-data shapes-pairs OUT`` writes
and what ``data.dataset: vlm-shapes-pairs`` generates on first use (``configs/vlm-dpo-shapes.yaml``).

Why these pairs: ``configs/vlm-shapes.yaml`` teaches a tiny VLM the shapes questions (colour, shape, count) by SFT,
and DPO should teach it to prefer the right answer. Pair ``i`` is shapes sample ``i`` of the seed
(:func:`loongforge_vlm.data.shapes.make_sample`: its image, question and right answer, the chosen response) and a
wrong answer of the same kind, the rejected one: another palette colour, another shape, another count. Right and
wrong answers are drawn from the same values, so no answer is preferred without looking at the image: held-out
preference accuracy above 50% means the model reads the image. The default seed (1) draws other images than the SFT
recipe's set (seed 0).

The pairs come in three forms, in turn, so that every form of the line format is written and read: the prompt a
string with an ``<image>`` placeholder, a string without one (the image goes first), and chat messages with an image
part (a list of ``{"type": ...}`` parts; the responses as assistant messages). All three render the same tokens.
``OUT`` is the ``.jsonl`` file; the images are written beside it (``pair-000001.png ...``), named relative to it.
The output is a pure function of ``(count, seed)``.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

from loongforge.data.generated_jsonl import add_generator_arguments, run_generator, write_jsonl

#: ``make-data shapes-pairs``' and ``vlm-shapes-pairs``' defaults: 1200 pairs of seed 1 (not the SFT set's seed 0).
DEFAULT_COUNT, DEFAULT_SEED = 1200, 1
#: The dataset kind that reads what the generator writes.
DATASET = "image-preference"
#: The pairs' file in the folder ``vlm-shapes-pairs`` generates.
FILE = "pairs.jsonl"


def wrong_answer(kind: str, right: str, rng: random.Random) -> str:
    """Another answer to a question of ``kind`` than ``right``, drawn uniformly from the other values."""
    from loongforge_vlm.data import shapes

    values = {"colour": list(shapes.COLOURS), "shape": list(shapes.SHAPES),
              "count": [str(n) for n in range(1, shapes.MAX_SHAPES + 1)]}[kind]
    return rng.choice([value for value in values if value != right])


def pair_record(index: int, image: str, question: str, chosen: str, rejected: str) -> dict[str, Any]:
    """The jsonl line of one pair, in the form ``index`` picks (see the module docstring)."""
    form = index % 3
    if form == 0:
        return {"image": image, "prompt": f"<image>\n{question}", "chosen": chosen, "rejected": rejected}
    if form == 1:
        return {"image": image, "prompt": question, "chosen": chosen, "rejected": rejected}
    parts = [{"type": "image", "image": image}, {"type": "text", "text": f"\n{question}"}]
    return {"prompt": [{"role": "user", "content": parts}],
            "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}]}


def write(out: str | Path, count: int = DEFAULT_COUNT, seed: int = DEFAULT_SEED, *, size: int = 32) -> Path:
    """Write ``count`` pairs to the ``.jsonl`` file ``out`` and their images beside it; return its path."""
    from loongforge_vlm.data import shapes

    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    records = []
    for index in range(1, count + 1):
        sample = shapes.make_sample(seed, index, size=size, heldout_fraction=0.0)
        name = image_name(index)
        shapes.render(sample, size).save(path.parent / name)
        rejected = wrong_answer(sample.kind, sample.answer, random.Random(f"{seed}:{index}"))
        records.append({**pair_record(index, name, sample.question, sample.answer, rejected), "kind": sample.kind})
    return write_jsonl(path, records)


def image_name(index: int) -> str:
    """The image file of pair ``index`` (from 1), beside the pairs' file."""
    return f"pair-{index:06d}.png"


def missing(folder: str | Path) -> list[str]:
    """What ``folder`` lacks of a generated set (``vlm-shapes-pairs``' cache): its pairs file, or the image of one
    of its lines; empty when complete."""
    path = Path(folder) / FILE
    if not path.is_file():
        return [f"{path}: missing"]
    lines = sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    return [f"{path.parent / image_name(i)}: missing" for i in range(1, lines + 1)
            if not (path.parent / image_name(i)).is_file()]


def configure(parser: argparse.ArgumentParser) -> None:
    """``loongforge make-data shapes-pairs``' arguments (torch-, numpy- and Pillow-free, as every generator's)."""
    add_generator_arguments(parser, unit="pairs", dataset=DATASET, count=DEFAULT_COUNT, seed=DEFAULT_SEED)


def run(args: argparse.Namespace) -> int:
    return run_generator(args, write, "image preference pairs (images beside them)")
