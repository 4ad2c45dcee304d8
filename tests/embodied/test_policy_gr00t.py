"""The GR00T-N1.6-style policy: GR00T's flow-matching convention (time 0 = noise, Beta(1.5, 1) mapped through
noise_s, 1000 timestep buckets, Euler from 0 to 1), the VL stream's independence from the action chunk, the DiT's
alternating cross-/self-attention (by perturbing single tokens), per-embodiment weights, parameter counts, the
flavor's frame inputs, determinism, a short overfit of the module on fixed chunks, and ``gr00t-tiny`` trained by
``loongforge train`` on the synthetic reach set."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from loongforge.errors import ConfigError
from loongforge.tasks import sample_generators
from loongforge_embodied.policies import flow_matching, gr00t_flow
from loongforge_embodied.policies.gr00t import CategoryLinear, Gr00tPolicy
from loongforge_embodied.policies.gr00t_flavors import FLAVORS, Gr00tFlavor
from loongforge_embodied.policies.reach import CAMERA, TASKS, reach_episode
from test_policy_pi05 import generators

TINY = Gr00tFlavor(image_size=8, patch_size=4, text_len=8, max_state_dim=4, max_action_dim=4, max_horizon=8,
                   embodiments=3, width=16, depth=1, heads=2, head_dim=8, vl_layers=1, dit_heads=2, dit_head_dim=8,
                   dit_depth=2, hidden=16, future_tokens=2, time_channels=8)
HORIZON = 5


def batch_inputs(flavor: Gr00tFlavor = TINY, batch: int = 2, seed: int = 0, embodiment: int = 0):
    """Batched model inputs from the flavor's own ``frame_inputs``, plus noisy actions and times."""
    g = torch.Generator().manual_seed(seed)
    frames = [flavor.frame_inputs(task, torch.randn(3, generator=g)) for task in ("pick", "place it")[:batch]]
    inputs = {key: torch.stack([f[key] for f in frames]) for key in frames[0]}
    inputs["embodiment"] = torch.full((batch,), embodiment)
    if flavor.cameras:
        inputs["images"] = torch.rand(batch, flavor.cameras, 3, flavor.image_size, flavor.image_size, generator=g)
    noisy = torch.randn(batch, HORIZON, flavor.max_action_dim, generator=g)
    return inputs, noisy, torch.rand(batch, generator=g)


def build(flavor: Gr00tFlavor = TINY, seed: int = 0) -> Gr00tPolicy:
    torch.manual_seed(seed)
    model = Gr00tPolicy(flavor)
    for p in model.parameters():  # zero-initialised biases and small embeddings pass little on; make paths visible
        torch.nn.init.normal_(p, std=0.3)
    return model.eval()


@pytest.fixture(scope="module")
def policy():
    return build()


# -- the flow-matching convention -----------------------------------------------------------------------------------
def test_time_is_grootlike_beta_and_generator_driven():
    t = gr00t_flow.sample_time(generators(4000))
    assert t.dtype == torch.float32 and float(t.max()) <= 1.0
    assert float(t.min()) >= (gr00t_flow.NOISE_S - 1.0) / gr00t_flow.NOISE_S  # s <= 1: t >= -0.001
    # s ~ Beta(1.5, 1) has mean 0.6; t = (0.999 - s) / 0.999, so noisy times (near 0) are the most frequent
    assert abs(float(t.mean()) - (1 - 0.6 / 0.999)) < 0.01
    assert float((t < 0.5).float().mean()) > 0.6
    assert torch.equal(gr00t_flow.sample_time(generators(3)), gr00t_flow.sample_time(generators(3)))


def test_noisy_actions_run_from_noise_to_data():
    actions, noise, t = torch.randn(3, HORIZON, 4), torch.randn(3, HORIZON, 4), torch.tensor([0.0, 0.25, 1.0])
    x_t, target = gr00t_flow.noisy_actions(actions, noise, t)
    assert torch.equal(x_t[0], noise[0]) and torch.equal(x_t[2], actions[2])
    assert torch.allclose(x_t[1], 0.75 * noise[1] + 0.25 * actions[1])
    assert torch.equal(target, actions - noise)


def test_timestep_buckets_and_euler_times():
    assert gr00t_flow.timestep_buckets(torch.tensor([0.0, 0.0015, 0.5, 0.9999, 1.0])).tolist() == [0, 1, 500, 999,
                                                                                                    1000]
    seen = []
    actions, noise = torch.randn(2, HORIZON, 4), torch.randn(2, HORIZON, 4)
    x = gr00t_flow.euler_sample(lambda x, t: seen.append(t) or actions - noise, noise, 10)
    # the straight path's velocity is constant, so Euler lands exactly on the actions
    assert torch.allclose(x, actions, atol=1e-6)
    assert [gr00t_flow.timestep_buckets(t)[0].item() for t in seen] == list(range(0, 1000, 100))


def test_noise_and_loss_are_the_shared_ones():
    assert gr00t_flow.masked_loss is flow_matching.masked_loss
    assert gr00t_flow.sample_noise is flow_matching.sample_noise
    assert TINY.flow_matching() is gr00t_flow


# -- the module -----------------------------------------------------------------------------------------------------
def test_frame_inputs_and_output_shape(policy):
    frame = TINY.frame_inputs("ab", torch.tensor([0.5, -1.0]))
    assert frame["tokens"].tolist() == [1 + ord("a"), 1 + ord("b")] + [0] * 6
    assert frame["state"].tolist() == [0.5, -1.0, 0.0, 0.0] and frame["embodiment"].item() == 0
    with pytest.raises(ValueError, match="at most 4"):
        TINY.frame_inputs("ab", torch.zeros(5))
    inputs, noisy, t = batch_inputs()
    assert policy(inputs, noisy, t).shape == (2, HORIZON, 4)
    state_only = TINY.with_overrides(cameras=0)
    inputs, noisy, t = batch_inputs(state_only)
    assert "images" not in inputs and build(state_only)(inputs, noisy, t).shape == (2, HORIZON, 4)
    empty = dict(inputs, tokens=torch.zeros_like(inputs["tokens"]))  # no camera, no text: nothing valid to attend
    assert build(state_only)(empty, noisy, t).isfinite().all()


@pytest.mark.parametrize("flavor", [*FLAVORS.values(), TINY, TINY.with_overrides(cameras=0, dit_depth=3)],
                         ids=[*FLAVORS, "test-tiny", "state-only-odd-depth"])
def test_parameter_count(flavor):
    assert flavor.num_params() == sum(p.numel() for p in Gr00tPolicy(flavor).parameters())


def _vl_features(model, inputs, noisy, t):
    seen = {}
    handle = model.vl_layers[-1].register_forward_hook(lambda m, i, o: seen.setdefault("out", o))
    velocity = model(inputs, noisy, t)
    handle.remove()
    return seen["out"], velocity


def test_vl_stream_never_sees_actions_time_state_or_embodiment(policy):
    inputs, noisy, t = batch_inputs()
    reference, _ = _vl_features(policy, inputs, noisy, t)
    other = dict(inputs, state=inputs["state"] + 3.0, embodiment=inputs["embodiment"] + 2)
    changed, _ = _vl_features(policy, other, noisy + 5.0 * torch.randn_like(noisy), 1.0 - t)
    assert torch.equal(reference, changed)


def test_vl_features_reach_the_actions(policy):
    inputs, noisy, t = batch_inputs()
    reference = policy(inputs, noisy, t)
    assert not torch.allclose(policy(dict(inputs, images=inputs["images"].flip(-1)), noisy, t), reference)
    tokens = inputs["tokens"].clone()
    tokens[:, 0] += 1
    assert not torch.allclose(policy(dict(inputs, tokens=tokens), noisy, t), reference)


def test_cross_attention_blocks_take_image_and_text_keys_in_turn():
    """With ``alternate_vl`` the 1st and 3rd cross-attention blocks attend to the image patches only, the 2nd to
    the text only (an empty text: to every VL token rather than to nothing); without, every block to all keys."""
    inputs, _, _ = batch_inputs()
    inputs["tokens"][1] = 0
    patches, text = TINY.patches, inputs["tokens"] != 0
    image_only = torch.cat([torch.ones(2, patches, dtype=torch.bool), torch.zeros_like(text)], dim=1)
    text_only = torch.cat([torch.zeros(patches, dtype=torch.bool), text[0]])
    _, keys = build(TINY.with_overrides(dit_depth=5)).encode(inputs)
    assert len(keys) == 3 and torch.equal(keys[0], image_only) and torch.equal(keys[2], image_only)
    assert torch.equal(keys[1][0], text_only) and keys[1][1].all()
    _, joint = build(TINY.with_overrides(dit_depth=3, alternate_vl=False)).encode(inputs)
    every = torch.cat([torch.ones(2, patches, dtype=torch.bool), text], dim=1)
    assert len(joint) == 2 and all(torch.equal(k, every) for k in joint)


def test_text_padding_is_masked(policy):
    """Padding ids are never attended (in the backbone, the VL layers or the DiT's cross-attention): changing the
    padding embedding changes nothing."""
    inputs, noisy, t = batch_inputs()
    reference = policy(inputs, noisy, t)
    model = build()
    with torch.no_grad():
        model.token_embed.weight[0] += 10.0
    assert torch.allclose(model(inputs, noisy, t), reference, atol=1e-6)


def test_dit_blocks_alternate_cross_and_self_attention():
    """Block 0 cross-attends to the VL features only: with one block, an action token's velocity depends on that
    token alone (not on the other actions, nor the state token). Block 1 self-attends: with two, it depends on all."""
    one, two = build(TINY.with_overrides(dit_depth=1)), build(TINY.with_overrides(dit_depth=2))
    assert [block.cross for block in two.dit] == [True, False]
    inputs, noisy, t = batch_inputs()
    moved = noisy.clone()
    moved[:, -1] += 3.0
    other_state = dict(inputs, state=inputs["state"] + 1.0)
    ref_one, ref_two = one(inputs, noisy, t), two(inputs, noisy, t)
    assert torch.allclose(one(inputs, moved, t)[:, :-1], ref_one[:, :-1], atol=1e-6)
    assert torch.allclose(one(other_state, noisy, t), ref_one, atol=1e-6)
    assert not torch.allclose(two(inputs, moved, t)[:, :-1], ref_two[:, :-1])
    assert not torch.allclose(two(other_state, noisy, t), ref_two)


def test_embodiments_have_their_own_weights(policy):
    inputs, noisy, t = batch_inputs(embodiment=1)
    assert not torch.allclose(policy(dict(inputs, embodiment=inputs["embodiment"] * 2), noisy, t),
                              policy(inputs, noisy, t))
    model = build()
    model(inputs, noisy, t).square().mean().backward()
    layers = [m for m in model.modules() if isinstance(m, CategoryLinear)]
    assert len(layers) == 7  # state encoder 2, action encoder 3, action decoder 2
    for layer in layers:
        for param in (layer.weight, layer.bias):
            assert param.grad[1].abs().sum() > 0, "embodiment 1 learns"
            assert torch.equal(param.grad[[0, 2]], torch.zeros_like(param.grad[[0, 2]])), "others untouched"


def test_flavor_checks_and_overrides():
    assert FLAVORS["gr00t-tiny"].with_overrides(dit_depth=6).dit_depth == 6
    with pytest.raises(ConfigError, match="unknown gr00t flavor field"):
        FLAVORS["gr00t-tiny"].with_overrides(layers=3)
    with pytest.raises(ConfigError, match="patch_size"):
        Gr00tFlavor(image_size=10, patch_size=4)
    with pytest.raises(ConfigError, match="time_channels"):
        Gr00tFlavor(time_channels=6, dit_head_dim=15)
    inputs, _, t = batch_inputs()
    with pytest.raises(ValueError, match="max_horizon"):
        build()(inputs, torch.zeros(2, TINY.max_horizon + 1, 4), t)


# -- training -------------------------------------------------------------------------------------------------------
def train(steps: int, seed: int = 0) -> list[float]:
    """The flow loss of the module on 4 fixed chunks (two embodiments, one with padded steps), each with its fixed
    noise and time: what the module must be able to fit (fresh draws need far more steps on this tiny a model)."""
    torch.manual_seed(seed)
    model = Gr00tPolicy(TINY)
    inputs, _, _ = batch_inputs(batch=2, seed=seed)
    inputs = {key: torch.cat([value, value]) for key, value in inputs.items()}
    inputs["embodiment"] = torch.tensor([0, 0, 1, 1])
    actions = torch.randn(4, HORIZON, TINY.max_action_dim, generator=torch.Generator().manual_seed(seed + 1))
    is_pad = torch.zeros(4, HORIZON, dtype=torch.bool)
    is_pad[1, -2:] = True
    draws = generators(4, seed=seed + 2)
    t = gr00t_flow.sample_time(draws)
    x_t, target = gr00t_flow.noisy_actions(actions, gr00t_flow.sample_noise(actions.shape[1:], draws), t)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = gr00t_flow.masked_loss(model(inputs, x_t, t), target, is_pad, action_dim=3)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_overfit_a_few_chunks():
    losses = train(50)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.2 * first, (first, last)


def test_determinism_with_fixed_seeds():
    assert train(3) == train(3)
    inputs, noisy, t = batch_inputs()
    assert torch.equal(build(seed=1)(inputs, noisy, t), build(seed=1)(inputs, noisy, t))


# -- a task that needs the camera -----------------------------------------------------------------------------------
#: 16 patches of a 16-pixel frame, the size at which joint image+text keys left the policy blind.
SEEING = Gr00tFlavor(image_size=16, patch_size=4, text_len=24, max_state_dim=2, max_action_dim=2, max_horizon=4,
                     embodiments=1, width=32, depth=1, heads=2, head_dim=16, vl_layers=1, dit_heads=2,
                     dit_head_dim=16, dit_depth=4, hidden=32, time_channels=16)
GAIN, CHUNK = 0.2, 4


def reach_frames(count: int, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``count`` independent "reach the red square" frames (:func:`reach_episode`'s first frames: a new square and
    start each) as model inputs, and their 4-step action chunks in pixels (the controller's ``a_k = a_0 (1-g)^k``).
    The square is in the image only, so without it the best guess is E[goal | state]."""
    rng = np.random.default_rng(seed)
    episodes = [reach_episode(0, rng, length=1, image_size=SEEING.image_size, gain=GAIN) for _ in range(count)]
    half = SEEING.image_size / 2
    frames = [SEEING.frame_inputs(TASKS[0], torch.tensor(e.features["observation.state"][0]) / half - 1)
              for e in episodes]
    inputs = {key: torch.stack([f[key] for f in frames]) for key in frames[0]}
    images = np.stack([e.cameras[CAMERA][0] for e in episodes])  # (B, S, S, 3) uint8
    inputs["images"] = torch.tensor(images).permute(0, 3, 1, 2)[:, None].float() / 255.0
    first = torch.tensor(np.stack([e.features["action"][0] for e in episodes]))
    return inputs, first[:, None] * (1 - GAIN) ** torch.arange(CHUNK)[:, None]


def train_to_reach(seed: int, steps: int = 300, batch: int = 32) -> dict[str, float]:
    """Train the module on 256 frames by GR00T's flow matching, then the held-out action MSE (pixels^2, 128 new
    frames, 4 Euler steps) with each frame's own image, with images shuffled across frames, and of the mean chunk."""
    inputs, chunks = reach_frames(256, seed=1000 + seed)
    scale = chunks.std()
    torch.manual_seed(seed)
    model = Gr00tPolicy(SEEING)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    order = torch.Generator().manual_seed(seed)
    for step in range(steps):
        index = torch.randint(0, len(chunks), (batch,), generator=order)
        draws = sample_generators(seed, step, index)
        t = gr00t_flow.sample_time(draws)
        x_t, target = gr00t_flow.noisy_actions(chunks[index] / scale, gr00t_flow.sample_noise((CHUNK, 2), draws), t)
        velocity = model({key: value[index] for key, value in inputs.items()}, x_t, t)
        loss = gr00t_flow.masked_loss(velocity, target, torch.zeros(batch, CHUNK, dtype=torch.bool), action_dim=2)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    model.eval()
    held, truth = reach_frames(128, seed=2000 + seed)
    noise = torch.randn(truth.shape, generator=torch.Generator().manual_seed(0))

    def mse(images: torch.Tensor) -> float:
        with torch.no_grad():
            guess = gr00t_flow.euler_sample(lambda x, t: model(dict(held, images=images), x, t), noise, 4) * scale
        return float(((guess - truth) ** 2).mean())

    return {"own": mse(held["images"]), "shuffled": mse(held["images"].roll(1, 0)),
            "mean": float(((chunks.mean(0) - truth) ** 2).mean())}


def test_the_policy_reads_its_camera_to_reach_the_square():
    """The square is seen only in the image: the trained policy must beat the mean-action baseline on held-out
    frames by far, and shuffling images across frames must hurt. Held-out own / shuffled / mean MSE of seeds 0-5:
    0.353 / 0.774 / 0.826, 0.092 / 0.740 / 0.859, 0.066 / 0.701 / 0.823, 0.055 / 0.881 / 0.799,
    0.135 / 0.708 / 0.867, 0.211 / 0.816 / 0.732 (own at most 0.43 of the mean, shuffled at least 2.2 times own);
    with N1.5's joint keys (``alternate_vl=False``) seed 0 scored 0.693 / 0.693 / 0.826: the image changed nothing."""
    scores = train_to_reach(seed=0)
    assert scores["own"] < 0.6 * scores["mean"], scores
    assert scores["shuffled"] > 1.5 * scores["own"], scores
