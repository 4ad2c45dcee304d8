"""``loongforge generate --image`` writes transformers' greedy tokens, 16 of them, for tiny Qwen2-VL, Qwen2.5-VL and
Qwen3-VL (dense and MoE) models.

Each model is transformers' own class built from a config with widely spread random weights
(:func:`vlm_reference.reference_model`), saved with ``save_pretrained`` beside a word-level tokenizer holding the
vision tokens and transformers' PIL image processor settings, as a user's directory would be. The command runs as a
user runs it: two prompts in one batch (one with an ``<image>`` placeholder mid-text, one without, so the images go
first), two images of odd sizes, with the KV cache and (Qwen2-VL, Qwen3-VL) without. The reference is
transformers' ``generate`` on each prompt alone, its inputs made by transformers' image processor and tokenizer
(each image pad repeated once per merged patch, as the Qwen processors do) -- none of our code builds them. A
LoongForge checkpoint converted from the directory writes the same tokens; a text-only model and a missing or
unreadable image are one-line errors.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tokenizers
import torch
from loongforge.cli import main
from loongforge_vlm.model.flavors import FLAVORS
from PIL import Image
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from vlm_reference import reference_model

STEPS = 16
PROMPTS = ("w5 w7 <image> w9 w11 <image> w2", "w30 w31 w32")
#: Two odd-sized images (width, height): 8 and 12 merged tokens at 4px patches merged 2x2.
IMAGES = ((28, 20), (20, 44))
VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")  # ids 380..383
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def _save_tokenizer(directory):
    """A word-level tokenizer (``w0`` .. ``w375``, chat and end tokens, the four Qwen vision tokens at 380..383)."""
    vocab = {f"w{i}": i for i in range(376)}
    vocab.update({"<unk>": 376, "<|im_start|>": 377, "<|im_end|>": 378, "<|endoftext|>": 379})
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    words.add_special_tokens([tokenizers.AddedToken(token, special=True) for token in VISION_TOKENS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<|endoftext|>", unk_token="<unk>")
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(directory)
    return tokenizer


def _save_directory(flavor, directory, seed=0):
    """The HF directory of a perturbed tiny model, its tokenizer and image processor; returns the reference model,
    tokenizer and processor."""
    model = reference_model(flavor, seed)
    model.save_pretrained(directory)
    tokenizer = _save_tokenizer(directory)
    assert tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)) == [
        flavor.image_token_id, flavor.video_token_id, flavor.vision_start_token_id, flavor.vision_end_token_id]
    vit = flavor.encoder
    processor = Qwen2VLImageProcessorPil(min_pixels=64, max_pixels=48 * 48, patch_size=vit.patch_size,
                                         merge_size=vit.spatial_merge_size, temporal_patch_size=vit.temporal_patch_size)
    processor.save_pretrained(directory)
    model.generation_config.eos_token_id = None  # all 16 steps, as --ignore-eos
    return model, tokenizer, processor


def _images(directory):
    rng = np.random.default_rng(7)
    paths = []
    for index, (width, height) in enumerate(IMAGES):
        path = directory / f"image{index}.png"
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def _reference_tokens(flavor, model, tokenizer, processor, paths, text):
    """transformers' greedy continuation of ``text`` (``<image>`` placeholders, else the images first)."""
    pixels = processor(images=[Image.open(p) for p in paths], return_tensors="pt")
    pads = (pixels["image_grid_thw"].prod(-1) // flavor.spatial_merge_size ** 2).tolist()
    vision = ["<|vision_start|>" + "<|image_pad|>" * count + "<|vision_end|>" for count in pads]
    pieces = text.split("<image>")
    text = "".join(vision) + text if len(pieces) == 1 else pieces[0] + "".join(
        v + piece for v, piece in zip(vision, pieces[1:], strict=True))
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             mm_token_type_ids=(ids == flavor.image_token_id).long(), **pixels,
                             max_new_tokens=STEPS, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def _ours(capsys, source, paths, *options, prompts=PROMPTS):
    argv = ["generate", str(source), "--max-new-tokens", str(STEPS), "--ignore-eos", "--jsonl", *options]
    for prompt in prompts:
        argv += ["--prompt", prompt]
    for path in paths:
        argv += ["--image", str(path)]
    assert main(argv) == 0
    return [json.loads(line)["tokens"] for line in capsys.readouterr().out.splitlines()]


#: (flavor, weight seed, also without the KV cache). Qwen2.5-VL-tiny ties its output layer to the embedding: seed 3
#: is one whose greedy text does not settle on one repeated token.
CASES = [("qwen2-vl-tiny", 0, True), ("qwen2.5-vl-tiny", 3, False), ("qwen3-vl-tiny", 0, True),
         ("qwen3-vl-moe-tiny", 0, False)]


@pytest.mark.parametrize(("name", "seed", "uncached"), CASES, ids=[case[0] for case in CASES])
def test_greedy_tokens_equal_transformers(name, seed, uncached, tmp_path, capsys):
    flavor = FLAVORS[name]
    model, tokenizer, processor = _save_directory(flavor, tmp_path / "hf", seed)
    paths = _images(tmp_path)
    theirs = [_reference_tokens(flavor, model, tokenizer, processor, paths, text) for text in PROMPTS]
    assert all(len(t) == STEPS and len(set(t)) >= 4 for t in theirs)  # varied text, not one repeated token
    capsys.readouterr()
    assert _ours(capsys, tmp_path / "hf", paths) == theirs
    if uncached:
        assert _ours(capsys, tmp_path / "hf", paths, "--no-kv-cache") == theirs
    if name == "qwen2-vl-tiny":  # a LoongForge checkpoint of the same model writes the same tokens
        assert main(["convert", "hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
        capsys.readouterr()
        assert _ours(capsys, tmp_path / "ours", paths) == theirs


def test_chat_prompt_renders_the_images_into_the_user_turn(tmp_path, capsys):
    flavor = FLAVORS["qwen2-vl-tiny"]
    model, tokenizer, processor = _save_directory(flavor, tmp_path / "hf")
    paths = _images(tmp_path)[:1]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "<image> w3 w4"}], tokenize=False,
                                         add_generation_prompt=True)
    theirs = _reference_tokens(flavor, model, tokenizer, processor, paths, text)
    capsys.readouterr()
    argv = ["generate", str(tmp_path / "hf"), "--chat", "--prompt", "<image> w3 w4", "--image", str(paths[0]),
            "--max-new-tokens", str(STEPS), "--ignore-eos", "--jsonl"]
    assert main(argv) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["prompt"] == text.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")
    assert line["tokens"] == theirs


def test_text_only_model_and_bad_image_files_are_one_line_errors(tmp_path, capsys):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    _save_directory(FLAVORS["qwen2-vl-tiny"], tmp_path / "vlm")
    text_model = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2, num_key_value_heads=1, vocab_size=384))
    text_model.save_pretrained(tmp_path / "llm")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "llm" / name).write_bytes((tmp_path / "vlm" / name).read_bytes())
    image = _images(tmp_path)[0]
    not_an_image = tmp_path / "notes.png"
    not_an_image.write_text("not pixels")
    capsys.readouterr()
    cases = [(tmp_path / "llm", image, "model 'qwen2' takes no image input (it reads text only)"),
             (tmp_path / "vlm", tmp_path / "missing.png", f"image file {tmp_path / 'missing.png'} does not exist"),
             (tmp_path / "vlm", not_an_image, f"image file {not_an_image}: cannot be read as an image")]
    for directory, path, message in cases:
        assert main(["generate", str(directory), "--prompt", "w1", "--image", str(path), "--max-new-tokens", "2"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert main(["generate", str(tmp_path / "vlm"), "--prompt", "w1 <image> <image>", "--image", str(image)]) == 2
    err = capsys.readouterr().err
    assert "holds 2 <image> placeholder(s) for 1 image file(s)" in err and err.count("\n") == 1, err


#: A GIF of 8 frames at 10 fps, or a directory of 4 frames (taken at the default 2 fps), of a moving square.
GIF_FRAMES, FRAME_DIR_FRAMES = 8, 4
#: Frames kept at the default 2 fps, by transformers' rules written out by hand: Qwen2-VL's ``arange(0, 8, 8 / n)``
#: with n = max(8 / 10 * 2, min_frames 4) = 4; Qwen3-VL's ``linspace(0, 7, 4)`` rounded; a frame directory is kept
#: whole.
KEPT = {"qwen2": [0, 2, 4, 6], "qwen3": [0, 2, 5, 7], "directory": [0, 1, 2, 3]}
#: Qwen3-VL's text time of each temporal patch (mean of its two frames' times, 10 fps): (0 + .2) / 2, (.5 + .7) / 2.
QWEN3_TIMES = ("<0.1 seconds>", "<0.6 seconds>")
VIDEO_PROMPTS = ("w5 w7 <image> w9 <video> w2", "w30 w31 w32")


def _moving_square(count: int, size: int = 32) -> list:
    frames = []
    for k in range(count):
        pixels = np.full((size, size, 3), 20, dtype=np.uint8)
        pixels[12:20, 2 + 3 * k:10 + 3 * k] = (255, 200, 40)
        frames.append(Image.fromarray(pixels))
    return frames


def _video_file(directory, as_frames: bool):
    """The moving square as a GIF (100 ms per frame) or as a directory of PNG frames; returns its path and frames."""
    if as_frames:
        frames = _moving_square(FRAME_DIR_FRAMES)
        (directory / "frames").mkdir()
        for k, frame in enumerate(frames):
            frame.save(directory / "frames" / f"{k:03d}.png")
        return directory / "frames", frames
    frames = _moving_square(GIF_FRAMES)
    frames[0].save(directory / "clip.gif", save_all=True, append_images=frames[1:], duration=100, loop=0)
    return directory / "clip.gif", frames


def _reference_video_tokens(flavor, model, tokenizer, processor, image, frames, text, seconds_per_patch):
    """transformers' greedy continuation of ``text`` with an image (transformers' processor) and a video (the kept
    frames through our video processor, which test_vlm_video.py ties to transformers' patchify)."""
    from loongforge_vlm.data.kind import processor_for_vlm

    pixels = processor(images=[image], return_tensors="pt")
    # the directory's pixel bounds and statistics (transformers' Qwen2-VL image processor: CLIP's), which videos share
    assert list(processor.image_mean) == pytest.approx([0.48145466, 0.4578275, 0.40821073])
    ours = processor_for_vlm(flavor, min_pixels=processor.size.shortest_edge, max_pixels=processor.size.longest_edge,
                             normalization="clip")
    video_rows, (t, h, w) = ours.video(frames)
    per_patch = h * w // flavor.spatial_merge_size ** 2
    image_text = "<|vision_start|>" + "<|image_pad|>" * int(pixels["image_grid_thw"].prod() // 4) + "<|vision_end|>"
    run = "<|vision_start|>" + "<|video_pad|>" * per_patch + "<|vision_end|>"
    video_text = "".join(f"{time}{run}" for time in QWEN3_TIMES) if flavor.timestamped_videos else \
        "<|vision_start|>" + "<|video_pad|>" * (t * per_patch) + "<|vision_end|>"
    if "<image>" in text:
        text = text.replace("<image>", image_text).replace("<video>", video_text)
    else:
        text = image_text + video_text + text
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    types = (ids == flavor.image_token_id).long() + 2 * (ids == flavor.video_token_id).long()
    videos = {"pixel_values_videos": torch.from_numpy(video_rows), "video_grid_thw": torch.tensor([[t, h, w]])}
    if flavor.tokens_per_second is not None:
        videos["second_per_grid_ts"] = torch.tensor([seconds_per_patch])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types, **pixels,
                             **videos, max_new_tokens=STEPS, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


#: (flavor, weight seed, video as a frame directory, also without the KV cache). Qwen2.5-VL-tiny: seed 8 is one whose
#: greedy texts do not settle on a repeated token.
VIDEO_CASES = [("qwen2-vl-tiny", 0, True, True), ("qwen2.5-vl-tiny", 8, False, False),
               ("qwen3-vl-tiny", 0, False, False)]


@pytest.mark.parametrize(("name", "seed", "as_frames", "uncached"), VIDEO_CASES, ids=[c[0] for c in VIDEO_CASES])
def test_greedy_tokens_with_a_video_equal_transformers(name, seed, as_frames, uncached, tmp_path, capsys):
    """``--video`` (a GIF; a frame directory for Qwen2-VL) beside an image, placed at ``<video>`` in one prompt and
    before the text of the other. Qwen2.5-VL's GIF patches are 0.4 s apart: 0.8 M-RoPE steps at 2 tokens per second,
    so positions that ignored ``second_per_grid_ts`` (1 s) would differ."""
    flavor = FLAVORS[name]
    model, tokenizer, processor = _save_directory(flavor, tmp_path / "hf", seed)
    image = _images(tmp_path)[0]
    video, frames = _video_file(tmp_path, as_frames)
    rule = "directory" if as_frames else "qwen3" if flavor.timestamped_videos else "qwen2"
    kept = [frames[i] for i in KEPT[rule]]
    seconds = 2 * 1 / 2 if as_frames else 2 * 2 / 10  # temporal patch size x frame spacing / frame rate
    theirs = [_reference_video_tokens(flavor, model, tokenizer, processor, Image.open(image), kept, text, seconds)
              for text in VIDEO_PROMPTS]
    assert all(len(t) == STEPS and len(set(t)) >= 4 for t in theirs)
    capsys.readouterr()
    argv = ["generate", str(tmp_path / "hf"), "--max-new-tokens", str(STEPS), "--ignore-eos", "--jsonl",
            "--image", str(image), "--video", str(video)]
    for prompt in VIDEO_PROMPTS:
        argv += ["--prompt", prompt]
    options = [[], ["--no-kv-cache"]] if uncached else [[]]
    for extra in options:
        assert main(argv + extra) == 0
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [line["tokens"] for line in lines] == theirs
    assert all(time in lines[0]["prompt"] for time in QWEN3_TIMES) == flavor.timestamped_videos


def test_bad_videos_are_one_line_errors_naming_the_file(tmp_path, capsys):
    _save_directory(FLAVORS["qwen2-vl-tiny"], tmp_path / "hf")
    broken = tmp_path / "broken.gif"
    broken.write_bytes(b"GIF89a not really")
    one_frame = tmp_path / "one.gif"
    _moving_square(1)[0].save(one_frame)
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("words")
    cases = [(broken, f"video file {broken}: cannot be decoded as a GIF"),
             (one_frame, f"video file {one_frame}: has 1 frame(s), too few to sample 2"),
             (tmp_path / "empty", f"video file {tmp_path / 'empty'}: has 0 frame(s)"),
             (tmp_path / "notes.txt", f"video file {tmp_path / 'notes.txt'}: is neither a video file"),
             (tmp_path / "gone.gif", f"video file {tmp_path / 'gone.gif'} does not exist")]
    capsys.readouterr()
    for path, message in cases:
        assert main(["generate", str(tmp_path / "hf"), "--prompt", "w1", "--video", str(path),
                     "--max-new-tokens", "2"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_internvl_greedy_tokens_equal_transformers_with_and_without_the_kv_cache(tmp_path, capsys):
    """InternVL-tiny from a ``save_pretrained`` directory (perturbed weights), two odd-sized images tiled to 12 tiles
    + thumbnail and 2 + thumbnail: the reference is transformers' ``generate`` given ``<img>`` + one context token per
    feature + ``</img>`` per image and the tiles of our processor (test_internvl.py ties both to transformers' image
    processor), since transformers' InternVL processor needs tokenizer attributes a plain tokenizer lacks."""
    from loongforge_vlm.data.tiling import TilingProcessor
    from test_internvl import TINY, _reference

    model = _reference(TINY)
    model.save_pretrained(tmp_path / "hf")
    tokenizer = _save_tokenizer(tmp_path / "hf")
    paths = _images(tmp_path)
    processor = TilingProcessor.for_encoder(TINY.encoder, merge_size=TINY.projector.merge)
    tiles = [processor.image(Image.open(path)) for path in paths]
    assert [grid[0] for _, grid in tiles] == [13, 3]  # 12 tiles + thumbnail, 2 + thumbnail (16px tiles)
    pixel_values = torch.cat([torch.from_numpy(pixels) for pixels, _ in tiles])
    images = [[TINY.vision_start_token_id, *[TINY.image_token_id] * processor.num_tokens(grid),
               TINY.vision_end_token_id] for _, grid in tiles]
    theirs = []
    for text in PROMPTS:
        pieces = [tokenizer(piece)["input_ids"] for piece in text.split("<image>")]
        ids = sum(images, []) + pieces[0] if len(pieces) == 1 else pieces[0] + [
            token for image, piece in zip(images, pieces[1:], strict=True) for token in image + piece]
        ids = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixel_values,
                                 max_new_tokens=STEPS, do_sample=False, pad_token_id=0, eos_token_id=None)
        theirs.append(out[0, ids.shape[1]:].tolist())
    assert all(len(t) == STEPS and len(set(t)) >= 4 for t in theirs)
    capsys.readouterr()
    assert _ours(capsys, tmp_path / "hf", paths) == theirs
    assert _ours(capsys, tmp_path / "hf", paths, "--no-kv-cache") == theirs



#: One image per prompt: with several, LLaVA-OneVision encodes each image's base tile alone (no AnyRes).
ANYRES_PROMPTS = ("w5 w7 <image> w9 w11", "w30 w31 w32")


def test_anyres_greedy_tokens_equal_transformers_llava_onevision(tmp_path, capsys):
    """An AnyRes model (a tiny LLaVA-OneVision, :mod:`test_anyres`'s) from its Hugging Face directory and from the
    checkpoint ``convert`` makes of it: the processor is AnyRes because the model's config says so, and the image
    tokens stand bare (LLaVA-OneVision has no start/end markers). The reference's pixels are transformers' image
    processor's and its image token counts ``LlavaOnevisionProcessor``'s own (built without its video processor,
    which needs torchvision)."""
    from test_anyres import _config, _reference_processor
    from transformers import LlavaOnevisionForConditionalGeneration, LlavaOnevisionProcessor
    from vlm_reference import perturbed

    model = perturbed(LlavaOnevisionForConditionalGeneration(_config(2)), seed=2)
    model.save_pretrained(tmp_path / "hf")
    model.generation_config.eos_token_id = None
    tokenizer = _save_tokenizer(tmp_path / "hf")
    counter = object.__new__(LlavaOnevisionProcessor)
    vision = model.config.vision_config
    counter.image_processor, counter.num_image_tokens = _reference_processor(None), \
        (vision.image_size // vision.patch_size) ** 2
    counter.vision_aspect_ratio, counter.vision_feature_select_strategy = model.config.vision_aspect_ratio, "full"
    path = _images(tmp_path)[1]  # 20x44: a 3x2 grid, shrunk to the anyres_max_2 budget
    pixels = counter.image_processor([Image.open(path).convert("RGB")], return_tensors="pt")
    pads = VISION_TOKENS[0] * counter._get_number_of_features(*pixels["image_sizes"][0].tolist(),
                                                              vision.image_size, vision.image_size)
    theirs = []
    for text in ANYRES_PROMPTS:
        ids = tokenizer(text.replace("<image>", pads) if "<image>" in text else pads + text,
                        return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **pixels,
                                 max_new_tokens=STEPS, do_sample=False, pad_token_id=0)
        theirs.append(out[0, ids.shape[1]:].tolist())
    assert all(len(t) == STEPS and len(set(t)) >= 4 for t in theirs), theirs
    capsys.readouterr()
    assert _ours(capsys, tmp_path / "hf", [path], prompts=ANYRES_PROMPTS) == theirs
    assert main(["convert", "hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "ours")]) == 0
    capsys.readouterr()
    assert _ours(capsys, tmp_path / "ours", [path], prompts=ANYRES_PROMPTS) == theirs
