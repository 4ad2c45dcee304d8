"""``loongforge convert mcore-to-hf`` for the DiTs: a trained Wan or Qwen-Image checkpoint becomes a diffusers
transformer folder that diffusers' own ``from_pretrained`` loads, and the loaded model predicts what ours does on the
same inputs (fp32, max abs < 1e-5); ``--ema`` exports the average a run kept, and is refused for a run that kept
none; an unrelated checkpoint is not claimed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import QwenImageTransformer2DModel, WanTransformer3DModel
from loongforge.cli import main
from loongforge.testing.faults import recipe_checkpoint
from loongforge.train.task_checkpoint import load_task_model
from loongforge_diffusion.certification import IMAGE_DIT
from safetensors.torch import load_file

TOLERANCE = 1e-5
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "diffusion-moving-squares.yaml"


def test_a_trained_qwen_image_loads_in_diffusers_and_predicts_the_same(tmp_path, capsys):
    checkpoint = recipe_checkpoint(IMAGE_DIT, tmp_path / "run", steps=2)
    assert main(["convert", "mcore-to-hf", str(checkpoint), str(tmp_path / "out")]) == 0
    assert "QwenImageTransformer2DModel" in capsys.readouterr().out
    theirs = QwenImageTransformer2DModel.from_pretrained(tmp_path / "out").eval()
    _, ours, _ = load_task_model(checkpoint)
    ours.eval()
    flavor = ours.flavor
    generator = torch.Generator().manual_seed(0)
    grids = [(1, 4, 4)]
    inputs = {"hidden_states": torch.randn(2, 16, flavor.in_channels, generator=generator),
              "encoder_hidden_states": torch.randn(2, 5, flavor.text_dim, generator=generator),
              "encoder_hidden_states_mask": torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]),
              "timestep": torch.tensor([0.1, 0.8]), "img_shapes": [grids, grids]}
    with torch.no_grad():
        expected = ours(**inputs)
        got = theirs(**inputs, return_dict=False)[0]
    assert expected.abs().max() > 0 and (got - expected).abs().max() < TOLERANCE


@pytest.fixture(scope="module")
def wan_run(tmp_path_factory):
    """configs/diffusion-moving-squares.yaml's Wan DiT, 4 steps (no warmup), keeping an EMA of its weights."""
    out = tmp_path_factory.mktemp("wan")
    command = [sys.executable, "-m", "loongforge.cli", "train", str(CONFIG),
               f"run.output_dir={out}", "training.steps=4", "scheduler.warmup_steps=0",
               "training.micro_batch_size=4", "task.samples=64", "task.sample.videos=0", "checkpoint.interval=0",
               "logging.progress=false", "logging.tensorboard=false", "task.ema={decay: 0.5}", "--device", "cpu"]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return out / "checkpoints"


def _wan_prediction(model, ours: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    flavor = model.flavor if ours else None
    channels = flavor.in_channels if ours else model.config.in_channels
    text_dim = flavor.text_dim if ours else model.config.text_dim
    video = torch.randn(2, channels, 4, 16, 16, generator=generator)
    context = torch.randn(2, 6, text_dim, generator=generator)
    timestep = torch.tensor([3.0, 700.0])
    with torch.no_grad():
        return model(video, timestep, context) if ours else model(video, timestep, context, return_dict=False)[0]


def test_a_trained_wan_loads_in_diffusers_and_predicts_the_same(wan_run, tmp_path, capsys):
    assert main(["convert", "mcore-to-hf", str(wan_run), str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["_class_name"] == "WanTransformer3DModel" and config["num_layers"] == 4
    theirs = WanTransformer3DModel.from_pretrained(tmp_path / "out").eval()
    _, ours, _ = load_task_model(wan_run)
    expected = _wan_prediction(ours.eval(), ours=True)
    assert expected.abs().max() > 0 and (_wan_prediction(theirs, ours=False) - expected).abs().max() < TOLERANCE


def test_ema_exports_the_average_the_run_kept(wan_run, tmp_path):
    assert main(["convert", "mcore-to-hf", str(wan_run), str(tmp_path / "trained")]) == 0
    assert main(["convert", "mcore-to-hf", str(wan_run), str(tmp_path / "ema"), "--ema"]) == 0
    trained = load_file(tmp_path / "trained" / "diffusion_pytorch_model.safetensors")
    averaged = load_file(tmp_path / "ema" / "diffusion_pytorch_model.safetensors")
    assert trained.keys() == averaged.keys()
    moved = [name for name in trained if not torch.equal(trained[name], averaged[name])]
    # decay 0.5: the average trails the last weights wherever training moved them (the zero-initialised gates keep
    # most block weights still for the first steps, so not everywhere)
    assert len(moved) >= 10 and "proj_out.weight" in moved


def test_ema_without_an_average_and_a_non_dit_checkpoint_are_one_line(tmp_path, capsys):
    checkpoint = recipe_checkpoint(IMAGE_DIT, tmp_path / "run", steps=1)
    assert main(["convert", "mcore-to-hf", str(checkpoint), str(tmp_path / "out"), "--ema"]) == 2
    error = capsys.readouterr().err.strip()
    assert "kept no EMA" in error and "\n" not in error
    assert not (tmp_path / "out").exists()  # refused before anything was written
    from loongforge_embodied.certification import POLICY

    policy = recipe_checkpoint(POLICY, tmp_path / "policy", steps=1)
    assert main(["convert", "mcore-to-hf", str(policy), str(tmp_path / "policy-out")]) == 2
    assert "dit-to-diffusers" in capsys.readouterr().err


def test_lora_adapters_load_into_diffusers_apart_from_the_base(wan_run, tmp_path, capsys):
    """A Wan LoRA run (from the run above, as a fine-tune starts from trained weights) exported with --lora-adapter:
    the base transformer alone predicts something else, and with the adapter file loaded through diffusers' own LoRA
    loader (PEFT) it predicts what our adapted model does."""
    from diffusers.loaders import WanLoraLoaderMixin

    out = tmp_path / "run"
    command = [sys.executable, "-m", "loongforge.cli", "train", str(CONFIG), f"run.output_dir={out}",
               "training.steps=4", "scheduler.warmup_steps=0", "training.micro_batch_size=4", "task.samples=64",
               "task.sample.videos=0", "checkpoint.interval=0", "logging.progress=false", "logging.tensorboard=false",
               "task.lora={rank: 4, alpha: 8}", f"task.init={wan_run / 'step-0000004'}", "optimizer.lr=1e-2",
               "--device", "cpu"]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert main(["convert", "mcore-to-hf", str(out / "checkpoints"), str(tmp_path / "hf"), "--lora-adapter"]) == 0
    assert "LoRA adapters" in capsys.readouterr().out
    _, ours, _ = load_task_model(out / "checkpoints")
    adapted = _wan_prediction(ours.eval(), ours=True)
    theirs = WanTransformer3DModel.from_pretrained(tmp_path / "hf").eval()
    assert (_wan_prediction(theirs, ours=False) - adapted).abs().max() > 100 * TOLERANCE  # the adapters matter
    state = WanLoraLoaderMixin.lora_state_dict(str(tmp_path / "hf"))
    WanLoraLoaderMixin.load_lora_into_transformer(state, transformer=theirs)
    assert (_wan_prediction(theirs, ours=False) - adapted).abs().max() < TOLERANCE


def test_a_wan_checkpoint_computes_what_its_export_computes_in_diffusers_module_by_module(wan_run, tmp_path, capsys):
    """``loongforge diff --reference``: the Wan run's task loss through our DiT and through diffusers' transformer of
    the export, with the same draws: every parameter, gradient and paired module output (each block among them)."""
    assert main(["convert", "mcore-to-hf", str(wan_run), str(tmp_path / "out")]) == 0
    capsys.readouterr()
    assert main(["diff", str(wan_run), str(tmp_path / "out"), "--reference", "B", "--json"]) == 0
    models = json.loads(capsys.readouterr().out)["models"]
    assert models["first"] is None
    assert models["compared"]["parameter"] == len(load_file(tmp_path / "out" / "diffusion_pytorch_model.safetensors"))
    assert models["compared"]["forward output"] >= 4 * 6  # 4 blocks: the block, projections, norms, MLP
