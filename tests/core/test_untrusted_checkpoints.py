"""Loading a checkpoint runs no code that came with it (issue 17 item 2).

A tiny LLM checkpoint is trained through the CLI once; copies of it are then crafted the way an attacker would, each
with a recomputed manifest (so verification passes, as it would for a checkpoint downloaded whole):

* ``metadata``: ``model_optim/.metadata`` pickles an object whose unpickling calls ``exec``;
* ``byte-item``: one BYTE_IO item (a layer's ``_extra_state``, read by torch with ``weights_only=False``) does;
* ``common``: megatron's ``common.pt`` does;
* ``backend``: ``metadata.json`` sends megatron to another checkpoint reader;
* ``config``: ``config.yaml`` names the model ``<module>:family``, a module whose import writes a marker.

Each crafted payload is first shown to be live (unpickled without restriction, it writes its marker). Then
``generate``, ``convert mcore-to-hf`` and a resume in ``train`` must exit 2 with one ``error:`` line naming the file
and what was refused, and no marker may appear. ``--trust-code`` (or ``run.trust_code``) lets the config's module
import, and nothing else: it never admits a pickle.
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
import uuid
from pathlib import Path

import pytest
import torch
from loongforge.checkpoint.manifest import write_manifest
from loongforge.checkpoint.trust import check_dist_checkpoint, read_dcp_metadata
from loongforge.cli import main
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.overrides.num_layers=1", "data.seq_length=32", "training.micro_batch_size=2",
        "training.global_batch_size=2", "training.sample_tokens=0", "training.threads=1", "logging.progress=false",
        "logging.tensorboard=false"]


class _RunsCode:
    """Unpickled, calls ``exec`` on code that creates ``marker``: what a crafted pickle does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A genuine checkpoint: 2 steps of the quickstart recipe, shrunk."""
    out = tmp_path_factory.mktemp("trained")
    assert main(["train", str(ROOT / "configs/quickstart.yaml"), *TINY, "training.steps=2",
                 f"run.output_dir={out}"]) == 0
    return out / "checkpoints" / "step-0000002"


def _copy(trained: Path, root: Path) -> Path:
    step = root / trained.name
    shutil.copytree(trained, step)
    return step


def _reseal(step: Path) -> None:
    """What an attacker does after editing files: recompute the manifest, so verification passes."""
    (step / "manifest.json").unlink()
    write_manifest(step, step=2)


def _live(payload: bytes, marker: Path, *, torch_file: bool) -> None:
    """``payload`` really runs code when read without restriction (then the marker is removed again)."""
    if torch_file:
        torch.load(io.BytesIO(payload), weights_only=False)
    else:
        pickle.loads(payload)
    assert marker.is_file(), "the crafted payload did not run"
    marker.unlink()


def _craft_metadata(step: Path, marker: Path) -> str:
    metadata_file = step / "model_optim" / ".metadata"
    metadata = read_dcp_metadata(metadata_file)
    metadata.planner_data = _RunsCode(marker)
    payload = pickle.dumps(metadata)
    _live(payload, marker, torch_file=False)
    metadata_file.write_bytes(payload)
    return f"{metadata_file}: names builtins.exec"


def _craft_byte_item(step: Path, marker: Path) -> str:
    metadata_file = step / "model_optim" / ".metadata"
    metadata = read_dcp_metadata(metadata_file)
    index, info = next((index, info) for index, info in metadata.storage_data.items()
                       if isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata))
    buffer = io.BytesIO()
    torch.save([_RunsCode(marker)], buffer)
    payload = buffer.getvalue()
    _live(payload, marker, torch_file=True)
    data_file = step / "model_optim" / info.relative_path
    offset = data_file.stat().st_size
    with open(data_file, "ab") as handle:
        handle.write(payload)
    metadata.storage_data[index] = _StorageInfo(info.relative_path, offset, len(payload))
    metadata_file.write_bytes(pickle.dumps(metadata))
    return f"item '{index.fqn}' (bytes {offset}..{offset + len(payload)}) is not plain data (it names the global"


def _craft_common(step: Path, marker: Path) -> str:
    buffer = io.BytesIO()
    torch.save({"state": _RunsCode(marker)}, buffer)
    _live(buffer.getvalue(), marker, torch_file=True)
    (step / "model_optim" / "common.pt").write_bytes(buffer.getvalue())
    return "common.pt is not plain data (it names the global"


def _craft_backend(step: Path, marker: Path) -> str:
    fmt = step / "model_optim" / "metadata.json"
    fmt.write_text(json.dumps({**json.loads(fmt.read_text()), "sharded_backend": "zarr"}))
    return "metadata.json: names the format"


def _craft_config(step: Path, marker: Path, monkeypatch, model: str = "llama-tiny") -> str:
    """``config.yaml`` names the model ``<module>:family``, a new module on sys.path whose import writes ``marker``
    and whose ``family()`` is the registered ``model`` (so the run works once the user trusts it)."""
    module = f"lf_probe_{uuid.uuid4().hex[:8]}"
    (step.parent / f"{module}.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from loongforge.plugins import get_host\n"
        "def family():\n"
        f"    return get_host().registry('model').load({model!r})\n"
    )
    monkeypatch.syspath_prepend(str(step.parent))
    config = step / "config.yaml"
    text = config.read_text()
    assert f"name: {model}" in text
    config.write_text(text.replace(f"name: {model}", f"name: {module}:family", 1))
    return f"model.name in {config}: '{module}:family' is an import path"


CRAFTS = {"metadata": _craft_metadata, "byte-item": _craft_byte_item, "common": _craft_common,
          "backend": _craft_backend}


@pytest.fixture
def crafted(trained, tmp_path, monkeypatch):
    """``crafted(kind) -> (step dir, marker, expected message part)``."""

    def make(kind: str) -> tuple[Path, Path, str]:
        marker = tmp_path / f"code-ran-{kind}"
        step = _copy(trained, tmp_path / f"crafted-{kind}")
        if kind == "config":
            expected = _craft_config(step, marker, monkeypatch)
        else:
            expected = CRAFTS[kind](step, marker)
        _reseal(step)
        return step, marker, expected

    return make


def _refused(capsys, code: int, expected: str) -> str:
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert expected in lines[0], lines[0]
    return lines[0]


def _generate(step: Path, *extra: str) -> int:
    return main(["generate", str(step), "--prompt", "It is", "--tokens", "3", *extra])


def test_a_genuine_checkpoint_passes_the_check_and_generates(trained, capsys):
    check_dist_checkpoint(trained / "model_optim")
    assert _generate(trained) == 0
    assert capsys.readouterr().out.startswith("It is")


def test_metadata_from_torchs_default_writer_is_admitted(trained, tmp_path, capsys):
    """Checkpoints written before LoongForge's own writer carry torch's StorageMeta (the save directory as a
    PosixPath): plain data, still loaded."""
    step = _copy(trained, tmp_path)
    metadata_file = step / "model_optim" / ".metadata"
    metadata = read_dcp_metadata(metadata_file)
    metadata.storage_meta = StorageMeta(checkpoint_id=Path("/old/run/model_optim"), save_id="0")
    metadata_file.write_bytes(pickle.dumps(metadata))
    _reseal(step)
    assert _generate(step) == 0
    assert capsys.readouterr().out.startswith("It is")


@pytest.mark.parametrize("kind", [*CRAFTS, "config"])
def test_generate_refuses_a_crafted_checkpoint_in_one_line_and_runs_nothing(crafted, capsys, kind):
    step, marker, expected = crafted(kind)
    line = _refused(capsys, _generate(step), expected)
    assert ("--trust-code" if kind == "config" else "so it was refused") in line
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["metadata", "byte-item"])
def test_resume_refuses_a_crafted_checkpoint(crafted, capsys, tmp_path, kind):
    step, marker, expected = crafted(kind)
    code = main(["train", str(ROOT / "configs/quickstart.yaml"), *TINY, "training.steps=4",
                 f"run.output_dir={tmp_path / 'resumed'}", f"checkpoint.resume={step}"])
    _refused(capsys, code, expected)
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["metadata", "config"])
def test_convert_refuses_a_crafted_checkpoint(crafted, capsys, tmp_path, kind):
    step, marker, expected = crafted(kind)
    _refused(capsys, main(["convert", "mcore-to-hf", str(step), str(tmp_path / "hf")]), expected)
    assert not marker.exists() and not (tmp_path / "hf").exists()


def _truncate_metadata(step: Path) -> str:
    metadata_file = step / "model_optim" / ".metadata"
    metadata_file.write_bytes(metadata_file.read_bytes()[:100])
    return f"{metadata_file}: unreadable distributed-checkpoint metadata"


def _point_outside(step: Path) -> str:
    """A BYTE_IO item whose storage entry names a file outside the checkpoint (here: its own config.yaml)."""
    metadata_file = step / "model_optim" / ".metadata"
    metadata = read_dcp_metadata(metadata_file)
    index = next(index for index in metadata.storage_data
                 if isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata))
    metadata.storage_data[index] = _StorageInfo("../config.yaml", 0, 10)
    metadata_file.write_bytes(pickle.dumps(metadata))
    return "is stored in '../config.yaml', which is no file of"


@pytest.mark.parametrize("damage", [_truncate_metadata, _point_outside], ids=["truncated", "outside"])
def test_malformed_metadata_is_one_line_not_a_traceback(trained, tmp_path, capsys, damage):
    step = _copy(trained, tmp_path)
    expected = damage(step)
    _reseal(step)
    _refused(capsys, _generate(step), expected)


def test_trust_code_imports_the_config_module_and_nothing_more(crafted, capsys, tmp_path):
    step, marker, _ = crafted("config")
    assert _generate(step, "--trust-code") == 0
    assert marker.is_file() and capsys.readouterr().out.startswith("It is")
    # The flag after SOURCE OUT belongs to the dispatch point too (the claims need it).
    assert main(["convert", "mcore-to-hf", str(step), str(tmp_path / "hf"), "--trust-code"]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert "writing Hugging Face tensors" in capsys.readouterr().err  # the conversion's progress, on stderr
    # --trust-code is about import paths in config.yaml only: a crafted pickle stays refused.
    bad, other_marker, expected = crafted("metadata")
    _refused(capsys, _generate(bad, "--trust-code"), expected)
    assert not other_marker.exists()


def test_model_load_of_a_crafted_config_needs_the_run_to_trust_it(crafted, capsys):
    """``model.load`` reads the checkpoint's config: its import path runs only with the user's ``run.trust_code``
    (``--trust-code`` on ``check``/``train``), and a ``run.trust_code: true`` recorded in the checkpoint is ignored."""
    step, marker, expected = crafted("config")
    config = step / "config.yaml"
    assert "trust_code: false" in config.read_text()
    config.write_text(config.read_text().replace("trust_code: false", "trust_code: true", 1))
    _reseal(step)
    args = ["check", str(ROOT / "configs/quickstart.yaml"), *TINY, f"model.load={step}"]
    _refused(capsys, main(args), expected)
    assert not marker.exists()
    assert main([*args, "--trust-code"]) == 0
    assert marker.is_file()


@pytest.mark.needs_plugins
def test_a_task_checkpoints_config_imports_only_with_trust_code(tmp_path, capsys, monkeypatch):
    """Task models (diffusion here; policies load the same way) keep safetensors and ``weights_only`` files, so only
    their config.yaml can carry code: ``loongforge sample`` refuses its import path unless ``--trust-code``."""
    out = tmp_path / "diffusion"
    assert main(["train", str(ROOT / "configs/diffusion-moving-squares.yaml"), f"run.output_dir={out}",
                 "training.steps=1", "task.samples=16", "task.sample={videos: 0}", "training.threads=1",
                 "logging.progress=false", "logging.tensorboard=false"]) == 0
    step = out / "checkpoints" / "step-0000001"
    marker = tmp_path / "code-ran"
    expected = _craft_config(step, marker, monkeypatch, model="wan-tiny")
    _reseal(step)
    sample = ["sample", str(step), "--prompt", "a red square of size 4 moving right", "--steps", "1",
              "--out", str(tmp_path / "samples")]
    _refused(capsys, main(sample), expected)
    assert not marker.exists() and not (tmp_path / "samples").exists()
    assert main([*sample, "--trust-code"]) == 0
    assert marker.is_file() and (tmp_path / "samples" / "sample-000.gif").is_file()
