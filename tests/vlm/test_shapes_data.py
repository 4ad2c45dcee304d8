"""The synthetic shapes generator: files, answers re-derived from the pixels, determinism, and validation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import deque
from pathlib import Path

import numpy as np
import pytest
from loongforge.cli import main as cli_main
from loongforge_vlm.data.shapes import BACKGROUND, COLOURS, KINDS, generate, validate
from PIL import Image


def _read(directory: Path, split: str) -> list[dict]:
    return [json.loads(line) for line in (directory / f"{split}.jsonl").read_text().splitlines()]


def _components(pixels: np.ndarray) -> list[dict]:
    """Connected (4-neighbour) regions of non-background pixels, each with its colours, box and fill ratio."""
    foreground = np.any(pixels != BACKGROUND, axis=-1)
    seen = np.zeros_like(foreground)
    regions = []
    for start in zip(*np.nonzero(foreground), strict=True):
        if seen[start]:
            continue
        seen[start] = True
        queue, cells = deque([start]), []
        while queue:
            r, c = queue.popleft()
            cells.append((r, c))
            for nr, nc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
                if 0 <= nr < foreground.shape[0] and 0 <= nc < foreground.shape[1] and foreground[nr, nc] \
                        and not seen[nr, nc]:
                    seen[nr, nc] = True
                    queue.append((nr, nc))
        rows, cols = np.array(cells).T
        box_area = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
        colours = {tuple(int(v) for v in pixels[r, c]) for r, c in cells}
        regions.append({"colours": colours, "fill": len(cells) / box_area,
                        "box": [int(cols.min()), int(rows.min()), int(cols.max()), int(rows.max())]})
    return regions


def _shape_of(fill: float) -> str:
    """Square boxes filled fully, circles ~pi/4, triangles ~1/2."""
    return "square" if fill > 0.95 else "circle" if fill > 0.65 else "triangle"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shapes")
    sizes = generate(out, count=60, seed=7, heldout_fraction=0.2)
    assert sizes["train"] + sizes["heldout"] == 60 and sizes["heldout"] > 0 and sizes["train"] > 0
    return out


def test_files_and_records(dataset):
    meta = json.loads((dataset / "meta.json").read_text())
    assert meta["count"] == 60 and meta["seed"] == 7 and meta["size"] == 32
    train, heldout = _read(dataset, "train"), _read(dataset, "heldout")
    assert (len(train), len(heldout)) == (meta["splits"]["train"], meta["splits"]["heldout"])
    names = [r["image"] for r in train + heldout]
    assert sorted(names) == [f"img-{i:06d}.png" for i in range(1, 61)]  # every image once, splits disjoint
    assert sorted(p.name for p in dataset.glob("*.png")) == sorted(names)
    assert {r["kind"] for r in train} == set(KINDS)
    for record in train + heldout:
        user, assistant = record["messages"]
        assert user["role"] == "user" and user["content"].startswith("<image>\n")
        assert assistant["role"] == "assistant" and assistant["content"]
    assert validate(dataset) == []


def test_answers_match_what_is_drawn(dataset):
    palette = {rgb: name for name, rgb in COLOURS.items()}
    for record in _read(dataset, "train") + _read(dataset, "heldout"):
        pixels = np.asarray(Image.open(dataset / record["image"]).convert("RGB"))
        assert pixels.shape == (32, 32, 3)
        regions = _components(pixels)
        assert all(len(r["colours"]) == 1 and next(iter(r["colours"])) in palette for r in regions)
        colours = [palette[next(iter(r["colours"]))] for r in regions]
        shapes = [_shape_of(r["fill"]) for r in regions]
        answer = record["messages"][1]["content"]
        if record["kind"] == "count":
            assert answer == str(len(regions)), record["image"]
        elif record["kind"] == "colour":
            assert set(colours) == {answer}, record["image"]
        else:
            assert set(shapes) == {answer}, record["image"]
        drawn = sorted((s["box"], s["shape"], s["colour"]) for s in record["shapes"])
        found = zip(regions, shapes, colours, strict=True)
        assert drawn == sorted((r["box"], shape, colour) for r, shape, colour in found)


def test_same_seed_same_bytes_and_samples_do_not_depend_on_count(tmp_path, dataset):
    generate(tmp_path / "a", count=60, seed=7, heldout_fraction=0.2)
    for path in sorted(dataset.iterdir()):
        assert (tmp_path / "a" / path.name).read_bytes() == path.read_bytes(), path.name
    generate(tmp_path / "b", count=10, seed=7, heldout_fraction=0.2)
    for index in range(1, 11):
        name = f"img-{index:06d}.png"
        assert (tmp_path / "b" / name).read_bytes() == (dataset / name).read_bytes()
    generate(tmp_path / "c", count=10, seed=8, heldout_fraction=0.2)
    assert sum((tmp_path / "c" / f"img-{i:06d}.png").read_bytes() != (dataset / f"img-{i:06d}.png").read_bytes()
               for i in range(1, 11)) >= 8


def test_validate_reports_the_corrupt_file_and_the_bad_line(tmp_path):
    out = tmp_path / "set"
    generate(out, count=6, seed=1, heldout_fraction=0.0)
    records = _read(out, "train")
    corrupt = out / records[1]["image"]
    corrupt.write_bytes(corrupt.read_bytes()[:40])  # a truncated PNG: the header survives, the pixels do not
    (out / records[3]["image"]).unlink()
    with (out / "train.jsonl").open("a") as fh:
        fh.write("{not json\n")
        fh.write(json.dumps({"image": records[0]["image"], "messages": []}) + "\n")
    problems = validate(out)
    assert len(problems) == 4, problems
    assert problems[0].startswith(f"{corrupt} (from {out / 'train.jsonl'}:2): cannot be decoded")
    assert problems[1] == f"{out / records[3]['image']} (from {out / 'train.jsonl'}:4): is missing"
    assert problems[2].startswith(f"{out / 'train.jsonl'}:7: not JSON")
    assert problems[3] == f"{out / 'train.jsonl'}:8: record needs 'messages' = [user, assistant]"


def test_command_writes_and_validates(tmp_path, capsys):
    out = tmp_path / "cli"
    done = subprocess.run([sys.executable, "-m", "loongforge.cli", "make-data", "shapes", str(out), "--count", "5",
                           "--seed", "2"], capture_output=True, text=True, check=False,
                          env={**os.environ, "LOONGFORGE_PROGRESS": "plain"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"{out}: valid"
    assert len(list(out.glob("*.png"))) == 5
    assert done.stderr.splitlines()[-1].startswith(f"drawing shapes into {out}: 5/5 image (")
    (out / "img-000002.png").write_bytes(b"\x89PNG garbage")
    assert cli_main(["make-data", "shapes", str(out), "--validate"]) == 1
    err = capsys.readouterr().err
    assert f"{out / 'img-000002.png'}" in err and "1 problem(s)" in err
    assert cli_main(["make-data", "shapes", str(tmp_path / "bad"), "--size", "15"]) == 2
    assert capsys.readouterr().err == ("error: shapes: --size must be even and >= 16 (four quadrants of shapes), "
                                       "got 15\n")
    assert not (tmp_path / "bad").exists()
