"""Packed chat rows train exactly like the same conversations one per row (megatron model, fp32, CPU), whether
attention takes their sequence boundaries (varlen, the default) or the dense block-diagonal mask (the fallback)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from loongforge.config.schema import DataConfig  # noqa: E402
from loongforge.data.chat_dataset import shipped_chat  # noqa: E402
from loongforge.data.packing import block_causal_mask  # noqa: E402
from loongforge.data.tokenizers import ByteTokenizer  # noqa: E402
from loongforge.models.decoder_model import build_model  # noqa: E402
from loongforge.models.llama import FLAVORS  # noqa: E402
from loongforge.parallel.packed_rows import PackedRows, attend_packed  # noqa: E402
from loongforge.train.engines.megatron import _masked_mean_loss  # noqa: E402

NUM_SAMPLES = 24


def _spread_weights(model):
    """Weights far from the 0.02 init, so attention is sharp and a leak across samples moves the loss a lot."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5, generator=generator)
            else:
                param.normal_(0.0, 0.15, generator=generator)


def _loss(model, batch, *, varlen=True):
    """The packed ``batch`` (with ``cu_seqlens``) as the trainer feeds it: varlen, dense mask, or (``None``) neither."""
    if "cu_seqlens" in batch:
        batch = attend_packed(batch, varlen=bool(varlen))
        if varlen is None:
            batch.pop("attention_mask")
    extra = {"packed_seq_params": batch["packed_seq_params"]} if "packed_seq_params" in batch else {}
    per_token = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"],
                      **extra)
    loss, _ = _masked_mean_loss(batch["loss_mask"], per_token)
    return loss


def _relative(a, b):
    return ((a - b).norm() / b.norm()).item()


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def test_packed_rows_give_the_unpacked_loss_and_grads(megatron_cpu_world):
    samples = shipped_chat([], ByteTokenizer()).samples[:NUM_SAMPLES]
    data = DataConfig(seq_length=256)
    from loongforge.data.packing import ChatRowDataset

    plain = ChatRowDataset(samples, data.seq_length, ByteTokenizer.pad_id, pack=False)
    packed = ChatRowDataset(samples, data.seq_length, ByteTokenizer.pad_id, pack=True)
    assert len(plain) == NUM_SAMPLES and len(packed) == 12
    plain_batch = plain.batch(np.arange(len(plain)))
    packed_batch = packed.batch(np.arange(len(packed)))
    # Both normalise the same way: one mean over all supervised tokens of the micro-batch.
    assert plain_batch["loss_mask"].sum() == packed_batch["loss_mask"].sum() == 787

    model = build_model(FLAVORS["llama-debug"], backend=megatron_cpu_world)
    _spread_weights(model)
    model.train()
    plain_loss = _loss(model, plain_batch)
    plain_grads = _grads(model, plain_loss)
    packed_loss = _loss(model, packed_batch)
    packed_grads = _grads(model, packed_loss)
    dense_loss = _loss(model, packed_batch, varlen=False)
    dense_grads = _grads(model, dense_loss)
    # varlen and the dense mask are the same attention: equal to fp32 rounding
    assert _relative(packed_loss, dense_loss) <= 1e-6 and _relative(packed_grads, dense_grads) <= 1e-6
    # and the samples one per row (RoPE turns them by other positions, the same distances: rounding only)
    assert _relative(packed_loss, plain_loss) <= 2e-6 and _relative(packed_grads, plain_grads) <= 2e-6
    # The test can see a leak: without the block-diagonal mask, later samples attend to earlier ones.
    with torch.no_grad():
        leaking = _loss(model, packed_batch, varlen=None).item()
    assert abs(leaking - plain_loss.item()) > 1e-2, (leaking, plain_loss.item())


def test_sdpa_attention_applies_a_block_causal_mask_exactly(megatron_cpu_world):
    """SDPAttention takes an explicit [b,1,s,s] mask instead of its causal flag; the mask must carry causality."""
    from loongforge.devices.sdpa_attention import SDPAttention
    from loongforge.models.decoder_model import transformer_config
    from megatron.core.transformer.enums import AttnMaskType

    config = transformer_config(FLAVORS["llama-debug"])
    attention = SDPAttention(config, 1, AttnMaskType.causal, "self").eval()
    s, b, heads, groups, dim = 10, 2, config.num_attention_heads, config.num_query_groups, config.kv_channels
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(s, b, heads, dim, generator=generator)
    k = torch.randn(s, b, groups, dim, generator=generator)
    v = torch.randn(s, b, groups, dim, generator=generator)
    segments = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, -1], [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]])
    mask = block_causal_mask(segments)
    out = attention(q, k, v, mask)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    varlen = attention(q, k, v, None, packed_seq_params=PackedRows.from_segments(segments))
    # Reference: plain softmax attention with GQA repeat and the same mask.
    rep = heads // groups
    qh = q.permute(1, 2, 0, 3)
    kh, vh = (t.repeat_interleave(rep, 2).permute(1, 2, 0, 3) for t in (k, v))
    scores = (qh @ kh.transpose(-1, -2)) / dim**0.5
    reference = (scores.masked_fill(mask, float("-inf")).softmax(-1) @ vh).permute(2, 0, 1, 3).reshape(s, b, -1)
    assert torch.allclose(out, reference, atol=1e-6)
    # varlen: the boundaries instead of the mask, the same numbers and gradients as the reference's
    assert torch.allclose(varlen, reference, atol=1e-6)
    weights = torch.randn(varlen.shape, generator=generator)
    grads = torch.autograd.grad((varlen * weights).sum(), (q, k, v))
    expected = torch.autograd.grad((reference * weights).sum(), (q, k, v))
    for got, want in zip(grads, expected, strict=True):
        assert torch.allclose(got, want, atol=1e-6)
    # One segment covering the row is plain causal attention.
    causal = attention(q, k, v, block_causal_mask(torch.zeros(b, s, dtype=torch.long)))
    assert torch.allclose(causal, attention(q, k, v, None), atol=1e-6)


def test_the_trainer_attends_packed_rows_varlen_unless_the_attention_cannot(megatron_cpu_world, caplog):
    """Core's attention takes the boundaries; any other core attention (Transformer Engine's) gets the dense mask."""
    from loongforge.train.engines.megatron import _packed_rows_varlen

    model = build_model(FLAVORS["llama-debug"], backend=megatron_cpu_world)
    assert _packed_rows_varlen([model])
    model.decoder.layers[1].self_attention.core_attention = torch.nn.Identity()  # stands for TEDotProductAttention
    with caplog.at_level("INFO", logger="loongforge.train.engines.megatron"):
        assert not _packed_rows_varlen([model])
    assert "Identity does not take packed_seq_params" in caplog.text
    batch = {"tokens": torch.zeros(2, 5, dtype=torch.long), "cu_seqlens": torch.tensor([0, 2, 5, 9, 10])}
    assert set(attend_packed(batch, varlen=True)) == {"tokens", "packed_seq_params"}
    mask = attend_packed(batch, varlen=False)["attention_mask"]
    assert torch.equal(mask, block_causal_mask(torch.tensor([[0, 0, 1, 1, 1], [2, 2, 2, 2, 3]])))
    with pytest.raises(ValueError, match="cross the row end at token 5"):
        PackedRows.from_cu_seqlens(torch.tensor([0, 2, 6, 10]), 2, 5)
