"""Measure BF16 vs FP8 time of every GEMM module of a model over token counts and write the FP8 policy.

Run it on the GPU you will train on, with the model and tensor-parallel size of the run::

    loongforge fp8-measure --model qwen3-8b --tp 2 --recipe blockwise --out fp8_policy.json
    loongforge fp8-measure --shape mlp.linear_fc1=4096,28672 --tokens 1024,4096,16384 --out p.json

then switch it on with ``optimizations: {adaptive-fp8: {policy: fp8_policy.json}}``. Without a GPU (or with
``--device cpu``) FP8 is emulated on the CPU: the run proves the tool and the file format, says EMULATION, and
writes a policy marked ``emulated`` that training refuses. A progress display (:mod:`loongforge.progress`, on
standard error) counts the measured points, each a module at one token count. The options are set up by
:func:`loongforge_cuda.commands.configure_fp8_measure`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence

from loongforge.errors import ConfigError
from loongforge.progress import job_progress

from loongforge_cuda.fp8.policy import Policy, derive_policy, save_policy
from loongforge_cuda.fp8.shapes import Shapes, module_shapes, parse_shape

#: Token ladders: from short micro-batches to long-context ones on a GPU; small ones for the CPU emulation.
DEFAULT_TOKENS = {"cuda": (512, 1024, 2048, 4096, 8192, 16384, 32768), "cpu": (32, 64, 128)}


def _no_report(kind: str, tokens: int) -> None:
    """The ``on_point`` of a measurement nobody watches."""


def measure(shapes: Mapping[str, tuple[int, int, float]], tokens: Sequence[int], timer,
            on_point: Callable[[str, int], None] = _no_report) -> dict:
    """``{kind: {tokens: (bf16_ms, fp8_ms)}}``; a module's token count is scaled by its ``tokens_scale``
    (routed experts see a fraction of the micro-batch), and the results stay keyed by the run's count.
    ``on_point(kind, tokens)`` is called after each point is timed in both precisions."""
    results: dict[str, dict[int, tuple[float, float]]] = {}
    for kind, (in_features, out_features, scale) in shapes.items():
        results[kind] = {}
        for count in tokens:
            rows = max(1, round(count * scale))
            results[kind][count] = (
                timer.time_ms(in_features, out_features, rows, fp8=False),
                timer.time_ms(in_features, out_features, rows, fp8=True),
            )
            on_point(kind, count)
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


def _token_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) <= 0:
        raise ConfigError(f"--tokens: expected comma-separated positive token counts, got {text!r}")
    return counts


def run(args: argparse.Namespace) -> int:
    """``loongforge fp8-measure``: time every point, print the report, write the policy to ``args.out``."""
    from loongforge_cuda.fp8.runners import make_timer

    try:  # a bad shape, recipe or device: one line naming it
        shapes = _shapes_from_args(args)
        timer = make_timer(args.device, args.recipe, repeat=args.repeat)
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(str(exc)) from None
    tokens = _token_counts(args.tokens) if args.tokens else list(DEFAULT_TOKENS["cpu" if timer.emulated else "cuda"])
    if timer.emulated:
        print("EMULATION: no FP8 GPU in use; FP8 runs as the CPU reference, so these timings prove the tool and "
              "the file format only (the policy is marked emulated and training refuses it)")
    print(f"device: {timer.device}, recipe: {timer.recipe}, tokens: {','.join(map(str, tokens))}")
    with job_progress("timing BF16 vs FP8", total=len(shapes) * len(tokens), unit="point", stderr=True) as progress:
        results = measure(shapes, tokens, timer,
                          on_point=lambda kind, count: progress.advance(note=f"{kind} at {count} tokens"))
    policy = derive_policy(shapes, results, device=timer.device, recipe=timer.recipe, emulated=timer.emulated,
                           min_speedup=args.min_speedup)
    print(format_report(policy))
    print(f"policy written to {save_policy(policy, args.out)}")
    return 0


if __name__ == "__main__":  # the old front-end: say where it went rather than exit 0 having done nothing
    raise SystemExit("python -m loongforge_cuda.fp8.measure is now `loongforge fp8-measure ...`")
