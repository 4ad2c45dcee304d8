"""``loongforge generate`` on a Hugging Face directory writes transformers' greedy tokens, 32 of them.

For tiny Llama, Qwen2, Qwen3, Mixtral and Qwen3-MoE models (random weights with a large spread, built from
configs, no downloads) at vocabularies 130, 777 and 1000 -- none a multiple of 128, so megatron's padded
vocabulary rows exist and must never be chosen -- the directory is saved with ``save_pretrained`` and a word-level
``tokenizer.json`` of exactly that many words, as a user's would be, and the command runs as a user runs it: two
prompts of different lengths in one batch (left padding, the KV cache), ``--ignore-eos`` so that all 32 steps are
compared. Each prompt's ids must equal ``transformers``' ``generate(do_sample=False)`` on that prompt alone.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import HF_TINY_CASES, make_hf_model, tiny_settings, word_tokenizer
from loongforge.cli import main

pytestmark = pytest.mark.slow  # 15 cases of ~3 s each

FAMILIES = ("llama3-rope-untied", "qwen2-bias-tied", "qwen3-qknorm-untied", "mixtral-top2", "qwen3-moe-top4")
VOCABS = (130, 777, 1000)
STEPS = 32


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("case", FAMILIES)
def test_greedy_tokens_equal_transformers(case, vocab, tmp_path, capsys):
    config_cls, model_cls, _ = HF_TINY_CASES[case]
    hf = make_hf_model(config_cls, model_cls, {**tiny_settings(case), "vocab_size": vocab})
    hf.save_pretrained(tmp_path)
    words = word_tokenizer(tmp_path, vocab)
    draw = torch.Generator().manual_seed(vocab)
    prompts = [torch.randint(2, vocab, (length,), generator=draw).tolist() for length in (9, 4)]

    argv = ["generate", str(tmp_path), "--max-new-tokens", str(STEPS), "--ignore-eos", "--jsonl"]
    for ids in prompts:
        argv += ["--prompt", " ".join(words[i] for i in ids)]
    assert main(argv) == 0
    ours = [json.loads(line)["tokens"] for line in capsys.readouterr().out.splitlines()]

    hf.generation_config.eos_token_id = None  # all 32 steps, as --ignore-eos
    with torch.no_grad():
        theirs = [hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=STEPS, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
                  for ids in prompts]
    assert [len(t) for t in theirs] == [STEPS, STEPS]
    assert all(len(set(t)) >= 4 for t in theirs)  # the models write varied text, not one repeated token
    assert ours == theirs


def test_generation_config_stop_ids_end_the_continuation_where_transformers_stops(tmp_path, capsys):
    """A chat model lists its end-of-turn token in ``generation_config.json``'s ``eos_token_id``: generation must stop
    there (not only at the tokenizer's end-of-text), exactly where transformers' ``generate`` stops."""
    config_cls, model_cls, _ = HF_TINY_CASES["qwen3-qknorm-untied"]
    hf = make_hf_model(config_cls, model_cls, {**tiny_settings("qwen3-qknorm-untied"), "vocab_size": 777})
    hf.save_pretrained(tmp_path)
    words = word_tokenizer(tmp_path, 777)
    prompt = " ".join(words[i] for i in (5, 17, 300, 42))
    argv = ["generate", str(tmp_path), "--max-new-tokens", str(STEPS), "--jsonl", "--prompt", prompt]
    assert main([*argv, "--ignore-eos"]) == 0
    free = json.loads(capsys.readouterr().out)["tokens"]
    stop = next(t for k, t in enumerate(free) if k >= 3 and t not in free[:k] and t != 0)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, stop]}))
    assert main(argv) == 0
    stopped = json.loads(capsys.readouterr().out)["tokens"]
    assert stopped == free[: free.index(stop)]
    ids = [5, 17, 300, 42]
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, 4, dtype=torch.long),
                             max_new_tokens=STEPS, do_sample=False, pad_token_id=0, eos_token_id=[0, stop])
    assert theirs[0, 4:].tolist() == [*stopped, stop]  # transformers keeps the stop token; we leave it out
