"""The PaliGemma-exact Pi0.5 policy (``pi05_gemma``): shapes, parameter counts against the sizes (the real 3B one
on the meta device), the attention structure by perturbation, LeRobot/OpenPI weight conversion both ways, and
training through ``loongforge train``. Numerical parity with LeRobot's ``PI05Pytorch`` runs in its own environment
(``parity/lerobot``, ``nox -s lerobot_parity``)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from loongforge.cli import main
from loongforge.errors import ConfigError, LoongForgeError
from loongforge_embodied import convert_lerobot
from loongforge_embodied.policies.gemma import prefix_lm_mask
from loongforge_embodied.policies.pi05_gemma_flavors import FLAVORS, Pi05GemmaFlavor
from safetensors import safe_open
from safetensors.torch import load_file, save_file

#: Two cameras, grouped-query heads (4 query heads per key/value head), a short prompt.
FLAVOR = FLAVORS["pi05-gemma-tiny"].with_overrides(cameras=2, heads=4, kv_heads=2, text_len=10, vision_depth=2)
HORIZON = 5


def randomised(flavor: Pi05GemmaFlavor = FLAVOR, seed: int = 0) -> torch.nn.Module:
    """The policy with every parameter drawn at random (the adaRMS projections start at zero, which would make
    every expert layer the identity and hide the structure under test)."""
    torch.manual_seed(seed)
    policy = flavor.build_policy().eval()
    with torch.no_grad():
        for param in policy.parameters():
            param.normal_(0.0, 0.1)
    return policy


def batch_inputs(flavor: Pi05GemmaFlavor = FLAVOR, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tasks = ("reach the red square", "go", "push")
    tokens = torch.stack([flavor.frame_inputs(t, torch.rand(3, generator=g) * 2 - 1)["tokens"] for t in tasks])
    inputs = {"tokens": tokens,
              "images": torch.rand(len(tasks), flavor.cameras, 3, flavor.image_size, flavor.image_size, generator=g)}
    actions = torch.randn(len(tasks), HORIZON, flavor.max_action_dim, generator=g)
    return inputs, actions, torch.tensor([0.2, 0.6, 0.9])


def test_shapes_and_sampling():
    policy = randomised()
    inputs, actions, time = batch_inputs()
    assert inputs["tokens"].shape == (3, FLAVOR.text_len + FLAVOR.max_state_dim)
    velocity = policy(inputs, actions, time)
    assert velocity.shape == actions.shape and torch.isfinite(velocity).all()
    sampled = policy.sample_actions(inputs, actions, steps=3)
    assert sampled.shape == actions.shape
    # the cached prefix gives what the full forward gives: Euler by hand, three steps of dt = -1/3 from t = 1
    x = actions
    for t in (1.0, 2 / 3, 1 / 3):
        x = x - policy(inputs, x, torch.full((3,), t)) / 3
    torch.testing.assert_close(sampled, x, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", sorted(FLAVORS))
def test_num_params_match_the_built_module(name):
    flavor = FLAVORS[name]
    with torch.device("meta"):
        policy = flavor.build_policy()
    assert sum(p.numel() for p in policy.parameters()) == flavor.num_params()


def test_pi05_base_has_the_published_sizes():
    """SigLIP So400m/14 at 224px + Gemma 2B (257152 ids) + the Gemma-300M expert: 3.35B parameters."""
    base = FLAVORS["pi05-base"]
    with torch.device("meta"):
        policy = base.build_policy()
    vision = sum(p.numel() for p in policy.vision.parameters())
    lm = sum(p.numel() for name, p in policy.named_parameters() if name.startswith(("embed_tokens", "norm."))
             or ".prefix." in name)
    expert = sum(p.numel() for name, p in policy.named_parameters() if ".expert." in name
                 or name.startswith("expert_norm"))
    # Gemma 2B is 2,506,172,416 with its 256000 ids; PaliGemma's 257152 add 1152 x 2048. The expert: 18 x (q/k/v/o
    # 4,718,592 + MLP 12,582,912 + two adaRMS 6,297,600) + the final adaRMS 3,148,800. So400m at 224px: 256 positions.
    assert (vision, lm, expert) == (412_442_352, 2_506_172_416 + 1152 * 2048, 18 * 23_599_104 + 3_148_800)
    assert base.num_params() == 3_353_433_872
    assert policy.embed_tokens.weight.shape == (257152, 2048)
    assert policy.layers[0].prefix.k_proj.weight.shape == (256, 2048)   # one key/value head of 256
    assert policy.layers[0].expert.q_proj.weight.shape == (8 * 256, 1024)


def test_flavor_validation():
    with pytest.raises(ConfigError, match="kv_heads"):
        FLAVOR.with_overrides(kv_heads=3)
    with pytest.raises(ConfigError, match="vocab"):
        FLAVOR.with_overrides(vocab=300)


def test_prefix_lm_mask_structure():
    pad = torch.tensor([[True, True, False, True, True, True]])
    starts = torch.tensor([[False, False, False, False, True, False]])  # prefix of 4 (one padded), 2 actions
    mask = prefix_lm_mask(pad, starts)[0].int()
    expected = torch.tensor([[1, 1, 0, 1, 0, 0],
                             [1, 1, 0, 1, 0, 0],
                             [0, 0, 0, 0, 0, 0],
                             [1, 1, 0, 1, 0, 0],
                             [1, 1, 0, 1, 1, 1],
                             [1, 1, 0, 1, 1, 1]])
    assert torch.equal(mask, expected)


def _changed(policy, inputs, actions, time, *, new_inputs=None, new_actions=None) -> torch.Tensor:
    """(B, H) bool: which samples' chunk steps change when ``new_inputs`` (merged in) / ``new_actions`` are used."""
    with torch.no_grad():
        before = policy(inputs, actions, time)
        after = policy({**inputs, **(new_inputs or {})}, actions if new_actions is None else new_actions, time)
    return (before - after).abs().amax(-1) > 1e-6


def test_attention_structure_by_perturbation():
    policy = randomised()
    inputs, actions, time = batch_inputs()
    # padding ids are masked as keys: changing the padding embedding changes nothing
    with torch.no_grad():
        before = policy(inputs, actions, time)
        policy.embed_tokens.weight[0].add_(1.0)
        assert torch.equal(before, policy(inputs, actions, time))
    # a real prompt token of sample 1 changes every action step of sample 1 only
    tokens = inputs["tokens"].clone()
    tokens[1, 0] += 1
    changed = _changed(policy, inputs, actions, time, new_inputs={"tokens": tokens})
    assert changed[1].all() and not changed[[0, 2]].any()
    # the last action step reaches every step (actions attend to each other bidirectionally)
    edited = actions.clone()
    edited[:, -1] += 1.0
    assert _changed(policy, inputs, actions, time, new_actions=edited).all()
    # a camera marked missing is masked out, a shown one is seen
    images = inputs["images"].clone()
    images[:, 1] = torch.rand_like(images[:, 1])
    shown = torch.tensor([[True, False]] * 3)
    masked = {**inputs, "image_masks": shown}
    assert not _changed(policy, masked, actions, time, new_inputs={"images": images}).any()
    assert _changed(policy, inputs, actions, time, new_inputs={"images": images}).all()


def test_prefix_never_sees_the_actions():
    """Inside a joint layer the prefix outputs do not depend on the suffix (what lets LeRobot cache them)."""
    policy = randomised()
    layer = policy.layers[0]
    g = torch.Generator().manual_seed(3)
    prefix = torch.randn(2, 7, FLAVOR.width, generator=g)
    suffixes = torch.randn(2, 2, HORIZON, FLAVOR.expert_width, generator=g)
    cond = torch.randn(2, FLAVOR.expert_width, generator=g)
    pad = torch.ones(2, 7 + HORIZON, dtype=torch.bool)
    starts = torch.zeros_like(pad)
    starts[:, 7] = True
    mask, positions = prefix_lm_mask(pad, starts), torch.arange(7 + HORIZON).expand(2, -1)
    outs = [layer(prefix, s, cond, positions, mask, FLAVOR.rope_theta, last=False) for s in suffixes]
    assert torch.equal(outs[0][0], outs[1][0]) and not torch.equal(outs[0][1], outs[1][1])


def test_time_conditions_the_expert():
    policy = randomised()
    inputs, actions, _ = batch_inputs()
    a = policy(inputs, actions, torch.tensor([0.2, 0.2, 0.2]))
    b = policy(inputs, actions, torch.tensor([0.2, 0.7, 0.2]))
    assert torch.equal(a[[0, 2]], b[[0, 2]]) and not torch.allclose(a[1], b[1])


def test_conversion_round_trip_is_bitwise():
    policy = randomised()
    ours = policy.state_dict()
    theirs = convert_lerobot.to_lerobot(ours, FLAVOR)
    prefix = "model.paligemma_with_expert."
    assert f"{prefix}gemma_expert.model.layers.1.input_layernorm.dense.weight" in theirs
    assert f"{prefix}paligemma.model.language_model.layers.0.self_attn.k_proj.weight" in theirs
    assert f"{prefix}paligemma.model.vision_tower.vision_model.encoder.layers.1.self_attn.v_proj.bias" in theirs
    assert theirs[f"{prefix}paligemma.model.vision_tower.vision_model.embeddings.patch_embedding.weight"].shape == (
        FLAVOR.vision_width, 3, FLAVOR.patch_size, FLAVOR.patch_size)
    assert "model.time_mlp_in.weight" in theirs and len(theirs) == len(ours) + 4 * FLAVOR.vision_depth
    # with LeRobot's unused heads present (the tied one alone carries the embedding) the way back drops them
    unused = {f"{prefix}paligemma.lm_head.weight": theirs.pop(f"{prefix}paligemma.model.language_model."
                                                               "embed_tokens.weight"),
              f"{prefix}gemma_expert.lm_head.weight": torch.zeros(FLAVOR.vocab, FLAVOR.expert_width)}
    back, dropped = convert_lerobot.from_lerobot({**theirs, **unused}, FLAVOR)
    assert dropped == sorted(name[len("model."):] for name in unused)
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)
    # OpenPI's layout (no "model.", older transformers names, Pi0's time-MLP names) reads the same
    legacy = {name[len("model."):].replace("paligemma.model.language_model.", "paligemma.language_model.model.")
              .replace("time_mlp_", "action_time_mlp_"): t for name, t in convert_lerobot.to_lerobot(ours, FLAVOR)
              .items()}
    back, _ = convert_lerobot.from_lerobot(legacy, FLAVOR)
    assert all(torch.equal(back[k], ours[k]) for k in ours)


def test_conversion_rejects_mismatches():
    theirs = convert_lerobot.to_lerobot(randomised().state_dict(), FLAVOR)
    with pytest.raises(LoongForgeError, match="unexpected checkpoint tensor 'state_proj.weight'"):
        convert_lerobot.from_lerobot({**theirs, "model.state_proj.weight": torch.zeros(1)}, FLAVOR)
    with pytest.raises(LoongForgeError, match="shape"):
        convert_lerobot.from_lerobot(theirs, FLAVOR.with_overrides(mlp_dim=96))
    del theirs["model.action_out_proj.bias"]
    with pytest.raises(LoongForgeError, match="lacks 'action_out_proj.bias'"):
        convert_lerobot.from_lerobot(theirs, FLAVOR)


def test_conversion_command_round_trip(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LOONGFORGE_PROGRESS", "plain")
    ours = randomised().state_dict()
    src = tmp_path / "lerobot.safetensors"
    save_file(convert_lerobot.to_lerobot(ours, FLAVOR), src)
    overrides = [f"{k}={json.dumps(v)}" for k, v in dataclasses.asdict(FLAVOR).items()
                 if v != getattr(FLAVORS["pi05-gemma-tiny"], k)]
    assert main(["convert", "hf-to-mcore", str(src), str(tmp_path / "ours.safetensors"), "--flavor", "pi05-gemma-tiny",
                 *[a for o in overrides for a in ("--set", o)]]) == 0
    mine = load_file(tmp_path / "ours.safetensors")
    assert mine.keys() == ours.keys() and all(torch.equal(mine[k], ours[k]) for k in ours)
    with safe_open(tmp_path / "ours.safetensors", "pt") as handle:
        assert Pi05GemmaFlavor(**json.loads(handle.metadata()["flavor"])) == FLAVOR
    assert main(["convert", "mcore-to-hf", str(tmp_path / "ours.safetensors"), str(tmp_path / "back.st")]) == 0
    original, back = load_file(src), load_file(tmp_path / "back.st")
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in original)
    printed = capsys.readouterr().out  # each source is read tensor by tensor, with progress
    assert f"reading lerobot.safetensors: {len(original)}/{len(original)} tensor" in printed
    assert f"reading ours.safetensors: {len(ours)}/{len(ours)} tensor" in printed
    assert f"wrote {len(ours)} tensors to {tmp_path / 'ours.safetensors'}" in printed


def test_every_trainable_parameter_gets_a_gradient():
    """Data-parallel wrappers wait for every trainable gradient: what feeds nothing is frozen instead."""
    policy = randomised()
    inputs, actions, time = batch_inputs()
    policy(inputs, actions, time).square().mean().backward()
    frozen = sorted(name for name, p in policy.named_parameters() if not p.requires_grad)
    assert frozen == ["layers.1.prefix.mlp.down_proj.weight", "layers.1.prefix.mlp.gate_proj.weight",
                      "layers.1.prefix.mlp.up_proj.weight", "layers.1.prefix.o_proj.weight",
                      "layers.1.prefix.post_attention_layernorm.weight", "layers.1.prefix.q_proj.weight",
                      "norm.weight"]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters() if p.requires_grad)
