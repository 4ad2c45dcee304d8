"""Generation speed with megatron's KV cache vs recomputing the whole context every token, on CPU.

Baseline: ``generate_batch(..., use_cache=False)``, which runs the full (growing) context through the model for
every new token (what ``loongforge generate`` did before the cache). Both runs are greedy on the same prompts,
so they must write the same tokens; the script checks that, then prints new tokens per second for each (median
of ``--repeats`` runs, after one warm-up) and the ratio. The model is a built-in flavor with random weights
(``llama-tiny`` by default: 4 layers, d256), built at TP=PP=1 in a one-process world. Usage::

    python benchmarks/generate_kv_cache.py                               # llama-tiny, 4 x 64-token prompts, 256 new
    python benchmarks/generate_kv_cache.py --model llama-debug --prompt-tokens 32 --new-tokens 128 --batch 1

Threads are set with ``--threads`` (default 1), so the numbers do not depend on what else the machine runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from loongforge.interop.world import standalone_world
from loongforge.models.chunks import build_standalone
from loongforge.models.generate import generate_batch, supports_kv_cache
from loongforge.models.registration import all_flavors


def _timed(model, prompts, new_tokens: int, vocab: int, use_cache: bool, repeats: int) -> tuple[list, float]:
    """The new ids and the median seconds of ``repeats`` runs (after one warm-up)."""
    options = dict(vocab_size=vocab, max_positions=len(prompts[0]) + new_tokens, use_cache=use_cache)
    ids = generate_batch(model, prompts, new_tokens, **options)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        generate_batch(model, prompts, new_tokens, **options)
        seconds.append(time.perf_counter() - start)
    return ids, statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-tiny", help="built-in flavor name (default llama-tiny)")
    parser.add_argument("--batch", type=int, default=4, help="prompts decoded together (default 4)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    flavor = all_flavors()[args.model]
    draw = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, flavor.vocab_size, (args.batch, args.prompt_tokens), generator=draw).tolist()
    with standalone_world() as backend:
        model = build_standalone(flavor, backend, seed=0)
        assert supports_kv_cache(model)
        cached, cached_s = _timed(model, prompts, args.new_tokens, flavor.vocab_size, True, args.repeats)
        full, full_s = _timed(model, prompts, args.new_tokens, flavor.vocab_size, False, args.repeats)
    if cached != full:
        raise SystemExit("the cached and the recomputed runs wrote different tokens")
    new = args.batch * args.new_tokens
    print(f"{args.model}: {args.batch} prompts x {args.prompt_tokens} tokens, {args.new_tokens} new each, "
          f"{args.threads} thread(s); the same tokens both ways")
    print(f"{'recompute (no cache)':22} {new / full_s:10.1f} tokens/s  ({full_s:.2f} s)")
    print(f"{'KV cache':22} {new / cached_s:10.1f} tokens/s  ({cached_s:.2f} s)")
    print(f"speed-up: {full_s / cached_s:.2f}x")


if __name__ == "__main__":
    main()
