"""Measure BF16 vs FP8 time of every GEMM module of a model over token counts and write the FP8 policy.

Run it on the GPU you will train on, with the model and tensor-parallel size of the run::

    python -m loongforge_cuda.fp8.measure --model qwen3-8b --tp 2 --recipe blockwise --out fp8_policy.json
    python -m loongforge_cuda.fp8.measure --shape mlp.linear_fc1=4096,28672 --tokens 1024,4096,16384 --out p.json

then switch it on with ``optimizations: {adaptive-fp8: {policy: fp8_policy.json}}``. Without a GPU (or with
``--device cpu``) FP8 is emulated on the CPU: the run proves the tool and the file format, says EMULATION, and
writes a policy marked ``emulated`` that training refuses.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence

from loongforge.errors import LoongForgeError

from loongforge_cuda.fp8.policy import Policy, derive_policy, save_policy
from loongforge_cuda.fp8.shapes import Shapes, module_shapes, parse_shape

#: Token ladders: from short micro-batches to long-context ones on a GPU; small ones for the CPU emulation.
DEFAULT_TOKENS = {"cuda": (512, 1024, 2048, 4096, 8192, 16384, 32768), "cpu": (32, 64, 128)}


def measure(shapes: Mapping[str, tuple[int, int, float]], tokens: Sequence[int], timer) -> dict:
    """``{kind: {tokens: (bf16_ms, fp8_ms)}}``; a module's token count is scaled by its ``tokens_scale``
    (routed experts see a fraction of the micro-batch), and the results stay keyed by the run's count."""
    results: dict[str, dict[int, tuple[float, float]]] = {}
    for kind, (in_features, out_features, scale) in shapes.items():
        results[kind] = {}
        for count in tokens:
            rows = max(1, round(count * scale))
            results[kind][count] = (
                timer.time_ms(in_features, out_features, rows, fp8=False),
                timer.time_ms(in_features, out_features, rows, fp8=True),
            )
    return results


def format_report(policy: Policy) -> str:
    """A table per module: tokens, BF16 ms, FP8 ms, speed-up, and the threshold chosen."""
    lines = []
    for kind, entry in sorted(policy.modules.items()):
        threshold = entry.fp8_from_tokens
        decision = f"FP8 from {threshold} tokens" if threshold else "always BF16"
        lines.append(f"{kind}  [{entry.in_features} -> {entry.out_features}]  {decision}")
        for count, (bf16_ms, fp8_ms) in sorted(entry.timings.items()):
            lines.append(f"  {count:>7} tokens  bf16 {bf16_ms:9.4f} ms  fp8 {fp8_ms:9.4f} ms  "
                         f"speed-up {bf16_ms / fp8_ms:5.2f}x")
    return "\n".join(lines)


def _shapes_from_args(args: argparse.Namespace) -> Shapes:
    if args.shape:
        return dict(parse_shape(text) for text in args.shape)
    from loongforge.plugins import get_registry

    flavor = get_registry("model").load(args.model, where="--model")
    return module_shapes(flavor, tp=args.tp)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loongforge_cuda.fp8.measure", description=__doc__.split("\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="model flavor name (its transformer layer's GEMMs are measured)")
    what.add_argument("--shape", action="append", help="kind=in_features,out_features[,tokens_scale] (repeatable)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the run (splits the GEMMs)")
    parser.add_argument("--tokens", help="comma-separated token counts per micro-batch (default: by device)")
    parser.add_argument("--recipe", default="auto", help="FP8 recipe: auto, blockwise, tensorwise, mxfp8, delayed")
    parser.add_argument("--device", default="auto", help="auto, cuda or cpu (cpu: FP8 emulated)")
    parser.add_argument("--min-speedup", type=float, default=1.0, help="FP8 must beat BF16 by this factor to win")
    parser.add_argument("--repeat", type=int, help="timed repetitions per point (median is kept)")
    parser.add_argument("--out", required=True, help="policy JSON file to write")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    from loongforge_cuda.fp8.runners import make_timer

    try:
        shapes = _shapes_from_args(args)
        timer = make_timer(args.device, args.recipe, repeat=args.repeat)
        ladder = DEFAULT_TOKENS["cpu" if timer.emulated else "cuda"]
        tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(ladder)
    except (ValueError, RuntimeError, LoongForgeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if timer.emulated:
        print("EMULATION: no FP8 GPU in use; FP8 runs as the CPU reference, so these timings prove the tool and "
              "the file format only (the policy is marked emulated and training refuses it)")
    print(f"device: {timer.device}, recipe: {timer.recipe}, tokens: {','.join(map(str, tokens))}")
    results = measure(shapes, tokens, timer)
    policy = derive_policy(shapes, results, device=timer.device, recipe=timer.recipe, emulated=timer.emulated,
                           min_speedup=args.min_speedup)
    print(format_report(policy))
    print(f"policy written to {save_policy(policy, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
