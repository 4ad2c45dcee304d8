"""The PaliGemma-exact Pi0.5's reference implementation for ``loongforge diff --reference`` is LeRobot's, and its
names are the conversion's: every parameter of the tiny policy renamed to what ``convert_lerobot.to_lerobot``
writes, and every module pair naming the LeRobot module that holds exactly the converted tensors of ours. LeRobot
itself runs in ``parity/lerobot`` (``test_pi05_diff_reference.py``); nothing here imports it."""

from __future__ import annotations

import pytest
import torch
from loongforge.errors import InteropError
from loongforge_embodied.convert_lerobot import to_lerobot
from loongforge_embodied.policies.pi05_gemma_flavors import FLAVORS

FLAVOR = FLAVORS["pi05-gemma-tiny"].with_overrides(heads=8, vision_depth=2)


def distinct_state(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter drawn at random, so that tensors (and their sums) tell each other apart."""
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(p.shape, generator=generator, dtype=torch.float64)
            for name, p in policy.named_parameters()}


def under(state: dict[str, torch.Tensor], module: str) -> tuple[int, float]:
    """(elements, sum) of the tensors inside ``module``."""
    inside = [t for name, t in state.items() if name.startswith(module + ".")]
    return sum(t.numel() for t in inside), sum(t.sum().item() for t in inside)


def test_reference_is_lerobot_with_the_conversions_names():
    reference = FLAVOR.reference_implementation()
    assert reference.library == "lerobot"
    policy = FLAVOR.build_policy()
    state = distinct_state(policy)
    renamed = reference.parameters(state)
    exported = to_lerobot(state, FLAVOR)
    assert renamed.keys() == exported.keys()
    assert all(torch.equal(renamed[name], exported[name]) for name in exported)
    assert sum(t.numel() for t in renamed.values()) == sum(t.numel() for t in state.values())

    pairs = reference.module_pairs()
    modules = dict(policy.named_modules())
    for pair in pairs:  # the LeRobot module holds exactly our module's tensors, converted
        assert pair.ours in modules, pair
        ours, theirs = under(state, pair.ours), under(exported, pair.theirs)
        assert ours[0] == theirs[0] > 0 and abs(ours[1] - theirs[1]) < 1e-9, pair
    assert len({pair.ours for pair in pairs}) == len({pair.theirs for pair in pairs}) == len(pairs)

    last = f"layers.{FLAVOR.depth - 1}.prefix"
    unpaired = {"vision", "vision.patch_embed", *(f"vision.blocks.{i}.attn.qkv" for i in range(FLAVOR.vision_depth)),
                "norm", f"{last}.q_proj", f"{last}.o_proj", f"{last}.post_attention_layernorm",
                *(f"{last}.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj"))}
    owners = {name.rpartition(".")[0] for name in state}
    assert owners - {pair.ours for pair in pairs} == unpaired
    for i in range(FLAVOR.depth):  # per layer: the expert's MLP and adaptive norms (their outputs, not only their
        expert = f"layers.{i}.expert"  # projections: a wrong epsilon shows in the norm's output alone)
        assert {f"{expert}.mlp", f"{expert}.input_layernorm", f"{expert}.post_attention_layernorm",
                f"{expert}.input_layernorm.dense"} <= {p.ours for p in pairs}
    assert "expert_norm" in {p.ours for p in pairs}
    assert {f"vision.blocks.{i}" for i in range(FLAVOR.vision_depth)} <= {p.ours for p in pairs}


def test_several_cameras_leave_the_vision_tower_unpaired():
    """LeRobot runs the tower once per camera, ours once over all of them: their outputs cannot be compared."""
    pairs = FLAVOR.with_overrides(cameras=2).reference_implementation().module_pairs()
    assert not [pair for pair in pairs if pair.ours.startswith(("vision", "projector"))]
    assert "action_in_proj" in {pair.ours for pair in pairs}


def test_what_lerobot_cannot_build_is_refused_in_one_line(tmp_path):
    """LeRobot reshapes attention outputs with 8 heads; a directory without LeRobot's two files is not its policy
    (both refused before LeRobot is imported, so this runs without it)."""
    with pytest.raises(InteropError, match="runs 8 query heads, the checkpoint's flavor has 4"):
        FLAVOR.with_overrides(heads=4).reference_implementation().load(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(InteropError, match="not a LeRobot policy directory"):
        FLAVOR.reference_implementation().load(tmp_path)
