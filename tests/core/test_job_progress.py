"""Progress of long jobs other than training (:mod:`loongforge.progress`): the plain line's counts, rate and ETA on a
controlled clock, when plain lines are printed, who prints nothing (``LOONGFORGE_PROGRESS=off``, a rank other than
0), and the lines a real ``loongforge convert`` (both ways) and ``loongforge generate`` print on standard error
while standard output keeps their results alone."""

from __future__ import annotations

import json
import re

import pytest
from loongforge import progress as progress_module
from loongforge.cli import main
from loongforge.progress import JobProgress, job_progress, track

LINE = re.compile(r"^(?P<what>[^:]+): (?P<done>\d+)(?:/(?P<total>\d+))? (?P<unit>\w+) \((?P<rate>[\d,.]+)/s, "
                  r"(?P<tail>[^)]*)\)(?: \[(?P<note>.*)\])?$")


class Clock:
    """``time.perf_counter`` of the progress module, moved by hand."""

    def __init__(self, monkeypatch, start: float = 1000.0) -> None:
        self.now = start
        monkeypatch.setattr(progress_module.time, "perf_counter", lambda: self.now)


@pytest.fixture
def plain(monkeypatch):
    monkeypatch.setenv("LOONGFORGE_PROGRESS", "plain")
    monkeypatch.delenv("RANK", raising=False)


@pytest.fixture
def every_step(plain, monkeypatch):
    """Plain progress with a line at every step (the module's interval is 10 s)."""
    monkeypatch.setattr(progress_module, "PLAIN_EVERY_S", 0.0)


def _shown(text: str, description: str) -> list[re.Match]:
    matches = [LINE.match(line) for line in text.splitlines()]
    return [m for m in matches if m is not None and m["what"] == description]


# -- the line and the cadence, on a controlled clock -----------------------------------------------------------------

def test_line_counts_rate_and_eta(monkeypatch):
    clock = Clock(monkeypatch)
    job = JobProgress("converting", 20, "tensor", "off", 10.0)
    assert job.line() == "converting: 0/20 tensor (0.00/s, 0.0s)"  # nothing done: no rate, so no ETA yet
    clock.now += 10.0
    job.advance(5, note="layers.3.mlp")
    assert job.rate() == 0.5
    assert job.line() == "converting: 5/20 tensor (0.50/s, eta 30s) [layers.3.mlp]"
    clock.now += 2.0
    job.advance(1)  # no new note: the last one stays
    assert job.line() == "converting: 6/20 tensor (0.50/s, eta 28s) [layers.3.mlp]"
    clock.now += 28.0
    job.advance(14, note="output_layer")
    assert job.line() == "converting: 20/20 tensor (0.50/s, 40.0s) [output_layer]"  # finished: elapsed, no ETA
    unknown = JobProgress("reading rows", None, "row", "off", 10.0)
    clock.now += 4.0
    unknown.advance(3000)
    assert unknown.line() == "reading rows: 3000 row (750.00/s, 4.0s)"
    clock.now += 2.0
    unknown.advance(3000)
    assert unknown.line() == "reading rows: 6000 row (1,000.00/s, 6.0s)"


def test_bytes_are_shown_as_sizes(monkeypatch):
    clock = Clock(monkeypatch)
    job = JobProgress("tokenizing (byte)", 104_857_600, "bytes", "off", 10.0)
    clock.now += 5.0
    job.advance(52_428_800, note="a.txt")
    assert job.line() == "tokenizing (byte): 52.4 MB/104.9 MB (10.5 MB/s, eta 5s) [a.txt]"
    streamed = JobProgress("reading", None, "bytes", "off", 10.0)
    clock.now += 2.0
    streamed.advance(999)
    assert streamed.line() == "reading: 999 B (500 B/s, 2.0s)"
    streamed.advance(5 * 10**15)
    assert streamed.line() == "reading: 5,000.0 TB (2,500.0 TB/s, 2.0s)"


def test_plain_lines_every_interval_plus_one_final_line(monkeypatch, capsys, plain):
    clock = Clock(monkeypatch)
    with job_progress("hashing", total=100, unit="file", plain_every=10.0) as job:
        for _ in range(100):
            clock.now += 1.5  # a line at 10.5 s, 21 s, ... (the first advance at least 10 s after the last line)
            job.advance()
    lines = capsys.readouterr().out.splitlines()
    done = [int(LINE.match(line)["done"]) for line in lines]
    assert done == [7, 14, 21, 28, 35, 42, 49, 56, 63, 70, 77, 84, 91, 98, 100]
    assert lines[0] == "hashing: 7/100 file (0.67/s, eta 140s)"
    assert lines[-1] == "hashing: 100/100 file (0.67/s, 150.0s)"


def test_the_final_line_is_not_repeated_and_the_default_interval_is_read_at_start(monkeypatch, capsys, plain):
    monkeypatch.setattr(progress_module, "PLAIN_EVERY_S", 0.0)  # the default is looked up when a job starts
    with job_progress("writing", total=3, unit="shard") as job:
        for index in range(3):
            job.advance(note=f"shard-{index}")
    assert [line.split(" (")[0] for line in capsys.readouterr().out.splitlines()] == [
        "writing: 1/3 shard", "writing: 2/3 shard", "writing: 3/3 shard"]


def test_track_counts_items_and_knows_totals_from_len(capsys, every_step):
    assert list(track(["a", "b", "c"], "reading", unit="file")) == ["a", "b", "c"]
    assert list(track((x for x in range(2)), "streaming")) == [0, 1]
    lines = capsys.readouterr().out.splitlines()
    counts = [(m["what"], m["done"], m["total"], m["unit"]) for m in map(LINE.match, lines)]
    assert counts == [("reading", "1", "3", "file"), ("reading", "2", "3", "file"), ("reading", "3", "3", "file"),
                      ("streaming", "1", None, "item"), ("streaming", "2", None, "item")]


def test_off_and_other_ranks_print_nothing(monkeypatch, capsys):
    monkeypatch.setattr(progress_module, "PLAIN_EVERY_S", 0.0)
    monkeypatch.setenv("LOONGFORGE_PROGRESS", "off")
    with job_progress("quiet", total=2) as job:
        job.advance(2)
        job.message("a message")
    monkeypatch.setenv("LOONGFORGE_PROGRESS", "plain")
    monkeypatch.setenv("RANK", "1")  # rank 1 of a multi-process job: rank 0 shows it
    with job_progress("rank one", total=2, stderr=True) as job:
        job.advance(2)
    assert capsys.readouterr() == ("", "")


def test_stderr_keeps_standard_output_for_results(capsys, every_step):
    with job_progress("generating", total=2, unit="token", stderr=True) as job:
        job.advance()
        job.message("loaded")
        job.advance()
    captured = capsys.readouterr()
    assert captured.out == ""
    assert [line.split(" (")[0] for line in captured.err.splitlines()] == [
        "generating: 1/2 token", "loaded", "generating: 2/2 token"]


def test_rich_mode_draws_the_bar_on_its_stream(monkeypatch, capsys):
    monkeypatch.setenv("LOONGFORGE_PROGRESS", "rich")
    monkeypatch.delenv("RANK", raising=False)
    with job_progress("drawing", total=4, unit="image", stderr=True) as job:
        job.advance(4, note="img-000004.png")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "drawing" in captured.err and "4/4" in captured.err and "img-000004.png" in captured.err



@pytest.mark.parametrize("columns", [60, 80, 120])
def test_a_narrow_terminal_cuts_the_note_and_description_never_the_count_or_eta(columns, monkeypatch):
    """A long note (a tensor's name) used to squeeze the count and the time left out of the bar at 80 columns
    ("converting ten… 50,701.05 tens…"); now the line fits and keeps both, the note giving way first."""
    import io

    from loongforge import progress_bar
    from rich.console import Console

    monkeypatch.setenv("LOONGFORGE_PROGRESS", "rich")
    monkeypatch.delenv("RANK", raising=False)
    out = io.StringIO()
    monkeypatch.setattr(progress_bar, "Console", lambda file: Console(file=out, width=columns, force_terminal=True,
                                                                      color_system=None))
    with job_progress("converting tensors", total=300, unit="tensor") as job:
        job.advance(120, note="decoder.layers.11.self_attention.linear_qkv.weight")
    last = out.getvalue().split("\r")[-1].replace("\x1b[2K", "").split("\n")[0]
    assert len(last) <= columns and "120/300" in last and re.search(r"eta \S:\S\S:\S\S", last), last
    assert "decoder" in last  # the note is cut, not dropped
    if columns == 120:
        assert "converting tensors" in last

# -- hashing and verifying checkpoints ------------------------------------------------------------------------------

def test_large_checkpoints_show_hashing_and_full_verification_per_block(tmp_path, monkeypatch, capsys, every_step):
    from loongforge.checkpoint import manifest

    (tmp_path / "model_optim").mkdir()
    (tmp_path / "model_optim" / "__0_0.distcp").write_bytes(b"\1" * (2 * manifest.BLOCK_SIZE + 1))  # three blocks
    (tmp_path / "trainer.json").write_text("{}")
    (tmp_path / "empty").write_bytes(b"")  # no block to read
    names = manifest.list_files(tmp_path)
    manifest.write_manifest(tmp_path, step=1, entries=manifest.hash_files(tmp_path, names, progress="hashing"))
    manifest.verify_manifest(tmp_path, progress=True)
    assert capsys.readouterr() == ("", "")  # 8 MiB: below LARGE_CHECKPOINT_BYTES, quiet

    monkeypatch.setattr(manifest, "LARGE_CHECKPOINT_BYTES", 1)
    manifest.hash_files(tmp_path, names, progress="hashing")
    manifest.verify_manifest(tmp_path, progress=True)
    manifest.verify_manifest(tmp_path, "sampled", progress=True)  # reads a few blocks: never shown
    manifest.verify_manifest(tmp_path)  # not asked for (a save during training, the pruner)
    err = capsys.readouterr().err
    distcp = "model_optim/__0_0.distcp"
    expected = [(1, 4, distcp), (2, 4, distcp), (3, 4, distcp), (4, 4, "trainer.json")]
    for description in ("hashing", f"verifying {tmp_path}"):
        shown = _shown(err, description)
        assert [(int(m["done"]), int(m["total"]), m["note"]) for m in shown] == expected
        assert {m["unit"] for m in shown} == {"block"}
    assert len(err.splitlines()) == 8


# -- real jobs through the CLI ---------------------------------------------------------------------------------------

def test_conversion_both_ways_shows_every_tensor_and_shard(hf_tiny, tmp_path, capsys, every_step):
    from safetensors import safe_open

    hf_dir, _ = hf_tiny("llama3-rope-untied")
    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as handle:
        names = sorted(handle.keys())  # noqa: SIM118 - safe_open has no __iter__
    assert main(["convert", "hf-to-mcore", str(hf_dir), str(tmp_path / "mcore")]) == 0
    captured = capsys.readouterr()
    read = _shown(captured.err, "reading Hugging Face tensors")
    assert [(int(m["done"]), int(m["total"]), m["unit"]) for m in read] == [
        (n, len(names), "tensor") for n in range(1, len(names) + 1)]
    assert [m["note"] for m in read] == names
    written = _shown(captured.err, "writing checkpoint tensors")
    total = int(written[0]["total"])
    assert [int(m["done"]) for m in written] == list(range(1, total + 1))
    notes = {m["note"] for m in written}
    assert {"embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"} <= notes
    assert captured.out.splitlines() == [captured.out.strip()] and captured.out.startswith(f"wrote {tmp_path}")
    assert not any(line.startswith(("hashing", "verifying")) for line in captured.err.splitlines())  # small: quiet

    out = tmp_path / "sharded"
    assert main(["convert", "mcore-to-hf", str(tmp_path / "mcore"), str(out), "--max-shard-size", "40KB"]) == 0
    captured = capsys.readouterr()
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(index.values()))
    shown = _shown(captured.err, "writing Hugging Face tensors")
    assert [m["note"] for m in shown] == shards  # one line per shard file, with its name
    per_shard = [sum(1 for f in index.values() if f == shard) for shard in shards]
    assert [int(m["done"]) for m in shown] == [sum(per_shard[: i + 1]) for i in range(len(shards))]
    assert all(int(m["total"]) == len(names) for m in shown)
    assert captured.out.startswith(f"wrote {out}: {len(names)} tensors")


def test_generate_counts_tokens_on_stderr_and_jsonl_stays_clean(hf_tiny, tmp_path, monkeypatch, capsys,
                                                                every_step):
    from loongforge.checkpoint import manifest

    monkeypatch.setattr(manifest, "LARGE_CHECKPOINT_BYTES", 1)  # as a large checkpoint shows it
    hf_dir, _ = hf_tiny("qwen2-bias-tied")
    assert main(["convert", "hf-to-mcore", str(hf_dir), str(tmp_path / "mcore")]) == 0
    listed = json.loads((tmp_path / "mcore" / "manifest.json").read_text())["files"]
    blocks = sum(-(-entry["size"] // manifest.BLOCK_SIZE) for entry in listed.values())
    hashed = _shown(capsys.readouterr().err, f"hashing {tmp_path / 'mcore'}")
    assert [int(m["done"]) for m in hashed] == list(range(1, blocks + 1))
    assert {m["note"] for m in hashed} == {name for name, entry in listed.items() if entry["size"]}
    assert main(["generate", str(tmp_path / "mcore"), "--prompt", "Emma", "--prompt", "Mr. Knightley", "--tokens",
                 "6", "--ignore-eos", "--tokenizer", "byte", "--jsonl"]) == 0
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines()]  # nothing but the completions
    assert [row["prompt"] for row in rows] == ["Emma", "Mr. Knightley"]
    assert all(len(row["tokens"]) == 6 for row in rows)
    shown = _shown(captured.err, "generating")
    assert [(int(m["done"]), int(m["total"]), m["unit"], m["note"]) for m in shown] == [
        (n, 6, "token", "2 of 2 prompts writing") for n in range(1, 7)]
    verified = _shown(captured.err, f"verifying {tmp_path / 'mcore'}")  # generate verifies every byte first
    assert [int(m["done"]) for m in verified] == list(range(1, blocks + 1))


def test_preprocess_counts_input_bytes_as_sizes(tmp_path, capsys, every_step):
    from loongforge.data.sources import iter_documents

    first, second = tmp_path / "a.txt", tmp_path / "b.jsonl"
    first.write_text("Chapter 1\n\nIt was a dark night.\n" * 40, encoding="utf-8")
    second.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(30)), encoding="utf-8")
    total = first.stat().st_size + second.stat().st_size
    assert main(["preprocess", str(first), str(second), "--output", str(tmp_path / "out" / "ds")]) == 0
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("tokenizing (byte): ")]
    pieces = [units for path in (first, second) for _, units in iter_documents(path)]
    assert sum(pieces) == total and len(lines) == len(pieces)  # a line per piece read, counting its bytes
    assert lines[-1].startswith(f"tokenizing (byte): {total / 1000:.1f} kB/{total / 1000:.1f} kB (")
    assert captured.out.startswith(f"wrote {tmp_path / 'out' / 'ds'}.bin")


def test_reading_a_checkpoint_on_another_rank_or_with_progress_off_prints_nothing(hf_tiny, monkeypatch, capsys,
                                                                                    every_step):
    from loongforge.interop.hf_checkpoint import index_hf_tensors, load_hf_tensors

    hf_dir, _ = hf_tiny("qwen2-bias-tied")
    infos = index_hf_tensors(hf_dir)
    load_hf_tensors(infos)
    assert len(_shown(capsys.readouterr().err, "reading Hugging Face tensors")) == len(infos)
    monkeypatch.setenv("RANK", "3")
    assert sorted(load_hf_tensors(infos)) == sorted(infos)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOONGFORGE_PROGRESS", "off")
    assert sorted(load_hf_tensors(infos)) == sorted(infos)
    assert capsys.readouterr() == ("", "")
