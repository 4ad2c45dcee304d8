"""``loongforge diff CHECKPOINT DIFFUSERS_DIR --reference B``: a DiT checkpoint against diffusers' own transformer
of its export, both through the checkpoint task's deterministic loss with the same draws, compared module by
module under diffusers' names (the plugin's ``DiffusersTransformer``: module pairs and parameter names from the
conversion's name maps).

The export of a trained Qwen-Image recipe checkpoint must come out identical (every diffusers parameter and
gradient compared, the blocks' modules paired); a weight changed in the diffusers folder must be named there, as the
parameter and as the first module whose output parts; a Wan checkpoint's export is identical too.
"""

from __future__ import annotations

import json
import shutil

import pytest
from loongforge.cli import main
from loongforge.testing.faults import recipe_checkpoint
from loongforge_diffusion.certification import IMAGE_DIT
from safetensors.torch import load_file, save_file

WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("dit-reference")
    checkpoint = recipe_checkpoint(IMAGE_DIT, root / "run", steps=2)
    assert main(["convert", "mcore-to-hf", str(checkpoint), str(root / "diffusers")]) == 0
    return checkpoint, root / "diffusers"


def _diff(capsys, *args) -> tuple[int, dict]:
    capsys.readouterr()
    code = main(["diff", *map(str, args), "--json"])
    return code, json.loads(capsys.readouterr().out)["models"]


def test_a_qwen_image_checkpoint_computes_what_diffusers_computes(exported, capsys):
    checkpoint, directory = exported
    code, models = _diff(capsys, checkpoint, directory, "--reference", "B")
    assert (code, models["first"]) == (0, None)
    assert models["models"][1] == f"QwenImageFlavor in diffusers ({directory})"
    assert models["compared"]["parameter"] == models["compared"]["gradient"] == len(load_file(directory / WEIGHTS))
    layers = json.loads((directory / "config.json").read_text())["num_layers"]
    assert models["compared"]["forward output"] >= 10 * layers  # per block: 2 streams x (modulation, out, 2 MLP, ...)
    assert models["loss"][0] == pytest.approx(models["loss"][1], rel=1e-6)


def test_a_weight_changed_in_the_diffusers_folder_is_named_in_its_terms(exported, tmp_path, capsys):
    checkpoint, directory = exported
    changed = tmp_path / "changed"
    shutil.copytree(directory, changed)
    tensors = load_file(changed / WEIGHTS)
    name = "transformer_blocks.1.img_mlp.net.2.weight"
    tensors[name] = tensors[name] * 1.02
    save_file(tensors, changed / WEIGHTS)
    code, models = _diff(capsys, changed, checkpoint, "--reference", "A")
    firsts = models["first_by_kind"]
    assert code == 1
    assert (firsts["parameter"]["name"], firsts["forward output"]["name"]) == (name,
                                                                            "transformer_blocks.1.img_mlp.net.2")


def test_the_reference_side_must_be_the_librarys_directory(exported, capsys):
    checkpoint, _ = exported
    assert main(["diff", str(checkpoint), str(checkpoint), "--reference", "B"]) == 2
    assert "is a LoongForge checkpoint; the reference library reads its own directories" in capsys.readouterr().err
