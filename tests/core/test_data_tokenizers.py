"""Tokenizers: byte-level round trips, and a Hugging Face tokenizer built locally (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from loongforge.data.errors import DataError
from loongforge.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "It is a truth universally acknowledged, that a single man in possession of a good fortune",
    "must be in want of a wife. However little known the feelings or views of such a man may be",
    "Sphinx of black quartz, judge my vow. Pack my box with five dozen liquor jugs.",
] * 4


def build_hf_tokenizer_dir(directory, *, eos="</s>", config=True, specials=("<s>", "</s>", "<pad>"), append=None):
    """Train a tiny byte-level BPE with the `tokenizers` library and save it as save_pretrained would (``config``:
    with a tokenizer_config.json; ``append``: a post-processor writing that special token after each text)."""
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = FastTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=list(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(SENTENCES, trainer)
    if append is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"$A {append}",
                                                           special_tokens=[(append, tok.token_to_id(append))])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if config:
        special = {"bos_token": {"content": "<s>", "__type": "AddedToken"}, "pad_token": "<pad>"}
        if eos is not None:
            special["eos_token"] = eos
        (directory / "tokenizer_config.json").write_text(json.dumps(special))
    return directory


def test_byte_tokenizer_round_trips_any_unicode():
    tok = ByteTokenizer()
    text = "Héllo, wörld! 你好 🦜\n\ttabs & newlines"
    ids = tok.encode(text)
    assert ids[:5] == list(b"H\xc3\xa9ll")
    assert max(ids) < 256 and tok.vocab_size == 259
    assert tok.decode(ids) == text
    assert isinstance(tok, Tokenizer)


def test_byte_tokenizer_decode_drops_specials_and_never_fails():
    tok = ByteTokenizer()
    ids = [tok.bos_id, *tok.encode("ab"), tok.eos_id, 0xE4, tok.pad_id]  # 0xE4 starts a cut-off UTF-8 char
    assert tok.decode(ids) == "ab\ufffd"
    assert len({tok.bos_id, tok.eos_id, tok.pad_id}) == 3 and min(tok.bos_id, tok.eos_id, tok.pad_id) >= 256


def test_hf_tokenizer_from_local_directory(tmp_path):
    directory = build_hf_tokenizer_dir(tmp_path / "tok")
    tok = HFTokenizer(directory)
    raw = json.loads((directory / "tokenizer.json").read_text())
    assert tok.eos_id == raw["model"]["vocab"]["</s>"]
    assert tok.bos_id == raw["model"]["vocab"]["<s>"]
    assert tok.pad_id == raw["model"]["vocab"]["<pad>"]
    assert tok.vocab_size == len(raw["model"]["vocab"])
    text = "The quick fox judges a single man."
    ids = tok.encode(text)
    assert len(ids) < len(text)  # BPE merges learned from the sentences
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == text
    assert tok.name.startswith("hf:tok@") and isinstance(tok, Tokenizer)
    assert load_tokenizer(f"hf:{directory}").name == tok.name
    assert load_tokenizer(str(directory)).name == tok.name


def test_hf_pad_defaults_to_eos_and_special_tokens_map_is_read(tmp_path):
    directory = build_hf_tokenizer_dir(tmp_path / "tok", config=False)
    (directory / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>"}))
    tok = HFTokenizer(directory)
    assert tok.pad_id == tok.eos_id and tok.bos_id is None


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d: None, "tokenizer directory not found"),
        (lambda d: d.mkdir(), "no tokenizer.json or tokenizer.model in"),
        (lambda d: build_hf_tokenizer_dir(d, eos=None, specials=("<s>", "<pad>")),
         "declares none (special tokens: <s>, <pad>)"),
        (lambda d: build_hf_tokenizer_dir(d, config=False, specials=("</s>", "<|endoftext|>")),
         "declares none (special tokens: </s>, <|endoftext|>)"),
        (lambda d: build_hf_tokenizer_dir(d, eos="<eos>"), "eos_token '<eos>'"),
    ],
)
def test_hf_tokenizer_errors_are_one_line_and_name_the_directory(tmp_path, setup, message):
    directory = tmp_path / "tok"
    setup(directory)
    with pytest.raises(DataError) as info:
        HFTokenizer(directory)
    assert message in str(info.value) and str(directory) in str(info.value) and "\n" not in str(info.value)


def test_a_bare_tokenizer_json_names_its_own_end_of_text(tmp_path):
    """What the ``tokenizers`` library saves, with no tokenizer_config.json: the one special token spelt as an end
    of text, or the one its post-processor appends after every text (chosen over other candidates)."""
    alone = HFTokenizer(build_hf_tokenizer_dir(tmp_path / "a", config=False, specials=("<pad>", "<|endoftext|>")))
    assert alone.eos_id == alone._tok.token_to_id("<|endoftext|>") and alone.pad_id == alone.eos_id
    appended = build_hf_tokenizer_dir(tmp_path / "b", config=False, specials=("<eos>", "</s>"), append="</s>")
    tok = HFTokenizer(appended)
    assert tok.eos_id == tok._tok.token_to_id("</s>")
    configured = build_hf_tokenizer_dir(tmp_path / "c", specials=("<s>", "</s>", "<pad>", "<eos>"), eos="<eos>")
    assert HFTokenizer(configured).eos_id == HFTokenizer(configured)._tok.token_to_id("<eos>")  # the config wins


def test_load_tokenizer_specs(tmp_path):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(DataError, match="unknown tokenizer 'gpt9'"):
        load_tokenizer("gpt9")
    with pytest.raises(DataError, match="tokenizer directory not found"):
        load_tokenizer(f"hf:{tmp_path / 'missing'}")


def build_sentencepiece_dir(directory, corpus_text: str, *, config: dict | None = None):
    """A SentencePiece BPE model trained on ``corpus_text`` and saved as ``tokenizer.model`` (no tokenizer.json), as
    Llama-2 and Mistral releases ship, with a ``tokenizer_config.json`` naming the class transformers reads it as."""
    import sentencepiece

    directory.mkdir()
    (directory / "corpus.txt").write_text(corpus_text)
    sentencepiece.SentencePieceTrainer.train(
        input=str(directory / "corpus.txt"), model_prefix=str(directory / "tokenizer"), vocab_size=400,
        model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, byte_fallback=True, character_coverage=1.0,
        minloglevel=2)
    (directory / "tokenizer.vocab").unlink()
    (directory / "corpus.txt").unlink()
    (directory / "tokenizer_config.json").write_text(json.dumps(
        config if config is not None else {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False}))
    return directory


SENTENCES = ["It is a truth universally acknowledged, that a single man", "  leading spaces and\ttabs\n\nnewlines",
             "accents éà, digits 1234567 and an emoji 😀 (byte fallback)", "Elizabeth", ""]


def test_a_sentencepiece_model_reads_as_autotokenizer_reads_it(tmp_path):
    """A directory with only tokenizer.model: the ids, decoding and special tokens transformers' AutoTokenizer gives."""
    from transformers import AutoTokenizer

    corpus = sorted((ROOT / "loongforge-core/src/loongforge/data/corpus").glob("*.txt"))[0].read_text()[:120_000]
    directory = build_sentencepiece_dir(tmp_path / "sp", corpus)
    ours, reference = HFTokenizer(directory), AutoTokenizer.from_pretrained(str(directory))
    for text in SENTENCES:
        ids = ours.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert len(ours.encode(SENTENCES[0])) < 0.75 * len(SENTENCES[0])  # merges are used: a subword vocabulary
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (1, 2, 2) == (reference.bos_token_id, reference.eos_token_id, 2)
    assert ours.vocab_size == len(reference) == 400
    assert load_tokenizer(f"hf:{directory}").name == ours.name and ours.name.startswith("hf:sp@")


def test_a_broken_sentencepiece_model_is_one_line(tmp_path):
    directory = tmp_path / "sp"
    directory.mkdir()
    (directory / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    with pytest.raises(DataError, match=f"cannot load the SentencePiece tokenizer in {directory}: ") as caught:
        HFTokenizer(directory)
    assert "\n" not in str(caught.value)
