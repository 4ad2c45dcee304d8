"""``data.dataset: hf-datasets``: local Hugging Face ``datasets`` data (parquet, arrow, jsonl files, save_to_disk
folders) read row by row, tokenized, cached, and trained on."""

from __future__ import annotations

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_training import assert_learns, paragraphs, train_losses
from loongforge.data.errors import DataError
from loongforge.data.hf_datasets import hf_dataset
from loongforge.data.tokenizers import ByteTokenizer

TOK = ByteTokenizer()
ROWS = ["first row", "", "second row, ä", "third"]


@pytest.fixture(autouse=True)
def _hf_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def decode_docs(ds):
    return [TOK.decode(ds[i]) for i in range(len(ds))]


def write_all_layouts(root):
    """The same rows as every input layout the kind reads."""
    table = datasets.Dataset.from_dict({"text": ROWS, "id": list(range(len(ROWS)))})
    pq.write_table(pa.table({"text": ROWS, "id": list(range(len(ROWS)))}), root / "rows.parquet")
    table.to_json(root / "rows.jsonl")
    table.save_to_disk(str(root / "saved"))
    datasets.DatasetDict({"train": table, "test": table.select([0])}).save_to_disk(str(root / "dict"))
    shards = root / "shards"
    shards.mkdir()
    pq.write_table(pa.table({"text": ROWS[:2]}), shards / "part-0.parquet")
    pq.write_table(pa.table({"text": ROWS[2:]}), shards / "part-1.parquet")
    arrow = next((root / "saved").glob("*.arrow"))
    return {"parquet": root / "rows.parquet", "jsonl": root / "rows.jsonl", "saved": root / "saved",
            "dataset-dict": root / "dict", "folder": shards, "arrow": arrow}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    return write_all_layouts(tmp_path_factory.mktemp("layouts"))


@pytest.mark.parametrize("layout", ["parquet", "jsonl", "saved", "dataset-dict", "folder", "arrow"])
def test_every_layout_gives_one_document_per_row(tmp_path, layouts, layout):
    ds = hf_dataset([str(layouts[layout])], TOK, cache_dir=tmp_path / "cache")
    assert decode_docs(ds) == [row for row in ROWS if row]  # empty rows are skipped
    assert all(int(ds[i][-1]) == TOK.eos_id for i in range(len(ds)))
    assert ds.tokenizer_name == "byte"


def test_several_inputs_in_order_with_another_text_column(tmp_path):
    first, second = tmp_path / "a.parquet", tmp_path / "b.parquet"
    pq.write_table(pa.table({"body": ["one", "two"]}), first)
    pq.write_table(pa.table({"body": ["three"]}), second)
    ds = hf_dataset([str(second), str(first)], TOK, text_key="body", cache_dir=tmp_path / "cache")
    assert decode_docs(ds) == ["three", "one", "two"]


def test_the_result_is_cached_until_an_input_changes(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"text": ["cached"]}), path)
    first = hf_dataset([str(path)], TOK, cache_dir=tmp_path / "cache")
    bin_path = first.prefix.with_name(first.prefix.name + ".bin")
    stamp = bin_path.stat().st_mtime_ns
    again = hf_dataset([str(path)], TOK, cache_dir=tmp_path / "cache")
    assert again.prefix == first.prefix and bin_path.stat().st_mtime_ns == stamp
    pq.write_table(pa.table({"text": ["rewritten, longer"]}), path)
    assert decode_docs(hf_dataset([str(path)], TOK, cache_dir=tmp_path / "cache")) == ["rewritten, longer"]


def test_bad_inputs_are_one_line_naming_file_and_row(tmp_path):
    def refused(paths, match, **kwargs):
        with pytest.raises(DataError, match=match) as info:
            hf_dataset([str(p) for p in paths], TOK, cache_dir=tmp_path / "cache", **kwargs)
        assert "\n" not in str(info.value)

    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"text": ["fine"], "other": [1]}), good)
    refused([good], r"good\.parquet: no column 'content' \(columns: text, other\); set data\.text_key",
            text_key="content")
    holes = tmp_path / "holes.parquet"
    pq.write_table(pa.table({"text": ["ok", "ok", None]}), holes)
    refused([holes], r"holes\.parquet: row 2: column 'text' holds nothing, not a string")
    numbers = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"text": [1, 2]}), numbers)
    refused([numbers], r"numbers\.parquet: row 0: column 'text' holds int, not a string")
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 this is not parquet at all")
    refused([broken], r"broken\.parquet: cannot read it with Hugging Face datasets")
    (tmp_path / "rows.csv").write_text("text\nx\n")
    refused([tmp_path / "rows.csv"], r"rows\.csv: unsupported input type '\.csv'")
    refused([tmp_path / "absent.parquet"], r"input not found: .*absent\.parquet")
    (tmp_path / "empty-folder").mkdir()
    refused([tmp_path / "empty-folder"], r"empty-folder: no \.parquet/\.arrow/\.jsonl/\.json files")
    refused([], "needs data.paths")
    blank = tmp_path / "blank.parquet"
    pq.write_table(pa.table({"text": ["", ""]}), blank)
    refused([blank], r"no text found in .*blank\.parquet")
    split = tmp_path / "no-train"
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": ["x"]})}).save_to_disk(str(split))
    refused([split], r"no-train: a DatasetDict without a 'train' split \(splits: test\)")


def test_preprocess_writes_a_parquet_file_as_an_indexed_dataset(tmp_path, layouts, capsys):
    from loongforge.data.kinds import mmap_dataset
    from loongforge.data.preprocess import preprocess_main

    preprocess_main([str(layouts["parquet"])], str(tmp_path / "pre"), "byte", "text")
    assert f"wrote {tmp_path / 'pre.bin'} and pre.idx: 3 documents" in capsys.readouterr().out
    assert decode_docs(mmap_dataset([str(tmp_path / "pre")], TOK)) == [row for row in ROWS if row]


@pytest.mark.slow
def test_a_parquet_dataset_trains(tmp_path):
    path = tmp_path / "austen.parquet"
    pq.write_table(pa.table({"content": paragraphs()}), path, row_group_size=64)
    losses = train_losses(tmp_path, {"dataset": "hf-datasets", "paths": [str(path)], "text_key": "content"})
    assert_learns(losses)
