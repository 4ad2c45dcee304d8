"""HF weights inside a run: ``model.load: hf:DIR`` starts training from them, ``checkpoint.save_hf`` writes them.

Both go through core's own plugin hooks (``loongforge_modify_model``, ``loongforge_on_checkpoint_save``). The
saved ``hf/`` directory must load in ``transformers.AutoModelForCausalLM`` and compute our logits.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from conftest import checkpoint_logits  # noqa: E402
from loongforge import load_config  # noqa: E402
from loongforge.cli import main  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

#: The HF twin of the registered ``llama-debug`` flavor.
LLAMA_DEBUG = dict(intermediate_size=176, max_position_embeddings=1024, rms_norm_eps=1e-5,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _config(tmp_path, *overrides):
    return load_config(None, [
        f"run.output_dir={tmp_path / 'run'}", "model.name=llama-debug", "data.seq_length=32",
        "training.micro_batch_size=2", "training.threads=1", "logging.progress=false", "logging.tensorboard=false",
        "checkpoint.save_hf=true", *overrides,
    ])


#: (HF case, its twin's settings, the model lines of the run): a dense model and an MoE one (Mixtral, 4 experts).
ONLINE_CASES = {
    "dense": ("llama3-rope-untied", LLAMA_DEBUG, ["model.name=llama-debug"]),
    "moe": ("mixtral-top2", {"max_position_embeddings": 2048}, [
        "model.name=mixtral-tiny",
        "model.overrides={num_layers: 2, hidden_size: 64, ffn_hidden_size: 96, moe_ffn_hidden_size: 96, "
        "norm_eps: 1.0e-6}",
    ]),
}


@pytest.mark.parametrize("kind", sorted(ONLINE_CASES))
def test_train_from_hf_and_save_hf_loads_in_transformers(hf_tiny, tmp_path, kind):
    from loongforge.train.run import run_training

    case, twin, model_lines = ONLINE_CASES[kind]
    hf_dir, _ = hf_tiny(case, **twin)
    summary = run_training(_config(tmp_path, *model_lines, f"model.load=hf:{hf_dir}", "training.steps=3",
                                   "optimizer.lr=1e-3", "scheduler.warmup_steps=0"))
    ckpt = tmp_path / "run" / "checkpoints" / "step-0000003"
    assert summary["checkpoint_dir"] == str(ckpt)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert {"hf/model.safetensors", "hf/config.json"} <= set(manifest["files"])
    assert json.loads((ckpt / "trainer.json").read_text())["extra_state"]["hf"] == {"dir": "hf"}

    source, trained = load_file(hf_dir / "model.safetensors"), load_file(ckpt / "hf" / "model.safetensors")
    assert sorted(trained) == sorted(source)
    moved = max((trained[k] - source[k]).abs().max().item() for k in source)
    assert 0 < moved < 0.02  # trained from the HF weights (std 0.15), not from a fresh init

    tokens = torch.randint(0, 259, (2, 32), generator=torch.Generator().manual_seed(3))
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt / "hf", attn_implementation="eager").eval()
    with torch.no_grad():
        expected = hf(tokens).logits
    diff = (checkpoint_logits(ckpt, tokens)[..., :384] - expected).abs().max().item()
    print(f"\n{kind}: save_hf after 3 steps: max |logits - transformers| = {diff:.2e}")
    assert diff <= 1e-4


def test_model_load_from_converted_checkpoint_keeps_weights_bitwise(hf_tiny, tmp_path):
    from loongforge.train.run import run_training

    hf_dir, _ = hf_tiny("llama3-rope-untied", **LLAMA_DEBUG)
    assert main(["convert", "hf-to-mcore", str(hf_dir), str(tmp_path / "mcore"), "--model", "llama-debug"]) == 0
    run_training(_config(tmp_path, f"model.load={tmp_path / 'mcore'}", "training.steps=1", "optimizer.lr=0",
                         "optimizer.min_lr=0"))
    saved = load_file(tmp_path / "run" / "checkpoints" / "step-0000001" / "hf" / "model.safetensors")
    source = load_file(hf_dir / "model.safetensors")
    assert sorted(saved) == sorted(source) and all(torch.equal(saved[k], source[k]) for k in source)


def test_model_load_refuses_another_model(hf_tiny, tmp_path):
    from loongforge.errors import InteropError
    from loongforge.train.run import run_training

    hf_dir, _ = hf_tiny("llama3-rope-untied", **LLAMA_DEBUG)
    with pytest.raises(InteropError, match=r"config.json does not match model 'llama-debug': num_layers 2 != 4$"):
        run_training(_config(tmp_path, f"model.load=hf:{hf_dir}", "model.overrides.num_layers=4"))
