"""The shapes generator as WebDataset shards: both layouts read as the same samples; shards are reproducible
and validated (the jsonl layout is tested in test_shapes_data.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from loongforge.cli import main as cli_main
from loongforge.data.errors import DataError
from loongforge_vlm.data.dataset import VisionChatDataset
from loongforge_vlm.data.kind import shapes_dataset
from loongforge_vlm.data.shapes import generate, validate
from loongforge_vlm.data.sources import JsonlSource, WebDatasetSource
from vlm_data_helpers import PROCESSOR, TOKENIZER, write_tar


def test_shapes_jsonl_and_shards_read_as_the_same_samples(tmp_path):
    generate(tmp_path / "j", count=12, seed=5, heldout_fraction=0.25)
    assert cli_main(["make-data", "shapes", str(tmp_path / "w"), "--count", "12", "--seed", "5",
                     "--heldout-fraction", "0.25", "--format", "wds", "--shard-size", "4"]) == 0
    meta = json.loads((tmp_path / "w" / "meta.json").read_text())
    assert meta["layout"] == "wds" and meta["shards"]["train"] == ["train-000000.tar", "train-000001.tar",
                                                                   "train-000002.tar"]
    for split in ("train", "heldout"):
        a = VisionChatDataset([JsonlSource(tmp_path / "j" / f"{split}.jsonl")], TOKENIZER, PROCESSOR)
        b = VisionChatDataset([WebDatasetSource(str(tmp_path / "w" / f"{split}-*.tar"))], TOKENIZER, PROCESSOR)
        assert len(a) == len(b) == meta["splits"][split]
        lines = (tmp_path / "j" / f"{split}.jsonl").read_text().splitlines()
        for i in range(len(a)):
            x, y = a[i], b[i]
            assert np.array_equal(x.ids, y.ids) and np.array_equal(x.supervised, y.supervised)
            assert np.array_equal(x.pixel_values, y.pixel_values) and x.pixel_values.shape == (4, 1176)
            assert x.image_grid_thw.tolist() == y.image_grid_thw.tolist() == [[1, 2, 2]]
            key = json.loads(lines[i])["image"].removesuffix(".png")
            assert x.where.endswith(f" line {i + 1}") and y.where.endswith(f".tar:{key}")


def test_shapes_shards_are_reproducible_and_validated(tmp_path, capsys):
    for name in ("a", "b"):
        generate(tmp_path / name, count=6, seed=1, heldout_fraction=0.0, layout="wds", shard_size=4)
    shards = sorted(p.name for p in (tmp_path / "a").glob("*.tar"))
    assert shards == ["train-000000.tar", "train-000001.tar"]
    assert all((tmp_path / "a" / s).read_bytes() == (tmp_path / "b" / s).read_bytes() for s in shards)
    assert validate(tmp_path / "a") == []
    source = WebDatasetSource(str(tmp_path / "a" / "train-000000.tar"))
    members = [(f"img-00000{i}.{ext}", source.media(i - 1, ext)[1]) for i in range(1, 5) for ext in ("json", "png")]
    members[3] = (members[3][0], members[3][1][:40])  # truncate img-000002.png
    write_tar(tmp_path / "a" / "train-000000.tar", members)
    (tmp_path / "a" / "train-000001.tar").unlink()
    problems = validate(tmp_path / "a")
    assert problems[0] == f"{tmp_path / 'a' / 'train-000001.tar'}: missing"
    assert problems[1].startswith(f"{tmp_path / 'a' / 'train-000000.tar'}:img-000002.png: cannot be decoded")
    assert len(problems) == 2
    assert cli_main(["make-data", "shapes", str(tmp_path / "a"), "--validate"]) == 1
    assert "2 problem(s)" in capsys.readouterr().err


def test_shapes_kind_generates_once_into_the_cache(tmp_path):
    first = shapes_dataset([], TOKENIZER, cache_dir=tmp_path, processor=PROCESSOR, count=10, seed=2)
    folder = tmp_path / "datasets" / "vlm-shapes-10-2"
    assert validate(folder) == [] and len(first) == json.loads((folder / "meta.json").read_text())["splits"]["train"]
    stamp = (folder / "train.jsonl").stat().st_mtime_ns
    again = shapes_dataset([], TOKENIZER, cache_dir=tmp_path, processor=PROCESSOR, count=10, seed=2)
    assert (folder / "train.jsonl").stat().st_mtime_ns == stamp and np.array_equal(again[0].ids, first[0].ids)
    (folder / "img-000003.png").write_bytes(b"broken")  # a damaged cache is rewritten
    shapes_dataset([], TOKENIZER, cache_dir=tmp_path, processor=PROCESSOR, count=10, seed=2)
    assert validate(folder) == []
    with pytest.raises(DataError, match="takes no paths"):
        shapes_dataset(["x.jsonl"], TOKENIZER)
