"""The CPU backend's RoPE (:mod:`loongforge.devices.megatron_cpu.rope`) against megatron's own unfused function.

Forward values and input gradients must match megatron's ``_apply_rotary_pos_emb_bshd`` (to float rounding:
``addcmul`` may fuse a multiply-add) for full and partial rotary, a yarn ``mscale``, and per-sample tables whose
halves differ (multimodal RoPE); the cases it does not cover must be megatron's result exactly; the per-step table
cache must notice a new or modified ``freqs``.
"""

from __future__ import annotations

import pytest
import torch
from loongforge.devices.megatron_cpu import apply_megatron_cpu_patches
from loongforge.devices.megatron_cpu.rope import RotaryHalves, fused_bshd
from megatron.core.models.common.embeddings import rope_utils

apply_megatron_cpu_patches()
MEGATRON = rope_utils._apply_rotary_pos_emb_bshd.megatron_original


def _both(t: torch.Tensor, freqs: torch.Tensor, **kwargs: object) -> tuple[torch.Tensor, ...]:
    """(ours, megatron's) outputs and their gradients for one random upstream gradient."""
    ours_fn = fused_bshd(MEGATRON)
    x1, x2 = t.clone().requires_grad_(), t.clone().requires_grad_()
    ours, theirs = ours_fn(x1, freqs, **kwargs), MEGATRON(x2, freqs, **kwargs)
    upstream = torch.randn_like(ours)
    (ours * upstream).sum().backward()
    (theirs * upstream).sum().backward()
    return ours, theirs, x1.grad, x2.grad


def test_the_patch_is_installed_where_megatron_looks_it_up() -> None:
    assert rope_utils._apply_rotary_pos_emb_bshd is not MEGATRON
    apply_megatron_cpu_patches()  # idempotent: still one layer of wrapping
    assert rope_utils._apply_rotary_pos_emb_bshd.megatron_original is MEGATRON


@pytest.mark.parametrize(("rot_dim", "mscale", "freq_batch"), [(64, 1.0, 1), (32, 1.0, 1), (64, 1.37, 1), (64, 1.0, 3)])
def test_matches_megatron_forward_and_backward(rot_dim: int, mscale: float, freq_batch: int) -> None:
    torch.manual_seed(0)
    t = torch.randn(12, 3, 4, 64)  # [s, b, heads, head_dim]
    freqs = torch.randn(12, freq_batch, 1, rot_dim) * 3  # halves differ: nothing assumes cat((f, f))
    ours, theirs, grad_ours, grad_theirs = _both(t, freqs, mscale=mscale)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_ours, grad_theirs, rtol=1e-6, atol=1e-6)
    if rot_dim < 64:  # the pass-through channels are copied, and so are their gradients
        assert torch.equal(ours[..., rot_dim:], t[..., rot_dim:])


def test_strided_input_from_a_fused_qkv_projection() -> None:
    torch.manual_seed(1)
    qkv = torch.randn(10, 2, 4, 3 * 32)  # megatron splits q/k/v as views of one projection
    query = qkv[..., :32]
    freqs = torch.randn(10, 1, 1, 32)
    ours, theirs, grad_ours, grad_theirs = _both(query, freqs)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_ours, grad_theirs, rtol=1e-6, atol=1e-6)


def test_gradient_is_exact_in_double() -> None:
    torch.manual_seed(2)
    t = torch.randn(5, 2, 3, 8, dtype=torch.float64, requires_grad=True)
    freqs = torch.randn(5, 2, 1, 6, dtype=torch.float64)  # partial rotary, per-sample tables
    assert torch.autograd.gradcheck(lambda x: RotaryHalves.apply(x, freqs.cos(), freqs.sin()), (t,))


@pytest.mark.parametrize("kwargs", [{"rotary_interleaved": True}, {"multi_latent_attention": True}])
def test_uncovered_cases_are_megatrons_own_result(kwargs: dict) -> None:
    torch.manual_seed(3)
    t, freqs = torch.randn(6, 2, 2, 16), torch.randn(6, 1, 1, 16)
    assert torch.equal(fused_bshd(MEGATRON)(t, freqs, **kwargs), MEGATRON(t, freqs, **kwargs))


def test_table_cache_follows_new_and_modified_freqs() -> None:
    apply = fused_bshd(MEGATRON)
    t = torch.randn(4, 1, 1, 8)
    freqs = torch.randn(4, 1, 1, 8)
    first = apply(t, freqs)
    assert torch.equal(apply(t, freqs), first)  # the same tables reused
    freqs.mul_(2.0)  # in place: a new version, new tables
    torch.testing.assert_close(apply(t, freqs), MEGATRON(t, freqs), rtol=1e-6, atol=1e-6)
    other = torch.randn(4, 1, 1, 8)
    torch.testing.assert_close(apply(t, other), MEGATRON(t, other), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(apply(t, other, mscale=0.5), MEGATRON(t, other, mscale=0.5), rtol=1e-6, atol=1e-6)
