"""The shipped SFT recipe trains: chat data, packed rows, loss on replies, and the loss falls."""

from __future__ import annotations

from pathlib import Path

from loongforge import load_config

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "sft-tiny.yaml"


def test_sft_recipe_loss_falls(tmp_path):
    from loongforge.train.run import run_training

    config = load_config(RECIPE, [
        f"run.output_dir={tmp_path}", "training.steps=10", "training.micro_batch_size=4", "training.sample_tokens=0",
        "checkpoint.save_at_end=false", "logging.progress=false", "logging.tensorboard=false",
    ])
    assert (config.training.phase, config.data.dataset, config.data.pack) == ("sft", "shipped-chat", True)
    summary = run_training(config)
    assert summary["steps"] == 10
    assert summary["final_loss"] < summary["first_loss"] - 1.5, (summary["first_loss"], summary["final_loss"])
