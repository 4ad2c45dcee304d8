"""The Pi0-style policy: its three-block attention (prefix blind to the expert stream, the state token blind to the
actions, actions see everything), Pi0's inputs (text-only prompt, continuous padded state), a state-only flavor,
and training through ``loongforge train`` (the loss falls; the same seed gives the same run)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from loongforge.config.loader import load_config
from loongforge.train.media import NoMediaLog
from loongforge_embodied.policies.blocks import joint_mask, positions
from loongforge_embodied.policies.flavors import FLAVORS, Pi0Flavor
from loongforge_embodied.policies.pi0 import Pi0Policy
from loongforge_embodied.policies.prompt import text_tokens
from test_policy_train import COMMON, ROOT, train

TINY = Pi0Flavor(width=32, expert_width=16, depth=2, vision_depth=1, heads=2, head_dim=8, image_size=8,
                 patch_size=4, text_len=8, max_state_dim=4, max_action_dim=4)
HORIZON = 5


def inputs(batch: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    obs = {"images": torch.rand(batch, 1, 3, 8, 8, generator=g), "state": torch.randn(batch, 4, generator=g),
           "tokens": torch.stack([text_tokens("pick", 8)] * batch)}
    return obs, torch.randn(batch, HORIZON, 4, generator=g), torch.rand(batch, generator=g)


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    return Pi0Policy(TINY).eval()


def _streams(model, obs, noisy, t):
    """The last layer's prefix keys/values and the expert stream it outputs (state token first), and the
    velocity."""
    seen = {}
    hooks = [model.layers[-1].prefix.qkv.register_forward_hook(lambda m, i, o: seen.update(prefix=o)),
             model.layers[-1].register_forward_hook(lambda m, i, o: seen.update(suffix=o[1]))]
    velocity = model(obs, noisy, t)
    for hook in hooks:
        hook.remove()
    return seen["prefix"], seen["suffix"], velocity


def test_mask_layout_of_three_blocks():
    mask = joint_mask(torch.tensor([[True, False]]), [1, 2, 2])[0, 0]
    assert mask[:2].tolist() == [[True, False, False, False, False]] * 2  # prefix: itself only
    assert mask[2].tolist() == [True, False, True, False, False]  # state: prefix + itself
    assert mask[3:].tolist() == [[True, False, True, True, True]] * 2  # actions: everything valid
    assert positions(torch.tensor([[True, False]]), 3).tolist() == [[0, 0, 1, 2, 3]]


def test_prefix_sees_neither_state_nor_actions(policy):
    obs, noisy, t = inputs()
    prefix, _, _ = _streams(policy, obs, noisy, t)
    changed, _, _ = _streams(policy, {**obs, "state": obs["state"] + 1.0}, noisy + 3.0, 1.0 - t)
    assert torch.equal(prefix, changed)


def test_state_token_sees_the_prefix_but_not_the_actions(policy):
    obs, noisy, t = inputs()
    _, suffix, velocity = _streams(policy, obs, noisy, t)
    _, moved, moved_velocity = _streams(policy, obs, noisy + 3.0, 1.0 - t)
    assert torch.equal(suffix[:, 0], moved[:, 0]) and not torch.allclose(velocity, moved_velocity)
    _, other_image, _ = _streams(policy, {**obs, "images": obs["images"].flip(-1)}, noisy, t)
    assert not torch.allclose(other_image[:, 0], suffix[:, 0])


def test_actions_see_the_state_and_each_other(policy):
    obs, noisy, t = inputs()
    reference = policy(obs, noisy, t)
    assert not torch.allclose(policy({**obs, "state": obs["state"] * -1.0}, noisy, t), reference)
    last_moved = noisy.clone()
    last_moved[:, -1] += 3.0
    assert not torch.allclose(policy(obs, last_moved, t)[:, 0], reference[:, 0])  # later -> earlier
    assert not torch.allclose(policy(obs, noisy, t * 0.5), reference)  # time enters through action_time_mlp


def test_frame_inputs_text_and_padded_state():
    got = TINY.frame_inputs("ab", torch.tensor([0.5, -2.0]))
    assert got["tokens"].tolist() == [1 + ord("a"), 1 + ord("b")] + [0] * 6
    assert got["state"].tolist() == [0.5, -2.0, 0.0, 0.0] and got["state"].dtype == torch.float32
    with pytest.raises(ValueError, match="at most 4"):
        TINY.frame_inputs("ab", torch.zeros(5))


def test_state_only_flavor():
    flavor = TINY.with_overrides(cameras=0)
    torch.manual_seed(0)
    model = Pi0Policy(flavor).eval()
    assert flavor.num_params() == sum(p.numel() for p in model.parameters())
    obs, noisy, t = inputs()
    out = model({"tokens": obs["tokens"], "state": obs["state"]}, noisy, t)
    assert out.shape == noisy.shape and torch.isfinite(out).all()


def test_registered_sizes_match_pi05():
    for size in ("tiny", "small"):
        pi0, pi05 = FLAVORS[f"pi0-{size}"], FLAVORS[f"pi05-{size}"]
        names = [f.name for f in dataclasses.fields(pi0)]
        assert [getattr(pi0, n) for n in names] == [getattr(pi05, n) for n in names]
    assert FLAVORS["pi0-tiny"].num_params() == 209_384 and FLAVORS["pi0-small"].num_params() == 1_755_616


#: Pi0's first steps are noisy (a fresh expert, no identity start): judge the loss over more of them.
PI0_STEPS = 24
PI0_RUN = ("model.name=pi0-tiny", f"scheduler.decay_steps={PI0_STEPS}", "task.eval={frames: 0}")


@pytest.fixture(scope="module")
def pi0_run(tmp_path_factory):
    return train(tmp_path_factory.mktemp("pi0") / "run", *PI0_RUN, f"training.steps={PI0_STEPS}")


def test_pi0_loss_falls_on_reach(pi0_run):
    rows = pi0_run
    assert sorted(rows) == list(range(1, PI0_STEPS + 1))
    first, last = [rows[s]["loss"] for s in range(1, 7)], [rows[s]["loss"] for s in range(PI0_STEPS - 5, PI0_STEPS + 1)]
    assert sum(last) < 0.7 * sum(first)


def test_pi0_same_seed_same_run(tmp_path, pi0_run):
    again = train(tmp_path / "run", *PI0_RUN, "training.steps=6")
    assert sorted(again) == list(range(1, 7))
    for step, row in again.items():
        assert (row["loss"], row["grad_norm"]) == (pi0_run[step]["loss"], pi0_run[step]["grad_norm"])


def test_state_only_task(tmp_path):
    """``cameras: 0`` on a set that has a camera, through the task in-process: items, inputs and the saved task
    state carry no images; a training step and the held-out evaluation run."""
    config = load_config(ROOT / "configs/embodied-tiny.yaml", [
        *COMMON, f"run.output_dir={tmp_path}", "model.name=pi0-tiny",
        "model.overrides={text_len: 24, depth: 1, vision_depth: 0, cameras: 0}", "task.eval={frames: 4, steps: 2}"])
    task = FLAVORS["pi0-tiny"].make_task(config)
    items = task.build_dataset()
    assert set(items[0]) == {"tokens", "state", "actions", "action_is_pad"} and task.state_dict()["camera_keys"] == []
    torch.manual_seed(0)
    model = task.build_model()
    batch = {key: torch.stack([items[i][key] for i in range(4)]) for key in items[0]} | {"index": torch.arange(4)}
    task.training_step(model, batch).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    scores = task.finish(model, tmp_path, NoMediaLog())["held_out_action_mse"]
    assert all(value > 0 for value in scores.values()) and (tmp_path / "eval.json").is_file()
