"""The GEMM shapes of a decoder flavor's transformer layer, keyed by policy module kind.

Derived from the flavor's sizes the way megatron-core builds the layer (fused QKV, SwiGLU's fused
gate+up projection, tensor-parallel splits of the column- and row-parallel linears), so that the
benchmark measures exactly the GEMMs a run will execute without building the model; a test checks the
result against the weights of a model megatron actually built.
"""

from __future__ import annotations

from typing import Any

#: ``{kind: (in_features, out_features, tokens_scale)}``.
Shapes = dict[str, tuple[int, int, float]]


def _split(size: int, tp: int, what: str) -> int:
    if size % tp:
        raise ValueError(f"{what} ({size}) is not divisible by tensor-parallel size {tp}")
    return size // tp


def module_shapes(flavor: Any, tp: int = 1) -> Shapes:
    """Per-rank GEMM shapes of one transformer layer of ``flavor`` (a DecoderFlavor) at tensor-parallel ``tp``.

    Routed experts see ``topk / num_experts`` of the tokens on average, which is their ``tokens_scale``.
    """
    h, d = flavor.hidden_size, flavor.kv_channels
    q, kv = flavor.num_attention_heads * d, flavor.num_query_groups * d
    shapes: Shapes = {
        "self_attention.linear_qkv": (h, _split(q + 2 * kv, tp, "q + 2 * kv channels"), 1.0),
        "self_attention.linear_proj": (_split(q, tp, "attention channels"), h, 1.0),
    }
    mlps = []
    if flavor.num_experts is None:
        mlps.append(("mlp", flavor.ffn_hidden_size, 1.0))
    else:
        mlps.append(("mlp.experts", flavor.moe_ffn_hidden_size, flavor.moe_router_topk / flavor.num_experts))
        if flavor.moe_shared_expert_intermediate_size:
            mlps.append(("mlp.shared_experts", flavor.moe_shared_expert_intermediate_size, 1.0))
    for prefix, ffn, scale in mlps:
        local = _split(ffn, tp, f"{prefix} ffn size")
        shapes[f"{prefix}.linear_fc1"] = (h, 2 * local, scale)  # SwiGLU: gate and up projections fused
        shapes[f"{prefix}.linear_fc2"] = (local, h, scale)
    return shapes


def parse_shape(text: str) -> tuple[str, tuple[int, int, float]]:
    """``kind=in,out[,tokens_scale]`` (the ``--shape`` option) -> ``(kind, (in, out, scale))``."""
    kind, sep, dims = text.partition("=")
    parts = dims.split(",")
    try:
        if not sep or not kind or len(parts) not in (2, 3):
            raise ValueError
        in_f, out_f = int(parts[0]), int(parts[1])
        scale = float(parts[2]) if len(parts) == 3 else 1.0
        if in_f < 1 or out_f < 1 or scale <= 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"--shape {text!r}: expected kind=in_features,out_features[,tokens_scale] with positive "
                         "numbers, e.g. mlp.linear_fc1=4096,28672") from None
    return kind, (in_f, out_f, scale)
