"""Mixtral with ``num_experts_per_tok: 1``: the one chosen probability renormalised to 1, a weight megatron-core
cannot compute from a softmax over one logit (it refuses the config). Inference is well defined -- transformers runs
it -- so ``convert``, ``generate`` and loading work; only training is refused, and only where the router would get
no gradient at all (no load-balancing loss)."""

from __future__ import annotations

import json

import torch
from conftest import checkpoint_logits, make_hf_model, tiny_settings, word_tokenizer
from loongforge import hookimpl
from loongforge.cli import main


class RouterWeights:
    """Every router's weight at the start and at the end of a run."""

    @hookimpl
    def loongforge_on_train_start(self, trainer):
        self.start = self._weights(trainer)

    @hookimpl
    def loongforge_on_train_end(self, trainer, metrics):
        self.end = self._weights(trainer)

    @staticmethod
    def _weights(trainer):
        return {n: p.detach().clone() for n, p in trainer.model[0].named_parameters() if n.endswith("router.weight")}


def test_converts_generates_and_trains_only_with_a_balancing_loss(tmp_path, capsys,
                                                                                     register_plugin):
    """Mixtral with ``num_experts_per_tok: 1`` (the one chosen probability renormalised to 1, a weight megatron
    cannot compute from a softmax over one logit): ``convert`` gives transformers' logits and greedy ``generate`` its
    tokens; ``check``/``train`` refuse it in one line only when the router would get no gradient at all (no
    load-balancing loss), and with one the router trains."""
    settings = {**tiny_settings("mixtral-top2"), "num_experts_per_tok": 1, "vocab_size": 300}
    hf = make_hf_model("MixtralConfig", "MixtralForCausalLM", settings)
    hf.save_pretrained(tmp_path / "hf")
    assert main(["convert", "hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "mcore")]) == 0
    tokens = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(tokens).logits
    assert (checkpoint_logits(tmp_path / "mcore", tokens)[..., :300] - expected).abs().max().item() <= 1e-4

    words = word_tokenizer(tmp_path / "hf", 300)
    prompt = [5, 17, 200, 42, 9]
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "hf"), "--max-new-tokens", "16", "--ignore-eos", "--jsonl",
                 "--prompt", " ".join(words[i] for i in prompt)]) == 0
    ours = json.loads(capsys.readouterr().out)["tokens"]
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 5, dtype=torch.long),
                             max_new_tokens=16, do_sample=False, pad_token_id=0)[0, 5:].tolist()
    assert ours == theirs and len(set(theirs)) >= 4

    top1 = ["model.name=mixtral-tiny", "model.overrides.moe_router_topk=1", f"run.output_dir={tmp_path / 'run'}"]
    for command in ("check", "train"):
        assert main([command, "configs/quickstart.yaml", *top1, "model.overrides.moe_aux_loss_coeff=0"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in err[0], err
        assert "moe_router_topk 1 with moe_norm_topk_prob" in err[0] and "router no gradient" in err[0]
    assert main(["check", "configs/quickstart.yaml", *top1, "model.overrides.moe_norm_topk_prob=false",
                 "model.overrides.moe_aux_loss_coeff=0"]) == 0
    routers = register_plugin(RouterWeights(), "router-weights")
    assert main(["train", "configs/quickstart.yaml", *top1, "training.steps=2", "logging.progress=false",
                 "logging.tensorboard=false", "checkpoint.save_at_end=false", "training.threads=1"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(row["moe_aux_loss"] > 0 for row in rows)
    assert routers.start and all(not routers.end[n].equal(w) for n, w in routers.start.items())  # it learns
