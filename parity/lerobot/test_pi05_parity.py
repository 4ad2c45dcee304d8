"""Our PaliGemma-exact Pi0.5 (``loongforge_embodied.policies.pi05_gemma``) against LeRobot 0.4.4's ``PI05Policy``.

The reference is built tiny, offline and in float32 (:mod:`reference`, on stock transformers 4.57 patched by
:mod:`transformers_shim`); its weights reach ours through ``convert_lerobot``. Then, for the same inputs, fixed
noise and fixed flow times, within 1e-5 relative: ``PI05Pytorch``'s per-element training loss, the gradients of
every parameter and its Euler-sampled chunks (two cameras, one missing for one sample; padded prompts), and
``PI05Policy``'s scalar loss and predicted chunks (the action dims cut to the robot's, 10 steps).
Runs in its own environment (see README.md): ``nox -s lerobot_parity``.
"""

from __future__ import annotations

import pytest
import torch
from loongforge_embodied.convert_lerobot import LEROBOT_PREFIX, UNUSED, from_lerobot, to_lerobot
from loongforge_embodied.policies import flow_matching
from loongforge_embodied.policies.pi05_gemma_flavors import Pi05GemmaFlavor
from reference import CAMERAS, TinySizes, build_reference

SIZES = TinySizes()
BATCH, STEPS, TOL = 3, 4, 1e-5


def our_flavor(s: TinySizes) -> Pi05GemmaFlavor:
    return Pi05GemmaFlavor(vision_width=s.vision_width, vision_depth=s.vision_depth, vision_mlp_dim=s.vision_mlp_dim,
                           vision_heads=s.vision_heads, patch_size=s.patch_size, image_size=s.image_size,
                           cameras=s.cameras, width=s.width, depth=s.depth, mlp_dim=s.mlp_dim, heads=s.heads,
                           kv_heads=s.kv_heads, head_dim=s.head_dim, vocab=s.vocab, expert_width=s.expert_width,
                           expert_mlp_dim=s.expert_mlp_dim, text_len=s.text_len, max_state_dim=s.max_state_dim,
                           max_action_dim=s.max_action_dim)


def errors(ours: torch.Tensor, theirs: torch.Tensor) -> tuple[float, float]:
    """(max abs difference, relative L2 difference)."""
    diff = (ours.double() - theirs.double())
    return diff.abs().max().item(), (diff.norm() / theirs.double().norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def models():
    policy = build_reference(SIZES, seed=0)
    flavor = our_flavor(SIZES)
    state, dropped = from_lerobot(policy.state_dict(), flavor)
    assert dropped == sorted(UNUSED)
    ours = flavor.build_policy().eval()
    ours.load_state_dict(state, strict=True)
    return policy, ours, flavor


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(1)
    images = torch.rand(BATCH, SIZES.cameras, 3, SIZES.image_size, SIZES.image_size, generator=g)
    shown = torch.ones(BATCH, SIZES.cameras, dtype=torch.bool)
    shown[1, 1] = False
    tokens = torch.randint(1, SIZES.vocab, (BATCH, SIZES.text_len), generator=g)
    tokens[0, 7:] = 0
    tokens[2, 10:] = 0
    chunk = (BATCH, SIZES.chunk_size, SIZES.max_action_dim)
    return {"images": images, "image_masks": shown, "tokens": tokens, "actions": torch.randn(chunk, generator=g),
            "noise": torch.randn(chunk, generator=g), "time": torch.tensor([0.05, 0.5, 0.97])}


def reference_inputs(batch):
    images = [batch["images"][:, c] * 2 - 1 for c in range(SIZES.cameras)]
    shown = [batch["image_masks"][:, c] for c in range(SIZES.cameras)]
    return images, shown, batch["tokens"], batch["tokens"] != 0


def test_conversion_round_trip_is_bitwise(models):
    policy, ours, flavor = models
    exported = to_lerobot(ours.state_dict(), flavor)
    theirs = policy.state_dict()
    unused = {LEROBOT_PREFIX + name for name in UNUSED}
    assert set(theirs) - set(exported) == unused and set(exported) <= set(theirs)
    for name, tensor in exported.items():
        assert torch.equal(tensor, theirs[name]), name
    missing, unexpected = policy.load_state_dict(exported, strict=False)
    assert set(missing) == unused and not unexpected


def test_same_loss_and_gradients(models, batch):
    policy, ours, flavor = models
    reference = policy.model
    reference.zero_grad()
    ours.zero_grad()
    theirs = reference(*reference_inputs(batch), batch["actions"], noise=batch["noise"], time=batch["time"])
    t = batch["time"][:, None, None]
    x_t = t * batch["noise"] + (1 - t) * batch["actions"]
    velocity = ours({k: batch[k] for k in ("images", "image_masks", "tokens")}, x_t, batch["time"])
    mine = (batch["noise"] - batch["actions"] - velocity) ** 2
    max_abs, rel = errors(mine, theirs)
    print(f"\nloss: ours {mine.mean().item():.8f} lerobot {theirs.mean().item():.8f}; per element max abs "
          f"{max_abs:.3e}, rel L2 {rel:.3e}")
    assert rel < TOL and abs(mine.mean().item() - theirs.mean().item()) < TOL * theirs.mean().item()
    theirs.mean().backward()
    mine.mean().backward()

    def grads(module):
        return {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in module.named_parameters()}

    mine_grads = to_lerobot(grads(ours), flavor, prefix="")
    theirs_grads = {n: g for n, g in grads(reference).items() if n in mine_grads}
    names = sorted(mine_grads)
    total = errors(torch.cat([mine_grads[n].flatten() for n in names]),
                   torch.cat([theirs_grads[n].flatten() for n in names]))
    scale = torch.cat([theirs_grads[n].flatten() for n in names]).norm()
    # Tensors whose true gradient is ~0 (attention key biases: softmax ignores a constant per query) are
    # compared against the whole gradient's norm, the others against their own.
    worst = max(((mine_grads[n] - theirs_grads[n]).norm().item()
                 / max(theirs_grads[n].norm().item(), 1e-3 * scale.item()), n) for n in names)
    print(f"gradients: all together max abs {total[0]:.3e}, rel L2 {total[1]:.3e}; worst tensor {worst[0]:.3e} "
          f"({worst[1]})")
    assert total[1] < TOL and worst[0] < TOL


def test_same_sampled_actions(models, batch):
    policy, ours, flavor = models
    reference = policy.model
    theirs = reference.sample_actions(*reference_inputs(batch), noise=batch["noise"].clone(), num_steps=STEPS)
    mine = ours.sample_actions({k: batch[k] for k in ("images", "image_masks", "tokens")}, batch["noise"].clone(),
                               STEPS)
    max_abs, rel = errors(mine, theirs)
    print(f"\nsampled actions ({STEPS} Euler steps): max abs {max_abs:.3e}, rel L2 {rel:.3e}, "
          f"max rel {max_abs / theirs.abs().max().item():.3e}")
    assert rel < TOL and max_abs < TOL * theirs.abs().max().item()


def test_policy_loss_and_predicted_chunks(models, batch, monkeypatch):
    """``PI05Policy.forward`` / ``predict_action_chunk`` (images in [0, 1], the robot's 6 action dims) against what
    PolicyTask computes with our model: flow_matching's noisy chunk and masked loss, and Euler sampling."""
    policy, ours, _ = models
    dim = SIZES.action_dim
    actions = batch["actions"].clone()
    actions[..., dim:] = 0.0                                   # what PI05Policy.prepare_action pads with
    monkeypatch.setattr(policy.model, "sample_noise", lambda shape, device: batch["noise"])
    monkeypatch.setattr(policy.model, "sample_time", lambda size, device: batch["time"])
    lerobot_batch = {key: batch["images"][:, c] for c, key in enumerate(CAMERAS)}
    lerobot_batch.update({"observation.language.tokens": batch["tokens"],
                          "observation.language.attention_mask": batch["tokens"] != 0, "action": actions[..., :dim]})
    inputs = {"images": batch["images"], "tokens": batch["tokens"]}
    with torch.no_grad():
        theirs, _ = policy.forward(lerobot_batch)
        x_t, target = flow_matching.noisy_actions(actions, batch["noise"], batch["time"])
        is_pad = torch.zeros(actions.shape[:2], dtype=torch.bool)
        mine = flow_matching.masked_loss(ours(inputs, x_t, batch["time"]), target, is_pad, dim)
    print(f"\nPI05Policy loss: ours {mine.item():.8f} lerobot {theirs.item():.8f}, "
          f"rel {abs(mine.item() - theirs.item()) / theirs.item():.3e}")
    assert abs(mine.item() - theirs.item()) < TOL * theirs.item()
    chunk_theirs = policy.predict_action_chunk(lerobot_batch, noise=batch["noise"].clone())
    chunk_mine = ours.sample_actions(inputs, batch["noise"].clone(), policy.config.num_inference_steps)[..., :dim]
    max_abs, rel = errors(chunk_mine, chunk_theirs)
    print(f"PI05Policy chunks ({policy.config.num_inference_steps} steps, {dim} dims): max abs {max_abs:.3e}, "
          f"rel L2 {rel:.3e}")
    assert chunk_theirs.shape == (BATCH, SIZES.chunk_size, dim)
    assert rel < TOL and max_abs < TOL * chunk_theirs.abs().max().item()
