"""GRPO end to end on a tiny model: the sampler's log-prob of every token equals the trainer's recomputation bit for
bit (dense, and MoE with routing replay; the KV-cache sampler's difference is reported), the held-out reward rises, a
resumed run continues bit for bit, sampled replies reach ``rollouts.jsonl`` with the rewards they earned, and a KL
term to the starting model holds the policy near it."""

from __future__ import annotations

import json
import math

import pytest
from grpo_runs import grpo_overrides, rows, write_vowel_prompts
from loongforge import hookimpl, load_config
from loongforge.train.rl.rewards import regex

#: Every number a step logs that must continue exactly after a resume (the times are not).
COMPARED = ("loss", "grad_norm", "rl/reward_mean", "rl/reward_std", "rl/reply_length", "rl/kl", "rl/clip_fraction",
            "rl/ratio_mean", "rl/ratio_max", "rl/logprob_diff_max")
#: qwen3-moe-tiny at two layers (four narrow experts per token of eight): the MoE case.
MOE = ("model.name=qwen3-moe-tiny", "model.overrides.num_layers=2", "model.overrides.hidden_size=64",
       "model.overrides.head_dim=16", "model.overrides.moe_ffn_hidden_size=32", "model.overrides.ffn_hidden_size=64")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return write_vowel_prompts(tmp_path_factory.mktemp("grpo") / "vowels.jsonl")


def _train(out, prompts, *extra):
    from loongforge.train.run import run_training

    return run_training(load_config(None, grpo_overrides(out, prompts, *extra)))


@pytest.mark.parametrize("case", ["dense", "moe-routing-replay"])
def test_sampled_log_probs_are_the_trainers_bit_for_bit(tmp_path, prompts, case):
    extra = [] if case == "dense" else [*MOE, "grpo.routing_replay=true", "grpo.updates_per_step=2"]
    _train(tmp_path, prompts, *extra)
    steps = rows(tmp_path)
    assert sorted(steps) == [1, 2, 3, 4]
    assert all(row["rl/logprob_diff_max"] == 0.0 for row in steps.values())  # the trainer's == the sampler's
    assert sum(0 < row["rl/reward_mean"] < 1 and row["grad_norm"] > 0 for row in steps.values()) >= 3  # it learns
    if case == "dense":  # one update per step: the training forward is the sampler's too, ratio exactly 1
        assert all(row["rl/ratio_max"] == 1.0 and row["rl/clip_fraction"] == 0.0 for row in steps.values())
    else:  # the second update of a step is off the sampling policy: the ratio moves, the clip bites
        assert any(row["rl/ratio_max"] != 1.0 for row in steps.values())


def test_the_kv_cache_sampler_reports_its_difference(tmp_path, prompts):
    _train(tmp_path, prompts, "grpo.rollout=kv_cache", "training.steps=2")
    for row in rows(tmp_path).values():
        assert 0.0 <= row["rl/logprob_diff_max"] < 1e-4  # measured 4.8e-7 (llama-debug, fp32)
        assert row["time/rollout_s"] > 0


def test_a_bf16_run_reports_the_difference(tmp_path, prompts):
    _train(tmp_path, prompts, "training.precision=bf16", "training.steps=1")
    (row,) = rows(tmp_path).values()
    assert math.isfinite(row["rl/logprob_diff_max"])  # reported, not asserted (docs/post-training.md)


class HeldOutAtStart:
    """The held-out numbers of the starting weights (what evaluation reports later)."""

    @hookimpl
    def loongforge_on_train_start(self, trainer):
        self.before = trainer.engine.evaluate()


def test_grpo_raises_the_held_out_reward(tmp_path, prompts, register_plugin):
    start = register_plugin(HeldOutAtStart(), "held-out-at-start")
    summary = _train(tmp_path, prompts, "training.steps=12", "evaluation.interval=12", "evaluation.steps=2",
                     "logging.interval=4")
    steps = rows(tmp_path)
    before, after = start.before["reward"], summary["val_reward"]
    assert before <= 0.5 and after >= 0.875, (before, after)  # greedy replies to the 8 held-out prompts
    assert summary["val_loss"] == -after
    early = sum(steps[s]["rl/reward_mean"] for s in (1, 2, 3)) / 3
    late = sum(steps[s]["rl/reward_mean"] for s in (10, 11, 12)) / 3
    assert late > early + 0.3, (early, late)  # the sampled replies earn more as it trains
    sampled = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert [s["step"] for s in sampled] == [4] * 4 + [8] * 4 + [12] * 4  # grpo.log_samples at each logging step
    for sample in sampled:  # each logged reward is what the reward gives the logged reply
        assert sample["reward"] == regex(completion=sample["reply"], answer=sample["answer"], prompt="")
        assert sample["prompt"].endswith("<|assistant|>\n")


def test_a_resumed_run_continues_bit_exactly(tmp_path, prompts):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ("grpo.kl_coeff=0.1", "training.steps=4", "scheduler.decay_steps=4")
    _train(straight, prompts, *common)
    _train(resumed, prompts, *common, "training.steps=2", "checkpoint.save_at_end=true")
    again = _train(resumed, prompts, *common, "checkpoint.resume=auto")
    assert again["steps_this_run"] == 2
    expected, got = rows(straight), rows(resumed)
    for step in (3, 4):
        assert {k: got[step][k] for k in COMPARED} == {k: expected[step][k] for k in COMPARED}, step
    assert expected[4]["rl/kl"] > 0  # the policy has left its reference: the KL term is live
    recorded = json.loads((resumed / "checkpoints" / "step-0000002" / "trainer.json").read_text())
    assert recorded["schedule_settings"]["grpo.reference"] == "frozen_copy"
