"""``loongforge generate --image`` writes transformers' greedy tokens, 16 of them, for tiny Qwen2-VL, Qwen2.5-VL and
Qwen3-VL models.

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


def _save_directory(flavor, directory, seed=0):
    """The HF directory of a perturbed tiny model, its tokenizer and image processor; returns the reference model,
    tokenizer and processor."""
    model = reference_model(flavor, seed)
    model.save_pretrained(directory)
    vocab = {f"w{i}": i for i in range(376)}
    vocab.update({"<unk>": 376, "<|im_start|>": 377, "<|im_end|>": 378, "<|endoftext|>": 379})
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    words.add_special_tokens([tokenizers.AddedToken(token, special=True) for token in VISION_TOKENS])
    assert [words.token_to_id(t) for t in VISION_TOKENS] == [flavor.image_token_id, flavor.video_token_id,
                                                              flavor.vision_start_token_id, flavor.vision_end_token_id]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<|endoftext|>", unk_token="<unk>")
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(directory)
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


def _ours(capsys, source, paths, *options):
    argv = ["generate", str(source), "--max-new-tokens", str(STEPS), "--ignore-eos", "--jsonl", *options]
    for prompt in PROMPTS:
        argv += ["--prompt", prompt]
    for path in paths:
        argv += ["--image", str(path)]
    assert main(argv) == 0
    return [json.loads(line)["tokens"] for line in capsys.readouterr().out.splitlines()]


#: (flavor, weight seed, also without the KV cache). Qwen2.5-VL-tiny ties its output layer to the embedding: seed 3
#: is one whose greedy text does not settle on one repeated token.
CASES = [("qwen2-vl-tiny", 0, True), ("qwen2.5-vl-tiny", 3, False), ("qwen3-vl-tiny", 0, True)]


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
