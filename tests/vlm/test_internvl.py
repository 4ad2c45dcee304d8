"""InternVL against transformers: the InternViT tower (outputs and gradients), the whole model's logits on a padded
batch of two images tiled to different tile counts, bitwise conversion both ways (in memory and through ``loongforge
convert`` from a ``save_pretrained`` directory), the dynamic tiling against transformers' own image processor, and
the real flavors' parameter counts against transformers' models built on the meta device.

Weights are perturbed with a wide spread (norm scales far from 1, large biases, position rows and CLS of unit
size, layer scales around 1) so a wrong norm, scale, token order or pixel-shuffle order cannot hide.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from loongforge.cli import main
from loongforge_vlm.data.tiling import TilingProcessor
from loongforge_vlm.encoders.internvit import INTERNVIT_FLAVORS, InternViT, from_hf_state_dict, to_hf_state_dict
from loongforge_vlm.model.flavors import FLAVORS, num_params
from loongforge_vlm.model.hf_interop import from_hf, hf_config_dict, read_hf_config, to_hf
from loongforge_vlm.model.vlm import build_vlm
from PIL import Image
from safetensors.torch import load_file
from transformers import InternVLConfig, InternVLForConditionalGeneration, InternVLVisionConfig, InternVLVisionModel
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
from vlm_reference import megatron_world

TINY = FLAVORS["internvl-tiny"]
#: Image sizes (width, height) that tile to 3 + thumbnail and to 1 tile at 16px with up to 12 tiles.
IMAGES = ((37, 13), (8, 9))


def _spread_(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "position_embeddings" in name or "cls_token" in name:
                param.copy_(noise)
            elif param.dim() > 1:
                param.copy_(noise * 1.5 / param[0].numel() ** 0.5)
            elif ("norm" in name and name.endswith("weight")) or "lambda" in name:
                param.copy_(1.0 + 0.3 * noise)
            else:
                param.copy_(0.3 * noise)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


@pytest.mark.parametrize("overrides", [{}, {"norm": "rms_norm", "qk_norm": True, "qkv_bias": False}],
                         ids=["300m-style", "6b-style"])
def test_tower_outputs_and_gradients_match_transformers(overrides):
    flavor = INTERNVIT_FLAVORS["internvit-tiny"].with_overrides(**overrides)
    ref = InternVLVisionModel(InternVLVisionConfig(**flavor.to_hf_config(), attn_implementation="eager")).eval()
    _spread_(ref, seed=0)
    ours = InternViT(flavor).eval()
    ours.load_state_dict(from_hf_state_dict(ref.state_dict(), flavor), strict=True)
    gen = torch.Generator().manual_seed(1)
    pixels = torch.randn(3, 3, 16, 16, generator=gen)
    probe = torch.randn(3, 16, flavor.dim, generator=gen) / (3 * 16 * flavor.dim) ** 0.5
    outputs, pixel_grads = [], []
    for call in (lambda x: ref(x).last_hidden_state[:, 1:], ours):
        x = pixels.clone().requires_grad_(True)
        out = call(x)
        (out * probe).sum().backward()
        outputs.append(out.detach())
        pixel_grads.append(x.grad)
    assert outputs[0].std() > 0.5
    for theirs, mine in (outputs, pixel_grads):
        diff = (mine - theirs).abs().max().item()
        print(f"tower {overrides}: max abs {diff:.3g} rel {diff / theirs.abs().max().item():.3g}")
        assert diff <= 1e-4 and ((mine - theirs).norm() / theirs.norm()).item() <= 1e-5
    our_grads = to_hf_state_dict({n: p.grad for n, p in ours.named_parameters()}, flavor)
    for name, param in ref.named_parameters():
        gap = (our_grads[name] - param.grad).norm().item()
        if name.endswith("k_proj.bias"):  # softmax ignores a per-query constant: this gradient is 0 up to rounding
            assert param.grad.norm() < 1e-5 and gap < 1e-5, name
        else:
            assert gap <= 1e-5 * param.grad.norm().item(), name


def _reference(flavor):
    model = InternVLForConditionalGeneration(InternVLConfig(**hf_config_dict(flavor), attn_implementation="eager"))
    _spread_(model.float().eval(), seed=2)
    return model


def _batch(flavor):
    """Two left/right-padded samples, one image each, tiled by our processor: 4 tiles (16 tokens) and 1 (4)."""
    processor = TilingProcessor.for_encoder(flavor.encoder, merge_size=flavor.projector.merge)
    rng = np.random.default_rng(3)
    gen = torch.Generator().manual_seed(4)
    rows, masks, tiles = [], [], []
    for width, height in IMAGES:
        pixels, grid = processor.image(Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)))
        tiles.append(torch.from_numpy(pixels))
        text = torch.randint(0, 259, (9,), generator=gen).tolist()
        image = [flavor.image_token_id] * processor.num_tokens(grid)
        rows.append(text[:4] + [flavor.vision_start_token_id, *image, flavor.vision_end_token_id] + text[4:])
    assert [t.shape[0] for t in tiles] == [4, 1]
    length = max(map(len, rows))
    for sample, row in enumerate(rows):  # sample 1 left-padded
        pad = length - len(row)
        rows[sample] = row + [0] * pad if sample == 0 else [0] * pad + row
        masks.append([1] * len(row) + [0] * pad if sample == 0 else [0] * pad + [1] * len(row))
    mask = torch.tensor(masks)
    return {"input_ids": torch.tensor(rows), "attention_mask": mask, "pixel_values": torch.cat(tiles),
            "position_ids": ((mask.cumsum(-1) - 1) * mask).clamp(min=0)}


@pytest.fixture
def world():
    with megatron_world() as backend:
        yield backend


@pytest.mark.parametrize("foundation", [None, "qwen3-tiny"], ids=["qwen2", "qwen3-tied"])
def test_logits_match_transformers_with_two_tiled_images(world, foundation):
    from loongforge.models.qwen import FLAVORS as QWEN

    flavor = TINY if foundation is None else TINY.with_overrides(foundation=QWEN[foundation])
    reference = _reference(flavor)
    ours = build_vlm(flavor, backend=world).eval()
    missing, unexpected = ours.load_state_dict(from_hf(reference.state_dict(), flavor), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    batch = _batch(flavor)
    keep = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = reference(**batch).logits
        actual = ours(batch["input_ids"], attention_mask=batch["attention_mask"], pixel_values=batch["pixel_values"])
    actual = actual[..., :flavor.foundation.vocab_size]
    assert expected[keep].std() > 0.5
    diff = (actual - expected)[keep].abs().max().item()
    print(f"internvl {foundation or 'qwen2'}: max abs logit diff {diff:.3g}, max rel "
          f"{diff / expected[keep].abs().max().item():.3g} (logit std {expected[keep].std():.3g})")
    assert diff <= 1e-4
    # The images matter: a batch without their features computes other logits at and after them.
    pixels = batch["pixel_values"].flip(0)
    with torch.no_grad():
        swapped = ours(batch["input_ids"], attention_mask=batch["attention_mask"], pixel_values=pixels)
    assert (swapped[..., :flavor.foundation.vocab_size] - expected)[keep].abs().max() > 1e-2


def test_hf_ours_hf_and_ours_hf_ours_are_bitwise(world):
    theirs = _reference(TINY).state_dict()
    assert _equal(to_hf(from_hf(theirs, TINY), TINY), theirs)
    ours = build_vlm(TINY, backend=world)
    with torch.no_grad():
        for param in ours.parameters():
            param.normal_()
    state = {k: v for k, v in ours.state_dict().items() if not k.endswith("_extra_state")}
    assert _equal(from_hf(to_hf(state, TINY), TINY), state)


def test_convert_round_trip_from_save_pretrained_is_bitwise(tmp_path, capsys):
    """transformers' own files -> a LoongForge checkpoint -> transformers' files again, tensor for tensor; and
    transformers loads what we wrote into the same weights."""
    reference = _reference(TINY)
    reference.save_pretrained(tmp_path / "hf")
    assert read_hf_config(tmp_path / "hf") == TINY
    assert main(["convert", "hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    assert "as model 'internvl-tiny' (fp32)" in capsys.readouterr().out
    assert main(["convert", "mcore-to-hf", str(tmp_path / "ours"), str(tmp_path / "back")]) == 0
    original = load_file(tmp_path / "hf" / "model.safetensors")
    assert _equal(load_file(tmp_path / "back" / "model.safetensors"), original)
    reloaded = InternVLForConditionalGeneration.from_pretrained(tmp_path / "back")
    assert _equal(reloaded.state_dict(), reference.state_dict())


def test_tiling_equals_transformers_image_processor():
    """Our tiles are bitwise transformers' (``GotOcr2ImageProcessorPil``, InternVL's processor with its
    ``crop_to_patches`` on) for odd sizes: wide, tall, square (the larger-grid tie), tiny, and a tile limit."""
    rng = np.random.default_rng(0)
    for max_tiles, sizes in ((6, ((37, 13), (13, 29), (50, 50), (8, 9), (100, 21))), (1, ((37, 13),))):
        reference = GotOcr2ImageProcessorPil(size={"height": 16, "width": 16}, crop_to_patches=True, min_patches=1,
                                             max_patches=max_tiles, image_mean=[0.485, 0.456, 0.406],
                                             image_std=[0.229, 0.224, 0.225])
        ours = TilingProcessor(tile_size=16, patch_size=4, merge_size=2, max_tiles=max_tiles)
        for width, height in sizes:
            image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
            expected = reference(image, return_tensors="np")
            pixels, grid = ours.image(image)
            assert grid == ours.grid(width, height) == (expected["num_patches"][0], 4, 4), (width, height)
            assert np.array_equal(pixels, np.asarray(expected["pixel_values"])), (width, height)
            assert ours.num_tokens(grid) == 4 * expected["num_patches"][0]


@pytest.mark.parametrize("name", ["internvl3-1b", "internvl3-2b", "internvl3-8b"])
def test_real_flavor_parameter_counts_equal_transformers(name):
    flavor = FLAVORS[name]
    with torch.device("meta"):
        model = transformers.InternVLForConditionalGeneration(InternVLConfig(**hf_config_dict(flavor)))
    assert num_params(flavor) == sum(p.numel() for p in model.parameters())
