"""The gated delta rule (Gated DeltaNet's token mixer) in pure torch: a chunked form for training, the per-token
recurrence as its reference, and the one seam through which a device plugin replaces the chunked form.

Per head, with a state ``S`` of shape ``[d_k, d_v]``, decay ``a_t = exp(g_t)`` (``g_t <= 0``) and write strength
``beta_t`` in ``(0, 1)``, each token first decays the state, then replaces what the state recalls for ``k_t`` by
``v_t`` (the delta rule), then reads it with ``q_t``::

    S_t = a_t S_{t-1} + k_t (beta_t (v_t - (a_t S_{t-1})^T k_t))^T        o_t = S_t^T q_t

:func:`recurrent_gated_delta_rule` runs exactly that, one token after another (``T`` sequential steps: the reference,
and what a one-token decoding step needs). :func:`chunk_gated_delta_rule` computes the same function in chunks of
``C`` tokens: within a chunk, with ``G_i`` the cumulative log-decay from the chunk start and ``D_ij = exp(G_i - G_j)``
(``j <= i``), the writes ``U`` of a chunk solve one unit lower-triangular system (the WY form of the ``C`` rank-one
updates)::

    (I + tril(diag(beta) K K^T * D, -1)) U = diag(beta) V - diag(beta) (K * exp(G)) S_0

so ``U = W - Kc S_0`` with ``W``, ``Kc`` independent of the state ``S_0`` the chunk starts from; the outputs are
``O = P W + (Q * exp(G) - P Kc) S_0`` with ``P = tril(Q K^T * D)``, and the state passed on is
``exp(G_C) S_0 + (K * exp(G_C - G))^T U``. Everything but the last line and ``U`` is batched over all chunks at
once; only ``T / C`` small state updates run in sequence. Padding to a multiple of ``C`` uses ``g = 0`` and
``beta = 0``, which writes nothing and decays nothing, so the final state is exact too.

Both take and return tensors in the layout of flash-linear-attention's ``chunk_gated_delta_rule`` (``q``, ``k``:
``[B, T, H, d_k]``; ``v``: ``[B, T, H, d_v]``; ``g``, ``beta``: ``[B, T, H]``; ``initial_state`` and the final state
``[B, H, d_k, d_v]``), with the same keywords (``scale`` defaults to ``d_k ** -0.5``), so that kernel is a drop-in
replacement: a device plugin installs it with :func:`set_gated_delta_rule` (one call, e.g. in its backend's
``apply_patches``) and every Gated DeltaNet layer uses it from then on. Computation is fp32 whatever the input
dtype; outputs come back in ``v``'s dtype, states in fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["CHUNK_SIZE", "GatedDeltaRule", "chunk_gated_delta_rule", "gated_delta_rule", "l2norm",
           "recurrent_gated_delta_rule", "set_gated_delta_rule"]

#: Tokens per chunk of :func:`chunk_gated_delta_rule` (flash-linear-attention's and transformers' choice).
CHUNK_SIZE = 64

#: ``fn(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
#: use_qk_l2norm_in_kernel=False) -> (o, final_state or None)``: the signature of the seam.
GatedDeltaRule = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (flash-linear-attention's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             scale: float | None, use_qk_l2norm: bool) -> tuple[torch.Tensor, ...]:
    if q.shape != k.shape or q.shape[:3] != v.shape[:3] or g.shape != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(f"gated delta rule: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)} do not fit [B, T, H, d] / [B, T, H]")
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k, v, g, beta


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    scale: float | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule one token at a time (the definition; ``T`` sequential steps)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    batch, length, heads, d_k = k.shape
    state = (torch.zeros(batch, heads, d_k, v.shape[-1], dtype=torch.float32, device=v.device)
             if initial_state is None else initial_state.float())
    outputs = []
    for t in range(length):
        state = state * g[:, t].exp()[..., None, None]
        recalled = torch.einsum("bhk,bhkv->bhv", k[:, t], state)
        write = (v[:, t] - recalled) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * write[:, :, None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    out = torch.stack(outputs, dim=1).to(dtype)
    return out, (state if output_final_state else None)


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
    scale: float | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule in chunks of ``chunk_size`` tokens: parallel within a chunk, recurrent across chunks
    (see the module docstring); equal to :func:`recurrent_gated_delta_rule` up to rounding."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    batch, length, heads, d_k = k.shape
    d_v = v.shape[-1]
    pad = -length % chunk_size
    chunks = (length + pad) // chunk_size

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [B, H, N, C, ...], zero-padded
        x = x.transpose(1, 2)
        x = F.pad(x, (0, 0, 0, pad)) if x.dim() == 4 else F.pad(x, (0, pad))
        return x.reshape(batch, heads, chunks, chunk_size, *x.shape[3:])

    q, k, v, g, beta = (chunked(x) for x in (q, k, v, g, beta))
    # Log-decays as sums over exactly the tokens they span, never as differences of cumulative sums: with g <= 0 every
    # partial sum is no larger than the result, so each is exact to its own rounding (a difference of two sums over a
    # strongly decaying chunk, ~ -1e3 each, would lose ~1e-4 of the result).
    cum = g.cumsum(-1)  # [B, H, N, C]: log-decay from the chunk start through each token
    tail = F.pad(g[..., 1:].flip(-1).cumsum(-1).flip(-1), (0, 1))  # from after each token to the chunk end
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    spans = g[..., :, None].expand(*g.shape, chunk_size).masked_fill(~causal.tril(-1), 0.0)  # [i, j]: g_i if i > j
    decay = spans.cumsum(-2).masked_fill(~causal, float("-inf")).exp()  # D_ij = exp(g_{j+1} + ... + g_i), 0 for j > i
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its strict lower triangle; the solve takes a unit diagonal
    rhs = torch.cat([v * beta[..., None], k_beta * cum.exp()[..., None]], dim=-1)
    w, k_cum = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split([d_v, d_k], -1)
    attend = (q @ k.transpose(-1, -2)) * decay  # P, diagonal included
    local = attend @ w  # the outputs' part that does not depend on the incoming state
    read = q * cum.exp()[..., None] - attend @ k_cum  # [B, H, N, C, d_k]: how the outputs read the incoming state
    k_tail = k * tail.exp()[..., None]  # each token's key decayed to the chunk end
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]

    state = (torch.zeros(batch, heads, d_k, d_v, dtype=torch.float32, device=v.device)
             if initial_state is None else initial_state.float())
    incoming = []
    for n in range(chunks):
        incoming.append(state)
        writes = w[:, :, n] - k_cum[:, :, n] @ state
        state = state * chunk_decay[:, :, n] + k_tail[:, :, n].transpose(-1, -2) @ writes
    out = local + read @ torch.stack(incoming, dim=2)
    out = out.reshape(batch, heads, chunks * chunk_size, d_v)[:, :, :length].transpose(1, 2)
    return out.to(dtype).contiguous(), (state if output_final_state else None)


_RULE: GatedDeltaRule = chunk_gated_delta_rule


def gated_delta_rule() -> GatedDeltaRule:
    """The implementation every Gated DeltaNet layer calls for a whole sequence (:func:`chunk_gated_delta_rule`
    unless a plugin installed another with :func:`set_gated_delta_rule`)."""
    return _RULE


def set_gated_delta_rule(rule: GatedDeltaRule | None) -> GatedDeltaRule:
    """Install ``rule`` (flash-linear-attention's ``chunk_gated_delta_rule`` or anything with its signature, see
    :data:`GatedDeltaRule`) for every Gated DeltaNet layer, ``None`` restoring the pure-torch one; returns the
    implementation it replaced, so a caller can put it back."""
    global _RULE
    previous, _RULE = _RULE, (rule or chunk_gated_delta_rule)
    return previous
