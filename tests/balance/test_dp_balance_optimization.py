"""The ``dp-balance`` optimization: options are checked, and a run it cannot help is refused, never run as is."""

from __future__ import annotations

import pytest
from loongforge import load_config
from loongforge.errors import ConfigError
from loongforge.plugins import PluginHost
from loongforge_balance.dp_balance import CostModel
from loongforge_balance.dp_balance.optimization import DPBalanceOptimization

pytestmark = pytest.mark.needs_plugins


def test_registered_by_name():
    factory = PluginHost().registry("optimization").load("dp-balance")
    assert factory is DPBalanceOptimization


@pytest.mark.parametrize(
    "options, message",
    [
        ({"warmup": 8}, r"unknown key 'optimizations.dp-balance.warmup' \(known keys here: warmup_steps, cost, "
                        r"token_cap, length_key\); did you mean 'warmup_steps'"),
        ({"warmup_steps": 3}, r"warmup_steps must be an integer >= 8"),
        ({"cost": {"a": 1.0, "b": 2.0}}, r"'optimizations.dp-balance.cost.c' is required"),
        ({"cost": {"a": -1.0, "b": 2.0, "c": 0.0}}, r"coefficients must be >= 0"),
        ({"token_cap": 0}, r"token_cap must be a positive integer"),
    ],
)
def test_bad_options_name_the_key(options, message):
    with pytest.raises(ConfigError, match=message):
        DPBalanceOptimization(options)


def test_pinned_cost_skips_warmup_and_survives_checkpoints():
    pinned = DPBalanceOptimization({"cost": {"a": 1e-4, "b": 1.0, "c": 10}, "token_cap": 4096})
    assert pinned.cost == CostModel(1e-4, 1.0, 10.0) and pinned.token_cap == 4096
    state: dict = {}
    pinned.loongforge_on_checkpoint_save(trainer=None, path="ckpt", extra_state=state)
    resumed = DPBalanceOptimization({})
    assert resumed.cost is None  # would warm up ...
    resumed.loongforge_on_checkpoint_load(trainer=None, path="ckpt", extra_state=state)
    assert resumed.cost == pinned.cost  # ... but continues with the saved coefficients


def test_fixed_length_pretraining_run_is_refused(tmp_path):
    """Core's pretraining rows have one length: every rank already does the same compute, so it is an error."""
    from loongforge.train.run import run_training

    config = load_config(None, [
        f"run.output_dir={tmp_path / 'out'}", "model.name=llama-debug", "data.seq_length=32",
        "training.micro_batch_size=2", "training.steps=1", "training.threads=1", "logging.progress=false",
        "logging.tensorboard=false", "optimizations.dp-balance.warmup_steps=8",
        "training.loss_normalization=global_tokens",
    ])
    with pytest.raises(ConfigError) as caught:
        run_training(config)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("optimizations.dp-balance: the run's data (TrainBatchIterator, data.dataset")
    assert "does not call loongforge_balance_samples" in message
