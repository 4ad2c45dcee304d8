"""Multi-latent attention (MLA, DeepSeek-V2/V3) on the CPU backend.

Three things make megatron's ``MLASelfAttention`` build and train on CPU: the CPU patch that corrects the MLA
module's Transformer Engine flag, :class:`~loongforge.devices.sdpa_attention.SDPAttention` taking MLA's
``k_channels``/``v_channels`` (query/key heads wider than value heads), and a layer spec whose modules come from
the CPU backend's provider. The references here are independent of our code: plain torch attention written in
the test, and transformers' ``DeepseekV3Attention`` from a config written by hand.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import free_port  # tests/core's, bound at collection (a later import may find another conftest)

# A small MLA: 4 heads, q/k heads of 16 (no rope) + 8 (rope) = 24 channels, value heads of 12.
HIDDEN, HEADS, Q_LORA, KV_LORA, QK_NOPE, QK_ROPE, V_DIM = 64, 4, 32, 24, 16, 8, 12
SEQ, BATCH = 10, 2


def _attention_config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                attention_dropout=0.0, hidden_dropout=0.0, masked_softmax_fusion=False)
    return TransformerConfig(**{**base, **kw})


def _reference_attention(q, k, v, scale, *, softcap=None, window=None):
    """softmax(q k^T * scale + causal mask) v over megatron's [s, b, heads, d] tensors, K/V groups repeated
    (computed in float64, returned in the inputs' dtype)."""
    groups, dtype = q.shape[2] // k.shape[2], q.dtype
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    s = q.shape[2]
    allowed = torch.ones(s, s, dtype=torch.bool).tril()
    if window is not None:
        allowed &= ~torch.ones(s, s, dtype=torch.bool).tril(diagonal=-window - 1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v  # [b, n, s, dv]
    return out.permute(2, 0, 1, 3).reshape(s, q.shape[0], -1).to(dtype)


@pytest.mark.parametrize("variant", ["sdpa", "softcap", "window"])
def test_sdpa_attention_with_wider_query_key_heads_than_value_heads(megatron_cpu_world, variant):
    """k_channels (24) != v_channels (12), 4 query heads over 2 K/V groups, causal: the output (heads * 12 wide)
    and the gradients of q, k and v equal plain torch attention; also on the soft-capped and windowed paths."""
    from loongforge.devices.sdpa_attention import SDPAttention
    from megatron.core.transformer.enums import AttnMaskType

    config = _attention_config(**({"window_size": (3, 0)} if variant == "window" else {}))
    softcap = 5.0 if variant == "softcap" else None
    attention = SDPAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                             attention_type="self", k_channels=24, v_channels=12, softcap=softcap,
                             cp_comm_type="p2p", num_splits=1)
    assert attention.softmax_scale == pytest.approx(1 / math.sqrt(24))  # of the q/k width, not kv_channels (16)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(9, 3, 4, 24, generator=gen, requires_grad=True)  # [s, b, heads, dk]
    k = torch.randn(9, 3, 2, 24, generator=gen, requires_grad=True)  # [s, b, groups, dk]
    v = torch.randn(9, 3, 2, 12, generator=gen, requires_grad=True)  # [s, b, groups, dv]
    weight = torch.randn(9, 3, 48, generator=gen) / 4  # gradients of order 1, so 1e-6 is several fp32 ulps
    out = attention(q, k, v, None)
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
    expected = _reference_attention(q, k, v, 1 / math.sqrt(24), softcap=softcap,
                                    window=3 if variant == "window" else None)
    expected_grads = torch.autograd.grad((expected * weight).sum(), (q, k, v))
    assert out.shape == (9, 3, 4 * 12)
    assert (out - expected).abs().max().item() <= 1e-6
    for name, g, e in zip("qkv", grads, expected_grads, strict=True):
        assert (g - e).abs().max().item() <= 1e-6, name


def test_sdpa_attention_uses_the_given_softmax_scale_and_checks_head_widths(megatron_cpu_world):
    from loongforge.devices.sdpa_attention import SDPAttention
    from megatron.core.transformer.enums import AttnMaskType

    attention = SDPAttention(config=_attention_config(), layer_number=1, attn_mask_type=AttnMaskType.causal,
                             attention_type="self", softmax_scale=0.3, k_channels=24, v_channels=12)
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(5, 1, 4, 24, generator=gen), torch.randn(5, 1, 2, 24, generator=gen), \
        torch.randn(5, 1, 2, 12, generator=gen)
    assert (attention(q, k, v, None) - _reference_attention(q, k, v, 0.3)).abs().max().item() <= 1e-6
    # Value heads as wide as the query heads (what the module was not built for) fail in one line.
    with pytest.raises(ValueError, match="built for query/key heads of 24 and value heads of 12 channels"):
        attention(q, k, torch.randn(5, 1, 2, 24), None)
    # Without k/v channels the heads are config.kv_channels wide, as before.
    plain = SDPAttention(config=_attention_config(), layer_number=1, attn_mask_type=AttnMaskType.causal,
                         attention_type="self")
    assert (plain.k_channels, plain.v_channels, plain.softmax_scale) == (16, 16, pytest.approx(0.25))


@pytest.mark.parametrize(("setting", "message"), [
    ({"qk_clip": True}, "does not record the max attention logit"),
    ({"log_max_attention_logit": True}, "does not record the max attention logit"),
    ({"experimental_attention_variant": "dsa"}, "does not implement DeepSeek sparse attention"),
])
def test_sdpa_attention_refuses_settings_it_would_otherwise_ignore(megatron_cpu_world, setting, message):
    from loongforge.devices.sdpa_attention import SDPAttention
    from loongforge.errors import ConfigError
    from megatron.core.transformer.enums import AttnMaskType

    config = _attention_config()
    for key, value in setting.items():  # set after construction: megatron's own checks want more for these
        setattr(config, key, value)
    with pytest.raises(ConfigError, match=message):
        SDPAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


def _mla_config():
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA,
        qk_head_dim=QK_NOPE, qk_pos_emb_head_dim=QK_ROPE, v_head_dim=V_DIM, rope_type="rope", rotary_base=10000,
        normalization="RMSNorm", layernorm_epsilon=1e-6, add_bias_linear=False, attention_dropout=0.0,
        hidden_dropout=0.0, use_cpu_initialization=True,
    )


def _mla_spec(provider):
    """MLASelfAttention with every module from ``provider`` (megatron's own MLA specs hard-code theirs)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    norm = provider.layer_norm(rms_norm=True, for_qk=True)
    return ModuleSpec(
        module=MLASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=provider.column_parallel_linear(),
            linear_q_down_proj=provider.column_parallel_linear(),
            linear_q_up_proj=provider.column_parallel_linear(),
            linear_kv_down_proj=provider.column_parallel_linear(),
            linear_kv_up_proj=provider.column_parallel_linear(),
            core_attention=provider.core_attention(),
            linear_proj=provider.row_parallel_linear(),
            q_layernorm=norm,
            kv_layernorm=norm,
        ),
    )


def _deepseek_v3_attention(rope_interleave=True):
    """transformers' MLA from a hand-written tiny config (plain RoPE, eager attention), weights off their init."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    config = DeepseekV3Config(
        vocab_size=32, hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=Q_LORA, kv_lora_rank=KV_LORA,
        qk_nope_head_dim=QK_NOPE, qk_rope_head_dim=QK_ROPE, v_head_dim=V_DIM, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rope_interleave=rope_interleave, attention_bias=False, attention_dropout=0.0,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(3)
    attention = DeepseekV3Attention(config, layer_idx=0)
    with torch.no_grad():
        for name, param in attention.named_parameters():
            param.add_(torch.randn_like(param) * 0.02)
            if "layernorm" in name:  # RMSNorm gains start at 1; make them clearly per-channel
                param.mul_(torch.rand_like(param) + 0.5)
    return attention, DeepseekV3RotaryEmbedding(config)


#: megatron MLA parameter -> transformers DeepseekV3Attention parameter (same [out, in] layouts: per head, q/k
#: channels are [no-rope, rope] and kv_b_proj's rows are [k_nope, v] in both).
MLA_TO_HF = {
    "linear_q_down_proj.weight": "q_a_proj.weight",
    "q_layernorm.weight": "q_a_layernorm.weight",
    "linear_q_up_proj.weight": "q_b_proj.weight",
    "linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
    "kv_layernorm.weight": "kv_a_layernorm.weight",
    "linear_kv_up_proj.weight": "kv_b_proj.weight",
    "linear_proj.weight": "o_proj.weight",
}


def _hf_forward(attention, rotary, hidden):
    """transformers' attention over megatron's [s, b, h] input with an explicit additive causal mask."""
    x = hidden.transpose(0, 1)  # [b, s, h]
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    mask = torch.full((SEQ, SEQ), float("-inf")).triu(1).expand(BATCH, 1, SEQ, SEQ)
    out, _ = attention(x, rotary(x, positions), mask)
    return out.transpose(0, 1)


def test_megatron_mla_on_the_cpu_provider_matches_transformers_deepseek_v3(megatron_cpu_world):
    """megatron's MLASelfAttention, every module from the CPU backend's provider, equals transformers'
    DeepseekV3Attention (rope_interleave=True, plain RoPE) in fp32: output, input gradient, weight gradients."""
    from loongforge.devices.sdpa_attention import SDPAttention
    from megatron.core.transformer.spec_utils import build_module

    provider = megatron_cpu_world.spec_provider()
    mla = build_module(_mla_spec(provider), config=_mla_config(), layer_number=1)
    assert isinstance(mla.core_attention, SDPAttention)
    assert (mla.core_attention.k_channels, mla.core_attention.v_channels) == (QK_NOPE + QK_ROPE, V_DIM)
    reference, rotary = _deepseek_v3_attention()
    ours = dict(mla.named_parameters())
    hf = dict(reference.named_parameters())
    assert set(ours) == set(MLA_TO_HF), sorted(ours)  # every megatron parameter is mapped (and no bias)
    with torch.no_grad():
        for name, hf_name in MLA_TO_HF.items():
            assert ours[name].shape == hf[hf_name].shape, name
            ours[name].copy_(hf[hf_name])

    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    weight = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    ours_in, hf_in = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    out, bias = mla(ours_in, None)
    expected = _hf_forward(reference, rotary, hf_in)
    assert bias is None and out.shape == (SEQ, BATCH, HIDDEN)
    assert (out - expected).abs().max().item() <= 1e-5
    (out * weight).sum().backward()
    (expected * weight).sum().backward()
    assert (ours_in.grad - hf_in.grad).abs().max().item() <= 1e-5
    for name, hf_name in MLA_TO_HF.items():  # weight gradients reach ~8 here: relative to their size
        scale = max(1.0, hf[hf_name].grad.abs().max().item())
        assert (ours[name].grad - hf[hf_name].grad).abs().max().item() <= 2e-6 * scale, name

    # Negative control: the same weights with transformers' non-interleaved RoPE layout give another result,
    # so the match above checks the RoPE channel layout too.
    other, other_rotary = _deepseek_v3_attention(rope_interleave=False)
    other.load_state_dict(reference.state_dict())
    with torch.no_grad():
        assert (_hf_forward(other, other_rotary, hidden) - out).abs().max().item() > 1e-3


def test_cpu_patches_clear_the_mla_transformer_engine_flag(megatron_cpu_world, monkeypatch):
    """Without TE, megatron's MLA module believes TE is there (its TELinear is the extension's mock) and its
    isinstance check raises; the CPU patches set its HAVE_TE to False. With a real TELinear class and TE
    reported present the patch leaves the flag alone."""
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed; this checks the CPU case without it")
    from loongforge.devices.megatron_cpu.mla import patch_mla_te_flag
    from megatron.core.extensions import transformer_engine as te_extension
    from megatron.core.transformer import multi_latent_attention as mla_module
    from megatron.core.transformer.spec_utils import build_module

    assert mla_module.HAVE_TE is False  # applied by CPUBackend.apply_patches (the fixture)
    assert not isinstance(mla_module.TELinear, type)  # the reason: a MagicMock, not a class

    spec, config = _mla_spec(megatron_cpu_world.spec_provider()), _mla_config()
    monkeypatch.setattr(mla_module, "HAVE_TE", True)  # megatron's own value without the patch
    with pytest.raises(TypeError, match="isinstance"):
        build_module(spec, config=config, layer_number=1)
    assert patch_mla_te_flag() is True and mla_module.HAVE_TE is False
    assert patch_mla_te_flag() is False  # idempotent
    build_module(spec, config=config, layer_number=1)

    class RealTELinear(torch.nn.Module):
        pass

    monkeypatch.setattr(mla_module, "HAVE_TE", True)
    monkeypatch.setattr(mla_module, "TELinear", RealTELinear)
    monkeypatch.setattr(te_extension, "HAVE_TE", True)
    assert patch_mla_te_flag() is False and mla_module.HAVE_TE is True



def _mla_rank_run(mla, rank, cp, seq=16):
    """Fill ``mla``'s parameters from a seed (by sorted name) and run forward/backward on this cp rank's chunks
    of a seeded sequence (megatron's load-balanced split: chunks ``rank`` and ``2*cp-1-rank``)."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in sorted(mla.named_parameters()):
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2 + (1.0 if "layernorm" in name else 0.0))
    x, w = (torch.randn(seq, BATCH, HIDDEN, generator=gen) for _ in range(2))
    chunk = seq // (2 * cp)
    idx = torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                     torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])
    x = x[idx].clone().requires_grad_()
    out, _ = mla(x, None)
    (out * w[idx]).sum().backward()
    return {"idx": idx, "out": out.detach(), "x_grad": x.grad,
            "grads": {name: p.grad.clone() for name, p in mla.named_parameters()}}


#: Two gloo processes at cp=2, each running :func:`_mla_rank_run` (weight gradients summed over the cp group,
#: as DDP's reduction over the data x context group does).
CP_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist

    def worker(rank, port, out_dir, test_dir):
        sys.path.insert(0, test_dir)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        from loongforge.devices.cpu import CPUBackend
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.transformer.spec_utils import build_module
        import test_cpu_mla as t
        backend = CPUBackend()
        backend.apply_patches()
        dist.init_process_group("gloo", rank=rank, world_size=2)
        parallel_state.initialize_model_parallel(1, 1, context_parallel_size=2)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        config = t._mla_config()
        config.context_parallel_size = 2
        mla = build_module(t._mla_spec(backend.spec_provider()), config=config, layer_number=1)
        assert mla.core_attention.cp_group is not None
        result = t._mla_rank_run(mla, rank, 2)
        for grad in result["grads"].values():
            dist.all_reduce(grad)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()

    if __name__ == "__main__":
        import torch.multiprocessing as mp
        mp.spawn(worker, args=(int(sys.argv[1]), sys.argv[2], sys.argv[3]), nprocs=2)
    """
)


@pytest.mark.distributed
def test_megatron_mla_with_context_parallelism_matches_one_rank(megatron_cpu_world, tmp_path):
    """MLA at cp=2 (SDPAttention's Ulysses exchange with 24-wide q/k and 12-wide v heads, RoPE on each rank's
    chunks) gives each rank its rows of the cp=1 output and input gradient, and the cp=1 weight gradients."""
    from megatron.core.transformer.spec_utils import build_module

    script = tmp_path / "mla_cp.py"
    script.write_text(CP_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(free_port()), str(tmp_path), os.path.dirname(__file__)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    mla = build_module(_mla_spec(megatron_cpu_world.spec_provider()), config=_mla_config(), layer_number=1)
    reference = _mla_rank_run(mla, 0, 1)
    for rank in range(2):
        part = torch.load(tmp_path / f"rank{rank}.pt")
        idx = part["idx"]
        assert (part["out"] - reference["out"][idx]).abs().max().item() <= 1e-5
        assert (part["x_grad"] - reference["x_grad"][idx]).abs().max().item() <= 1e-5
        for name, grad in reference["grads"].items():
            scale = max(1.0, grad.abs().max().item())
            assert (part["grads"][name] - grad).abs().max().item() <= 2e-6 * scale, name
