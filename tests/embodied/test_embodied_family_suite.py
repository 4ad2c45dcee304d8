"""The ModelFamilySuite for a policy family the task engine trains: Pi0.5-tiny builds through its task, trains one
step on its recipe's synthetic episodes (written to a temporary directory) and saves and loads."""

from __future__ import annotations

import tempfile
from pathlib import Path

from loongforge.plugins import get_host
from loongforge.testing.family_suite import ModelFamilySuite

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


class TestPi05Tiny(ModelFamilySuite):
    family = get_host().registry("model").load("pi05-tiny")
    causal_lm = False
    config_path = str(CONFIGS / "embodied-tiny.yaml")
    config_overrides = (f"run.output_dir={tempfile.mkdtemp(prefix='pi05-suite-')}",
                        "task.synthetic.episodes=4", "task.held_out_episodes=1")
