"""The Pi0-FAST-style token policy (``pi0-fast-*``): its loss is cross-entropy on the action tokens alone, a tiny model
that memorises one batch acts out chunks within the tokenizer's bound of the recorded ones (FAST and OpenVLA bins:
the decode path end to end), KV-cached greedy decoding equals recomputing the sequence, the fitted tokenizer is kept
with the checkpoint and is the one the evaluator's policy decodes with, and its config errors are one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from loongforge.cli import main
from loongforge.config.loader import load_config
from loongforge.train.run import run_training
from loongforge_embodied.action_tokens.registry import load_action_tokenizer, tokenizer_files
from loongforge_embodied.policies.fast_flavors import FLAVORS
from loongforge_embodied.policies.pi0_fast import IGNORE, action_token_loss
from loongforge_embodied.token_task import TOKENIZER_DIR, action_targets
from test_policy_train import ROOT

#: A tiny token policy on a few synthetic reach episodes (1 camera, 2 state and 2 action dimensions).
TINY = ["logging.progress=false", "logging.tensorboard=false", "training.threads=1", "logging.interval=1",
        "model.name=pi0-fast-tiny", "model.overrides={text_len: 24, depth: 1, vision_depth: 0, width: 32, heads: 2}",
        "task.synthetic={episodes: 6, length: 8}", "task.held_out_episodes=2", "task.action_horizon=4",
        "task.eval={frames: 0}", "checkpoint.save_at_end=false"]
BINS = "task.action_tokenizer={kind: uniform-bins, options: {bins: 256}}"


def make_task(tmp_path, *overrides):
    config = load_config(ROOT / "configs/embodied-tiny.yaml", [*TINY, f"run.output_dir={tmp_path}", *overrides])
    return FLAVORS["pi0-fast-tiny"].make_task(config)


def stack(items, indices):
    return {key: torch.stack([items[i][key] for i in indices]) for key in items[0]}


def model_inputs(batch):
    return {key: batch[key] for key in ("tokens", "state", "images")}


def test_loss_is_cross_entropy_on_action_tokens_only(tmp_path):
    """The loss equals a by-hand log-softmax over the action positions; changing the prefix's logits changes
    nothing (and gets no gradient), changing one action position's logits changes it."""
    task = make_task(tmp_path)
    items = task.build_dataset()
    torch.manual_seed(0)
    model = task.build_model()
    batch = stack(items, range(6))
    sequence = batch["action_ids"]
    logits = model(model_inputs(batch), sequence[:, :-1]).detach().requires_grad_(True)
    targets = action_targets(sequence, logits.shape[1])
    loss = action_token_loss(logits, targets)
    prefix = logits.shape[1] - (sequence.shape[1] - 1)
    terms = [-torch.log_softmax(logits[b, prefix + j], -1)[sequence[b, j + 1]]
             for b in range(len(sequence)) for j in range(sequence.shape[1] - 1) if sequence[b, j + 1] != 0]
    assert len(terms) == int((sequence[:, 1:] != 0).sum()) and (targets[:, :prefix] == IGNORE).all()
    assert torch.allclose(loss, torch.stack(terms).mean(), rtol=1e-6)
    loss.backward()
    assert logits.grad[:, :prefix].abs().max() == 0 and logits.grad[:, prefix:].abs().max() > 0
    with torch.no_grad():
        noisy = logits.clone()
        noisy[:, :prefix] += 5 * torch.randn_like(noisy[:, :prefix])
        assert action_token_loss(noisy, targets) == loss
        noisy[:, prefix] += 5 * torch.randn_like(noisy[:, prefix])
        assert abs(action_token_loss(noisy, targets) - loss) > 1e-3
    assert torch.allclose(task.validation_loss(model, batch, []), loss)


@pytest.fixture
def one_thread():
    """Tiny models train several times faster on one thread of a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("tokenizer", [[], [BINS]], ids=["fast", "uniform-bins"])
def test_memorised_batch_acts_within_the_tokenizer_bound(tmp_path, one_thread, tokenizer):
    """Trained on one batch until its greedy ids are the targets, the policy's chunks (``task.act``: cached greedy
    decoding, then the tokenizer) are within the tokenizer's error bound of the recorded chunks."""
    task = make_task(tmp_path, *tokenizer)
    items = task.build_dataset()
    torch.manual_seed(0)
    model = task.build_model()
    picked = list(range(0, len(items), len(items) // 8))
    batch = stack(items, picked)
    wanted = [model.ids.tokenizer_ids(row) for row in batch["action_ids"].tolist()]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(1, 601):
        optimizer.zero_grad()
        task.validation_loss(model, batch, []).backward()
        optimizer.step()
        if step % 20 == 0 and model.generate(model_inputs(batch), task.max_tokens) == wanted:
            break
    assert model.generate(model_inputs(batch), task.max_tokens) == wanted
    truth = task.train.raw_actions[picked].double().numpy()
    acted = task.act(model, model_inputs(batch))
    tokenizer = task.tokenizer
    bound = np.broadcast_to(tokenizer.error_bound(truth.shape[1]), truth.shape[1:])
    assert acted.shape == truth.shape
    for chunk, recorded in zip(acted, truth, strict=True):
        inside = tokenizer.in_range(recorded)
        assert inside.mean() > 0.5
        assert (np.abs(chunk - recorded)[inside] <= bound[inside] + 1e-9).all()


def test_kv_cache_decoding_equals_recomputing(tmp_path):
    """Greedy decoding that extends cached keys and values chooses the same ids from the same logits as rerunning
    the whole sequence for every token (texts of different lengths, so positions and padding differ per row)."""
    flavor = FLAVORS["pi0-fast-tiny"].with_overrides(depth=2, width=32, heads=2)
    torch.manual_seed(0)
    model = flavor.build_policy().eval()
    with torch.no_grad():
        model.token_embed.weight.mul_(0.05)  # the observation, not the last id alone, decides the next id
    inputs = {"tokens": torch.randint(1, 257, (4, flavor.text_len)), "state": torch.randn(4, flavor.max_state_dim),
              "images": torch.rand(4, flavor.cameras, 3, flavor.image_size, flavor.image_size)}
    inputs["tokens"][0, 5:] = 0
    inputs["tokens"][2, 17:] = 0
    cached, cached_logits = model.greedy(inputs, 12)
    full, full_logits = model.greedy(inputs, 12, cache=False)
    assert torch.equal(cached, full) and cached.shape == (4, 12) and len(set(map(tuple, cached.tolist()))) > 1
    finite = torch.isfinite(full_logits)
    assert torch.equal(finite, torch.isfinite(cached_logits))
    assert torch.allclose(cached_logits[finite], full_logits[finite], atol=1e-5, rtol=1e-5)
    assert finite.sum(-1).eq(flavor.action_vocab + 1).all()  # only the action ids and EOS may be chosen


def test_tokenizer_is_kept_with_the_checkpoint_and_used_by_eval(tmp_path):
    """``loongforge train`` writes the fitted tokenizer to the run directory and into the checkpoint's task state;
    the evaluator's ``CheckpointPolicy`` restores it (after the run's copy is gone) and acts with it."""
    from loongforge_embodied.sim.policy import CheckpointPolicy

    run = tmp_path / "run"
    config = load_config(ROOT / "configs/embodied-tiny.yaml", [*TINY, f"run.output_dir={run}", "training.steps=3",
                                                               "checkpoint.save_at_end=true", BINS])
    run_training(config)
    fitted = load_action_tokenizer(run / TOKENIZER_DIR)
    assert fitted.kind == "uniform-bins" and fitted.vocab_size == 256
    files = tokenizer_files(fitted)
    for path in (run / TOKENIZER_DIR).iterdir():
        path.unlink()
    policy = CheckpointPolicy(run / "checkpoints")
    assert tokenizer_files(policy.task.tokenizer) == files
    assert policy.task.max_tokens == 4 * 2
    states = np.array([[0.1, -0.2], [0.3, 0.4]])
    images = [{"observation.images.top": np.zeros((16, 16, 3), np.uint8)}] * 2
    acted = policy.act_batch("reach the red square", states, images, [0, 1])
    observed = [policy.task.observation_inputs("reach the red square", state, views)
                for state, views in zip(states, images, strict=True)]
    batch = stack(observed, range(2))
    ids = policy.model.generate(batch, policy.task.max_tokens)
    expected = np.stack([fitted.decode(row, 4) for row in ids])
    assert acted.shape == (2, 4, 2) and np.array_equal(acted, expected)


@pytest.mark.parametrize(("command", "overrides", "expected"), [
    ("check", ["task.action_tokenizer.kind=fats"], "Did you mean 'fast'?"),
    ("check", ["task.action_tokenizer.options={scael: 2}"], "has no option(s) ['scael']"),
    ("check", ["task.action_tokenizer.options={scale: -1}"], "scale must be a positive number"),
    ("check", ["task.action_tokenizer.path=/nonexistent/tokenizer"], "/nonexistent/tokenizer"),
    ("train", [BINS, "model.overrides.action_vocab=100"], "the tokenizer has 256 ids, the flavor holds 100"),
])
def test_config_errors_are_one_line(tmp_path, capsys, command, overrides, expected):
    code = main([command, str(ROOT / "configs/embodied-tiny.yaml"), *TINY, f"run.output_dir={tmp_path}", *overrides])
    err = capsys.readouterr().err.strip()
    assert code != 0 and expected in err and len(err.splitlines()) == 1, err


def test_flow_policies_take_no_action_tokenizer(tmp_path, capsys):
    code = main(["check", str(ROOT / "configs/embodied-tiny.yaml"), f"run.output_dir={tmp_path}",
                 "task.action_tokenizer.kind=fast"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "task.action_tokenizer" in err and len(err.splitlines()) == 1, err
