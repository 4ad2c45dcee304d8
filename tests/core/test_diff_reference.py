"""``loongforge diff --reference``: a Hugging Face directory run in transformers' own ``*ForCausalLM`` against
LoongForge's model, compared module by module under transformers' names.

Every core family with a Hugging Face format (tiny transformers models with perturbed weights, built from configs
in tests/core/conftest.py) must come out identical -- forward outputs, every parameter and every gradient within
1e-4 -- which holds the module pairs, the renaming of parameters and gradients through the conversion, the
``(output, bias)`` sums and the MoE balancing loss left out. Faults of the kind conversions make (gate and up
swapped, a weight changed on one side) must be named at the module and parameter where they begin.
"""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import HF_TINY_CASES, make_hf_model, tiny_settings
from loongforge.cli import main
from safetensors.torch import load_file, save_file


def _diff(capsys, a, b, *extra) -> tuple[int, dict]:
    code = main(["diff", str(a), str(b), "--json", *extra])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("case", sorted(HF_TINY_CASES))
def test_every_family_computes_what_transformers_computes(tmp_path, capsys, case):
    config_cls, model_cls, _ = HF_TINY_CASES[case]
    reference = make_hf_model(config_cls, model_cls, tiny_settings(case))
    reference.save_pretrained(tmp_path / "hf")
    code, report = _diff(capsys, tmp_path / "hf", tmp_path / "hf", "--reference", "B")
    models = report["models"]
    assert models["models"][1].endswith(f"in transformers ({tmp_path / 'hf'})")
    assert (code, models["first"], models["settings"]) == (0, None, [])
    layers = reference.config.num_hidden_layers
    parameters = len(dict(reference.named_parameters()))
    # every transformers parameter is compared (no name left unmatched), and at least five modules of each layer
    # (input norm, output projection, attention or its norm, MLP, the layer) besides the final norm
    assert models["compared"]["parameter"] == models["compared"]["gradient"] == parameters
    assert models["compared"]["forward output"] >= 5 * layers + 1
    assert models["loss"][0] == pytest.approx(models["loss"][1], rel=1e-6)
    assert all(d["why"] == "" for kind in models["largest"].values() for d in kind)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("reference") / "hf"
    make_hf_model("LlamaConfig", "LlamaForCausalLM", tiny_settings("llama3-rope-untied")).save_pretrained(directory)
    return directory


def _converted(hf_dir, tmp_path, edit) -> str:
    """The LoongForge checkpoint ``convert hf-to-mcore`` makes of a copy of ``hf_dir`` whose tensors ``edit``
    changed: what a conversion with that fault would have written."""
    copy = tmp_path / "edited"
    shutil.copytree(hf_dir, copy)
    tensors = load_file(copy / "model.safetensors")
    edit(tensors)
    save_file(tensors, copy / "model.safetensors", {"format": "pt"})
    assert main(["convert", "hf-to-mcore", str(copy), str(tmp_path / "mcore")]) == 0
    return str(tmp_path / "mcore")


def _swap_gate_and_up(tensors):
    gate, up = "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"
    tensors[gate], tensors[up] = tensors[up], tensors[gate]


def _scale_output_projection(tensors):
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = tensors[name] * 1.01


@pytest.mark.parametrize(("edit", "reference_side", "parameter", "output"), [
    (_swap_gate_and_up, "B", "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.down_proj"),
    (_scale_output_projection, "A", "model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.o_proj"),
], ids=["gate-up-swapped", "output-projection-scaled"])
def test_a_conversion_fault_is_named_in_transformers_terms(llama_dir, tmp_path, capsys, edit, reference_side,
                                                           parameter, output):
    converted = _converted(llama_dir, tmp_path, edit)
    capsys.readouterr()
    sides = (llama_dir, converted) if reference_side == "A" else (converted, llama_dir)
    code, report = _diff(capsys, *sides, "--reference", reference_side)
    firsts = report["models"]["first_by_kind"]
    assert code == 1
    assert (firsts["parameter"]["name"], firsts["forward output"]["name"]) == (parameter, output)
    assert report["models"]["first"]["kind"] == "parameter"


def test_the_reference_side_must_be_a_hugging_face_directory(llama_dir, tmp_path, capsys):
    assert main(["convert", "hf-to-mcore", str(llama_dir), str(tmp_path / "mcore")]) == 0
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "mcore"), str(llama_dir), "--reference", "a"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --reference A: {tmp_path / 'mcore'} is not a Hugging Face "
                                               "directory (the reference library reads those)")
