"""The Pi0.5-style policy's pieces: flow-matching time/noise/targets, the joint attention mask (prefix
bidirectional and blind to actions; actions see the prefix and each other), the padded-step loss mask, the state
prompt, the flavor table and the task's option checks."""

from __future__ import annotations

import types

import pytest
import torch
from loongforge.errors import ConfigError
from loongforge_embodied.policies import flow_matching as fm
from loongforge_embodied.policies.blocks import joint_mask, positions
from loongforge_embodied.policies.flavors import FLAVORS, Pi05Flavor
from loongforge_embodied.policies.pi05 import Pi05Policy
from loongforge_embodied.policies.prompt import BYTES, discretise, prompt_tokens

TINY = Pi05Flavor(width=32, expert_width=16, depth=2, vision_depth=1, heads=2, head_dim=8, image_size=8,
                  patch_size=4, text_len=8, max_state_dim=4, max_action_dim=4)
HORIZON = 5


def generators(n: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def inputs(batch: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(batch, 1, 3, 8, 8, generator=g)
    tokens = torch.stack([prompt_tokens("pick", torch.tensor([0.1, -0.5]), text_len=8, max_state_dim=4,
                                        state_bins=256)] * batch)
    obs = {"images": images, "tokens": tokens}
    return obs, torch.randn(batch, HORIZON, 4, generator=g), torch.rand(batch, generator=g)


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    model = Pi05Policy(TINY)
    for p in model.parameters():  # adaRMS starts as identity (zero modulation); give it something to pass on
        torch.nn.init.normal_(p, std=0.2)
    return model.eval()


def test_beta_time_range_and_mean():
    t = fm.sample_time(generators(4000))
    assert float(t.min()) >= fm.T_MIN and float(t.max()) <= 1.0
    # Beta(1.5, 1) has mean 0.6; scaled into [0.001, 1]: 0.6 * 0.999 + 0.001
    assert abs(float(t.mean()) - (0.6 * 0.999 + 0.001)) < 0.01
    assert torch.equal(fm.sample_time(generators(3)), fm.sample_time(generators(3)))  # generators decide


def test_noisy_actions_and_target():
    actions, noise, t = torch.randn(3, HORIZON, 4), torch.randn(3, HORIZON, 4), torch.tensor([0.001, 0.5, 1.0])
    x_t, target = fm.noisy_actions(actions, noise, t)
    assert torch.allclose(x_t[1], 0.5 * noise[1] + 0.5 * actions[1])
    assert torch.allclose(x_t[2], noise[2]) and torch.allclose(target, noise - actions)


def test_euler_sampling_integrates_an_exact_velocity():
    actions, noise = torch.randn(2, HORIZON, 4), torch.randn(2, HORIZON, 4)
    # the straight path's velocity is constant, so 10 Euler steps land exactly on the actions
    assert torch.allclose(fm.euler_sample(lambda x, t: noise - actions, noise, 10), actions, atol=1e-6)


def test_loss_ignores_padded_steps_and_extra_dims():
    velocity, target = torch.randn(2, HORIZON, 4), torch.randn(2, HORIZON, 4)
    is_pad = torch.tensor([[False] * 3 + [True] * 2, [False] * 5])
    loss = fm.masked_loss(velocity, target, is_pad, action_dim=3)
    changed = target.clone()
    changed[0, 3:] += 100.0  # padded steps
    changed[..., 3] += 100.0  # a padding dimension of the action vector
    assert float(fm.masked_loss(velocity, changed, is_pad, action_dim=3)) == float(loss)
    manual = ((velocity - target)[..., :3] ** 2 * (~is_pad)[..., None]).sum() / (2 * HORIZON * 3)
    assert torch.allclose(loss, manual)


def test_mask_layout():
    valid = torch.tensor([[True, True, False]])
    mask = joint_mask(valid, [1, 1])[0, 0]
    assert mask[:3, :3].tolist() == [[True, True, False]] * 3  # prefix: bidirectional over valid keys
    assert not mask[:3, 3:].any()  # prefix never sees actions
    assert mask[3:].tolist() == [[True, True, False, True, True]] * 2  # actions: prefix + every action
    assert positions(valid, 2).tolist() == [[0, 1, 1, 2, 3]]


def _prefix_keys(model, obs, noisy, t):
    """The last joint layer's prefix keys/values (all the prefix contributes to the action expert)."""
    seen = {}
    handle = model.layers[-1].prefix.qkv.register_forward_hook(lambda m, i, o: seen.setdefault("kv", o))
    model(obs, noisy, t)
    handle.remove()
    return seen["kv"]


def test_prefix_never_sees_actions_or_time(policy):
    obs, noisy, t = inputs()
    reference = _prefix_keys(policy, obs, noisy, t)
    changed = _prefix_keys(policy, obs, noisy + 5.0 * torch.randn_like(noisy), 1.0 - t)
    assert torch.equal(reference, changed)


def test_prefix_is_bidirectional(policy):
    obs, noisy, t = inputs()
    reference = _prefix_keys(policy, obs, noisy, t)
    later = obs["tokens"].clone()
    later[:, -4] = 1 + BYTES + 200  # the first state token, the prefix's end
    changed = _prefix_keys(policy, {**obs, "tokens": later}, noisy, t)
    assert not torch.allclose(reference[:, 0], changed[:, 0])  # the first image token sees it


def test_action_tokens_see_the_prefix_and_each_other(policy):
    obs, noisy, t = inputs()
    reference = policy(obs, noisy, t)
    last_moved = noisy.clone()
    last_moved[:, -1] += 3.0
    assert not torch.allclose(policy(obs, last_moved, t)[:, 0], reference[:, 0])  # later -> earlier
    assert not torch.allclose(policy({**obs, "images": obs["images"].flip(-1)}, noisy, t), reference)


def test_padding_tokens_are_ignored(policy):
    """More text padding (a longer ``text_len``, same weights) changes nothing: pads are masked as keys and the
    rotary positions count only valid tokens."""
    obs, noisy, t = inputs()
    wider = Pi05Policy(TINY.with_overrides(text_len=12))
    wider.load_state_dict(policy.state_dict())
    tokens = obs["tokens"]
    padded = torch.cat([tokens[:, :8], torch.zeros(2, 4, dtype=torch.long), tokens[:, 8:]], dim=1)
    assert torch.allclose(wider.eval()({**obs, "tokens": padded}, noisy, t), policy(obs, noisy, t), atol=1e-6)


def test_state_only_flavor_reads_text_and_state_tokens():
    """``cameras: 0``: no image weights, no "images" input; the prefix is the prompt alone."""
    flavor = TINY.with_overrides(cameras=0)
    torch.manual_seed(0)
    model = Pi05Policy(flavor).eval()
    assert not hasattr(model, "patch_embed") and flavor.num_params() == sum(p.numel() for p in model.parameters())
    for p in model.parameters():  # past the identity start of adaRMS (see the fixture)
        torch.nn.init.normal_(p, std=0.2)
    obs, noisy, t = inputs()
    out = model({"tokens": obs["tokens"]}, noisy, t)
    assert out.shape == noisy.shape and torch.isfinite(out).all()
    moved = obs["tokens"].clone()
    moved[:, -4] = 1 + BYTES + 3  # another bin of the first state dimension
    assert not torch.allclose(model({"tokens": moved}, noisy, t), out)
    assert flavor.frame_inputs("pick", torch.tensor([0.1, -0.5])).keys() == {"tokens"}


def test_state_discretisation_and_prompt():
    assert discretise(torch.tensor([-1.0, -0.999, 0.0, 0.999, 1.0, 3.0]), 256).tolist() == [0, 0, 128, 255, 255, 255]
    ids = prompt_tokens("ab", torch.tensor([0.0]), text_len=4, max_state_dim=2, state_bins=256)
    assert ids.tolist() == [1 + ord("a"), 1 + ord("b"), 0, 0, 1 + BYTES + 128, 0]
    with pytest.raises(ValueError, match="at most 2"):
        prompt_tokens("ab", torch.zeros(3), text_len=4, max_state_dim=2, state_bins=256)


@pytest.mark.parametrize("name", sorted(FLAVORS))
def test_flavor_parameter_count(name):
    flavor = FLAVORS[name]
    assert flavor.num_params() == sum(p.numel() for p in flavor.build_policy().parameters())
    assert f"{flavor.num_params() / 1e6:.2f}M params" in flavor.describe()


def test_flavor_checks_and_overrides():
    with pytest.raises(ConfigError, match="patch_size"):
        Pi05Flavor(image_size=10, patch_size=4)
    assert FLAVORS["pi05-tiny"].with_overrides(depth=3).depth == 3
    with pytest.raises(ConfigError, match="unknown pi05 flavor field"):
        FLAVORS["pi05-tiny"].with_overrides(layers=3)


@pytest.mark.parametrize("task,message", [
    ({"horizon": 4}, "run.yaml: unknown key 'task.horizon'"),
    ({"eval": {"frame": 3}}, "run.yaml: unknown key 'task.eval.frame' .*did you mean 'frames'"),
    ({"action_horizon": "abc"}, "run.yaml: 'task.action_horizon' must be an integer, got 'abc'"),
    ({"normalization": "zscore"}, "normalization 'zscore' is unknown"),
])
def test_task_option_errors(task, message):
    config = types.SimpleNamespace(task=task, source="run.yaml", model=types.SimpleNamespace(overrides={}),
                                   run=types.SimpleNamespace(seed=0, output_dir="unused"))
    with pytest.raises(ConfigError, match=message):
        FLAVORS["pi05-tiny"].make_task(config)
