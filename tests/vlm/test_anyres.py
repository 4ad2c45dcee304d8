"""AnyRes tiling for a SigLIP tower against transformers' LLaVA-OneVision, built tiny from a config written here.

The reference is ``LlavaOnevisionForConditionalGeneration`` (SigLIP tower read before its final LayerNorm, a GELU
projector, a Qwen2 decoder, grid pinpoints up to 3x3 tiles of 16px) with noise added to every weight, imported into
our composed model through the plugin's Hugging Face path (its ``config.json`` read into a flavor, its state dict
mapped). Checked: our processor's pixels and image sizes against transformers' PIL processor; logits on a padded batch
of a wide and a tall image (unpadded along different axes), once within the token budget and once shrunk to it
(``anyres_max_2``); and every parameter's gradient of a loss through both models. A multi-image sample beside a
single-image one (transformers' ``batch_num_images``): its images padded to squares, one tile each, pixels and logits
equal.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from loongforge_vlm.data.processor import processor_for
from loongforge_vlm.model.flavors import VLMFlavor
from loongforge_vlm.model.hf_interop import flavor_from_hf_config, from_hf, hf_config_dict, saved_layout, to_hf
from loongforge_vlm.model.vlm import build_vlm
from PIL import Image
from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, Qwen2Config, SiglipVisionConfig
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil
from vlm_reference import megatron_world

TILE = 16
#: Every arrangement of 16px tiles up to 3x3, as (height, width).
PINPOINTS = [[rows * TILE, cols * TILE] for rows in (1, 2, 3) for cols in (1, 2, 3)]
IMAGE_TOKEN = 380
#: (width, height): a wide image on a 1x3 grid (rows of padding cut: 2x12 features) and a tall one on a 3x2 grid
#: (columns cut: 12x6, shrunk to 8x4 at anyres_max_2).
BATCH_IMAGES = ((100, 21), (23, 41))
#: Two samples: two images of different sizes (not tiled: padded squares, one tile each), then one tall image (tiled).
MULTI_IMAGE_SAMPLES = (((100, 21), (30, 57)), ((23, 41),))


def _config(budget: int) -> LlavaOnevisionConfig:
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_attention_heads=2, num_hidden_layers=2,
                                patch_size=4, image_size=TILE, vision_use_head=False)
    text = Qwen2Config(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=384, max_position_embeddings=1024, rms_norm_eps=1e-6,
                       rope_parameters={"rope_type": "default", "rope_theta": 100.0}, tie_word_embeddings=False)
    return LlavaOnevisionConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                                video_token_index=381, image_grid_pinpoints=PINPOINTS, vision_feature_layer=-1,
                                vision_feature_select_strategy="full", vision_aspect_ratio=f"anyres_max_{budget}",
                                attn_implementation="eager")


def _perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Noise on every weight: norm scales and biases of order 0.3, matrices a fifth of their init spread again."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=gen)
            spread = 0.5 / param[0].numel() ** 0.5 if param.dim() > 1 else 0.3
            param.add_(noise * spread)
    return model.float().eval()


def _image(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _reference_processor(flavor: VLMFlavor) -> LlavaOnevisionImageProcessorPil:
    return LlavaOnevisionImageProcessorPil(size={"height": TILE, "width": TILE}, image_grid_pinpoints=PINPOINTS,
                                           image_mean=[0.5] * 3, image_std=[0.5] * 3)


def test_pixels_and_sizes_equal_transformers_image_processor():
    flavor = flavor_from_hf_config(_config(9).to_dict())
    ours = processor_for(flavor.encoder, merge_size=flavor.projector.merge)
    rng = np.random.default_rng(0)
    images = [_image(rng, w, h) for w, h in ((37, 13), (23, 41), (50, 50), (9, 8), (100, 21))]
    expected = _reference_processor(flavor)(images, return_tensors="np")
    worst = 0.0
    for image, theirs, size in zip(images, expected["pixel_values"], expected["image_sizes"], strict=True):
        pixels, grid = ours.image(image)
        assert grid == ours.grid(*image.size) and tuple(grid[1:]) == tuple(size), (image.size, grid, size)
        worst = max(worst, float(np.abs(pixels - theirs[:len(pixels)]).max()))
        assert not theirs[len(pixels):].any()  # transformers pads the batch with zero tiles, nothing else
    print(f"anyres pixels: max abs diff {worst:.3g}")
    assert worst <= 1e-6


def test_multi_image_sample_pixels_equal_transformers_image_processor():
    """Nested lists give transformers ``batch_num_images``: the images of a multi-image sample are padded to squares
    of the mean colour and squashed to one tile each, the lone image is tiled."""
    flavor = flavor_from_hf_config(_config(9).to_dict())
    processor = processor_for(flavor.encoder, merge_size=flavor.projector.merge)
    rng = np.random.default_rng(1)
    samples = [[_image(rng, w, h) for w, h in sizes] for sizes in MULTI_IMAGE_SAMPLES]
    expected = _reference_processor(flavor)(samples, return_tensors="np")
    assert expected["batch_num_images"].tolist() == [2, 1]
    ours = [processor.for_sample(len(images)).image(image) for images in samples for image in images]
    assert [grid[0] for _, grid in ours] == [1, 1, processor.grid(23, 41)[0]]
    worst = 0.0
    for (pixels, grid), theirs, size in zip(ours, expected["pixel_values"], expected["image_sizes"], strict=True):
        assert tuple(grid[1:]) == tuple(size) and not theirs[len(pixels):].any()
        worst = max(worst, float(np.abs(pixels - theirs[:len(pixels)]).max()))
    print(f"anyres multi-image pixels: max abs diff {worst:.3g}")
    assert worst <= 1e-6


@pytest.fixture  # per test: loongforge convert starts a megatron world of its own
def world():
    with megatron_world() as backend:
        yield backend


def _batch(flavor: VLMFlavor, samples=tuple((size,) for size in BATCH_IMAGES)) -> dict[str, torch.Tensor]:
    """Two samples of the given image sizes (placeholders as our processor counts them, a text token between two
    images); sample 1 left-padded."""
    processor = processor_for(flavor.encoder, merge_size=flavor.projector.merge)
    rng = np.random.default_rng(3)
    gen = torch.Generator().manual_seed(4)
    rows, tiles, grids = [], [], []
    for sizes in samples:
        counts = []
        for width, height in sizes:
            pixels, grid = processor.for_sample(len(sizes)).image(_image(rng, width, height))
            tiles.append(torch.from_numpy(pixels))
            grids.append(grid)
            counts.append(processor.num_tokens(grid))
        text = torch.randint(0, 300, (10,), generator=gen).tolist()
        vision = [token for count in counts for token in [IMAGE_TOKEN] * count + text[-1:]][:-1]
        rows.append(text[:4] + vision + text[4:])
    length = max(map(len, rows))
    pads = [length - len(row) for row in rows]
    ids = [rows[0] + [0] * pads[0], [0] * pads[1] + rows[1]]
    mask = torch.tensor([[1] * len(rows[0]) + [0] * pads[0], [0] * pads[1] + [1] * len(rows[1])])
    grid_thw = torch.tensor(grids)
    return {"input_ids": torch.tensor(ids), "attention_mask": mask, "pixel_values": torch.cat(tiles),
            "image_grid_thw": grid_thw, "image_sizes": grid_thw[:, 1:],
            "batch_num_images": torch.tensor([len(sizes) for sizes in samples]),
            "position_ids": ((mask.cumsum(-1) - 1) * mask).clamp(min=0)}


def _ours(batch: dict[str, torch.Tensor], model: torch.nn.Module, vocab: int) -> torch.Tensor:
    return model(batch["input_ids"], attention_mask=batch["attention_mask"], pixel_values=batch["pixel_values"],
                 image_grid_thw=batch["image_grid_thw"])[..., :vocab]


def _theirs(batch: dict[str, torch.Tensor], model: torch.nn.Module) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 pixel_values=batch["pixel_values"], image_sizes=batch["image_sizes"],
                 batch_num_images=batch["batch_num_images"], position_ids=batch["position_ids"]).logits


def _loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token loss on the real tokens, targets the inputs themselves shifted (image positions included)."""
    keep = batch["attention_mask"][:, 1:].bool()
    targets = batch["input_ids"][:, 1:][keep] % 300
    return torch.nn.functional.cross_entropy(logits[:, :-1][keep], targets)


@pytest.mark.parametrize("budget", [9, 2], ids=["within-budget", "shrunk"])
def test_logits_and_gradients_match_transformers(world, budget):
    reference = _perturbed(LlavaOnevisionForConditionalGeneration(_config(budget)), seed=budget)
    flavor = flavor_from_hf_config(reference.config.to_dict())
    assert flavor.encoder.anyres and not flavor.encoder.post_norm and flavor.encoder.anyres_max_tiles == budget
    ours = build_vlm(flavor, backend=world).eval()
    missing, unexpected = ours.load_state_dict(from_hf(reference.state_dict(), flavor), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    batch = _batch(flavor)
    keep = batch["attention_mask"].bool()
    expected = _theirs(batch, reference)
    actual = _ours(batch, ours, flavor.foundation.vocab_size)
    assert expected[keep].std() > 0.5
    diff = (actual - expected)[keep].abs().max().item()
    print(f"anyres logits (anyres_max_{budget}): max abs diff {diff:.3g}, max rel "
          f"{diff / expected[keep].abs().max().item():.3g}")
    assert diff <= 1e-4

    _loss(expected, batch).backward()
    _loss(actual, batch).backward()
    grads = to_hf({name: param.grad for name, param in ours.named_parameters()}, flavor)
    worst = 0.0
    for name, param in reference.named_parameters():
        if param.grad is None:  # the tower's final LayerNorm: LLaVA-OneVision does not use it
            assert "post_layernorm" in name, name
            continue
        gap, size = (grads[name] - param.grad).norm().item(), param.grad.norm().item()
        if name.startswith("model.vision_tower.") and name.endswith("k_proj.bias"):  # softmax ignores it: ~0
            assert size < 1e-5 and gap < 1e-5, name
            continue
        worst = max(worst, gap / size)
        assert gap <= 1e-4 * size, (name, gap, size)
    print(f"anyres gradients (anyres_max_{budget}): worst relative L2 gap {worst:.3g}")
    assert reference.model.image_newline.grad.norm() > 0


def test_multi_image_sample_logits_match_transformers(world):
    """A sample of two images beside one of a single image: transformers (given ``batch_num_images``) encodes the two
    as one padded tile each, its features then one newline; ours reads the same from their one-tile grid rows."""
    reference = _perturbed(LlavaOnevisionForConditionalGeneration(_config(2)), seed=7)
    flavor = flavor_from_hf_config(reference.config.to_dict())
    ours = build_vlm(flavor, backend=world).eval()
    ours.load_state_dict(from_hf(reference.state_dict(), flavor), strict=False)
    batch = _batch(flavor, MULTI_IMAGE_SAMPLES)
    untiled = (TILE // flavor.encoder.patch_size) ** 2 + 1  # one tile's features and the newline
    assert batch["image_grid_thw"][:, 0].tolist()[:2] == [1, 1]
    assert (batch["input_ids"][0] == IMAGE_TOKEN).sum() == 2 * untiled
    keep = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = _theirs(batch, reference)
        actual = _ours(batch, ours, flavor.foundation.vocab_size)
    assert expected[keep].std() > 0.5
    diff = (actual - expected)[keep].abs().max().item()
    print(f"anyres multi-image logits: max abs diff {diff:.3g}, max rel {diff / expected[keep].abs().max().item():.3g}")
    assert diff <= 1e-4


def test_round_trips_are_bitwise_in_memory_and_through_saved_names(world):
    reference = _perturbed(LlavaOnevisionForConditionalGeneration(_config(9)), seed=5)
    flavor = flavor_from_hf_config(reference.config.to_dict())
    assert flavor_from_hf_config(hf_config_dict(flavor)) == flavor
    theirs = reference.state_dict()
    ours = from_hf(theirs, flavor)
    back = to_hf(ours, flavor)
    assert back.keys() == theirs.keys()
    for name, tensor in theirs.items():
        if "post_layernorm" in name:  # unused by the model: written as the identity
            identity = torch.ones_like(tensor) if name.endswith("weight") else torch.zeros_like(tensor)
            assert torch.equal(back[name], identity), name
        else:
            assert torch.equal(back[name], tensor), name
    again = from_hf(saved_layout(back, flavor), flavor)
    assert again.keys() == ours.keys() and all(torch.equal(again[k], ours[k]) for k in ours)


def test_convert_commands_round_trip_a_saved_directory_to_the_same_logits(tmp_path):
    """``loongforge convert hf-to-mcore`` then ``mcore-to-hf``: no registered flavor has an AnyRes SigLIP, so the
    checkpoint's config names the nearest one with the whole encoder as an override mapping, which the export must
    rebuild. The exported directory loads in transformers and computes the original's logits."""
    from loongforge.cli import main
    from loongforge_vlm.model.hf_interop import read_hf_config

    with torch.random.fork_rng():  # transformers' own init under the noise: seeded, so the logits' spread is fixed
        torch.manual_seed(0)
        reference = _perturbed(LlavaOnevisionForConditionalGeneration(_config(2)), seed=2)
    reference.save_pretrained(tmp_path / "hf")
    assert main(["convert", "hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    assert main(["convert", "mcore-to-hf", str(tmp_path / "ours"), str(tmp_path / "back")]) == 0
    flavor = read_hf_config(tmp_path / "back")
    assert flavor == read_hf_config(tmp_path / "hf")
    exported = LlavaOnevisionForConditionalGeneration.from_pretrained(tmp_path / "back", attn_implementation="eager")
    batch = _batch(flavor)
    keep = batch["attention_mask"].bool()
    with torch.no_grad():
        expected, actual = _theirs(batch, reference), _theirs(batch, exported.float().eval())
    diff = (actual - expected)[keep].abs().max().item()
    print(f"anyres export through loongforge convert: max abs logit diff {diff:.3g}, std {expected[keep].std():.3g}")
    assert expected[keep].std() > 0.5 and diff <= 1e-5


def test_dp_balance_costs_an_anyres_image_by_its_tiles(tmp_path):
    """What data-parallel balancing hands the cost model for AnyRes samples: the tower's work is each tile's patches
    (a tile attends alone), not the image's size in pixels that its grid row holds; its tokens hold the image's
    packed features (the counts the logits tests hold to transformers). The images of a two-image sample cost one tile
    each."""
    from loongforge_vlm.data.balanced import BalancedBatches
    from loongforge_vlm.data.batching import VisionRowDataset
    from loongforge_vlm.data.dataset import VisionChatDataset
    from loongforge_vlm.data.sources import JsonlSource
    from vlm_data_helpers import TOKENIZER, ask, png, write_jsonl

    flavor = flavor_from_hf_config(_config(9).to_dict())
    processor = processor_for(flavor.encoder, merge_size=flavor.projector.merge)
    files = {f"{w}x{h}.png": png(w, h, seed=w) for w, h in BATCH_IMAGES}
    lines = [{"image": name, "messages": ask("What is it?", "noise")} for name in files]
    lines.append({"images": list(files), "messages": ask("Which is wider?", "the first", images=2)})
    dataset = VisionChatDataset([JsonlSource(write_jsonl(tmp_path / "d.jsonl", lines, files))], TOKENIZER, processor)
    rows = VisionRowDataset(dataset, range(len(lines)), 512, pack=True)
    sent: list[dict[str, torch.Tensor]] = []
    next(BalancedBatches(rows, 1, 0, balance=lambda samples: sent.extend(samples) or samples,
                         num_microbatches=len(rows)))
    patches = (TILE // flavor.encoder.patch_size) ** 2
    # base tile, then rows and their newlines; untiled (one tile): its features and one newline
    tokens = {(21, 100): 16 + 2 * (12 + 1), (41, 23): 16 + 12 * (6 + 1), 1: 16 + 1}
    assert sorted(len(wire["image_grid_thw"]) for wire in sent) == [1, 1, 2]
    for wire in sent:
        grid = wire["image_grid_thw"].tolist()
        tiles = sum(row[0] for row in grid)
        assert all((row[0] == 1) == (len(grid) == 2) for row in grid), grid
        assert wire["pixel_values"].shape[0] == tiles
        assert wire["encoder_work"].tolist() == [tiles * patches, tiles * patches ** 2]
        expected = sum(tokens[1] if n == 1 else tokens[height, width] for n, height, width in grid)
        assert (wire["tokens"] == TOKENIZER.vision_tokens.image_pad).sum() == expected
