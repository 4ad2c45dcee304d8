"""The exact sampler's draft only makes it faster: replies and log-probs drafted by the KV cache and verified by the
trainer's forward are bit for bit those of one full forward per token, also when the draft is wrong on purpose,
for a dense and an MoE model, sampled and greedy."""

from __future__ import annotations

import pytest
import torch
from grpo_runs import grpo_overrides, write_vowel_prompts
from loongforge import hookimpl, load_config
from loongforge.checkpoint.saver import unwrap_model
from loongforge.train.rl.rollout import kv_cache_draft, reply_seed, reply_uniforms, sample_replies

MOE = ("model.name=qwen3-moe-tiny", "model.overrides.num_layers=2", "model.overrides.hidden_size=64",
       "model.overrides.head_dim=16", "model.overrides.moe_ffn_hidden_size=32", "model.overrides.ffn_hidden_size=64")


class SampleAtStart:
    """Samples the first prompts three ways with the starting policy: no draft, the KV-cache draft, a corrupted one."""

    def __init__(self, greedy: bool) -> None:
        self.greedy = greedy

    @hookimpl
    def loongforge_on_train_start(self, trainer):
        engine = trainer.engine
        prompts = [engine.data.dataset[i].ids for i in range(6) for _ in range(2)]
        max_new = engine.options.max_new_tokens
        uniforms = None if self.greedy else reply_uniforms([reply_seed(3, i, 0) for i in range(12)], max_new)
        tokenizer = engine._tokenizer
        shape = {"width": trainer.config.data.seq_length, "max_new_tokens": max_new, "vocab_size": tokenizer.vocab_size,
                 "stop_ids": (tokenizer.eos_id,), "pad_id": tokenizer.pad_id, "uniforms": uniforms}
        kv = kv_cache_draft(unwrap_model(engine.model[0]), shape["vocab_size"], shape["stop_ids"])

        def corrupted(prefixes, limits, draws):  # every third drafted token replaced by another id
            return [[(t + 1) % shape["vocab_size"] if i % 3 == 2 else t for i, t in enumerate(ids)]
                    for ids in kv(prefixes, limits, draws)]

        self.results, self.forwards = {}, {}
        for name, draft in (("none", None), ("kv", kv), ("corrupted", corrupted)):
            calls = []

            def forward(tokens, positions, calls=calls):
                calls.append(1)
                return engine._policy_forward(tokens, positions)

            with engine._forward_only():
                self.results[name] = sample_replies(forward, engine._token_loss, prompts, draft=draft, **shape)
            self.forwards[name] = len(calls)


@pytest.mark.parametrize("case", ["dense-sampled", "dense-greedy", "moe-sampled"])
def test_a_draft_changes_nothing_but_the_number_of_forwards(tmp_path, register_plugin, case):
    from loongforge.train.run import run_training

    prompts = write_vowel_prompts(tmp_path / "vowels.jsonl")
    sampler = register_plugin(SampleAtStart(greedy=case.endswith("greedy")), "sample-at-start")
    extra = MOE if case.startswith("moe") else ()
    run_training(load_config(None, grpo_overrides(tmp_path / "run", prompts, "training.steps=1",
                                                  *extra)))
    exact = sampler.results["none"]
    for name in ("kv", "corrupted"):
        other = sampler.results[name]
        assert torch.equal(other.tokens, exact.tokens) and torch.equal(other.loss_mask, exact.loss_mask), name
        assert torch.equal(other.logps, exact.logps), name  # bit for bit
        assert other.ids == exact.ids and other.ended == exact.ended
    lengths = [len(ids) + ended for ids, ended in zip(exact.ids, exact.ended, strict=True)]
    assert sampler.forwards["none"] == max(lengths) > 4  # one forward per token of the longest reply
    assert sampler.forwards["kv"] <= 3  # the draft agrees (nearly) everywhere: one verifying forward, rarely two
    assert sampler.forwards["kv"] < sampler.forwards["corrupted"] < sampler.forwards["none"]
    if not case.endswith("greedy"):
        assert len({tuple(ids) for ids in exact.ids}) > 6  # the draws differ per reply
