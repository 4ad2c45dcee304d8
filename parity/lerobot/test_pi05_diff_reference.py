"""``loongforge diff CHECKPOINT LEROBOT_DIR --reference B`` on the PaliGemma-exact Pi0.5: LeRobot 0.4.4's own
``PI05Policy`` (built from the directory's config.json at the checkpoint flavor's sizes, on the transformers of
:mod:`transformers_shim`) against our policy, both through the checkpoint task's loss with the same draws.

The checkpoint is a real one (``pi05-gemma-tiny`` with LeRobot's 8 heads, one training step on a synthetic set),
its weights then re-drawn at random (the adaRMS projections start at zero, which would make every expert layer
the identity); the LeRobot directory holds LeRobot's config and our weights converted by ``convert_lerobot``.
The untouched pair is identical; a weight scaled in one LeRobot layer, and one expert norm's epsilon changed in
LeRobot's model, are named at that module under LeRobot's names.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers_shim
import yaml
from loongforge.checkpoint.layout import CONFIG_YAML
from loongforge.checkpoint.manifest import write_manifest
from loongforge.cli import main
from loongforge_embodied.certification import POLICY
from loongforge_embodied.convert_lerobot import to_lerobot
from loongforge_embodied.lerobot_reference import LeRobotPi05
from loongforge_embodied.policies.pi05_gemma_flavors import FLAVORS
from safetensors.torch import load_file, save_file

transformers_shim.install()

FLAVOR = FLAVORS["pi05-gemma-tiny"].with_overrides(heads=8)
HORIZON = 4
EXPERT = "model.paligemma_with_expert.gemma_expert.model.layers.1"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A task checkpoint of the embodied certification recipe's run with pi05-gemma-tiny at LeRobot's 8 heads, its
    weights drawn at random: written as the task engine writes one (config.yaml, model.safetensors, manifest),
    since training needs megatron-core, which this environment does not have."""
    step = tmp_path_factory.mktemp("pi05") / "step-0000001"
    step.mkdir()
    config = {**POLICY.config, "model": {"name": "pi05-gemma-tiny", "overrides": {"heads": FLAVOR.heads}},
              "task": {**POLICY.config["task"], "synthetic": {"episodes": 2, "length": 8, "seed": 0},
                       "held_out_episodes": 0, "action_horizon": HORIZON},
              "run": {**POLICY.config["run"], "output_dir": str(step.parent / "run")}}
    (step / CONFIG_YAML).write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    generator = torch.Generator().manual_seed(0)
    save_file({name: torch.randn(p.shape, generator=generator) * 0.05
               for name, p in FLAVOR.build_policy().state_dict().items()}, str(step / "model.safetensors"))
    write_manifest(step, step=1)
    return step


@pytest.fixture(scope="module")
def lerobot_dir(checkpoint, tmp_path_factory):
    """LeRobot's policy directory of the checkpoint: its config (LeRobot's writer) and our converted weights."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.pi05.configuration_pi05 import PI05Config

    out = tmp_path_factory.mktemp("lerobot")
    size = FLAVOR.image_size
    config = PI05Config(chunk_size=HORIZON, n_action_steps=HORIZON, max_state_dim=FLAVOR.max_state_dim,
                        max_action_dim=FLAVOR.max_action_dim, image_resolution=(size, size), device="cpu",
                        input_features={"observation.images.cam": PolicyFeature(FeatureType.VISUAL, (3, size, size))},
                        output_features={"action": PolicyFeature(FeatureType.ACTION, (2,))})
    config._save_pretrained(out)
    save_file(to_lerobot(load_file(str(checkpoint / "model.safetensors")), FLAVOR), str(out / "model.safetensors"))
    return out


def report(capsys) -> dict:
    """The ``models`` part of ``diff --json``'s report (LeRobot prints its own lines before it)."""
    out = capsys.readouterr().out
    return json.loads(out[out.index("{\n"):])["models"]


def test_the_converted_policy_is_identical(checkpoint, lerobot_dir, capsys):
    assert main(["diff", str(checkpoint), str(lerobot_dir), "--reference", "B", "--json"]) == 0
    models = report(capsys)
    assert models["first"] is None and models["settings"] == []
    compared = models["compared"]
    print(f"\ncompared {compared}; largest relative differences: "
          + ", ".join(f"{kind} {max([d['rel'] for d in found] or [0]):.2e}" for kind, found in
                      models["largest"].items()))
    assert compared["parameter"] == len(load_file(str(lerobot_dir / "model.safetensors")))
    assert compared["forward output"] > 8 * FLAVOR.depth and compared["gradient"] == compared["parameter"]
    assert models["loss"][0] == pytest.approx(models["loss"][1], rel=1e-5)


def test_a_weight_scaled_in_one_lerobot_layer_is_named_there(checkpoint, lerobot_dir, tmp_path, capsys):
    faulty = tmp_path / "faulty"
    faulty.mkdir()
    (faulty / "config.json").write_text((lerobot_dir / "config.json").read_text())
    weights = load_file(str(lerobot_dir / "model.safetensors"))
    weights[f"{EXPERT}.mlp.down_proj.weight"] *= 1.01
    save_file(weights, str(faulty / "model.safetensors"))
    assert main(["diff", str(checkpoint), str(faulty), "--reference", "B", "--json"]) == 1
    first = report(capsys)["first_by_kind"]
    assert first["parameter"]["name"] == f"{EXPERT}.mlp.down_proj.weight"
    assert first["forward output"]["name"] == f"{EXPERT}.mlp.down_proj"


def test_one_expert_norms_epsilon_is_named_there(checkpoint, lerobot_dir, capsys, monkeypatch):
    """LeRobot's model with one action-expert layer's second norm at another epsilon: no parameter differs, the
    first forward output that does is that norm's."""
    load = LeRobotPi05.load

    def with_other_epsilon(self, path):
        policy = load(self, path)
        policy.get_submodule(f"{EXPERT}.post_attention_layernorm").eps = 1e-2
        return policy

    monkeypatch.setattr(LeRobotPi05, "load", with_other_epsilon)
    assert main(["diff", str(checkpoint), str(lerobot_dir), "--reference", "B", "--json"]) == 1
    first = report(capsys)["first_by_kind"]
    assert first["parameter"] is None
    assert first["forward output"]["name"] == f"{EXPERT}.post_attention_layernorm"
