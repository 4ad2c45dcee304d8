"""Megatron-Energon datasets train through the VLM recipe (``data.dataset: energon``).

The dataset is written with energon's own tools: tar shards by ``webdataset``'s ``TarWriter`` (energon's
dependency) holding shapes samples, then ``energon prepare`` (its click command, non-interactive) writes
``.nv-meta`` with the ``VQASample`` type and a field map. Our kind must read every sample back as the
conversation energon maps (question asked, answer supervised), and ``loongforge train`` on it must lower the loss.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from loongforge.cli import main
from loongforge.data.errors import DataError
from loongforge_vlm.data import shapes
from loongforge_vlm.data.kind import energon_dataset
from PIL import Image
from vlm_data_helpers import PROCESSOR, TOKENIZER

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "vlm-shapes.yaml"
COUNT = 16
FIELD_MAP = {"image": "png", "context": "json[question]", "answers": "json[answers]"}


def _prepare(path: Path, *options: str) -> None:
    from click.testing import CliRunner
    from megatron.energon.tools.prepare import command

    result = CliRunner().invoke(command, [str(path), "--non-interactive", "--no-progress", "--num-workers", "1",
                                          *options])
    assert result.exit_code == 0, result.output[-2000:]


@pytest.fixture(scope="module")
def energon_vqa(tmp_path_factory) -> tuple[Path, dict[str, tuple[str, str]]]:
    """An energon VQA dataset of ``COUNT`` shapes samples over two shards, and its key -> (question, answer)."""
    import webdataset

    root = tmp_path_factory.mktemp("energon-vqa")
    written = {}
    for shard in range(2):
        with webdataset.TarWriter(str(root / f"part-{shard:06d}.tar")) as tar:
            for index in range(shard * COUNT // 2, (shard + 1) * COUNT // 2):
                sample = shapes.make_sample(0, index)
                image = io.BytesIO()
                shapes.render(sample).save(image, format="PNG")
                key = f"shape{index:04d}"
                tar.write({"__key__": key, "png": image.getvalue(),
                           "json": {"question": sample.question, "answers": [sample.answer]}})
                written[key] = (sample.question, sample.answer)
    _prepare(root, "--split-ratio", "1,0,0", "--sample-type", "VQASample", "--field-map", json.dumps(FIELD_MAP))
    return root, written


def test_every_energon_sample_is_read_as_its_question_and_answer(energon_vqa):
    root, written = energon_vqa
    dataset = energon_dataset([str(root)], TOKENIZER)
    seen = {}
    for i in range(len(dataset)):
        sample = dataset[i]
        key = sample.where.rpartition(":")[2]
        supervised = TOKENIZER.decode(sample.ids[sample.supervised].tolist())
        prompt = TOKENIZER.decode(sample.ids[~sample.supervised].tolist())
        seen[key] = (prompt, supervised)
        assert sample.pixel_values.size and sample.image_grid_thw.shape == (1, 3)
    assert sorted(seen) == sorted(written)
    for key, (question, answer) in written.items():
        prompt, supervised = seen[key]
        assert supervised.startswith(answer) and question not in supervised, (key, supervised)
        assert question in prompt and answer not in prompt.rpartition(question)[2].split("assistant")[0]


def test_the_vlm_recipe_trains_on_an_energon_dataset(energon_vqa, tmp_path):
    root, _ = energon_vqa
    out = tmp_path / "run"
    assert main(["train", str(CONFIG), "data.dataset=energon", f"data.paths=[{root}]", f"run.output_dir={out}",
                 "logging.progress=false", "logging.tensorboard=false", "training.threads=1", "data.seq_length=96",
                 "scheduler.warmup_steps=2", "checkpoint.save_at_end=false", "training.steps=6",
                 "logging.interval=1"]) == 0
    losses = [row["loss"] for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in row]
    assert len(losses) == 6 and sum(losses[-2:]) < 0.75 * sum(losses[:2]), losses


def test_an_energon_video_qa_sample_is_a_video_conversation(tmp_path):
    """``VidQASample`` with GIF clips: each becomes ``<video>`` + its question, its answer supervised, and the
    clip's 4 frames two temporal patches."""
    import webdataset

    answers = {}
    with webdataset.TarWriter(str(tmp_path / "clips-000000.tar")) as tar:
        for index in range(2):
            frames = [Image.new("RGB", (32, 32), (60 * step, 100 * index, 0)) for step in range(4)]
            clip = io.BytesIO()
            frames[0].save(clip, format="GIF", save_all=True, append_images=frames[1:], duration=500)
            answers[f"clip{index}"] = f"it turns red {index}"
            tar.write({"__key__": f"clip{index}", "gif": clip.getvalue(),
                       "json": {"q": "what happens?", "a": [answers[f"clip{index}"]]}})
    _prepare(tmp_path, "--split-ratio", "1,0,0", "--sample-type", "VidQASample",
             "--field-map", json.dumps({"video": "gif", "context": "json[q]", "answers": "json[a]"}))
    dataset = energon_dataset([str(tmp_path)], TOKENIZER, processor=PROCESSOR, strict=True)
    for i in range(len(dataset)):
        sample = dataset[i]
        answer = answers[sample.where.rpartition(":")[2]]
        assert TOKENIZER.decode(sample.ids[sample.supervised].tolist()).startswith(answer)
        assert "what happens?" in TOKENIZER.decode(sample.ids[~sample.supervised].tolist())
        assert sample.video_grid_thw[:, 0].tolist() == [2] and not sample.image_grid_thw.size
    assert len(dataset) == 2


def test_what_is_not_an_energon_vqa_dataset_fails_in_one_line(energon_vqa, tmp_path):
    root, _ = energon_vqa
    with pytest.raises(DataError, match=f"^{tmp_path}: not an energon dataset") as plain:
        energon_dataset([str(tmp_path)], TOKENIZER)
    other = tmp_path / "images"
    shutil.copytree(root, other)
    _prepare(other, "--force-overwrite", "--split-ratio", "1,0,0", "--sample-type", "ImageSample",
             "--field-map", json.dumps({"image": "png"}))
    with pytest.raises(DataError, match="sample type 'ImageSample' is not supported") as unsupported:
        energon_dataset([str(other)], TOKENIZER)
    assert "\n" not in str(plain.value) and str(other) in str(unsupported.value)
