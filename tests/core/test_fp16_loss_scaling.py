"""fp16 runs get megatron's fp16 optimizer with the loss scaler the config asks for; the CPU refuses fp16.

Megatron's loss scaler keeps its scale in CUDA tensors, so what this machine can check is the contract up to
megatron: the settings ``optimizer_config`` hands ``get_megatron_optimizer`` (its fp16 optimizer and a dynamic
or constant scaler follow from them), the one-line refusals of unusable scaling values by ``check`` (whatever the
precision), and that ``check`` and ``train`` refuse fp16 on the CPU before building anything.
``benchmarks/gpu_smoke.sh`` trains the ``lf-local-fp16`` case on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loongforge.config import load_config
from loongforge.train.optim import optimizer_config

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


def _settings(*overrides: str, dtype: str = "fp16"):
    return optimizer_config(load_config(None, list(overrides)), dtype)


def test_fp16_gets_a_dynamic_scaler_with_the_configured_schedule():
    settings = _settings("optimizer.initial_loss_scale=1024", "optimizer.min_loss_scale=2",
                         "optimizer.loss_scale_window=50")
    assert settings.fp16 and not settings.bf16
    assert settings.params_dtype == torch.float16
    assert settings.loss_scale is None  # megatron builds a DynamicGradScaler when this is unset
    assert (settings.initial_loss_scale, settings.min_loss_scale, settings.loss_scale_window) == (1024, 2, 50)


def test_fixed_loss_scale_is_passed_on():
    settings = _settings("optimizer.loss_scale=128")
    assert settings.fp16 and settings.loss_scale == 128  # megatron's ConstantGradScaler


@pytest.mark.parametrize("dtype,half", [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_other_precisions_never_scale_the_loss(dtype, half):
    settings = _settings("optimizer.loss_scale=128", dtype=dtype)
    assert not settings.fp16 and settings.bf16 == (dtype == "bf16")
    assert settings.loss_scale is None and settings.params_dtype == half


@pytest.mark.parametrize("override,key", [
    ("optimizer.loss_scale=0", "optimizer.loss_scale"),
    ("optimizer.loss_scale=.inf", "optimizer.loss_scale"),
    ("optimizer.initial_loss_scale=-1", "optimizer.initial_loss_scale"),
    ("optimizer.min_loss_scale=1e9", "optimizer.min_loss_scale"),
    ("optimizer.loss_scale_window=0", "optimizer.loss_scale_window"),
])
def test_unusable_scaling_values_are_refused_by_check_in_one_line(tmp_path, capsys, override, key):
    from loongforge.cli import main

    assert main(["check", str(QUICKSTART), f"run.output_dir={tmp_path}", override]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: command line ({override}): {key} must be ") and "\n" not in err, err


def test_cpu_refuses_fp16_before_building(tmp_path, capsys):
    from loongforge.cli import main

    config = tmp_path / "run.yaml"
    config.write_text("model: llama-debug\ntraining: {precision: fp16, steps: 1}\nlogging: {progress: false}\n"
                      f"run: {{output_dir: {tmp_path / 'run'}}}\n")
    for command in ("check", "train"):
        assert main([command, str(config)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and "cannot train in fp16" in err[0], err
    assert not (tmp_path / "run" / "checkpoints").exists()
