"""The composed VLM computes what transformers' Qwen2-VL / Qwen2.5-VL compute: logits, loss and gradients of a
padded batch with images of two resolutions and a video, M-RoPE position ids, and parameter counts."""

from __future__ import annotations

import pytest
import torch
import transformers
from loongforge.errors import LoongForgeError
from loongforge_vlm.model.flavors import FLAVORS, describe, num_params
from loongforge_vlm.model.hf_interop import from_hf
from loongforge_vlm.model.position_ids import mrope_position_ids
from loongforge_vlm.model.vlm import build_vlm
from vlm_reference import hf_config, megatron_world, mixed_batch, reference_model

TINY = ("qwen2-vl-tiny", "qwen2.5-vl-tiny")
#: Parameter totals of the published checkpoints (their safetensors index metadata).
PUBLISHED = {"qwen2-vl-2b": 2_208_985_600, "qwen2-vl-7b": 8_291_375_616, "qwen2.5-vl-3b": 3_754_622_976,
             "qwen2.5-vl-7b": 8_292_166_656}


@pytest.fixture(scope="module")
def world():
    with megatron_world() as backend:
        yield backend


def _pair(world, name):
    flavor = FLAVORS[name]
    reference = reference_model(flavor)
    ours = build_vlm(flavor, backend=world).eval()
    missing, unexpected = ours.load_state_dict(from_hf(reference.state_dict(), flavor), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    return flavor, reference, ours


def _our_inputs(batch):
    return {key: batch[key] for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
            if key in batch}


@pytest.mark.parametrize("name", TINY)
def test_logits_loss_and_grads_match_transformers(world, name):
    flavor, reference, ours = _pair(world, name)
    batch = mixed_batch(flavor)
    keep = batch["attention_mask"].bool()
    expected = reference(**batch).logits
    actual = ours(batch["input_ids"], attention_mask=batch["attention_mask"], **_our_inputs(batch))
    assert actual.shape[:2] == expected.shape[:2] and actual.shape[-1] >= flavor.foundation.vocab_size
    assert expected[keep].std() > 0.5  # not a comparison of small numbers
    diff = (actual[..., :flavor.foundation.vocab_size] - expected)[keep].abs().max().item()
    print(f"{name}: max abs logit diff {diff:.3g} (logit std {expected[keep].std():.3g})")
    assert diff <= 1e-4

    # Loss: next-token targets over the real tokens; transformers shifts itself and ignores -100.
    targets = batch["input_ids"].roll(-1, dims=1)
    scored = keep & keep.roll(1, dims=1)  # token j is a target when it and its predecessor are real
    scored[:, 0] = False
    loss_mask = scored.roll(-1, dims=1)  # ours scores at the predicting position
    hf_labels = batch["input_ids"].masked_fill(~scored, -100)
    reference.zero_grad()
    ref_loss = reference(**batch, labels=hf_labels).loss
    ref_loss.backward()
    per_token = ours(batch["input_ids"], attention_mask=batch["attention_mask"], labels=targets, **_our_inputs(batch))
    our_loss = (per_token * loss_mask).sum() / loss_mask.sum()
    our_loss.backward()
    assert abs(our_loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    grads = {
        "patch embedding": (ours.encoder.patch_embed.weight.grad.flatten(),
                            reference.model.visual.patch_embed.proj.weight.grad.flatten()),
        "last decoder norm": (ours.language_model.decoder.final_layernorm.weight.grad,
                              reference.model.language_model.norm.weight.grad),
    }
    for what, (mine, theirs) in grads.items():
        rel = ((mine - theirs).norm() / theirs.norm()).item()
        print(f"{name}: {what} grad rel-L2 {rel:.3g}")
        assert rel <= 1e-5, what


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("padding", ["left", "right", "none"])
def test_position_ids_equal_get_rope_index(name, padding):
    flavor = FLAVORS[name]
    reference = getattr(transformers, flavor.hf_architecture)(hf_config(flavor)).model
    batch = mixed_batch(flavor)
    mask = batch["attention_mask"]
    if padding == "right":  # move sample 1's padding to the end
        keep = mask[1].bool()
        batch["input_ids"][1] = torch.cat([batch["input_ids"][1][keep], batch["input_ids"][1][~keep]])
        batch["mm_token_type_ids"][1] = torch.cat([batch["mm_token_type_ids"][1][keep],
                                                   batch["mm_token_type_ids"][1][~keep]])
        mask[1] = torch.cat([mask[1][keep], mask[1][~keep]])
    extra = {}
    if flavor.tokens_per_second is not None:
        extra["second_per_grid_ts"] = torch.tensor([1.6])  # frames 3.2 positions apart
    expected, expected_deltas = reference.get_rope_index(
        batch["input_ids"], batch["mm_token_type_ids"], image_grid_thw=batch["image_grid_thw"],
        video_grid_thw=batch["video_grid_thw"], attention_mask=None if padding == "none" else mask, **extra)
    actual, deltas = mrope_position_ids(
        batch["input_ids"], spatial_merge_size=flavor.spatial_merge_size, image_token_id=flavor.image_token_id,
        video_token_id=flavor.video_token_id, image_grid_thw=batch["image_grid_thw"],
        video_grid_thw=batch["video_grid_thw"], attention_mask=None if padding == "none" else mask,
        tokens_per_second=flavor.tokens_per_second, **extra)
    assert torch.equal(actual, expected)
    assert torch.equal(deltas, expected_deltas.reshape(deltas.shape))
    assert not torch.equal(actual[0], actual[1]) and not torch.equal(actual[1], actual[2])  # truly 3D


def test_placeholder_count_mismatch_names_the_sample(world):
    flavor = FLAVORS["qwen2-vl-tiny"]
    ours = build_vlm(flavor, backend=world).eval()
    batch = mixed_batch(flavor, video=False)
    ids = batch["input_ids"].clone()
    ids[1, ids[1].tolist().index(flavor.image_token_id)] = 7  # sample 1 loses one image placeholder
    with pytest.raises(LoongForgeError, match=r"^sample 1: 3 image placeholder token\(s\), but images 1\.\.1 give 4"):
        ours.embed(ids, pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])


def test_1d_positions_give_text_rows_or_derived_mrope_ids(world):
    """Core's trainer passes 1D text positions: text alone uses them on all three rows; with images the model
    derives the M-RoPE ids from the tokens and grids, exactly as when no ids are passed."""
    flavor, reference, ours = _pair(world, "qwen2-vl-tiny")
    tokens = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(12).expand(2, -1)
    assert (ours(tokens, positions) - reference(input_ids=tokens).logits).abs().max().item() <= 1e-4
    batch = mixed_batch(flavor, video=False)
    ids, vision = batch["input_ids"], dict(pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])
    text_positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    with torch.no_grad():
        assert torch.equal(ours(ids, text_positions, batch["attention_mask"], **vision),
                           ours(ids, None, batch["attention_mask"], **vision))


def test_components_partition_the_parameters(world):
    for name in ("qwen2.5-vl-tiny", "vlm-tiny"):
        model = build_vlm(FLAVORS[name], backend=world)
        parts = {part: dict(model.component_parameters(part)) for part in ("encoder", "projector", "foundation")}
        assert sum(len(p) for p in parts.values()) == len(dict(model.named_parameters()))
        assert all(parts.values())
        prefix = "encoder.merger." if name.startswith("qwen") else "projector."
        assert all(n.startswith(prefix) for n in parts["projector"])
        assert all(n.startswith("language_model.") for n in parts["foundation"])
    with pytest.raises(LoongForgeError, match="unknown VLM component 'decoder'; known: encoder, projector, foundation"):
        model.component_parameters("decoder")


def test_vlm_tiny_trains_on_plain_positions(world):
    """SigLIP + MLP projector + a core Llama: 16 tokens per 32px image, 1D RoPE, loss decreases."""
    flavor = FLAVORS["vlm-tiny"]
    assert not flavor.uses_mrope
    torch.manual_seed(0)
    model = build_vlm(flavor, backend=world)
    images = torch.rand(2, 3, 32, 32)
    tokens = torch.randint(0, 256, (2, 24))
    tokens[:, 2:18] = flavor.image_token_id
    targets = tokens.roll(-1, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = model(tokens, labels=targets, pixel_values=images)[:, 17:-1].mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert model.encoder.patch_embed.weight.grad.abs().sum() > 0  # vision features reach the loss
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_equal_transformers(name):
    flavor = FLAVORS[name]
    with torch.device("meta"):
        reference = getattr(transformers, flavor.hf_architecture)(hf_config(flavor))
    assert num_params(flavor) == sum(p.numel() for p in reference.parameters()) == PUBLISHED[name]
    assert describe(flavor).startswith(f"vision-language model, {PUBLISHED[name] / 1e9:.2f}B params: Qwen2")


def test_distributed_checkpoint_round_trip(world, tmp_path):
    """megatron dist-checkpointing saves and restores the whole model, the replicated vision parts included."""
    from megatron.core import dist_checkpointing

    flavor = FLAVORS["qwen2.5-vl-tiny"]
    saved = build_vlm(flavor, backend=world)
    dist_checkpointing.save(saved.sharded_state_dict(), str(tmp_path))
    restored = build_vlm(flavor, backend=world)
    with torch.no_grad():
        for param in restored.parameters():
            param.zero_()
    restored.load_state_dict(dist_checkpointing.load(restored.sharded_state_dict(), str(tmp_path)))
    expected, actual = saved.state_dict(), restored.state_dict()
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[k], actual[k]) for k in expected if not k.endswith("_extra_state"))
