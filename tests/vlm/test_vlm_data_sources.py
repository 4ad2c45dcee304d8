"""Readers (jsonl + image files, WebDataset tar shards) and the checks that skip or refuse bad samples."""

from __future__ import annotations

import io
import json
import logging

import numpy as np
import pytest
import torch
from loongforge.data.errors import DataError
from loongforge_vlm.data.batching import split_rows
from loongforge_vlm.data.dataset import VisionChatDataset
from loongforge_vlm.data.kind import image_text_dataset
from loongforge_vlm.data.processor import FixedSizeProcessor
from loongforge_vlm.data.sources import JsonlSource, WebDatasetSource, expand_pattern
from PIL import Image
from vlm_data_helpers import PROCESSOR, TOKENIZER, ask, png, write_jsonl, write_tar

IMAGE_PAD = TOKENIZER.vision_tokens.image_pad


def _image_of(sample, k: int, width: int, height: int, seed: int) -> bool:
    """Whether image ``k`` of a sample holds exactly the processed pixels of ``png(width, height, seed)``."""
    rows, grid = PROCESSOR.image(Image.open(io.BytesIO(png(width, height, seed))))
    offsets = np.concatenate([[0], np.cumsum(np.prod(sample.image_grid_thw, axis=1))])
    return tuple(sample.image_grid_thw[k]) == grid and np.array_equal(
        sample.pixel_values[offsets[k]: offsets[k + 1]], rows)


def test_expand_pattern(tmp_path):
    assert expand_pattern("s-{000..002}.tar") == ["s-000.tar", "s-001.tar", "s-002.tar"]
    assert expand_pattern("{a,b}/x-{8..10}.tar") == ["a/x-8.tar", "a/x-9.tar", "a/x-10.tar", "b/x-8.tar",
                                                     "b/x-9.tar", "b/x-10.tar"]
    for name in ("m-2.tar", "m-1.tar", "other.txt"):
        (tmp_path / name).write_bytes(b"")
    assert expand_pattern(str(tmp_path / "m-*.tar")) == [str(tmp_path / "m-1.tar"), str(tmp_path / "m-2.tar")]
    with pytest.raises(DataError, match="a range needs digits"):
        expand_pattern("s-{a..c}.tar")


def test_jsonl_images_resolve_next_to_the_file(tmp_path):
    path = write_jsonl(tmp_path / "set" / "data.jsonl", [
        {"images": ["img/a.png", "img/b.png"], "messages": ask("Same?", "no", images=2)},
        "",  # blank lines are not records
        {"messages": [{"role": "user", "content": "no image here"}, {"role": "assistant", "content": "ok"}]},
    ], {"img/a.png": png(40, 30, 1), "img/b.png": png(60, 60, 2)})
    source = JsonlSource(path)
    assert len(source) == 2 and source.where(1) == f"{path} line 3"
    dataset = VisionChatDataset([source], TOKENIZER, PROCESSOR)
    first, second = dataset[0], dataset[1]
    assert first.image_grid_thw.tolist() == [[1, 2, 2], [1, 4, 4]]
    assert _image_of(first, 0, 40, 30, 1) and _image_of(first, 1, 60, 60, 2)
    assert first.ids.tolist().count(IMAGE_PAD) == 1 + 4
    assert second.pixel_values.shape == (0, PROCESSOR.patch_dim) and second.image_grid_thw.shape == (0, 3)
    assert dataset.skipped.total == 0


def test_webdataset_shards_by_brace_and_glob_patterns(tmp_path):
    record = {"messages": ask("Which is bigger?", "the second", images=2), "images": ["1.png", "0.png"]}
    write_tar(tmp_path / "shard-000.tar", [
        ("a.json", json.dumps(record).encode()), ("a.0.png", png(28, 28, 10)), ("a.1.png", png(56, 56, 11)),
        ("sub/b.json", json.dumps({"messages": ask("Colour?", "red")}).encode()), ("sub/b.png", png(30, 30, 12)),
    ])
    write_tar(tmp_path / "shard-001.tar", [("c.jpg", png(28, 28, 13)),  # image member before the json: fine
                                           ("c.json", json.dumps({"messages": ask("Shape?", "square")}).encode())])
    write_tar(tmp_path / "extra-9.tar", [("d.json", json.dumps({"messages": ask("Count?", "2")}).encode()),
                                         ("d.png", png(28, 28, 14))])
    source = WebDatasetSource([str(tmp_path / "shard-{000..001}.tar"), str(tmp_path / "extra-*.tar")])
    assert [source.where(i) for i in range(len(source))] == [
        f"{tmp_path}/shard-000.tar:a", f"{tmp_path}/shard-000.tar:sub/b", f"{tmp_path}/shard-001.tar:c",
        f"{tmp_path}/extra-9.tar:d"]
    assert source.default_images(0) == ["0.png", "1.png"] and source.default_images(2) == ["jpg"]
    dataset = VisionChatDataset([source], TOKENIZER, PROCESSOR)
    assert len(dataset) == 4
    a = dataset[0]  # the record's order wins: 1.png first
    assert a.image_grid_thw.tolist() == [[1, 4, 4], [1, 2, 2]]
    assert _image_of(a, 0, 56, 56, 11) and _image_of(a, 1, 28, 28, 10)
    assert _image_of(dataset[1], 0, 30, 30, 12) and _image_of(dataset[2], 0, 28, 28, 13)
    assert dataset[3].where == f"{tmp_path}/extra-9.tar:d"


def test_kind_mixes_jsonl_and_shards_in_the_order_given(tmp_path):
    jsonl = write_jsonl(tmp_path / "a.jsonl", [{"image": "x.png", "messages": ask("Q?", "A")}],
                        {"x.png": png(28, 28, 0)})
    write_tar(tmp_path / "b.tar", [("k.json", json.dumps({"messages": ask("Q?", "B")}).encode()),
                                   ("k.png", png(28, 28, 1))])
    dataset = image_text_dataset([str(tmp_path / "b.tar"), str(jsonl)], TOKENIZER, processor=PROCESSOR)
    assert [dataset[i].where for i in range(2)] == [f"{tmp_path}/b.tar:k", f"{jsonl} line 1"]
    with pytest.raises(DataError, match="no WebDataset shards match"):
        image_text_dataset([str(tmp_path / "none-*.tar")], TOKENIZER)


def _bad_jsonl(tmp_path):
    good = png(28, 28, 0)
    return write_jsonl(tmp_path / "data.jsonl", [
        {"image": "ok.png", "messages": ask("Fine?", "yes")},
        {"image": "truncated.png", "messages": ask("Fine?", "no")},
        {"images": ["ok.png"], "messages": ask("Two?", "no", images=2)},
        "{not json",
        {"image": "missing.png", "messages": ask("Fine?", "no")},
        {"image": "ok.png", "messages": ask("Fine again?", "yes")},
    ], {"ok.png": good, "truncated.png": good[:60]})


def test_bad_samples_are_skipped_with_one_counted_warning(tmp_path, caplog):
    path = _bad_jsonl(tmp_path)
    with caplog.at_level(logging.WARNING, logger="loongforge_vlm.data.dataset"):
        dataset = VisionChatDataset([JsonlSource(path)], TOKENIZER, PROCESSOR)
    assert len(dataset) == 2 and [dataset[i].where for i in range(2)] == [f"{path} line 1", f"{path} line 6"]
    assert dataset.skipped.counts == {"corrupt": 2, "mismatch": 1, "malformed": 1}
    summary = dataset.skipped.summary(dataset.num_records)
    assert summary.startswith(f"skipped 4 of 6 samples: 2 corrupt images (first: {tmp_path / 'truncated.png'}: "
                              "cannot be decoded")
    assert (f"1 image-token mismatch (first: {path} line 3: 2 image and 0 video placeholder(s) for 1 image(s) and "
            "0 video(s))") in summary
    assert f"1 malformed record (first: {path} line 4: not JSON" in summary
    assert [r.getMessage() for r in caplog.records] == [summary]


def test_header_only_checks_defer_a_damaged_image_to_loading_time(tmp_path):
    path = _bad_jsonl(tmp_path)
    dataset = VisionChatDataset([JsonlSource(path)], TOKENIZER, PROCESSOR, verify_images=False)
    assert dataset.skipped.counts == {"corrupt": 1, "mismatch": 1, "malformed": 1}  # the missing file
    assert [entry.where for entry in dataset.entries] == [f"{path} line {n}" for n in (1, 2, 6)]
    with pytest.raises(DataError, match=f"^{tmp_path / 'truncated.png'}: cannot be decoded .*when the dataset was"):
        dataset[1]


def test_strict_raises_naming_the_file_and_line(tmp_path):
    path = _bad_jsonl(tmp_path)
    with pytest.raises(DataError, match=f"^{tmp_path / 'truncated.png'}: cannot be decoded .*strict"):
        VisionChatDataset([JsonlSource(path)], TOKENIZER, PROCESSOR, strict=True)


def test_a_corrupt_member_of_a_shard_is_named_by_shard_and_member(tmp_path):
    good = png(28, 28, 0)
    shard = write_tar(tmp_path / "shards" / "00001.tar", [
        ("abc.json", json.dumps({"messages": ask("Q?", "A")}).encode()), ("abc.jpg", good[:50]),
        ("def.json", json.dumps({"messages": ask("Q?", "A")}).encode()), ("def.png", good),
        ("ghi.json", json.dumps({"messages": ask("Q?", "A", images=2)}).encode()), ("ghi.png", good),
        ("jkl.png", good),  # no json: a malformed sample
    ])
    dataset = VisionChatDataset([WebDatasetSource(str(shard))], TOKENIZER, PROCESSOR)
    assert len(dataset) == 1 and dataset[0].where == f"{shard}:def"
    summary = dataset.skipped.summary(dataset.num_records)
    assert summary.startswith(f"skipped 3 of 4 samples: 1 corrupt image (first: {shard}:abc.jpg: cannot be decoded")
    assert f"1 image-token mismatch (first: {shard}:ghi: 2 image and 0 video placeholder(s)" in summary
    assert f"1 malformed record (first: {shard}:jkl: sample has no jkl.json" in summary
    with pytest.raises(DataError, match=f"^{shard}:abc.jpg: cannot be decoded"):
        VisionChatDataset([WebDatasetSource(str(shard))], TOKENIZER, PROCESSOR, strict=True)


def test_nothing_usable_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"image": "gone.png", "messages": ask("Q?", "A")}], {})
    with pytest.raises(DataError, match="no usable samples among 1 record.*1 corrupt image"):
        VisionChatDataset([JsonlSource(path)], TOKENIZER, PROCESSOR)


def test_videos_as_frame_files(tmp_path):
    frames = {f"v/{k}.png": png(56, 28, k) for k in range(3)}
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"videos": [["v/0.png", "v/1.png", "v/2.png"]], "image": "v/0.png", "fps": 4,
         "messages": [{"role": "user", "content": "<video>Then <image>?"}, {"role": "assistant", "content": "ok"}]},
        {"videos": [["v/0.png", "odd.png"]], "messages": [{"role": "user", "content": "<video>?"},
                                                          {"role": "assistant", "content": "no"}]},
    ], {**frames, "odd.png": png(28, 28, 9)})
    dataset = VisionChatDataset([JsonlSource(path)], TOKENIZER, PROCESSOR)
    assert len(dataset) == 1 and dataset.skipped.counts == {"corrupt": 1}
    assert "video frames differ in size" in dataset.skipped.first["corrupt"]
    sample = dataset[0]
    frames_decoded = [Image.open(io.BytesIO(frames[f"v/{k}.png"])) for k in range(3)]
    rows, grid = PROCESSOR.video(frames_decoded)
    assert grid == (2, 2, 4) and sample.video_grid_thw.tolist() == [[2, 2, 4]]
    assert np.array_equal(sample.pixel_values_videos, rows)
    assert sample.ids.tolist().count(TOKENIZER.vision_tokens.video_pad) == PROCESSOR.num_tokens(grid) == 4
    assert sample.image_grid_thw.tolist() == [[1, 2, 4]]
    batch = split_rows(dataset, 64, pack=True)[0].batch([0])
    assert torch.equal(batch["pixel_values_videos"], torch.from_numpy(rows))
    assert batch["video_grid_thw"].tolist() == [[2, 2, 4]] and batch["image_grid_thw"].tolist() == [[1, 2, 4]]
    assert batch["second_per_grid_ts"].tolist() == [0.5]  # 2 frames per temporal patch at 4 fps
    with pytest.raises(DataError, match="line 1: has videos, but the vision tower's processor takes only images"):
        VisionChatDataset([JsonlSource(path)], TOKENIZER, FixedSizeProcessor(32, 4, 2))
