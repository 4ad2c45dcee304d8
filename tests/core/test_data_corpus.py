"""The shipped English corpus: present, documented, as large as promised, and losslessly tokenized."""

from __future__ import annotations

import hashlib
import re

from loongforge.data.shipped import shipped_corpus_dataset, shipped_corpus_files, shipped_corpus_path
from loongforge.data.tokenizers import ByteTokenizer


def test_corpus_files_match_their_source_record():
    files = shipped_corpus_files()
    source = (shipped_corpus_path() / "SOURCE.md").read_text(encoding="utf-8")
    assert [f.name for f in files] == ["persuasion.txt", "pride-and-prejudice.txt", "sense-and-sensibility.txt"]
    assert "public domain" in source and "MIT" in source and "r-cran-janeaustenr" in source
    for path in files:
        data = path.read_bytes()
        row = re.search(rf"`{path.name}` \|.*\| (\d+) \| `([0-9a-f]{{64}})` \|", source)
        assert row, f"{path.name} is not listed in SOURCE.md"
        assert int(row.group(1)) == len(data) and row.group(2) == hashlib.sha256(data).hexdigest()
    assert sum(f.stat().st_size for f in files) > 1_000_000


def test_corpus_is_clean_english_prose():
    text = "".join(f.read_text(encoding="utf-8") for f in shipped_corpus_files())
    assert "It is a truth universally acknowledged, that a single man in possession" in text
    assert "gutenberg" not in text.lower()  # the Project Gutenberg boilerplate is not in the corpus
    assert "\r" not in text
    words = re.findall(r"[a-z]+", text.lower())
    assert len(words) > 300_000 and sum(w in {"the", "and", "of", "to"} for w in words) / len(words) > 0.1


def test_byte_tokenizer_round_trips_the_corpus_through_the_cached_dataset(tmp_path):
    tok = ByteTokenizer()
    ds = shipped_corpus_dataset(cache_dir=tmp_path)
    assert ds.tokenizer_name == "byte" and ds.prefix.parent == tmp_path / "datasets"
    for i, path in enumerate(shipped_corpus_files()):
        text = path.read_text(encoding="utf-8")
        assert tok.decode(tok.encode(text)) == text
        assert ds[i][-1] == tok.eos_id and tok.decode(ds[i]) == text
