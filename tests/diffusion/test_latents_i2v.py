"""Image-to-video conditioning in the latent cache: ``loongforge cache-latents --i2v --image-encoder`` stores, per clip,
exactly what diffusers' ``WanImageToVideoPipeline`` computes from the clip's first frame (``prepare_latents``'
condition: the first-frame mask and the normalised VAE mode of the first frame followed by black frames;
``encode_image``'s CLIP tokens), with a tiny VAE, UMT5 and CLIP vision encoder built from configs. A Wan 2.1
I2V-shaped DiT then trains on the cache through ``loongforge train``, and a flavor that does not fit the cache's
conditioning is one line from ``loongforge check``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from loongforge.cli import main
from loongforge_diffusion.data import moving_squares
from loongforge_diffusion.data.latents import CachedLatentDataset
from loongforge_diffusion.data.moving_squares import TensorVideoDataset
from PIL import Image
from safetensors.torch import load_file
from test_latents import TEXT_DIM, TEXT_LEN, _tiny_text_encoder, _tiny_vae

ROOT = Path(__file__).resolve().parents[2]
FRAMES, SIDE, CLIP_SIDE, CLIP_DIM = 5, 32, 32, 24
LATENT, CONDITION = 4, 4 + 4  # the tiny VAE's channels; the I2V mask's 4 channels in front of them


def _tiny_clip(directory: Path):
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(1)
    model = CLIPVisionModel(CLIPVisionConfig(hidden_size=CLIP_DIM, intermediate_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=CLIP_SIDE, patch_size=8))
    model.save_pretrained(directory)
    CLIPImageProcessor(size={"shortest_edge": CLIP_SIDE},
                       crop_size={"height": CLIP_SIDE, "width": CLIP_SIDE}).save_pretrained(directory)
    return model.eval()


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("i2v")
    vae, encoder, clip = _tiny_vae(root / "vae"), _tiny_text_encoder(root / "umt5"), _tiny_clip(root / "clip")
    squares = moving_squares.write(root / "squares.pt", moving_squares.MovingSquares(
        3, seed=5, geometry=moving_squares.Geometry(frames=FRAMES, side=SIDE, speed=2)))
    args = ["--vae", str(root / "vae"), "--text-encoder", str(root / "umt5"), "--videos", str(squares),
            "--text-len", str(TEXT_LEN), "--batch", "2"]
    assert main(["cache-latents", *args, "--i2v", "--image-encoder", str(root / "clip"),
                 "--out", str(root / "cache")]) == 0
    assert main(["cache-latents", *args, "--out", str(root / "t2v-cache")]) == 0
    return {"root": root, "vae": vae, "encoder": encoder, "clip": clip, "squares": squares}


def test_the_cache_holds_what_wans_i2v_pipeline_computes_from_each_first_frame(made):
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline
    from transformers import AutoTokenizer, CLIPImageProcessor

    root = made["root"]
    pipe = WanImageToVideoPipeline(
        tokenizer=AutoTokenizer.from_pretrained(root / "umt5"), text_encoder=made["encoder"], vae=made["vae"],
        scheduler=FlowMatchEulerDiscreteScheduler(), image_processor=CLIPImageProcessor.from_pretrained(root / "clip"),
        image_encoder=made["clip"])
    videos = TensorVideoDataset(made["squares"]).tensors["video"]
    first = videos[:, :, 0]  # what the pipeline's video_processor makes of the first frame: [-1, 1], (B, 3, H, W)
    pictures = [Image.fromarray(((f + 1) * 127.5).round().byte().permute(1, 2, 0).numpy()) for f in first]
    with torch.no_grad():
        condition = torch.cat([pipe.prepare_latents(image[None], 1, LATENT, SIDE, SIDE, FRAMES, torch.float32, "cpu")[1]
                               for image in first])  # one image per call: the pipeline repeats it over its batch
        tokens = torch.cat([pipe.encode_image(picture, "cpu") for picture in pictures])

    index = json.loads((root / "cache" / "index.json").read_text())
    shards = [load_file(str(root / "cache" / shard["file"])) for shard in index["shards"]]
    cached = {key: torch.cat([shard[key] for shard in shards]) for key in ("condition", "image_context")}
    assert index["shapes"]["condition"] == [CONDITION, 2, SIDE // 8, SIDE // 8]
    assert index["shapes"]["image_context"] == [(CLIP_SIDE // 8) ** 2 + 1, CLIP_DIM]
    assert index["image_encoder"]["class"] == "CLIPVisionModel"
    assert condition[:, 4:].abs().max() > 0.05 and tokens.abs().max() > 0.05
    torch.testing.assert_close(cached["condition"], condition, rtol=0, atol=1e-5)
    torch.testing.assert_close(cached["image_context"], tokens, rtol=0, atol=1e-5)

    item = CachedLatentDataset(root / "cache", in_channels=LATENT + CONDITION, image_dim=CLIP_DIM)[1]
    assert set(item) == {"video", "context", "condition", "image_context"}
    assert torch.equal(item["condition"], cached["condition"][1])


I2V = ["model.name=wan-tiny", f"model.overrides={{task: i2v, in_channels: {LATENT + CONDITION}, out_channels: "
       f"{LATENT}, text_dim: {TEXT_DIM}, image_dim: {CLIP_DIM}}}", "logging.progress=false",
       "logging.tensorboard=false", "training.micro_batch_size=3", "scheduler.warmup_steps=0", "task.ema=null",
       "training.threads=1"]


def test_an_i2v_dit_trains_on_the_cache_and_a_mismatched_flavor_is_one_line(made, tmp_path, capsys):
    root = made["root"]
    config = str(ROOT / "configs" / "diffusion-moving-squares.yaml")
    run = [config, *I2V, f"task.data={root / 'cache'}", f"run.output_dir={tmp_path / 'run'}", "training.steps=8",
           "optimizer.lr=1e-3", "logging.interval=1", "checkpoint.interval=0"]
    assert main(["train", *run]) == 0
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 8 and losses[-1] < losses[0]
    capsys.readouterr()

    t2v_cache = [config, *I2V, f"task.data={root / 't2v-cache'}"]
    assert main(["check", *t2v_cache]) != 0
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "needs a cache written with --i2v" in said[0], said
    no_image_branch = [config, *I2V, f"task.data={root / 'cache'}",
                       f"model.overrides={{task: i2v, in_channels: {LATENT + CONDITION}, out_channels: {LATENT}, "
                       f"text_dim: {TEXT_DIM}}}"]
    assert main(["check", *no_image_branch]) != 0
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "CLIP tokens of width 24 but the model takes no image tokens" in said[0], said


def test_an_image_encoder_without_i2v_is_refused(made, tmp_path, capsys):
    root = made["root"]
    args = ["cache-latents", "--vae", str(root / "vae"), "--text-encoder", str(root / "umt5"), "--videos",
            str(made["squares"]), "--image-encoder", str(root / "clip"), "--out", str(tmp_path / "cache")]
    assert main(args) != 0
    assert "add --i2v" in capsys.readouterr().err
    assert not (tmp_path / "cache").exists()
