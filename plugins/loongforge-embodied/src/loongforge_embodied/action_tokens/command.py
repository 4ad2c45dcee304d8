"""``loongforge fit-action-tokenizer DATASET --kind KIND --out DIR``: fit a tokenizer on a LeRobotDataset's action
chunks, save it, and print its round trip -- the largest error against the bound it states, and the compression
(values per token) -- on the fitted chunks or, with ``--held-out-episodes``, on episodes it never saw. The same
numbers go to ``DIR/round_trip.json``."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from loongforge_embodied.action_tokens.names import ACTION_TOKENIZERS

REPORT_FILE = "round_trip.json"
#: The kinds' options the command line can set (passed only when given, so each kind keeps its defaults).
KIND_OPTIONS = ("bins", "range", "scale", "vocab_size", "clip")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dataset", help="a LeRobotDataset directory (its 'action' column is read)")
    parser.add_argument("--kind", required=True, help=f"the tokenizer: {', '.join(ACTION_TOKENIZERS.names())}")
    parser.add_argument("--out", required=True, help="directory to save the tokenizer in")
    parser.add_argument("--horizon", type=int, default=10, help="actions per chunk (default 10)")
    parser.add_argument("--stride", type=int, default=1, help="frames between chunk starts (default 1)")
    parser.add_argument("--held-out-episodes", type=int, default=0,
                        help="fit without the last N episodes and measure on them (default 0: measure on the fit)")
    parser.add_argument("--bins", type=int, help="bins per dimension (uniform-bins, quantile-bins; default 256)")
    parser.add_argument("--range", help="uniform-bins: min_max (default) or quantiles (q01..q99, clipped)")
    parser.add_argument("--scale", type=float, help="fast: DCT coefficient scale before rounding (default 10)")
    parser.add_argument("--vocab-size", type=int, help="fast: BPE vocabulary (default 1024)")
    parser.add_argument("--clip", type=float, help="fast: normalised values clip to [-clip, clip] (default 2)")


def run(args: argparse.Namespace) -> int:
    from loongforge_embodied.action_tokens.base import ActionTokenizerError
    from loongforge_embodied.action_tokens.chunks import action_chunks
    from loongforge_embodied.action_tokens.registry import fit_action_tokenizer, measure_round_trip
    from loongforge_embodied.data.lerobot_dataset import LeRobotDataset

    dataset = LeRobotDataset(args.dataset)
    indices = [ep.index for ep in dataset.episodes]
    held_out = args.held_out_episodes
    if not 0 <= held_out < len(indices):
        raise ActionTokenizerError(f"--held-out-episodes {held_out}: {args.dataset} has {len(indices)} episode(s), "
                                   f"so hold out 0 to {len(indices) - 1}")
    fit_on, measure_on = indices[:len(indices) - held_out], indices[len(indices) - held_out:] or None
    chunks = action_chunks(dataset, args.horizon, stride=args.stride, episodes=fit_on)
    options = {name: getattr(args, name) for name in KIND_OPTIONS if getattr(args, name) is not None}
    tokenizer = fit_action_tokenizer(args.kind, chunks, **options)
    tokenizer.save(Path(args.out))
    measured = chunks if measure_on is None else action_chunks(dataset, args.horizon, stride=args.stride,
                                                               episodes=measure_on)
    trip = measure_round_trip(tokenizer, measured)
    (Path(args.out) / REPORT_FILE).write_text(json.dumps(
        {"kind": tokenizer.kind, "dataset": str(args.dataset), "horizon": args.horizon, "fit_episodes": fit_on,
         "measured_episodes": measure_on or fit_on, **trip.to_json()}, indent=1))
    where = "the fitted chunks" if measure_on is None else f"{held_out} held-out episode(s)"
    print(f"{tokenizer.kind} fitted on {len(chunks)} chunks of {args.horizon} x {tokenizer.action_dim} actions from "
          f"{len(fit_on)} episode(s) of {args.dataset}; vocabulary {tokenizer.vocab_size}")
    clipped = "" if trip.in_range == 1 else f"; the clipped rest err up to {_numbers(trip.max_error_all)}"
    print(f"round trip on {trip.chunks} chunks ({where}): max error {_numbers(trip.max_error)}, bound "
          f"{_numbers(trip.bound)} per dimension ({'within' if trip.within_bound else 'OUTSIDE'} the bound on the "
          f"{trip.in_range:.2%} of values in the fitted range{clipped})")
    print(f"compression: {trip.values_per_chunk} values -> {trip.tokens_per_chunk:.2f} tokens per chunk "
          f"({trip.compression:.2f}x)")
    print(f"saved to {args.out}")
    return 0 if trip.within_bound else 1


def _numbers(values: Sequence[float]) -> str:
    return "[" + ", ".join(f"{value:.4f}" for value in values) + "]"
