"""``loongforge diff`` names where two models or runs part.

Faults are injected the way they reach users -- a weight changed in one layer of a checkpoint, a ``config.json``
setting that changes one operation (the norm's epsilon, RoPE's base), a learning rate that changes training from
some step on -- into copies of a tiny Llama built from a transformers config, and the command must name the module
(or step) where each begins; a tp=2 run and its tp=1 twin, and a Hugging Face directory and its converted
checkpoint, must come out identical.
"""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import HF_TINY_CASES, make_hf_model, tiny_settings
from loongforge.cli import main
from safetensors.torch import load_file, save_file

QUIET = ["training.steps=4", "logging.progress=false", "logging.tensorboard=false", "training.sample_tokens=0",
         "training.threads=1", "model.overrides.num_layers=2", "data.seq_length=32", "training.micro_batch_size=2"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("diff") / "hf"
    make_hf_model("LlamaConfig", "LlamaForCausalLM", {**tiny_settings("llama3-rope-untied"), "num_hidden_layers": 3}
                  ).save_pretrained(directory)
    return directory


def _diff(capsys, a, b, *extra) -> tuple[int, dict]:
    code = main(["diff", str(a), str(b), "--json", *extra])
    return code, json.loads(capsys.readouterr().out)


def _variant(hf_dir, tmp_path, *, tensor=None, config=None):
    """A copy of ``hf_dir`` with one tensor scaled (name, factor) or config.json keys changed."""
    copy = tmp_path / "variant"
    shutil.copytree(hf_dir, copy)
    if tensor is not None:
        tensors = load_file(copy / "model.safetensors")
        name, factor = tensor
        tensors[name] = tensors[name] * factor
        save_file(tensors, copy / "model.safetensors", {"format": "pt"})
    if config is not None:
        raw = json.loads((copy / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps({**raw, **config}))
    return copy


@pytest.mark.parametrize(("fault", "parameter", "output", "setting"), [
    ({"tensor": ("model.layers.1.mlp.down_proj.weight", 1.01)}, "decoder.layers.1.mlp.linear_fc2.weight",
     "decoder.layers.1.mlp.linear_fc2", None),
    ({"tensor": ("model.layers.2.self_attn.k_proj.weight", 0.98)}, "decoder.layers.2.self_attention.linear_qkv.weight",
     "decoder.layers.2.self_attention.linear_qkv", None),
    ({"config": {"rms_norm_eps": 0.1}}, None, "decoder.layers.0.input_layernorm", "norm_eps"),
    ({"config": {"rope_parameters": {"rope_type": "default", "rope_theta": 50.0}}}, None, "rotary_pos_emb",
     "rope_theta"),  # the rotary table is the first module that computes differently
    ({"tensor": ("model.embed_tokens.weight", 1.01)}, "embedding.word_embeddings.weight",
     "embedding.word_embeddings", None),
    ({"tensor": ("model.layers.0.post_attention_layernorm.weight", 1.05)},
     "decoder.layers.0.pre_mlp_layernorm.weight", "decoder.layers.0.pre_mlp_layernorm", None),
    ({"tensor": ("model.norm.weight", 0.95)}, "decoder.final_layernorm.weight", "decoder.final_layernorm", None),
    ({"tensor": ("lm_head.weight", 1.01)}, "output_layer.weight", "output_layer", None),
], ids=["weight-layer-1", "weight-layer-2", "norm-epsilon", "rope-base", "embedding", "mlp-norm-layer-0",
        "final-norm", "output-layer"])
def test_an_injected_fault_is_named_where_it_begins(hf_dir, tmp_path, capsys, fault, parameter, output, setting):
    code, report = _diff(capsys, hf_dir, _variant(hf_dir, tmp_path, **fault))
    models = report["models"]
    assert code == 1
    firsts = models["first_by_kind"]
    assert (firsts["parameter"] or {}).get("name") == parameter
    assert firsts["forward output"]["name"] == output
    assert any(line.startswith(setting) for line in models["settings"]) == (setting is not None)


def test_a_directory_and_its_converted_checkpoint_are_identical(hf_dir, tmp_path, capsys):
    assert main(["convert", "hf-to-mcore", str(hf_dir), str(tmp_path / "mcore")]) == 0
    capsys.readouterr()
    code, report = _diff(capsys, hf_dir, tmp_path / "mcore")
    assert code == 0 and report["models"]["first"] is None and report["models"]["settings"] == []
    assert report["models"]["compared"] == {"parameter": 21, "forward output": 49, "gradient": 21}


def test_runs_part_at_the_step_their_settings_do_and_tp2_matches_tp1(tmp_path, capsys):
    """Three short runs: the reference, the same at tp=2 (two gloo processes), and one whose learning rate differs;
    the tp=2 twin is identical within the tolerance (metrics and trained weights), the other parts at step 3 --
    step 1's update is made at lr 0 (warm-up), so the first loss a different learning rate moves is step 3's."""
    runs = {}
    for name, extra in {"one": [], "tp2": ["--nproc", "2", "parallel.tp=2"], "lr": ["optimizer.lr=0.003"]}.items():
        runs[name] = tmp_path / name
        assert main(["train", "configs/quickstart.yaml", *QUIET, f"run.output_dir={runs[name]}", *extra]) == 0
    capsys.readouterr()
    code, report = _diff(capsys, runs["one"], runs["tp2"])
    assert code == 0 and report["metrics"] == {"common_steps": 4, "step": None, "key": "", "values": [None, None]}
    assert report["models"]["first"] is None
    code, report = _diff(capsys, runs["one"], runs["lr"])
    assert code == 1 and (report["metrics"]["step"], report["metrics"]["key"]) == (3, "loss")
    assert report["models"]["first_by_kind"]["parameter"] is not None


def test_the_report_reads_as_a_verdict(hf_dir, tmp_path, capsys):
    variant = _variant(hf_dir, tmp_path, tensor=("model.layers.1.mlp.down_proj.weight", 1.01))
    assert main(["diff", str(hf_dir), str(variant), "--top", "1"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("verdict: they part at the parameter of decoder.layers.1.mlp.linear_fc2.weight")
    assert "  forward outputs (49): first part at decoder.layers.1.mlp.linear_fc2 (max abs" in "\n".join(out)


def test_what_cannot_be_compared_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["diff", str(tmp_path / "nowhere"), str(tmp_path / "empty")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nowhere'}: no such run, checkpoint or Hugging " \
                                              "Face directory"


def test_a_changed_activation_is_named_at_the_first_module_it_changes(tmp_path, capsys):
    """GPT-2's ``gelu_new`` (tanh approximation) against exact ``gelu``: the setting, and the first output that
    parts is layer 0's MLP output projection (the activation is a function inside megatron's MLP, not a module)."""
    hf = make_hf_model("GPT2Config", "GPT2LMHeadModel", HF_TINY_CASES["gpt2-tied"][2])
    hf.save_pretrained(tmp_path / "hf")
    variant = _variant(tmp_path / "hf", tmp_path, config={"activation_function": "gelu"})
    code, report = _diff(capsys, tmp_path / "hf", variant)
    assert code == 1
    assert report["models"]["first_by_kind"]["parameter"] is None
    assert report["models"]["first"]["name"] == "decoder.layers.0.mlp.linear_fc2"
    assert report["models"]["settings"] == ["activation 'gelu' != 'gelu_tanh'"]
