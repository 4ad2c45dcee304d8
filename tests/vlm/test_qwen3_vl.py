"""Qwen3-VL against transformers' ``qwen3_vl``: the vision tower with DeepStack (outputs and gradients), the whole
model's logits with two images of different sizes in one batch (DeepStack injection, interleaved M-RoPE), bitwise
Hugging Face round trips, and the parameter counts of the published sizes (training: test_vlm_train.py)."""

from __future__ import annotations

import pytest
import torch
import transformers
from loongforge.errors import LoongForgeError
from loongforge_vlm.encoders.qwen_vit import QwenViT
from loongforge_vlm.encoders.qwen_vit_adapter import from_hf, to_hf
from loongforge_vlm.model.flavors import FLAVORS
from loongforge_vlm.model.hf_interop import flavor_from_hf_config, hf_config_dict
from loongforge_vlm.model.hf_interop import from_hf as vlm_from_hf
from loongforge_vlm.model.hf_interop import to_hf as vlm_to_hf
from loongforge_vlm.model.vlm import build_vlm
from qwen_vit_reference import QWEN3, batch, max_abs, reference_model, rel_l2
from vlm_reference import megatron_world, mixed_batch
from vlm_reference import reference_model as reference_vlm

#: Two images and a 2-frame video: learned positions resampled to three grids, attention within each frame.
IMAGES_AND_VIDEO = ((1, 6, 8), (1, 4, 4), (2, 2, 4))


def test_vision_tower_matches_transformers_with_deepstack():
    reference = reference_model(QWEN3)
    ours = QwenViT(QWEN3)
    ours.load_state_dict(from_hf(reference.state_dict(), QWEN3))
    pixels, grid_thw = batch(QWEN3, IMAGES_AND_VIDEO)
    theirs_in, ours_in = pixels.clone().requires_grad_(), pixels.clone().requires_grad_()
    output = reference(theirs_in, grid_thw)
    theirs = [output.pooler_output, *output.deepstack_features]
    merged, deepstack = ours.encode(ours_in, grid_thw)
    mine = [merged, *deepstack]
    assert len(mine) == len(theirs) == 1 + len(QWEN3.deepstack_layers)
    generator = torch.Generator().manual_seed(2)
    weights = [torch.randn(t.shape, generator=generator) for t in theirs]
    sum((t * w).sum() for t, w in zip(theirs, weights, strict=True)).backward()
    sum((t * w).sum() for t, w in zip(mine, weights, strict=True)).backward()
    for a, b in zip(mine, theirs, strict=True):
        assert a.shape == (sum(t * h * w for t, h, w in IMAGES_AND_VIDEO) // 4, QWEN3.out_dim)
        assert b.abs().mean() > 0.1
        assert max_abs(a, b) < 1e-5 and rel_l2(a, b) < 1e-6
    assert max_abs(ours_in.grad, theirs_in.grad) < 1e-5 and rel_l2(ours_in.grad, theirs_in.grad) < 1e-6
    ours_grads = to_hf({name: p.grad for name, p in ours.named_parameters()}, QWEN3)
    for name, grad in reference.named_parameters():
        assert grad.grad.abs().max() > 0, name
        assert rel_l2(ours_grads[name], grad.grad) < 1e-5, name


# -- the whole model -----------------------------------------------------------------------------------------

TINY = FLAVORS["qwen3-vl-tiny"]
MOE = FLAVORS["qwen3-vl-moe-tiny"]


@pytest.fixture(scope="module")
def world():
    with megatron_world() as backend:
        yield backend


def test_logits_loss_and_grads_match_transformers(world):
    """Two images of different sizes in a left-padded batch: the merged tokens, DeepStack into decoder layers 0 and
    1, interleaved M-RoPE over the image grids, QK-norm and the LM head all have to agree."""
    reference = reference_vlm(TINY)
    ours = build_vlm(TINY, backend=world).eval()
    missing, unexpected = ours.load_state_dict(vlm_from_hf(reference.state_dict(), TINY), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    batch = mixed_batch(TINY, video=False)
    images = {key: batch[key] for key in ("pixel_values", "image_grid_thw")}
    keep = batch["attention_mask"].bool()
    expected = reference(**batch).logits
    vocab = TINY.foundation.vocab_size
    actual = ours(batch["input_ids"], attention_mask=batch["attention_mask"], **images)[..., :vocab]
    assert expected[keep].std() > 0.5  # O(1) logits: the tolerance below means something
    assert max_abs(actual[keep], expected[keep]) <= 2e-5

    targets = batch["input_ids"].roll(-1, dims=1)
    scored = keep & keep.roll(1, dims=1)
    scored[:, 0] = False
    loss_mask = scored.roll(-1, dims=1)
    ref_loss = reference(**batch, labels=batch["input_ids"].masked_fill(~scored, -100)).loss
    ref_loss.backward()
    per_token = ours(batch["input_ids"], attention_mask=batch["attention_mask"], labels=targets, **images)
    our_loss = (per_token * loss_mask).sum() / loss_mask.sum()
    our_loss.backward()
    assert abs(our_loss.item() - ref_loss.item()) <= 1e-5 * ref_loss.item()
    visual = reference.model.visual
    grads = {  # the DeepStack mergers learn only through the decoder layers they feed
        "deepstack merger": (ours.encoder.deepstack_mergers[1].fc2.weight, visual.deepstack_merger_list[1].linear_fc2),
        "position grid": (ours.encoder.pos_embed.weight, visual.pos_embed),
        "patch embedding bias": (ours.encoder.patch_embed.bias, visual.patch_embed.proj),
    }
    for what, (mine, module) in grads.items():
        theirs = (module.weight if what != "patch embedding bias" else module.bias).grad
        assert theirs.abs().max() > 0 and rel_l2(mine.grad, theirs) <= 1e-5, what


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in b)


def _read_directory(directory, flavor):
    """A Hugging Face directory as core reads it: the adapter's tensor check, then the adapter's ``from_hf``."""
    from loongforge.interop.hf_checkpoint import check_hf_tensors, index_hf_tensors, load_hf_tensors

    infos = index_hf_tensors(directory)
    check_hf_tensors(infos, flavor, directory)
    return flavor.hf_adapter().from_hf(load_hf_tensors(infos))


@pytest.mark.parametrize("flavor", [TINY, MOE], ids=["dense", "moe"])
def test_round_trips_are_bitwise_both_ways(world, flavor, tmp_path):
    """In memory both ways; then files: transformers' ``save_pretrained`` directory reads as its in-memory weights
    do, and the directory we write (Qwen3-VL-MoE's experts in the published ``[E, H, 2I]`` / ``[E, I, H]``
    orientation) loads in transformers as the very weights we wrote."""
    from loongforge.interop.hf_checkpoint import write_hf_checkpoint

    reference = reference_vlm(flavor)
    theirs = reference.state_dict()
    ours = vlm_from_hf(theirs, flavor)
    assert _equal(vlm_to_hf(ours, flavor), theirs)
    model = build_vlm(flavor, backend=world, seed=3)
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert _equal(vlm_from_hf(vlm_to_hf(state, flavor), flavor), state)
    # config.json both ways: the interleaved M-RoPE, the DeepStack blocks and the experts survive; transformers reads it
    config = hf_config_dict(flavor)
    assert flavor_from_hf_config(config) == flavor
    config_class = getattr(transformers, flavor.hf_architecture.replace("ForConditionalGeneration", "Config"))
    assert config_class(**config).text_config.rope_parameters["mrope_interleaved"] is True

    reference.save_pretrained(tmp_path / "theirs")
    assert _equal(_read_directory(tmp_path / "theirs", flavor), ours)
    adapter = flavor.hf_adapter()
    files = adapter.to_hf(state)
    if flavor.foundation.num_experts:
        text = flavor.foundation
        stored = files["model.language_model.layers.2.mlp.experts.gate_up_proj"]
        assert stored.shape == (text.num_experts, text.hidden_size, 2 * text.moe_ffn_hidden_size)
    write_hf_checkpoint(tmp_path / "ours", files, adapter.config_json("fp32"))
    loaded = getattr(transformers, flavor.hf_architecture).from_pretrained(tmp_path / "ours")
    assert _equal(loaded.state_dict(), vlm_to_hf(state, flavor))
    assert _equal(_read_directory(tmp_path / "ours", flavor), state)


#: The published Qwen/Qwen3-VL-*-Instruct config.json values, written out here independently of the flavor table.
_VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
               num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24])
_SMALL_VISION = dict(_VISION, depth=24, hidden_size=1024, intermediate_size=4096, deepstack_visual_indexes=[5, 11, 17])
_TEXT = dict(vocab_size=151936, head_dim=128, max_position_embeddings=262144,
             rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                              "mrope_interleaved": True})
PUBLISHED = {
    "qwen3-vl-2b": ("Qwen3VL", True, dict(_SMALL_VISION, out_hidden_size=2048), dict(
        _TEXT, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8)),
    "qwen3-vl-8b": ("Qwen3VL", False, dict(_VISION, out_hidden_size=4096), dict(
        _TEXT, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8)),
    "qwen3-vl-30b-a3b": ("Qwen3VLMoe", False, dict(_VISION, out_hidden_size=2048), dict(
        _TEXT, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4)),
    "qwen3-vl-235b-a22b": ("Qwen3VLMoe", False, dict(_VISION, out_hidden_size=4096), dict(
        _TEXT, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536, num_experts=128,
        num_experts_per_tok=8, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4)),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_real_flavors_are_the_published_configs(name):
    """Each real flavor is what its published config reads as (architecture, experts and router included) and has
    transformers' parameter count."""
    prefix, tied, vision, text = PUBLISHED[name]
    config = getattr(transformers, f"{prefix}Config")(vision_config=vision, text_config=text,
                                                      tie_word_embeddings=tied)
    assert flavor_from_hf_config(config.to_dict()) == FLAVORS[name]
    with torch.device("meta"):
        reference = getattr(transformers, f"{prefix}ForConditionalGeneration")(config)
    unique = {id(p): p.numel() for p in reference.parameters()}
    assert FLAVORS[name].num_params() == sum(unique.values())


def test_what_deepstack_cannot_run_is_refused_in_one_line(world):
    from loongforge.parallel.megatron import Layout

    layout = dict(tp=2, dp=1, sequence_parallel=True, distributed_optimizer=False)
    assert TINY.check_layout(Layout(pp=1, **layout)) == []  # tp + sequence parallelism: the residuals scatter
    (problem,) = TINY.check_layout(Layout(pp=3, **layout))
    assert problem.message.startswith("Qwen3-VL's DeepStack runs with pp=1 and cp=1 (got pp=3, cp=1)")
    with pytest.raises(LoongForgeError, match="granularity 'full' is not supported with Qwen3-VL's DeepStack"):
        build_vlm(TINY, backend=world, extra_config={"recompute_granularity": "full", "recompute_method": "uniform",
                                                     "recompute_num_layers": 1})

