"""Conversations with images -> token ids: expanded vision tokens, reply masks, record formats, tokenizers."""

from __future__ import annotations

import json

import numpy as np
import pytest
from loongforge.data.chat_template import chat_template_for
from loongforge.data.errors import DataError
from loongforge.data.tokenizers import ByteTokenizer, HFTokenizer
from loongforge_vlm.data.records import RecordError, parse_record
from loongforge_vlm.data.tokens import (
    IMAGE_MARKER,
    VisionByteTokenizer,
    VisionTokenIds,
    tokenize_multimodal,
    vision_token_ids,
)

TOK = VisionByteTokenizer()
START, END, IMAGE, VIDEO = 260, 261, 259, 262


def _tokenize(raw: dict, image_tokens, video_tokens=(), tokenizer=TOK):
    record = parse_record(raw)
    return tokenize_multimodal(record.messages, tokenizer, chat_template_for(tokenizer), image_tokens,
                               video_tokens, "test")


def test_images_expand_to_their_token_counts_and_only_the_reply_is_supervised():
    raw = {"images": ["a.png", "b.png"], "messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " and "}, {"type": "image"},
                                     {"type": "text", "text": " differ?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "yes"}]}]}
    sample = _tokenize(raw, image_tokens=[4, 6])
    enc = TOK.encode
    prompt = (enc("<|user|>\n") + [START] + [IMAGE] * 4 + [END] + enc(" and ") + [START] + [IMAGE] * 6 + [END]
              + enc(" differ?\n<|assistant|>\n"))
    reply = enc("yes\n") + [TOK.eos_id]
    assert sample.ids.tolist() == prompt + reply
    assert sample.supervised.tolist() == [False] * len(prompt) + [True] * len(reply)
    assert TOK.decode(sample.ids) == "<|user|>\n and  differ?\n<|assistant|>\nyes\n"


def test_text_placeholders_parts_and_llava_turns_give_the_same_ids():
    parts = {"images": ["x.png"], "messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\nWhat colour?"}]},
        {"role": "assistant", "content": "red"}]}
    placeholder = {"image": "x.png", "messages": [{"role": "user", "content": "<image>\nWhat colour?"},
                                                  {"role": "assistant", "content": "red"}]}
    llava = {"image": "x.png", "conversations": [{"from": "human", "value": "<image>\nWhat colour?"},
                                                 {"from": "gpt", "value": "red"}]}
    inline = {"messages": [{"role": "user", "content": [{"type": "image", "image": "x.png"},
                                                        {"type": "text", "text": "\nWhat colour?"}]},
                           {"role": "assistant", "content": "red"}]}
    samples = [_tokenize(raw, [3]) for raw in (parts, placeholder, llava, inline)]
    assert all(parse_record(raw).images == ["x.png"] for raw in (parts, placeholder, llava, inline))
    for other in samples[1:]:
        assert np.array_equal(other.ids, samples[0].ids) and np.array_equal(other.supervised, samples[0].supervised)
    assert samples[0].ids.tolist().count(IMAGE) == 3


def test_videos_use_their_own_pad_token_and_vision_tokens_are_never_targets():
    raw = {"videos": [["f0.png", "f1.png", "f2.png"]], "messages": [
        {"role": "user", "content": "<video>What moves?"},
        {"role": "assistant", "content": [{"type": "text", "text": "the ball"}, {"type": "image"}]}],
        "images": ["answer.png"]}
    sample = _tokenize(raw, image_tokens=[2], video_tokens=[5])
    ids = sample.ids.tolist()
    assert ids.count(VIDEO) == 5 and ids.count(IMAGE) == 2 and ids.count(START) == ids.count(END) == 2
    vision = np.isin(sample.ids, [START, END, IMAGE, VIDEO])
    assert not (sample.supervised & vision).any()
    assert sample.supervised.sum() == len("the ball\n") + 1  # reply text, newline and eos


def test_records_that_cannot_be_read_say_why():
    cases = [
        ([], "not a JSON object"),
        ({"messages": []}, "non-empty 'messages'"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "turn 0 needs a role"),
        ({"messages": [{"role": "user", "content": "x"}]}, "no assistant turn"),
        ({"images": [3], "messages": [{"role": "assistant", "content": "x"}]}, "'images' must be"),
        ({"messages": [{"role": "assistant", "content": [{"type": "audio"}]}]}, "not text, image or video"),
        ({"fps": 0, "messages": [{"role": "assistant", "content": "x"}]}, "'fps' must be a positive number"),
    ]
    for raw, reason in cases:
        with pytest.raises(RecordError, match=reason):
            parse_record(raw)


def test_tokenizers_need_single_vision_tokens(tmp_path):
    with pytest.raises(DataError, match="byte.*no single token for <\\|vision_start\\|>.*'byte-vision'"):
        vision_token_ids(ByteTokenizer())
    assert vision_token_ids(TOK) == VisionTokenIds(vision_start=260, vision_end=261, image_pad=259, video_pad=262)
    assert TOK.decode(TOK.encode("héllo") + [START, IMAGE, END]) == "héllo"


def test_a_hugging_face_tokenizer_with_qwen_vision_tokens(tmp_path):
    """A Qwen-like tokenizer directory (word-level vocabulary, the vision tokens as added special tokens,
    a jinja chat template) tokenizes through the same path, with the vision ids from its vocabulary."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    words = ["<|im_start|>", "<|im_end|>", "user", "assistant", "what", "colour", "?", "red", "\n", "[UNK]"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[ \n?]"), behavior="isolated")
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                            "<|video_pad|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>",
                                                                "chat_template": template}))
    hf = HFTokenizer(tmp_path)
    assert vision_token_ids(hf) == VisionTokenIds(10, 11, 12, 13)
    raw = {"image": "a.png", "messages": [{"role": "user", "content": "<image>what?"},
                                          {"role": "assistant", "content": "red"}]}
    sample = _tokenize(raw, [2], tokenizer=hf)
    assert sample.ids.tolist() == [0, 2, 8, 10, 12, 12, 11, 4, 6, 1, 8, 0, 3, 8, 7, 1, 8]
    assert sample.ids[sample.supervised].tolist() == [7, 1, 8]  # "red", <|im_end|>, "\n"
    assert IMAGE_MARKER not in hf.decode(sample.ids)


def test_byte_vision_ids_can_follow_a_model():
    qwen_tiny = VisionTokenIds(vision_start=382, vision_end=383, image_pad=380, video_pad=381)
    tok = VisionByteTokenizer(qwen_tiny)
    assert tok.vocab_size == 384 and tok.name == "byte-vision:382,383,380,381" and vision_token_ids(tok) == qwen_tiny
    assert TOK.vocab_size == 263 and TOK.name == "byte-vision"
    sample = _tokenize({"image": "a.png", "messages": [{"role": "user", "content": "<image>?"},
                                                      {"role": "assistant", "content": "A"}]}, [2], tokenizer=tok)
    assert sample.ids.tolist()[9:13] == [382, 380, 380, 383]
    with pytest.raises(DataError, match="4 distinct ids above 258"):
        VisionByteTokenizer(VisionTokenIds(100, 101, 102, 103))
