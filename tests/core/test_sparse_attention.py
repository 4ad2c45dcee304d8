"""DeepSeek sparse attention (DSA, DeepSeek-V3.2): :mod:`loongforge.models.sparse_attention`.

The efficient operators (blockwise top-k selection, gather-based sparse attention, blockwise KL loss) against
their dense-masked references, forward and backward, fp32 within 1e-5; the indexer against transformers'
``DeepseekV32Indexer``; megatron's ``MLASelfAttention`` with :class:`DSACoreAttention` against transformers'
``DeepseekV32Attention`` with the sparse mask active (sequence longer than top-k); the training phases.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from loongforge.models.sparse_attention import (
    LightningIndexer,
    absorb_mla,
    index_scores_reference,
    indexer_kl_loss,
    indexer_kl_loss_reference,
    rope_cos_sin,
    select_topk,
    select_topk_reference,
    sparse_attention,
    sparse_attention_reference,
    topk_mask,
)

TOL = 1e-5


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _random_indices(batch: int, seq: int, keys: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct random key indices per row (future keys included: the kernels must drop them), one slot ``-1``."""
    rows = [torch.randperm(keys, generator=gen)[:width] for _ in range(batch * seq)]
    indices = torch.stack(rows).view(batch, seq, width)
    indices[:, ::3, 0] = -1
    return indices


def _valid_sets(indices: torch.Tensor) -> list[list[set[int]]]:
    """Per row, the selected keys a causal query can use (index in [0, position])."""
    seq = indices.shape[1]
    return [[{int(i) for i in row if 0 <= int(i) <= s} for s, row in zip(range(seq), rows, strict=True)]
            for rows in indices]


# ---------------------------------------------------------------------------------------------------------------
# sparse attention: efficient vs dense-masked reference
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("batch", "seq", "heads", "groups", "dk", "dv", "width", "block"), [
    (2, 37, 4, 2, 12, 8, 9, 5),    # GQA-like, seq not a multiple of the block
    (1, 50, 4, 1, 20, 16, 7, 8),   # one shared latent head (MLA's absorbed form), q/k wider than v
    (2, 16, 3, 3, 10, 6, 16, 4),   # per-head (expanded) keys/values, every key selectable (seq <= top-k)
    (1, 9, 2, 1, 8, 8, 4, None),   # default block size
])
def test_sparse_attention_equals_the_dense_masked_reference(batch, seq, heads, groups, dk, dv, width, block):
    gen = torch.Generator().manual_seed(seq)
    q = torch.randn(batch, seq, heads, dk, generator=gen, requires_grad=True)
    k = torch.randn(batch, seq, groups, dk, generator=gen, requires_grad=True)
    v = torch.randn(batch, seq, groups, dv, generator=gen, requires_grad=True)
    indices = _random_indices(batch, seq, seq, width, gen)
    weight = torch.randn(batch, seq, heads, dv, generator=gen)
    out, head_sum = sparse_attention(q, k, v, indices, 0.3, block_size=block, return_head_sum=True)
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
    expected = sparse_attention_reference(q, k, v, indices, 0.3)
    expected_grads = torch.autograd.grad((expected * weight).sum(), (q, k, v))
    assert out.shape == (batch, seq, heads, dv)
    assert _max_diff(out, expected) <= TOL
    for name, got, want in zip("qkv", grads, expected_grads, strict=True):
        assert _max_diff(got, want) <= TOL, name
    # the head-summed probabilities at the selected slots are the reference's, gathered
    with torch.no_grad():
        qh, kh = q.transpose(1, 2), k.repeat_interleave(heads // groups, dim=2).transpose(1, 2)
        allowed = topk_mask(indices, seq)
        probs = torch.softmax((qh @ kh.transpose(-1, -2) * 0.3).masked_fill(~allowed[:, None], float("-inf")), -1)
        dense_sum = probs.nan_to_num().sum(1)  # [B, S, T]
        valid = (indices >= 0) & (indices <= torch.arange(seq)[:, None])
        gathered = dense_sum.gather(-1, indices.clamp(min=0)) * valid
    assert _max_diff(head_sum, gathered) <= TOL
    # the operator sees the mask: dropping one selected key changes the result
    fewer = indices.clone()
    fewer[:, -1, 1:] = -1
    assert _max_diff(sparse_attention(q, k, v, fewer, 0.3, block_size=block), out) > 1e-3


def test_sparse_attention_over_all_earlier_tokens_is_dense_causal_attention():
    """seq <= top-k: the indexer selects every earlier token, and sparse attention is plain causal attention
    (torch SDPA as the independent reference), forward and backward."""
    gen = torch.Generator().manual_seed(5)
    batch, seq, heads, groups = 2, 11, 4, 2
    iq, ik, iw = torch.randn(batch, seq, 3, 8, generator=gen), torch.randn(batch, seq, 8, generator=gen), \
        torch.randn(batch, seq, 3, generator=gen)
    indices = select_topk(iq, ik, iw, topk=16, block_size=4)
    assert indices.shape == (batch, seq, seq)
    assert all(row == set(range(s + 1)) for rows in _valid_sets(indices) for s, row in enumerate(rows))
    q = torch.randn(batch, seq, heads, 12, generator=gen, requires_grad=True)
    k = torch.randn(batch, seq, groups, 12, generator=gen, requires_grad=True)
    v = torch.randn(batch, seq, groups, 6, generator=gen, requires_grad=True)
    weight = torch.randn(batch, seq, heads, 6, generator=gen)
    out = sparse_attention(q, k, v, indices, 0.25, block_size=3)
    expected = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                              scale=0.25, enable_gqa=True).transpose(1, 2)
    assert _max_diff(out, expected) <= TOL
    for got, want in zip(torch.autograd.grad((out * weight).sum(), (q, k, v)),
                         torch.autograd.grad((expected * weight).sum(), (q, k, v)), strict=True):
        assert _max_diff(got, want) <= TOL


def test_absorbed_mla_form_equals_the_expanded_form():
    """MLA with one shared latent key/value head (W_uk folded into q, W_uv applied after) gives the per-head
    expanded result, and the same gradients for the latent."""
    gen = torch.Generator().manual_seed(6)
    batch, seq, heads, dn, dr, dv, rank = 1, 20, 4, 8, 4, 6, 10
    q_nope = torch.randn(batch, seq, heads, dn, generator=gen)
    q_rope = torch.randn(batch, seq, heads, dr, generator=gen)
    latent = torch.randn(batch, seq, rank, generator=gen, requires_grad=True)
    k_rope = torch.randn(batch, seq, dr, generator=gen)
    kv_b = torch.randn(heads * (dn + dv), rank, generator=gen) / 3
    indices = _random_indices(batch, seq, seq, 6, gen)
    scale = (dn + dr) ** -0.5
    kv = (latent @ kv_b.T).view(batch, seq, heads, dn + dv)
    k_exp = torch.cat((kv[..., :dn], k_rope[:, :, None].expand(-1, -1, heads, -1)), dim=-1)
    expanded = sparse_attention(torch.cat((q_nope, q_rope), -1), k_exp, kv[..., dn:], indices, scale, block_size=7)
    q_abs, k_abs, v_abs, w_uv = absorb_mla(q_nope, q_rope, latent, k_rope, kv_b, dv)
    assert k_abs.shape == (batch, seq, 1, rank + dr) and v_abs.shape == (batch, seq, 1, rank)
    absorbed = torch.einsum("bshc,hvc->bshv", sparse_attention(q_abs, k_abs, v_abs, indices, scale, block_size=7), w_uv)
    assert _max_diff(absorbed, expanded) <= TOL
    weight = torch.randn(expanded.shape, generator=gen)
    (grad_expanded,) = torch.autograd.grad((expanded * weight).sum(), latent)
    (grad_absorbed,) = torch.autograd.grad((absorbed * weight).sum(), latent)
    assert _max_diff(grad_absorbed, grad_expanded) <= TOL


# ---------------------------------------------------------------------------------------------------------------
# the lightning indexer vs transformers
# ---------------------------------------------------------------------------------------------------------------

HIDDEN, HEADS, Q_LORA, KV_LORA, QK_NOPE, QK_ROPE, V_DIM = 64, 4, 32, 24, 16, 8, 12
INDEX_HEADS, INDEX_DIM, TOPK = 4, 16, 8


def _v32_config(topk: int = TOPK):
    from transformers import DeepseekV32Config

    config = DeepseekV32Config(
        vocab_size=32, hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA,
        qk_nope_head_dim=QK_NOPE, qk_rope_head_dim=QK_ROPE, v_head_dim=V_DIM, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attention_bias=False,
        attention_dropout=0.0, index_topk=topk, index_head_dim=INDEX_DIM, index_n_heads=INDEX_HEADS,
    )
    config._attn_implementation = "eager"
    return config


def _perturb(module: torch.nn.Module, seed: int) -> None:
    """Random weights well away from init (norm gains and biases per channel), so nothing ties."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
            elif name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)


@pytest.mark.parametrize("seq", [24, 6])  # longer than top-k (8), and not
def test_indexer_matches_transformers_deepseek_v32(seq, monkeypatch):
    """Scores within 1e-5 of transformers' ``DeepseekV32Indexer`` (captured where it calls ``topk``) and the same
    selected sets per query, blockwise and dense; with the RoPE left out the scores move (negative control)."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer, DeepseekV32RotaryEmbedding

    config = _v32_config()
    hf = DeepseekV32Indexer(config, layer_idx=0)
    _perturb(hf, 1)
    ours = LightningIndexer.from_hf_config(config, block_size=5)
    ours.load_state_dict(hf.state_dict())
    gen = torch.Generator().manual_seed(2)
    hidden, q_resid = torch.randn(2, seq, HIDDEN, generator=gen), torch.randn(2, seq, Q_LORA, generator=gen)
    positions = torch.arange(seq).expand(2, -1)
    cos, sin = DeepseekV32RotaryEmbedding(config)(hidden, positions)
    mask = torch.full((seq, seq), float("-inf")).triu(1).expand(2, seq, seq)

    captured = []
    topk = torch.Tensor.topk

    def recording_topk(self, *args, **kwargs):
        captured.append(self.detach().clone())
        return topk(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "topk", recording_topk)
    hf_indices = hf(hidden, q_resid, (cos, sin), mask, positions)
    monkeypatch.undo()
    (hf_scores,) = captured

    proj = ours.project(hidden, q_resid, cos, sin)
    scores = index_scores_reference(*proj)
    finite = torch.isfinite(hf_scores)
    assert torch.equal(finite, torch.isfinite(scores))
    assert _max_diff(scores[finite], hf_scores[finite]) <= TOL
    assert hf_scores[finite].abs().max() > 0.1  # the scores are not trivially small

    blockwise = ours(hidden, q_resid, cos, sin)
    dense = select_topk_reference(scores, TOPK)
    assert blockwise.shape == dense.shape == hf_indices.shape == (2, seq, min(TOPK, seq))
    assert _valid_sets(blockwise) == _valid_sets(dense) == _valid_sets(hf_indices)
    if seq > TOPK:  # later queries use all top-k slots
        assert all(len(row) == TOPK for rows in _valid_sets(blockwise) for row in rows[TOPK:])
    # positions come from our own RoPE helper just the same; leaving RoPE out changes the scores
    own_cos, own_sin = rope_cos_sin(torch.arange(seq), QK_ROPE)
    assert _max_diff(index_scores_reference(*ours.project(hidden, q_resid, own_cos, own_sin))[finite],
                     hf_scores[finite]) <= TOL
    no_rope = index_scores_reference(*ours.project(hidden, q_resid, torch.ones_like(cos), torch.zeros_like(sin)))
    assert _max_diff(no_rope[finite], hf_scores[finite]) > 1e-3


# ---------------------------------------------------------------------------------------------------------------
# the indexer's KL loss
# ---------------------------------------------------------------------------------------------------------------

def _loss_inputs(seq: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    indexer = LightningIndexer(HIDDEN, Q_LORA, INDEX_HEADS, INDEX_DIM, QK_ROPE, TOPK)
    _perturb(indexer, seed)
    hidden, q_resid = torch.randn(2, seq, HIDDEN, generator=gen), torch.randn(2, seq, Q_LORA, generator=gen)
    cos, sin = rope_cos_sin(torch.arange(seq), QK_ROPE)
    q = torch.randn(2, seq, HEADS, 12, generator=gen, requires_grad=True)
    k = torch.randn(2, seq, 2, 12, generator=gen, requires_grad=True)
    return indexer, hidden, q_resid, cos, sin, q, k


@pytest.mark.parametrize("phase", ["dense_warmup", "sparse"])
def test_indexer_kl_loss_blockwise_equals_the_reference(phase):
    """Loss and gradients w.r.t. every indexer parameter, blockwise vs materialised; no gradient to the main
    attention's q/k (the target is detached)."""
    indexer, hidden, q_resid, cos, sin, q, k = _loss_inputs(seq=23, seed=3)
    proj = indexer.project(hidden, q_resid, cos, sin)
    indices = select_topk(*proj, TOPK) if phase == "sparse" else None
    params = list(indexer.parameters())
    loss = indexer_kl_loss(*proj, q, k, 0.3, indices, block_size=5)
    grads = torch.autograd.grad(loss, params, retain_graph=True)
    expected = indexer_kl_loss_reference(index_scores_reference(*proj), q, k, 0.3, indices)
    expected_grads = torch.autograd.grad(expected, params, retain_graph=True)
    assert loss.item() > 0.01 and abs(loss.item() - expected.item()) <= TOL
    for (name, _), got, want in zip(indexer.named_parameters(), grads, expected_grads, strict=True):
        assert want.abs().max() > 0, name
        assert _max_diff(got, want) <= TOL, name
    assert torch.autograd.grad(loss, (q, k), allow_unused=True) == (None, None)
    if phase == "sparse":  # the target handed over by sparse_attention is the one recomputed
        _, head_sum = sparse_attention(q, k, torch.randn(2, 23, 2, 4), indices, 0.3, return_head_sum=True)
        again = indexer_kl_loss(*proj, q, k, 0.3, indices, attention_head_sum=head_sum)
        assert abs(again.item() - loss.item()) <= 1e-6
        # restricted to the selected keys, the sparse loss differs from the dense one
        assert abs(indexer_kl_loss(*proj, q, k, 0.3).item() - loss.item()) > 1e-3


def test_indexer_kl_loss_reference_is_the_kl_of_the_papers_equations():
    """The reference against ``F.kl_div`` row by row: target = head-summed softmax(q k^T * scale) over the allowed
    keys, L1-normalised; prediction = softmax of the indexer scores over the same keys; mean over queries."""
    indexer, hidden, q_resid, cos, sin, q, k = _loss_inputs(seq=10, seed=4)
    with torch.no_grad():
        scores = index_scores_reference(*indexer.project(hidden, q_resid, cos, sin))
        indices = select_topk_reference(scores, 4)
        for indices_or_none in (None, indices):
            allowed = topk_mask(indices_or_none, 10) if indices_or_none is not None else \
                torch.ones(2, 10, 10, dtype=torch.bool).tril()
            terms = []
            for b in range(2):
                for s in range(10):
                    keys = allowed[b, s].nonzero().squeeze(-1)
                    logits = torch.einsum("hd,thd->ht", q[b, s], k[b, keys].repeat_interleave(2, dim=1)) * 0.3
                    target = torch.softmax(logits, -1).sum(0)
                    target = target / target.sum()
                    terms.append(F.kl_div(torch.log_softmax(scores[b, s, keys], -1), target, reduction="sum"))
            expected = torch.stack(terms).mean()
            got = indexer_kl_loss_reference(scores, q, k, 0.3, indices_or_none)
            assert abs(got.item() - expected.item()) <= TOL


def test_dense_warmup_trains_the_indexer_towards_the_attention():
    """A few Adam steps on the dense KL loss alone lower it (the indexer learns the attention distribution)."""
    indexer, hidden, q_resid, cos, sin, q, k = _loss_inputs(seq=16, seed=5)
    optimizer = torch.optim.Adam(indexer.parameters(), lr=2e-2)
    losses = []
    for _ in range(15):
        loss = indexer_kl_loss(*indexer.project(hidden, q_resid, cos, sin), q, k, 0.3, block_size=6)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


# ---------------------------------------------------------------------------------------------------------------
# megatron MLA + DSACoreAttention vs transformers' DeepseekV32Attention
# ---------------------------------------------------------------------------------------------------------------

SEQ, BATCH = 24, 2  # longer than TOPK: the sparse mask is active

#: megatron MLA parameter -> transformers DeepseekV32Attention parameter (tests/core/test_cpu_mla.py's mapping, plus
#: the indexer, which is the core attention's here).
MLA_TO_HF = {
    "linear_q_down_proj.weight": "q_a_proj.weight",
    "q_layernorm.weight": "q_a_layernorm.weight",
    "linear_q_up_proj.weight": "q_b_proj.weight",
    "linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
    "kv_layernorm.weight": "kv_a_layernorm.weight",
    "linear_kv_up_proj.weight": "kv_b_proj.weight",
    "linear_proj.weight": "o_proj.weight",
    **{f"core_attention.indexer.{name}": f"indexer.{name}"
       for name in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")},
}


def _dsa_mla(provider, dsa_phase: str | None = None, **config_overrides):
    from loongforge.models.sparse_attention.core_attention import DSACoreAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = MLATransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA,
        qk_head_dim=QK_NOPE, qk_pos_emb_head_dim=QK_ROPE, v_head_dim=V_DIM, rope_type="rope", rotary_base=10000,
        normalization="RMSNorm", layernorm_epsilon=1e-6, add_bias_linear=False, attention_dropout=0.0,
        hidden_dropout=0.0, use_cpu_initialization=True, experimental_attention_variant="dsa",
        dsa_indexer_n_heads=INDEX_HEADS, dsa_indexer_head_dim=INDEX_DIM, dsa_indexer_topk=TOPK,
        **config_overrides,
    )
    if dsa_phase is not None:  # not a megatron field: a family sets it on its config (e.g. from training.phase)
        config.dsa_phase = dsa_phase
    norm = provider.layer_norm(rms_norm=True, for_qk=True)
    spec = ModuleSpec(module=MLASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                      submodules=MLASelfAttentionSubmodules(
                          linear_q_proj=provider.column_parallel_linear(),
                          linear_q_down_proj=provider.column_parallel_linear(),
                          linear_q_up_proj=provider.column_parallel_linear(),
                          linear_kv_down_proj=provider.column_parallel_linear(),
                          linear_kv_up_proj=provider.column_parallel_linear(),
                          core_attention=ModuleSpec(module=DSACoreAttention),
                          linear_proj=provider.row_parallel_linear(), q_layernorm=norm, kv_layernorm=norm))
    return build_module(spec, config=config, layer_number=1)


def _hf_attention(topk: int = TOPK):
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Attention, DeepseekV32RotaryEmbedding

    config = _v32_config(topk)
    attention = DeepseekV32Attention(config, layer_idx=0)
    _perturb(attention, 7)
    return attention, DeepseekV32RotaryEmbedding(config)


def _hf_forward(attention, rotary, hidden):
    x = hidden.transpose(0, 1)
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    mask = torch.full((SEQ, SEQ), float("-inf")).triu(1).expand(BATCH, 1, SEQ, SEQ)
    out, _ = attention(x, rotary(x, positions), mask)
    return out.transpose(0, 1)


def _copy_from_hf(mla, hf) -> dict[str, torch.nn.Parameter]:
    ours, theirs = dict(mla.named_parameters()), dict(hf.named_parameters())
    assert set(ours) == set(MLA_TO_HF), sorted(ours)
    with torch.no_grad():
        for name, hf_name in MLA_TO_HF.items():
            ours[name].copy_(theirs[hf_name])
    return ours


@pytest.mark.parametrize("training", [False, True])
def test_megatron_mla_with_dsa_core_attention_matches_transformers_deepseek_v32(megatron_cpu_world, training):
    """fp32, sequence 24 > top-k 8: output, input gradient and the main weights' gradients equal transformers';
    in training the attached indexer loss leaves all of those unchanged and gives the indexer gradients (the
    transformers indexer has none). Negative control: transformers with top-k >= seq (dense) differs."""
    mla = _dsa_mla(megatron_cpu_world.spec_provider(), dsa_indexer_loss_coeff=0.5)
    hf, rotary = _hf_attention()
    ours = _copy_from_hf(mla, hf)
    mla.train(training)
    hf.train(training)
    gen = torch.Generator().manual_seed(8)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    weight = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    ours_in, hf_in = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    out, _ = mla(ours_in, None)
    expected = _hf_forward(hf, rotary, hf_in)
    assert _max_diff(out, expected) <= TOL
    (out * weight).sum().backward()
    (expected * weight).sum().backward()
    assert _max_diff(ours_in.grad, hf_in.grad) <= TOL
    theirs = dict(hf.named_parameters())
    for name, hf_name in MLA_TO_HF.items():
        if "indexer" in name:
            assert theirs[hf_name].grad is None
            assert (ours[name].grad is not None and ours[name].grad.abs().max() > 0) == training, name
            continue
        scale = max(1.0, theirs[hf_name].grad.abs().max().item())
        assert _max_diff(ours[name].grad, theirs[hf_name].grad) <= 2e-6 * scale, name
    core = mla.core_attention
    assert (core.last_indexer_loss is not None) == training
    dense, dense_rotary = _hf_attention(topk=SEQ)
    dense.load_state_dict(hf.state_dict())
    with torch.no_grad():
        assert _max_diff(_hf_forward(dense, dense_rotary, hidden), out) > 1e-3


def test_dsa_phases_dense_warmup_trains_only_the_indexer(megatron_cpu_world):
    """Dense warm-up: dense causal attention (transformers' layer at top-k >= seq), the main model frozen, the
    loss's gradient reaching only the indexer. Sparse phase: the indexer loss leaves the main gradients alone."""
    from loongforge.errors import ConfigError
    from loongforge.models.sparse_attention.core_attention import freeze_all_but_indexers, set_dsa_phase

    provider = megatron_cpu_world.spec_provider()
    mla = _dsa_mla(provider, dsa_indexer_loss_coeff=1.0, dsa_phase="dense_warmup")
    reference = _dsa_mla(provider, dsa_indexer_loss_coeff=0.0)
    dense_hf, rotary = _hf_attention(topk=SEQ)
    _copy_from_hf(mla, dense_hf)
    _copy_from_hf(reference, dense_hf)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(9))

    trained = freeze_all_but_indexers(mla)
    assert {id(p) for p in trained} == {id(p) for p in mla.core_attention.indexer.parameters()}
    mla.train()
    out, _ = mla(hidden, None)
    with torch.no_grad():
        assert _max_diff(out, _hf_forward(dense_hf, rotary, hidden)) <= TOL
    assert out.requires_grad  # through the attached loss only
    out.sum().backward()
    for name, param in mla.named_parameters():
        assert (param.grad is not None) == ("indexer" in name), name
    assert mla.core_attention.last_indexer_loss > 0

    # sparse phase, everything trainable: the attached loss changes no main gradient
    assert set_dsa_phase(mla, "sparse") == 1
    for module in (mla, reference):
        module.train()
        module.zero_grad(set_to_none=True)
        for param in module.parameters():
            param.requires_grad_(True)
    weight = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(10))
    for module in (mla, reference):
        (module(hidden, None)[0] * weight).sum().backward()
    main = dict(reference.named_parameters())
    for name, param in mla.named_parameters():
        if "indexer" in name:
            assert param.grad.abs().max() > 0 and main[name].grad is None, name
        else:
            assert _max_diff(param.grad, main[name].grad) <= 1e-6 * max(1.0, main[name].grad.abs().max().item()), name
    with pytest.raises(ConfigError, match="not one of"):
        set_dsa_phase(mla, "warmup")
