"""Answer held-out questions with a trained VLM checkpoint and score the answers: is it better than chance?

Each held-out conversation is cut before its reply; the model answers greedily (image included) until the
end-of-sequence token, and the answer counts as right when it equals the reference text exactly. For the
synthetic shapes set the questions are of three kinds (colour, shape, count), told apart by the reference
answer's vocabulary, and chance is a uniform guess within the kind (1/4, 1/3, 1/4). Usage::

    loongforge eval runs/vlm-shapes/checkpoints            # the shapes set's held-out split
    loongforge eval CKPT --data heldout.jsonl --limit 100  # any image-text jsonl/shards

Prints per-kind and overall accuracy next to chance, and writes ``eval.json`` beside the checkpoint. While it
runs, a progress display (:mod:`loongforge.progress`, on standard error) counts the questions answered and shows the
accuracy so far.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from loongforge.progress import job_progress

from loongforge_vlm.data import shapes

#: Question kind of a shapes answer, and the chance of a uniform guess within that kind.
_KIND_OF_ANSWER = {**{c: "colour" for c in shapes.COLOURS}, **{s: "shape" for s in shapes.SHAPES},
                   **{str(n): "count" for n in range(1, shapes.MAX_SHAPES + 1)}}
CHANCE = {"colour": 1 / len(shapes.COLOURS), "shape": 1 / len(shapes.SHAPES), "count": 1 / shapes.MAX_SHAPES}


@torch.no_grad()
def answer(model: Any, sample: Any, eos_id: int, max_tokens: int) -> list[int]:
    """Greedy reply ids to ``sample``'s prompt (its ids up to the first supervised one)."""
    prompt_end = int(sample.supervised.argmax())
    ids = torch.from_numpy(sample.ids[:prompt_end]).long()[None]
    vision = {}
    if len(sample.image_grid_thw):
        vision = {"pixel_values": torch.from_numpy(sample.pixel_values),
                  "image_grid_thw": torch.from_numpy(sample.image_grid_thw)}
    reply: list[int] = []
    for _ in range(max_tokens):
        logits = model(ids, torch.arange(ids.shape[1])[None], None, **vision)
        token = int(logits[0, -1].argmax())
        if token == eos_id:
            break
        reply.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return reply


def score(references: list[str], answers: list[str]) -> dict[str, Any]:
    """Accuracy per question kind and overall, with each kind's chance and the sample-weighted chance."""
    kinds = [_KIND_OF_ANSWER.get(ref, "other") for ref in references]
    result: dict[str, Any] = {}
    for kind in sorted(set(kinds)):
        picked = [a == r for a, r, k in zip(answers, references, kinds, strict=True) if k == kind]
        result[kind] = {"n": len(picked), "accuracy": sum(picked) / len(picked), "chance": CHANCE.get(kind)}
    result["overall"] = {
        "n": len(answers),
        "accuracy": sum(a == r for a, r in zip(answers, references, strict=True)) / max(1, len(answers)),
        "chance": sum(CHANCE.get(k, 0.0) for k in kinds) / max(1, len(kinds)),
    }
    return result


def evaluate(checkpoint: str | Path, *, data: list[str] | None = None, limit: int = 0,
             max_tokens: int = 8, trust_code: bool = False) -> dict[str, Any]:
    """Load ``checkpoint`` (TP=PP=1, CPU), answer the held-out questions, return :func:`score`'s result;
    ``trust_code`` lets a ``pkg.module:attr`` name in its config.yaml import its module."""
    from loongforge.checkpoint.layout import find_checkpoint
    from loongforge.interop.mcore_checkpoint import (
        checkpoint_config,
        checkpoint_dtype,
        load_trained_weights,
        resolve_family,
    )
    from loongforge.interop.world import standalone_world
    from loongforge.models.chunks import build_standalone
    from loongforge.plugins import get_host
    from loongforge.train.batches import load_tokenizer

    from loongforge_vlm.data.kind import image_text_dataset, shapes_dataset

    path = find_checkpoint(checkpoint)
    config = checkpoint_config(path, trust_code=trust_code)
    flavor = resolve_family(config)
    tokenizer = load_tokenizer(get_host(), config)
    if data:
        dataset = image_text_dataset(data, tokenizer, model=flavor)
    else:
        dataset = shapes_dataset([], tokenizer, split="heldout", model=flavor)
    count = min(len(dataset), limit) if limit else len(dataset)
    with standalone_world() as backend:
        model = build_standalone(flavor, backend, checkpoint_dtype(path, config)).eval()
        load_trained_weights(path, [model], config)  # a LoRA run: its adapters folded in
        references, answers, right = [], [], 0
        with job_progress("answering held-out questions", total=count, unit="question", stderr=True) as progress:
            for index in range(count):
                sample = dataset[index]
                reference = sample.ids[int(sample.supervised.argmax()):]
                # The template ends a reply with a newline before eos: compare the stripped texts.
                references.append(tokenizer.decode([int(t) for t in reference
                                                    if int(t) != tokenizer.eos_id]).strip())
                answers.append(tokenizer.decode(answer(model, sample, tokenizer.eos_id, max_tokens)).strip())
                right += answers[-1] == references[-1]
                progress.advance(note=f"accuracy {right / len(answers):.3f}")
    result = score(references, answers)
    (path / "eval.json").write_text(json.dumps({"checkpoint": str(path), **result}, indent=2) + "\n")
    return result


def configure(parser: argparse.ArgumentParser) -> None:
    """The options of ``loongforge eval CHECKPOINT`` for a VLM checkpoint."""
    parser.add_argument("--data", nargs="*", help="jsonl files / shards (default: the shapes set's held-out split)")
    parser.add_argument("--limit", type=int, default=0, help="answer at most this many questions (0: all)")
    parser.add_argument("--max-tokens", type=int, default=8, help="longest answer generated, in tokens (default 8)")


def run(args: argparse.Namespace) -> int:
    """``loongforge eval``: ``args.source`` is the checkpoint; prints per-kind accuracy next to chance."""
    result = evaluate(args.source, data=args.data, limit=args.limit, max_tokens=args.max_tokens,
                      trust_code=args.trust_code)
    for kind, row in result.items():
        chance = f"{row['chance']:.3f}" if row["chance"] is not None else "-"
        print(f"{kind:8s} n={row['n']:4d}  accuracy {row['accuracy']:.3f}  chance {chance}")
    return 0


if __name__ == "__main__":  # the old front-end: say where it went rather than exit 0 having done nothing
    raise SystemExit("python -m loongforge_vlm.evaluate is now `loongforge eval CHECKPOINT [--data ...] [--limit N]`")
