"""Pi0.5's knowledge insulation (``task.knowledge_insulation``): the flow loss trains the action expert and never
the backbone, the FAST loss trains the backbone, the expert never reads the FAST tokens (so training sees what acting
sees), and ``loongforge train`` with it lowers both losses and resumes bit-exactly from its checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from loongforge.config.loader import load_config
from loongforge.errors import ConfigError
from loongforge.train.run import run_training
from loongforge.train.task_checkpoint import load_task_model
from loongforge_embodied.policies import flow_matching as fm
from loongforge_embodied.policies.flavors import FLAVORS
from loongforge_embodied.policies.pi0_fast import action_token_loss
from loongforge_embodied.token_task import action_targets
from test_policy_train import ROOT

#: A tiny Pi0.5 with 128 FAST ids on a few synthetic reach episodes (1 camera, 2 state and 2 action dimensions).
TINY = ["logging.progress=false", "logging.tensorboard=false", "training.threads=1", "logging.interval=1",
        "model.overrides={text_len: 24, depth: 2, vision_depth: 1, action_vocab: 128}",
        "task.synthetic={episodes: 6, length: 8}", "task.held_out_episodes=2", "task.action_horizon=4",
        "task.eval={frames: 0}", "checkpoint.save_at_end=false"]
INSULATED = "task.knowledge_insulation={action_tokenizer: {kind: fast, options: {vocab_size: 128, scale: 10.0}}}"
#: What the flow loss may train under insulation: the action expert's stream and its heads.
EXPERT = (".expert.", "action_in.", "time_in.", "time_out.", "final_norm.", "action_out.")


def make_task(tmp_path, *overrides):
    config = load_config(ROOT / "configs/embodied-tiny.yaml", [*TINY, f"run.output_dir={tmp_path}", *overrides])
    return FLAVORS["pi05-tiny"].make_task(config)


@pytest.fixture(scope="module")
def insulated(tmp_path_factory):
    """The task, a seeded model and a batch of eight training frames."""
    task = make_task(tmp_path_factory.mktemp("ki"), INSULATED)
    items = task.build_dataset()
    torch.manual_seed(0)
    model = perturbed(task.build_model())
    batch = {key: torch.stack([items[i][key] for i in range(8)]) for key in items[0]}
    batch["index"] = torch.arange(8)
    return task, model, batch


def perturbed(model):
    """``model`` with random adaRMS modulations: they start at zero (expert layers as identities, their residual
    gates closed), where the expert's MLPs and its reading of the prefix get no gradient at all."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "modulation" in name:
                parameter.normal_(0.0, 0.05)
    return model


def gradients(model, loss, *, retain=False):
    model.zero_grad(set_to_none=True)
    loss.backward(retain_graph=retain)
    return {name: (0.0 if p.grad is None else float(p.grad.abs().max())) for name, p in model.named_parameters()}


def loss_parts(task, model, batch, action_ids=None):
    """(flow loss, FAST loss) of one forward, with the draws of sample index 0..B-1 at step 1."""
    generators = [torch.Generator().manual_seed(1000 + i) for i in range(len(batch["index"]))]
    inputs, x_t, t, target = task.flow_batch(batch, generators)
    sequence = batch["action_ids"] if action_ids is None else action_ids
    velocity, logits = model(inputs, x_t, t, sequence[:, :-1])
    flow = fm.masked_loss(velocity, target, batch["action_is_pad"], task.action_dim)
    return flow, action_token_loss(logits, action_targets(sequence, logits.shape[1])), logits


def test_flow_loss_trains_the_expert_only_and_fast_loss_the_backbone(insulated, tmp_path):
    """Insulated: the flow loss leaves every backbone parameter without gradient and reaches every expert one; the
    FAST loss reaches every backbone parameter and no expert one. The task's loss is flow + fast_weight * fast.
    Without insulation (plain pi05) the flow loss reaches the backbone."""
    task, model, batch = insulated
    flow, fast, _ = loss_parts(task, model, batch)
    flow_grads = gradients(model, flow, retain=True)
    expert = {name for name in flow_grads if any(part in name for part in EXPERT)}
    backbone = set(flow_grads) - expert
    assert {"token_embed.weight", "token_head.weight", "patch_embed.weight"} <= backbone
    assert len(expert) > 10 and len(backbone) > 10
    assert [name for name in backbone if flow_grads[name] != 0] == []
    assert [name for name in expert if flow_grads[name] == 0] == []
    fast_grads = gradients(model, fast)
    assert [name for name in backbone if fast_grads[name] == 0] == []
    assert [name for name in expert if fast_grads[name] != 0] == []

    generators = [torch.Generator().manual_seed(1000 + i) for i in range(len(batch["index"]))]
    total = task.validation_loss(model, batch, generators)
    assert torch.allclose(total, flow + fast) and set(task.step_metrics()) == {"flow_loss", "fast_loss"}

    plain = make_task(tmp_path, "model.overrides={text_len: 24, depth: 2, vision_depth: 1}")
    assert type(plain).__name__ == "PolicyTask"
    plain.build_dataset()
    plain_model = perturbed(plain.build_model())
    plain_batch = {key: value for key, value in batch.items() if key != "action_ids"}
    plain_grads = gradients(plain_model, plain.validation_loss(plain_model, plain_batch, generators))
    reached = {name for name, grad in plain_grads.items() if grad > 0}
    assert {"token_embed.weight", "patch_embed.weight", "layers.0.prefix.qkv.weight",
            "layers.1.prefix.qkv.weight"} <= reached


def test_expert_never_reads_the_fast_tokens(insulated):
    """Other FAST ids leave the flow loss bitwise equal (and change the FAST loss); the expert's velocity with the
    FAST tokens equals the one acting computes without them, which is the plain joint Pi0.5 path's; a FAST token's
    logits depend on the tokens before it only."""
    task, model, batch = insulated
    with torch.no_grad():
        flow, fast, logits = loss_parts(task, model, batch)
        ids = batch["action_ids"].clone()
        offset = task.targets.ids.offset
        draw = torch.Generator().manual_seed(0)
        ids[:, 1:-1] = torch.randint(offset, offset + 128, ids[:, 1:-1].shape, generator=draw)
        other_flow, other_fast, other_logits = loss_parts(task, model, batch, ids)
        assert torch.equal(flow, other_flow) and abs(float(other_fast - fast)) > 1e-3
        changed = (ids != batch["action_ids"])[:, :-1].float().argmax(dim=1)  # the first changed input per row
        for row, first in enumerate(changed.tolist()):
            assert torch.equal(logits[row, :first], other_logits[row, :first])
            assert not torch.equal(logits[row, first], other_logits[row, first])

        inputs, x_t, t, _ = task.flow_batch(batch, [torch.Generator().manual_seed(i) for i in range(8)])
        with_tokens, _ = model(inputs, x_t, t, batch["action_ids"][:, :-1])
        acting = model(inputs, x_t, t)
        prefix, valid = model.embed_prefix(inputs)
        cond = model.condition(t)
        joint = model.run(prefix, valid, model.action_in(x_t), [1] * x_t.shape[1], cond)
        joint = model.action_out(model.final_norm(joint, cond)[0])
        assert torch.allclose(with_tokens, acting, atol=1e-5) and torch.allclose(acting, joint, atol=1e-5)

    chunks = task.act(model, {key: inputs[key][:3] for key in ("tokens", "images")}, steps=3, seed=[1, 2, 3])
    assert chunks.shape == (3, 4, 2) and np.isfinite(chunks).all()


def test_train_lowers_both_losses_and_resumes(tmp_path):
    """``loongforge train`` with insulation records flow_loss and fast_loss every step (their weighted sum is the
    loss), both fall, the checkpoint keeps the FAST tokenizer, and a resumed run repeats the losses exactly."""
    run = tmp_path / "run"
    common = [*TINY, INSULATED, "task.knowledge_insulation.fast_weight=0.5", "optimizer.lr=3e-3",
              "scheduler.warmup_steps=1", "training.micro_batch_size=8", "training.steps=16"]
    run_training(load_config(ROOT / "configs/embodied-tiny.yaml", [*common, f"run.output_dir={run}",
                                                                   "checkpoint.interval=8", "checkpoint.keep_last=2"]))
    rows = {row["step"]: row for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    for row in rows.values():
        assert row["loss"] == pytest.approx(row["flow_loss"] + 0.5 * row["fast_loss"], rel=1e-5)
    for part in ("flow_loss", "fast_loss"):
        first, last = np.mean([rows[s][part] for s in (1, 2, 3)]), np.mean([rows[s][part] for s in (14, 15, 16)])
        assert last < 0.8 * first, (part, first, last)
    checkpoint = run / "checkpoints" / "step-0000008"
    task, _, _ = load_task_model(checkpoint)
    assert task.targets.tokenizer.kind == "fast" and task.targets.max_tokens > 0

    resumed_dir = tmp_path / "resumed"
    run_training(load_config(ROOT / "configs/embodied-tiny.yaml", [*common, f"run.output_dir={resumed_dir}",
                                                                   "checkpoint.interval=0",
                                                                   f"checkpoint.resume={checkpoint}"]))
    resumed = {row["step"]: row for row in map(json.loads, (resumed_dir / "metrics.jsonl").read_text().splitlines())}
    assert sorted(resumed) == list(range(9, 17))
    for step, row in resumed.items():
        assert (row["loss"], row["flow_loss"], row["fast_loss"]) == (
            rows[step]["loss"], rows[step]["flow_loss"], rows[step]["fast_loss"])


def test_insulation_needs_fast_ids(tmp_path):
    """Knowledge insulation on a Pi0.5 flavor without FAST ids is refused in one line naming the override."""
    with pytest.raises(ConfigError, match=r"task.knowledge_insulation needs .* model.overrides.action_vocab"):
        make_task(tmp_path, "model.overrides={text_len: 24}", INSULATED)
