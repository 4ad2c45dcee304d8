"""The latent cache: ``loongforge cache-latents`` with a tiny Wan VAE and UMT5 encoder built
from configs (no downloads) writes what the encoders compute directly, ``CachedLatentDataset`` reads it back,
``loongforge train`` trains a Wan DiT on it, and bad caches are reported by shard and sample."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from loongforge.cli import main as loongforge_main
from loongforge.data.errors import DataError
from loongforge_diffusion.data import moving_squares
from loongforge_diffusion.data.latents import CachedLatentDataset
from loongforge_diffusion.data.moving_squares import TensorVideoDataset, caption
from loongforge_diffusion.data.video_files import fit, list_clips
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[2]
LATENTS_MEAN, LATENTS_STD = [0.1, -0.2, 0.3, 0.0], [1.5, 0.5, 2.0, 1.0]
TEXT_DIM, TEXT_LEN = 16, 12
SPECIALS = ["<pad>", "</s>", "<unk>"]
WORDS = ["a", "square", "of", "size", "moving", *moving_squares.PALETTE, *moving_squares.DIRECTIONS,
         *(str(s) for s in moving_squares.SIZES)]
VOCAB = {word: i for i, word in enumerate(SPECIALS + WORDS)}


def cache_latents(args: list[str]) -> int:
    return loongforge_main(["cache-latents", *args])


def _tiny_vae(directory: Path):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           latents_mean=LATENTS_MEAN, latents_std=LATENTS_STD)
    vae.save_pretrained(directory)
    return vae.eval()


def _tiny_text_encoder(directory: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    config = UMT5Config(vocab_size=len(VOCAB), d_model=TEXT_DIM, d_kv=4, d_ff=32, num_layers=1, num_heads=4,
                        relative_attention_num_buckets=8)
    encoder = UMT5EncoderModel(config)
    encoder.save_pretrained(directory)
    words = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", VOCAB["</s>"])])
    PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(directory)
    return encoder.eval()


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Encoders saved to directories, four moving-squares videos of 5 frames, and the cache written from them."""
    root = tmp_path_factory.mktemp("latents")
    vae, encoder = _tiny_vae(root / "vae"), _tiny_text_encoder(root / "umt5")
    squares = moving_squares.write(root / "squares.pt", moving_squares.MovingSquares(
        4, seed=3, geometry=moving_squares.Geometry(frames=5, side=16, speed=2)))
    args = ["--vae", str(root / "vae"), "--text-encoder", str(root / "umt5"), "--videos", str(squares),
            "--text-len", str(TEXT_LEN), "--batch", "3", "--shard-size", "3"]
    assert cache_latents([*args, "--out", str(root / "cache")]) == 0
    return {"root": root, "vae": vae, "encoder": encoder, "squares": squares, "args": args, "cache": root / "cache"}


def _expected_context(encoder, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids built by hand from the vocabulary (words, ``</s>``, padding) -> the encoder's zero-padded states."""
    ids = torch.zeros(len(captions), TEXT_LEN, dtype=torch.long)
    for row, text in enumerate(captions):
        tokens = [VOCAB[w] for w in text.split()] + [VOCAB["</s>"]]
        ids[row, :len(tokens)] = torch.tensor(tokens)
    mask = (ids != 0).long()
    with torch.no_grad():
        states = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
    return states * mask[..., None], mask.bool()


def test_cache_holds_the_encoders_outputs_and_the_dataset_reads_them(made):
    cache = made["cache"]
    index = json.loads((cache / "index.json").read_text())
    assert [s["file"] for s in index["shards"]] == ["latents-00000.safetensors", "latents-00001.safetensors"]
    assert [s["count"] for s in index["shards"]] == [3, 1] and index["count"] == 4
    assert index["shapes"] == {"video": [4, 2, 2, 2], "context": [TEXT_LEN, TEXT_DIM]}
    assert index["normalisation"]["latents_mean"] == LATENTS_MEAN
    assert index["vae"]["class"] == "AutoencoderKLWan" and index["text_encoder"]["class"] == "UMT5EncoderModel"
    assert not list(made["root"].glob(".cache.tmp-*"))

    stored = TensorVideoDataset(made["squares"]).tensors
    captions = [caption(labels) for labels in stored["labels"]]
    with torch.no_grad():
        z = made["vae"].encode(stored["video"]).latent_dist.mean
    mean, std = torch.tensor(LATENTS_MEAN).view(1, 4, 1, 1, 1), torch.tensor(LATENTS_STD).view(1, 4, 1, 1, 1)
    want_video = (z - mean) / std
    want_context, want_mask = _expected_context(made["encoder"], captions)
    shards = [load_file(str(cache / s["file"])) for s in index["shards"]]
    got = {key: torch.cat([s[key] for s in shards]) for key in ("video", "context", "mask")}
    torch.testing.assert_close(got["video"], want_video, rtol=0, atol=1e-5)
    torch.testing.assert_close(got["context"], want_context, rtol=0, atol=1e-5)
    assert torch.equal(got["mask"], want_mask) and got["mask"].sum(1).tolist() == [9, 9, 9, 9]
    assert got["video"].abs().max() > 0.05 and got["context"][:, 9:].abs().max() == 0

    dataset = CachedLatentDataset(cache, latent_channels=4, text_dim=TEXT_DIM)
    assert len(dataset) == 4
    for i in range(4):
        item = dataset[i]
        assert set(item) == {"video", "context"}
        assert torch.equal(item["video"], got["video"][i]) and torch.equal(item["context"], got["context"][i])
    with pytest.raises(DataError, match="latent channels 4 but the model expects 3"):
        CachedLatentDataset(cache, latent_channels=3)


def test_loongforge_train_runs_on_the_cache(made, tmp_path):
    out = tmp_path / "run"
    code = loongforge_main([
        "train", str(ROOT / "configs/diffusion-moving-squares.yaml"), f"run.output_dir={out}",
        "logging.progress=false", "logging.tensorboard=false", "training.threads=1", "training.steps=2",
        "training.micro_batch_size=2", "checkpoint.interval=0", f"task.data={made['cache']}",
        "task.sample={videos: 0}", f"model.overrides={{in_channels: 4, out_channels: 4, text_dim: {TEXT_DIM}}}"])
    assert code == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses)


def test_frames_dir_and_mp4_inputs_via_jsonl(made, tmp_path, capsys, monkeypatch):
    from loongforge_diffusion.media import write_video
    from PIL import Image

    stored = TensorVideoDataset(made["squares"]).tensors
    frames_dir = tmp_path / "clip0"
    frames_dir.mkdir()
    pixels = ((stored["video"][0] + 1) * 127.5).round().to(torch.uint8)  # -1/+1 -> 0/255: exact
    for t in range(5):
        Image.fromarray(pixels[:, t].permute(1, 2, 0).numpy()).save(frames_dir / f"{t:03d}.png")
    mp4 = write_video(stored["video"][1], tmp_path / "clip1", "mp4", scale=2)  # 32 x 32, resized back to 16
    lines = [{"video": "clip0", "caption": caption(stored["labels"][0])},
             {"video": mp4.name, "caption": "a  red square &amp; more"}]
    (tmp_path / "clips.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    args = [*made["args"], "--videos", str(tmp_path / "clips.jsonl"), "--frames", "5", "--height", "16",
            "--width", "16"]
    monkeypatch.setenv("LOONGFORGE_PROGRESS", "plain")
    assert cache_latents([*args, "--out", str(tmp_path / "cache")]) == 0
    printed = capsys.readouterr().out
    assert f"encoding videos into {tmp_path / 'cache'}: 2/2 video" in printed  # progress per video
    assert f"wrote 2 samples in 1 shard(s) to {tmp_path / 'cache'}: video (4, 2, 2, 2), context (12, 16)" in printed
    from_files = CachedLatentDataset(tmp_path / "cache")
    from_squares = CachedLatentDataset(made["cache"])
    assert len(from_files) == 2 and from_files[1]["video"].shape == (4, 2, 2, 2)
    torch.testing.assert_close(from_files[0]["video"], from_squares[0]["video"], rtol=0, atol=1e-5)
    torch.testing.assert_close(from_files[0]["context"], from_squares[0]["context"], rtol=0, atol=1e-6)
    lengths = load_file(str(tmp_path / "cache" / "latents-00000.safetensors"))["mask"].sum(1).tolist()
    assert lengths == [9, 6]  # "a red square & more </s>": html unescaped, whitespace collapsed, & is <unk>


def test_a_directory_of_videos_is_captioned_by_sibling_text_files(tmp_path):
    from PIL import Image

    (tmp_path / "walk").mkdir()
    for t in range(3):
        Image.new("RGB", (8, 6), (255, 0, 0)).save(tmp_path / "walk" / f"{t}.png")
    with pytest.raises(DataError, match="walk: no caption file walk.txt beside it"):
        list_clips(tmp_path)
    (tmp_path / "walk.txt").write_text("a red field\n")
    [clip] = list_clips(tmp_path)
    video = clip.load()
    assert clip.caption == "a red field" and video.shape == (3, 3, 6, 8)
    assert video[0].eq(1).all() and video[1:].eq(-1).all()


def test_fit_resizes_to_cover_and_crops_the_centre():
    video = torch.zeros(3, 6, 20, 24)
    video[:, :, :, :2] = 1.0  # a bright left border that the centre crop of the 16 x 20 resize cuts away
    out = fit(video, 5, 16, 16, source="x")
    assert out.shape == (3, 5, 16, 16) and out.abs().max() < 0.05
    with pytest.raises(DataError, match="x: 6 frames, fewer than the 9 requested"):
        fit(video, 9, 16, 16, source="x")


def test_bad_caches_and_inputs_are_one_line_errors_naming_the_shard(made, tmp_path, capsys, monkeypatch):
    def copy(name):
        shutil.copytree(made["cache"], tmp_path / name)
        return tmp_path / name

    corrupt = copy("corrupt")
    data = (corrupt / "latents-00001.safetensors").read_bytes()
    (corrupt / "latents-00001.safetensors").write_bytes(data[:-16])
    with pytest.raises(DataError, match=r"latents-00001\.safetensors: corrupt shard"):
        CachedLatentDataset(corrupt)
    code = loongforge_main(["train", str(ROOT / "configs/diffusion-moving-squares.yaml"), f"task.data={corrupt}",
                            f"run.output_dir={tmp_path / 'run'}", "task.sample={videos: 0}",
                            "model.overrides={in_channels: 4, out_channels: 4, text_dim: 16}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "latents-00001.safetensors: corrupt shard" in err

    missing = copy("missing")
    (missing / "latents-00000.safetensors").unlink()
    with pytest.raises(DataError, match=r"latents-00000\.safetensors: missing shard"):
        CachedLatentDataset(missing)

    bad = copy("bad")
    shard = load_file(str(bad / "latents-00001.safetensors"))
    save_file({**shard, "video": shard["video"][:, :, :1].contiguous()}, str(bad / "latents-00001.safetensors"))
    with pytest.raises(DataError, match=r"latents-00001\.safetensors: video has shape \(1, 4, 1, 2, 2\), index"):
        CachedLatentDataset(bad)
    save_file({**shard, "video": shard["video"] * float("nan")}, str(bad / "latents-00001.safetensors"))
    with pytest.raises(DataError, match=r"latents-00001\.safetensors: sample 0 \(dataset index 3\) has NaN"):
        CachedLatentDataset(bad)[3]

    assert cache_latents([*made["args"], "--out", str(made["cache"])]) == 2
    assert "already exists" in capsys.readouterr().err
    assert cache_latents([*made["args"], "--frames", "4", "--out", str(tmp_path / "four")]) == 2
    assert "--frames 4: the Wan VAE encodes 1 + 4k frames" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "diffusers", None)
    assert cache_latents([*made["args"], "--out", str(tmp_path / "nodiffusers")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install diffusers" in err
    assert not (tmp_path / "four").exists() and not (tmp_path / "nodiffusers").exists()
