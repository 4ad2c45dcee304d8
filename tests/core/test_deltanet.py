"""The pure-torch gated delta rule: the chunked form equals the per-token recurrence (outputs, final states and every
gradient within 1e-5 in fp32) for sequence lengths that are and are not multiples of the chunk, both stay as close to
a float64 recurrence under strong decay, and the seam a device plugin replaces the op through is honoured."""

from __future__ import annotations

import pytest
import torch
from loongforge.models.qwen3_next import deltanet
from loongforge.models.qwen3_next.deltanet import (
    chunk_gated_delta_rule,
    gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule,
    set_gated_delta_rule,
)

#: (batch, tokens, heads, d_k, d_v, chunk): shorter than a chunk, exactly one, several with a ragged last chunk.
SHAPES = [(2, 37, 3, 16, 24, 16), (1, 64, 2, 8, 8, 64), (2, 130, 2, 32, 16, 64), (1, 5, 1, 4, 4, 64),
          (1, 200, 2, 16, 32, 32)]


def _inputs(batch, tokens, heads, d_k, d_v, decay=2.0, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).requires_grad_()

    q, k, v = rand(batch, tokens, heads, d_k), rand(batch, tokens, heads, d_k), rand(batch, tokens, heads, d_v)
    g = (-torch.rand(batch, tokens, heads, generator=generator) * decay).requires_grad_()
    beta = torch.rand(batch, tokens, heads, generator=generator).requires_grad_()
    state = rand(batch, heads, d_k, d_v, scale=0.5)
    return q, k, v, g, beta, state


def _run(rule, inputs, chunk=None, **kwargs):
    q, k, v, g, beta, state = inputs
    options = {"chunk_size": chunk} if chunk else {}
    out, final = rule(q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
                      **options, **kwargs)
    weights = torch.Generator().manual_seed(7)
    loss = (out * torch.randn(out.shape, generator=weights)).sum() + (final * torch.randn(final.shape,
                                                                                         generator=weights)).sum()
    return out, final, torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-t{}-h{}-k{}-v{}-c{}".format(*s))
def test_chunked_equals_recurrence_outputs_states_and_gradients(shape):
    *sizes, chunk = shape
    inputs = _inputs(*sizes)
    out, final, grads = _run(chunk_gated_delta_rule, inputs, chunk)
    ref_out, ref_final, ref_grads = _run(recurrent_gated_delta_rule, inputs)
    assert out.shape == ref_out.shape == (*sizes[:3], sizes[4])
    assert (out - ref_out).abs().max() <= 1e-5
    assert (final - ref_final).abs().max() <= 1e-5
    for name, grad, ref in zip(("q", "k", "v", "g", "beta", "initial_state"), grads, ref_grads, strict=True):
        assert grad.abs().max() > 0, name
        assert (grad - ref).abs().max() <= 1e-5, (name, (grad - ref).abs().max().item())


def _float64_recurrence(q, k, v, g, beta):
    q, k, v, g, beta = (x.detach().double() for x in (q, k, v, g, beta))
    q, k = l2norm(q) * q.shape[-1] ** -0.5, l2norm(k)
    state = torch.zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3], dtype=torch.float64)
    outs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        write = (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], state)) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * write[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(outs, 1)


@pytest.mark.parametrize("decay", [0.1, 30.0])
def test_chunked_stays_exact_under_strong_decay(decay):
    """Log-decays are summed over the tokens they span, never differenced: with g down to -30 per token a chunk's
    cumulative decay reaches ~-1000, where a difference of two such sums would lose ~1e-5 of the output."""
    q, k, v, g, beta, _ = _inputs(2, 150, 4, 8, 12, decay=decay)
    expected = _float64_recurrence(q, k, v, g, beta)
    chunked, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    recurrent, _ = recurrent_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert (recurrent.double() - expected).abs().max() <= 2e-6
    assert (chunked.double() - expected).abs().max() <= 2e-6


def test_padding_writes_nothing_and_dtypes_round_trip():
    """A ragged last chunk leaves the final state exact; bf16 inputs give bf16 outputs (fp32 inside)."""
    q, k, v, g, beta, state = (x.detach() for x in _inputs(1, 70, 2, 8, 8))
    _, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True)
    _, ref = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True)
    assert (final - ref).abs().max() <= 1e-5
    out, none = chunk_gated_delta_rule(*(x.bfloat16() for x in (q, k, v, g, beta)))
    assert out.dtype == torch.bfloat16 and none is None
    with pytest.raises(ValueError, match="do not fit"):
        chunk_gated_delta_rule(q, k, v[:, :10], g, beta)


def test_the_seam_replaces_the_op_for_every_layer_and_restores():
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return chunk_gated_delta_rule(*args, **kwargs)

    previous = set_gated_delta_rule(spy)
    try:
        assert previous is chunk_gated_delta_rule and gated_delta_rule() is spy
        from loongforge.interop.world import standalone_world
        from loongforge.models.chunks import build_standalone
        from loongforge.models.qwen3_next.flavors import FLAVORS

        flavor = FLAVORS["qwen3-next-tiny"]
        with standalone_world() as backend:
            model = build_standalone(flavor, backend, seed=0)
            with torch.no_grad():
                model(torch.zeros(1, 8, dtype=torch.long), torch.arange(8)[None], None)
        assert len(calls) == flavor.layer_kinds.count("linear_attention") == 3
        assert all(call["use_qk_l2norm_in_kernel"] and call["scale"] == flavor.linear_key_head_dim**-0.5
                   for call in calls)
    finally:
        assert set_gated_delta_rule(None) is spy
    assert deltanet.gated_delta_rule() is chunk_gated_delta_rule
