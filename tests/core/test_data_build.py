"""Text files -> token datasets: formats, errors naming file and line, caching, the CLI entry, registration."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from loongforge.data.build import build_token_dataset
from loongforge.data.cache import cached_token_dataset
from loongforge.data.errors import DataError
from loongforge.data.kinds import mmap_dataset, shipped_corpus, text_dataset
from loongforge.data.preprocess import preprocess_main
from loongforge.data.registration import register_builtin_datasets, register_builtin_tokenizers
from loongforge.data.tokenizers import ByteTokenizer
from loongforge.registry import Registry, resolve_import_path

TOK = ByteTokenizer()


@pytest.fixture
def inputs(tmp_path):
    txt = tmp_path / "book.txt"
    txt.write_text("Chapter 1\n\nIt was a dark night.\n\nThe end.\n", encoding="utf-8")
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text('{"text": "first doc", "id": 1}\n\n{"text": "zweites Dokument \\u00e4"}\n{"text": ""}\n')
    return txt, jsonl


def decode_docs(ds):
    return [TOK.decode(ds[i]) for i in range(len(ds))]


def test_txt_is_a_document_per_paragraph_and_jsonl_one_per_line(tmp_path, inputs, capsys):
    ds = build_token_dataset(list(inputs), tmp_path / "out" / "ds", TOK, progress=True)
    assert decode_docs(ds) == ["Chapter 1", "It was a dark night.", "The end.", "first doc", "zweites Dokument ä"]
    assert all(ds[i][-1] == TOK.eos_id for i in range(len(ds)))
    assert "tokenizing (byte)" in capsys.readouterr().err  # the progress bar goes to stderr


@pytest.mark.parametrize(
    "txt_split, documents",
    [
        ("paragraph", ["Title", "one line\r\nsame paragraph", "last,  \nno final newline"]),
        ("line", ["Title", "one line", "same paragraph", "last,  ", "no final newline"]),
        ("file", ["Title\n\n \t\none line\r\nsame paragraph\r\n\n\n\nlast,  \nno final newline"]),
    ],
)
def test_txt_split_rules(tmp_path, txt_split, documents):
    """Blank (whitespace-only) lines end a paragraph and are dropped; a paragraph keeps its inner line breaks."""
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"Title\n\n \t\none line\r\nsame paragraph\r\n\n\n\nlast,  \nno final newline")
    ds = build_token_dataset([path], tmp_path / "ds", TOK, txt_split=txt_split, progress=False)
    assert decode_docs(ds) == documents
    with pytest.raises(DataError, match="unknown txt_split 'pages'"):
        build_token_dataset([path], tmp_path / "bad", TOK, txt_split="pages", progress=False)


def test_custom_text_key(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"content": "hello"}) + "\n")
    ds = build_token_dataset([path], tmp_path / "ds", TOK, text_key="content", progress=False)
    assert decode_docs(ds) == ["hello"]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"text": "ok"}\n{"text": broken}\n', "bad.jsonl:2: invalid JSON"),
        ('{"text": "ok"}\n\n{"body": "x"}\n', "bad.jsonl:3: no string field 'text'"),
        ('["text"]\n', "bad.jsonl:1: no string field 'text'"),
    ],
)
def test_bad_jsonl_line_names_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        build_token_dataset([path], tmp_path / "ds", TOK, progress=False)
    assert not list(tmp_path.glob("ds*"))  # the partial dataset was removed


def test_bad_inputs_fail_before_any_work(tmp_path):
    (tmp_path / "a.csv").write_text("x")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="a.csv: unsupported input type '.csv'"):
        build_token_dataset([tmp_path / "a.csv"], tmp_path / "ds", TOK, progress=False)
    with pytest.raises(DataError, match="input file not found: .*missing.txt"):
        build_token_dataset([tmp_path / "missing.txt"], tmp_path / "ds", TOK, progress=False)
    with pytest.raises(DataError, match="latin1.txt:1: not valid UTF-8"):
        build_token_dataset([tmp_path / "latin1.txt"], tmp_path / "ds", TOK, progress=False)
    with pytest.raises(DataError, match="no text found in .*empty.jsonl"):
        build_token_dataset([tmp_path / "empty.jsonl"], tmp_path / "ds", TOK, progress=False)
    with pytest.raises(DataError, match="no input files given"):
        build_token_dataset([], tmp_path / "ds", TOK, progress=False)


def test_cache_reuses_and_rebuilds_on_change_or_damage(tmp_path, inputs):
    cache = tmp_path / "cache"
    first = cached_token_dataset([inputs[0]], TOK, cache_dir=cache)
    assert first.prefix.parent == cache / "datasets"
    bin_path = first.prefix.with_name(first.prefix.name + ".bin")
    mtime = bin_path.stat().st_mtime_ns
    assert cached_token_dataset([inputs[0]], TOK, cache_dir=cache).prefix == first.prefix
    assert bin_path.stat().st_mtime_ns == mtime  # reused, not rebuilt
    bin_path.write_bytes(b"\0")  # damaged entry: rebuilt rather than failing
    assert decode_docs(cached_token_dataset([inputs[0]], TOK, cache_dir=cache))[0] == "Chapter 1"
    inputs[0].write_text("changed")
    os.utime(inputs[0], ns=(mtime + 10**9, mtime + 10**9))
    changed = cached_token_dataset([inputs[0]], TOK, cache_dir=cache)
    assert changed.prefix != first.prefix and decode_docs(changed) == ["changed"]


def test_default_cache_dir_follows_the_environment(tmp_path, inputs, monkeypatch):
    monkeypatch.setenv("LOONGFORGE_CACHE_DIR", str(tmp_path / "envcache"))
    assert cached_token_dataset([inputs[0]], TOK).prefix.parent == tmp_path / "envcache" / "datasets"


def test_preprocess_main_writes_and_summarises(tmp_path, inputs, capsys):
    ds = preprocess_main([str(p) for p in inputs], str(tmp_path / "pre"), "byte", "text")
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'pre.bin'} and pre.idx: 5 documents, {ds.num_tokens} tokens (uint16), tokenizer byte" \
        in out


def test_dataset_kinds(tmp_path, inputs):
    prebuilt = build_token_dataset([inputs[1]], tmp_path / "pre", TOK, progress=False)
    assert mmap_dataset([str(prebuilt.prefix)], TOK).num_tokens == prebuilt.num_tokens
    with pytest.raises(DataError, match="exactly one path prefix"):
        mmap_dataset([], TOK)
    assert decode_docs(text_dataset([inputs[1]], TOK, cache_dir=tmp_path / "c")) == decode_docs(prebuilt)
    assert len(shipped_corpus([], TOK, cache_dir=tmp_path / "c")) == 3
    with pytest.raises(DataError, match="takes no paths"):
        shipped_corpus(["x.txt"], TOK)


def test_registration_names_resolve_to_the_factories():
    datasets, tokenizers = Registry("dataset"), Registry("tokenizer")
    register_builtin_datasets(datasets)
    register_builtin_tokenizers(tokenizers)
    assert datasets.names() == ["hf-datasets", "mmap", "preference", "prompts", "sft", "shipped-chat", "shipped-corpus",
                               "shipped-preference", "shipped-tasks", "text"]
    assert datasets.load("megatron") is mmap_dataset
    assert datasets.load("jsonl") is text_dataset and datasets.load("shipped-corpus") is shipped_corpus
    assert tokenizers.names() == ["byte", "hf"]
    assert isinstance(tokenizers.load("byte")(), ByteTokenizer)
    for registry in (datasets, tokenizers):
        for entry in registry.entries():
            assert resolve_import_path(entry.target) is entry.load() and entry.description


def test_importing_the_package_and_registering_stays_torch_free():
    code = (
        "import sys, loongforge.data, loongforge.data.registration as r;"
        "from loongforge.registry import Registry;"
        "r.register_builtin_datasets(Registry('dataset')); r.register_builtin_tokenizers(Registry('tokenizer'));"
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
