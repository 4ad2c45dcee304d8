"""Adaptive FP8 vs BF16 vs full FP8, per GEMM module of a model, and the FP8 numerics vs the CPU reference.

1. Measure BF16 and FP8 time of every transformer-layer GEMM over a token ladder and derive the policy
   (``loongforge_cuda.fp8.measure``), written to ``--policy-out``.
2. Time every module again, independently, at each token count and report per module and for the whole
   layer: adaptive vs BF16 (target >= 1.00x: adaptive never picks the slower one) and adaptive vs full FP8
   (target >= 0.98x on large dense shapes, where the policy should pick FP8 everywhere).
3. Numerics at one token count: FP8 output vs the emulated reference (:mod:`loongforge_cuda.fp8.blockwise`)
   and vs the exact fp32 product.

On an NVIDIA GPU with Transformer Engine every FP8 number is TE's (forward + backward of ``te.pytorch.Linear``
in ``fp8_autocast``). Elsewhere it runs the CPU emulation and says EMULATION: the ratios then describe the
reference implementation, not a GPU. Usage::

    python benchmarks/fp8_policy.py --model llama3-8b --recipe blockwise            # on the GPU
    python benchmarks/fp8_policy.py --model llama-tiny --tokens 32,64,128           # CPU emulation
"""

from __future__ import annotations

import argparse
import sys

import torch
from loongforge_cuda.fp8.blockwise import relative_error
from loongforge_cuda.fp8.measure import DEFAULT_TOKENS, format_report, measure
from loongforge_cuda.fp8.policy import derive_policy, save_policy
from loongforge_cuda.fp8.runners import emulated_fp8_linear, make_timer
from loongforge_cuda.fp8.shapes import module_shapes


def _operands(timer, in_features: int, out_features: int, tokens: int):
    """Inputs and the weight the FP8 forward will use, on the timer's device."""
    if timer.emulated:
        return (*timer.operands(in_features, out_features, tokens), None)
    layer = timer.layer(in_features, out_features)
    x = torch.randn(tokens, in_features, device="cuda", dtype=torch.bfloat16)
    return x, layer.weight.detach(), layer


def numerics(timer, in_features: int, out_features: int, tokens: int) -> dict[str, float]:
    """Relative errors of the FP8 forward: the device's vs the emulated reference and both vs exact fp32."""
    x, w, layer = _operands(timer, in_features, out_features, tokens)
    exact = x.float() @ w.float().T
    reference = emulated_fp8_linear(x, w, timer.recipe, pow2=not timer.emulated)
    errors = {"reference_vs_exact": relative_error(reference, exact)}
    if layer is not None:
        with torch.no_grad():
            device_out = timer.forward(layer, x, fp8=True)
        errors["te_vs_reference"] = relative_error(device_out, reference)
        errors["te_vs_exact"] = relative_error(device_out, exact)
    return errors


def compare(policy, shapes, tokens, timer) -> None:
    """Re-time each module and print adaptive/BF16 and adaptive/full-FP8 speed ratios."""
    again = measure(shapes, tokens, timer)
    print("\nadaptive vs BF16 and vs full FP8 (speed ratios, re-timed independently of the policy's timings)")
    for count in tokens:
        layer = {"bf16": 0.0, "fp8": 0.0, "adaptive": 0.0}
        for kind, timings in sorted(again.items()):
            bf16_ms, fp8_ms = timings[count]
            use_fp8 = policy.modules[kind].use_fp8(count)
            adaptive_ms = fp8_ms if use_fp8 else bf16_ms
            for key, value in (("bf16", bf16_ms), ("fp8", fp8_ms), ("adaptive", adaptive_ms)):
                layer[key] += value
            print(f"  {count:>7} tokens  {kind:<28} {'FP8 ' if use_fp8 else 'BF16'}  "
                  f"vs BF16 {bf16_ms / adaptive_ms:5.2f}x  vs FP8 {fp8_ms / adaptive_ms:5.2f}x")
        print(f"  {count:>7} tokens  {'whole layer':<28}       vs BF16 {layer['bf16'] / layer['adaptive']:5.2f}x  "
              f"vs FP8 {layer['fp8'] / layer['adaptive']:5.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--tokens", help="comma-separated token counts (default: the measure tool's, by device)")
    parser.add_argument("--recipe", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeat", type=int)
    parser.add_argument("--policy-out", default="fp8_policy.json")
    args = parser.parse_args()
    from loongforge.plugins import get_registry

    shapes = module_shapes(get_registry("model").load(args.model, where="--model"), tp=args.tp)
    timer = make_timer(args.device, args.recipe, repeat=args.repeat)
    ladder = DEFAULT_TOKENS["cpu" if timer.emulated else "cuda"]
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(ladder)
    if timer.emulated:
        print("EMULATION: no FP8 GPU in use; FP8 is the CPU reference, so these ratios are not GPU numbers")
    print(f"model {args.model} tp={args.tp}, device: {timer.device}, recipe: {timer.recipe}")
    policy = derive_policy(shapes, measure(shapes, tokens, timer), device=timer.device, recipe=timer.recipe,
                           emulated=timer.emulated)
    print(format_report(policy))
    print(f"policy written to {save_policy(policy, args.policy_out)}")
    compare(policy, shapes, tokens, timer)
    print(f"\nFP8 numerics at {tokens[0]} tokens (relative Frobenius error)")
    for kind, (in_features, out_features, _) in sorted(shapes.items()):
        errors = numerics(timer, in_features, out_features, tokens[0])
        print(f"  {kind:<28} " + "  ".join(f"{k} {v:.4f}" for k, v in errors.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
