"""The data path feeds the plugin's tiny VLMs, and a packed row trains exactly as its samples do one by one.

Per-token losses of every sample in a packed row (attended sample by sample: varlen ``packed_seq_params``) must
equal those of the sample alone, and the loss and gradients must equal those of the dense block-diagonal mask,
for a fixed-size tower with plain RoPE (``vlm-tiny``: SigLIP + MLP projector) and a Qwen ViT with M-RoPE
(``qwen2-vl-tiny``). M-RoPE ids are left to the model: computed over a whole packed row they shift every
later sample by one constant in all three components, which rotary attention inside a segment cannot see.
"""

from __future__ import annotations

import pytest
import torch
from loongforge.interop.world import standalone_world
from loongforge.parallel.packed_rows import PackedRows
from loongforge_vlm.data.batching import split_rows
from loongforge_vlm.data.kind import byte_tokenizer_for, processor_for_vlm, shapes_dataset
from loongforge_vlm.data.processor import FixedSizeProcessor, VisionProcessor
from loongforge_vlm.model.flavors import FLAVORS
from loongforge_vlm.model.vlm import build_vlm


@pytest.fixture(scope="module")
def world():
    with standalone_world() as backend:
        yield backend


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def _relative(a, b):
    return ((a - b).norm() / b.norm()).item()


def _vision_inputs(batch):
    return {key: batch[key] for key in ("pixel_values", "image_grid_thw") if key in batch}


@pytest.mark.parametrize(("name", "seq_length", "processor_type"),
                         [("vlm-tiny", 160, FixedSizeProcessor), ("qwen2-vl-tiny", 256, VisionProcessor)])
def test_packed_rows_give_the_losses_of_their_samples(world, cache, name, seq_length, processor_type):
    flavor = FLAVORS[name]
    tokenizer, processor = byte_tokenizer_for(flavor), processor_for_vlm(flavor)
    assert isinstance(processor, processor_type)
    assert tokenizer.vision_tokens.image_pad == flavor.image_token_id
    dataset = shapes_dataset([], tokenizer, cache_dir=cache, processor=processor, count=8)
    packed, _ = split_rows(dataset, seq_length, pack=True)
    single, _ = split_rows(dataset, seq_length, pack=False)
    row = next(r for r, samples in enumerate(packed.rows) if len(samples) >= 2)
    batch = packed.batch([row])
    torch.manual_seed(0)
    model = build_vlm(flavor, backend=world).eval()
    layout = PackedRows.from_cu_seqlens(batch["cu_seqlens"], *batch["tokens"].shape)
    losses = model(batch["tokens"], labels=batch["labels"], packed_seq_params=layout, **_vision_inputs(batch))
    dense = model(batch["tokens"], attention_mask=layout.dense_mask(), labels=batch["labels"],
                  **_vision_inputs(batch))
    targets = batch["loss_mask"].bool()
    varlen_grads, dense_grads = (_grads(model, x[targets].sum()) for x in (losses, dense))
    assert _relative(losses[targets], dense[targets]) <= 1e-6 and _relative(varlen_grads, dense_grads) <= 1e-6
    alone_loss = 0.0
    for k, index in enumerate(packed.rows[row]):
        alone = single.batch([index])
        expected = model(alone["tokens"], labels=alone["labels"], **_vision_inputs(alone))[0]
        segment = batch["segment_ids"][0] == k
        n = int(segment.sum())
        mine = alone["loss_mask"][0][:n].bool()
        assert mine.sum() > 0
        assert torch.allclose(losses[0][segment][mine].detach(), expected[:n][mine].detach(), rtol=0, atol=1e-5)
        alone_loss = alone_loss + expected[:n][mine].sum()
    assert _relative(varlen_grads, _grads(model, alone_loss)) <= 2e-6  # rounding only (other RoPE positions)
