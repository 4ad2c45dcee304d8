"""Preference data and settings: the pair format (strings and chat messages give the same tokens), masks over the
responses only, the micro-batch layout (a pair's two rows together), one-line ``FILE:LINE`` errors for bad lines,
what ``loongforge check`` refuses, and the shipped set is what its generator writes."""

from __future__ import annotations

import json

import numpy as np
import pytest
from loongforge.config import load_config
from loongforge.config.schema import DataConfig
from loongforge.data.errors import DataError
from loongforge.data.preference_dataset import (
    PAIR_INDEX,
    PreferenceDataset,
    shipped_preference,
    shipped_preference_path,
)
from loongforge.data.tokenizers import ByteTokenizer
from loongforge.errors import ConfigError
from loongforge.train.batches import split_dataset
from loongforge.train.preference.settings import check_dpo, dpo_settings
from loongforge.train.resume_settings import check_resume_settings, schedule_settings

BYTE = ByteTokenizer()
PAIR = {"prompt": "What is 2 + 3?", "chosen": "2 + 3 = 5.", "rejected": "2 + 3 = 6."}


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


def _text(ids):
    return BYTE.decode([int(i) for i in ids])


def test_strings_and_chat_messages_give_the_same_tokens(tmp_path):
    messages = {"prompt": [{"role": "user", "content": PAIR["prompt"]}],
                "chosen": [{"role": "assistant", "content": PAIR["chosen"]}],
                "rejected": [{"role": "assistant", "content": [{"type": "text", "text": PAIR["rejected"]}]}]}
    strings, listed = PreferenceDataset([_write(tmp_path / "p.jsonl", [PAIR, "", messages])], BYTE).pairs
    for a, b in ((strings.chosen, listed.chosen), (strings.rejected, listed.rejected)):
        assert np.array_equal(a.ids, b.ids) and np.array_equal(a.supervised, b.supervised)


def test_masks_cover_the_responses_only(tmp_path):
    """The byte template's rendering, counted here: only the reply, its newline and ``eos`` are targets; the prompt --
    a system prompt, an earlier exchange (its assistant turn is context) and the question -- is the same on both
    sides and never a target."""
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello."}, {"role": "user", "content": PAIR["prompt"]}]
    (pair,) = PreferenceDataset([_write(tmp_path / "p.jsonl", [{**PAIR, "prompt": prompt}])], BYTE).pairs
    shown = "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello.\n<|user|>\nWhat is 2 + 3?\n<|assistant|>\n"
    for side, reply in ((pair.chosen, PAIR["chosen"]), (pair.rejected, PAIR["rejected"])):
        assert _text(side.ids[~side.supervised]) == shown
        assert _text(side.ids[side.supervised][:-1]) == reply + "\n" and side.ids[-1] == BYTE.eos_id
        assert side.supervised[-1] and side.supervised.sum() == len(reply) + 2


def test_a_pair_stays_in_its_micro_batch_chosen_rows_first():
    dataset = shipped_preference([], BYTE)
    train, valid = dataset.split_samples(DataConfig(seq_length=192, valid_fraction=0.1))
    assert (len(dataset), len(train), len(valid)) == (640, 576, 64)  # every pair fits 192 tokens
    batch = train.batch(np.array([5, 2]))
    assert batch["tokens"].shape == (4, 192) and batch[PAIR_INDEX].tolist() == [5, 2]
    for row, (index, side) in enumerate([(5, "chosen"), (2, "chosen"), (5, "rejected"), (2, "rejected")]):
        sample = getattr(dataset.pairs[index], side)
        n = len(sample.ids) - 1
        assert batch["tokens"][row, :n].tolist() == sample.ids[:-1].tolist()
        assert batch["loss_mask"][row, :n].tolist() == sample.supervised[1:].tolist()
        assert not batch["loss_mask"][row, n:].any()
    assert np.array_equal(valid.chosen.samples[0].ids, dataset.pairs[576].chosen.ids)  # the last pairs held out


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "invalid JSON"),
        (json.dumps([1, 2]), "expected an object with prompt, chosen, rejected"),
        (json.dumps({"prompt": "q", "chosen": "a"}), "missing 'rejected'"),
        (json.dumps({**PAIR, "chosen": ""}), "chosen is an empty string"),
        (json.dumps({**PAIR, "rejected": 3}), "rejected: expected a string or a non-empty list of messages"),
        (json.dumps({**PAIR, "rejected": PAIR["chosen"]}), "chosen and rejected are the same response"),
        (json.dumps({**PAIR, "prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}),
         "prompt ends with an assistant message"),
        (json.dumps({**PAIR, "chosen": [{"role": "user", "content": "a"}]}),
         "chosen: a response must start with an assistant message, not user"),
        (json.dumps({**PAIR, "prompt": [{"role": "robot", "content": "q"}]}), "prompt: message 0 needs a role"),
        (json.dumps({**PAIR, "chosen": [{"role": "assistant", "content": "a", "weight": 0}]}),
         "chosen: the assistant replies render to no tokens"),
        (json.dumps({**PAIR, "tools": "none"}), "'tools' must be a list"),
    ],
)
def test_a_bad_line_is_one_line_naming_file_and_line(tmp_path, line, message):
    path = _write(tmp_path / "pairs.jsonl", [PAIR, line])
    with pytest.raises(DataError, match=rf"^{path}:2: {message}") as caught:
        PreferenceDataset([path], BYTE)
    assert "\n" not in str(caught.value)


def _config(*overrides):
    return load_config(None, ["model.name=llama-debug", "data.dataset=shipped-preference", "training.phase=dpo",
                              *overrides])


@pytest.mark.parametrize(("phase", "dataset", "message"), [
    ("sft", "shipped-preference", "is preference-pair data but training.phase is 'sft'"),
    ("dpo", "shipped-chat", "is chat data but training.phase is 'dpo'"),
    ("dpo", "shipped-corpus", "is plain-text data but training.phase is 'dpo'"),
])
def test_the_phase_must_match_the_data(phase, dataset, message):
    from loongforge.plugins import get_host
    from loongforge.train.batches import open_dataset

    config = _config(f"training.phase={phase}", f"data.dataset={dataset}")
    with pytest.raises(ConfigError, match=message):
        split_dataset(open_dataset(get_host(), config, BYTE), config)


@pytest.mark.parametrize(("overrides", "message"), [
    (["dpo.loss_type=simpo", "dpo.reference=frozen_copy"], "dpo.reference: simpo has no reference model"),
    (["dpo.reference=adapters_off"], "dpo.reference: adapters_off needs model.lora"),
    (["dpo.loss_type=hinge", "dpo.label_smoothing=0.1"], "dpo.label_smoothing: applies to loss_type sigmoid and"),
    (["dpo.beta=0"], r"dpo.beta: must be a finite number > 0, got 0"),
    (["dpo.label_smoothing=0.5"], r"dpo.label_smoothing: must be in \[0, 0.5\)"),
    (["dpo.reference=none", "dpo.precompute_reference=true"], "there is no reference to precompute"),
    (["parallel.cp=2"], "parallel.cp: dpo scores whole responses per row"),
    (["data.pack=true"], "data.pack: dpo keeps one response per row"),
    (["training.loss_normalization=global_tokens"], "dpo averages its loss over pairs"),
    (["training.phase=sft", "data.dataset=shipped-chat", "dpo.beta=0.2"], "the dpo section applies to training.phase"),
])
def test_check_refuses_dpo_settings_that_cannot_work(overrides, message):
    with pytest.raises(ConfigError, match=rf"^command line \(.*\): .*{message}") as caught:
        check_dpo(_config(*overrides), "megatron")
    assert "\n" not in str(caught.value)


def test_dpo_settings_resolve_and_a_resume_must_keep_them():
    lora = _config("model.lora.rank=4")
    assert check_dpo(lora, "megatron") == ["dpo: loss sigmoid, beta 0.1, reference adapters_off, response log-prob sum"]
    simpo = _config("dpo.loss_type=simpo", "dpo.beta=2")
    assert dpo_settings(simpo)["dpo.reference"] == "none" and dpo_settings(simpo)["dpo.length_normalization"]
    assert dpo_settings(_config())["dpo.reference"] == "frozen_copy"
    saved = schedule_settings(_config(), 8)
    assert not check_resume_settings(saved, _config(), 8, "ckpt")
    with pytest.raises(ConfigError, match=r"dpo.beta 0.1 -> 0.2.*dpo.reference frozen_copy -> none"):
        check_resume_settings(saved, _config("dpo.beta=0.2", "dpo.reference=none"), 8, "ckpt")


def test_loongforge_check_names_the_bad_line(tmp_path, capsys):
    from loongforge.cli import main

    data = _write(tmp_path / "pairs.jsonl", [PAIR, PAIR, {**PAIR, "chosen": [{"role": "tool", "content": "x"}]}])
    config = tmp_path / "run.yaml"
    config.write_text(f"model: llama-debug\ndata: {{dataset: preference, paths: [{data}], seq_length: 64}}\n"
                      f"training: {{phase: dpo}}\nrun: {{output_dir: {tmp_path / 'out'}}}\n")
    assert main(["check", str(config)]) == 2
    error = capsys.readouterr().err.strip()
    assert error == f"error: {config}: {data}:3: chosen: a response must start with an assistant message, not tool"


def test_shipped_pairs_are_what_the_generator_writes(tmp_path):
    from loongforge.cli import main

    out = tmp_path / "pairs.jsonl"
    assert main(["make-data", "preference-pairs", str(out)]) == 0
    assert out.read_bytes() == shipped_preference_path().read_bytes()
    assert main(["make-data", "preference-pairs", str(out), "--count", "8", "--seed", "1"]) == 0
    assert len(out.read_text().splitlines()) == 8
