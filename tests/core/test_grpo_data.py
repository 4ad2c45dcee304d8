"""GRPO's inputs: the prompt format (strings and chat messages render as ``generate --chat`` feeds them), one-line
``FILE:LINE`` errors for bad lines, the built-in rewards on replies they must accept and reject, rewards a plugin
registers or a config names by import path, what ``loongforge check`` refuses, and the shipped tasks are what their
generator writes."""

from __future__ import annotations

import json
import math
import re

import pytest
from loongforge import hookimpl
from loongforge.config import load_config
from loongforge.config.schema import DataConfig
from loongforge.data.errors import DataError
from loongforge.data.prompt_dataset import PROMPT_INDEX, PromptDataset, shipped_tasks_path
from loongforge.data.tokenizers import ByteTokenizer
from loongforge.data.verifiable_tasks import DEFAULT_KINDS, tasks
from loongforge.errors import ConfigError, LoongForgeError
from loongforge.plugins import get_host
from loongforge.train.rl.rewards import exact_match, numeric, regex, resolve_rewards, score
from loongforge.train.rl.settings import check_grpo, grpo_settings

BYTE = ByteTokenizer()
TASK = {"prompt": "What is 2 + 3?", "answer": "5", "reward": "numeric"}


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


def test_prompts_render_up_to_the_reply_as_generate_feeds_them(tmp_path):
    from loongforge.interop.generate import chat_prompt_text

    system = {"role": "system", "content": "Be brief."}
    path = _write(tmp_path / "p.jsonl", [TASK, {**TASK, "prompt": [system, {"role": "user", "content": "Hi?"}]}])
    first, second = PromptDataset([path], BYTE).prompts
    assert first.text == chat_prompt_text(BYTE, "What is 2 + 3?") == "<|user|>\nWhat is 2 + 3?\n<|assistant|>\n"
    assert BYTE.decode(first.ids.tolist()) == first.text and (first.answer, first.reward) == ("5", "numeric")
    assert second.text == "<|system|>\nBe brief.\n<|user|>\nHi?\n<|assistant|>\n"
    assert second.where == f"{path}:2"
    train, valid = PromptDataset([path], BYTE).split_samples(DataConfig(seq_length=64, valid_fraction=0.5))
    assert (len(train), len(valid)) == (1, 1) and train.batch([0])[PROMPT_INDEX].tolist() == [0]


@pytest.mark.parametrize(("line", "message"), [
    ("[1, 2]", "expected an object with 'prompt' and 'answer'"),
    (json.dumps({**TASK, "answer": 5}), "'answer' must be a string"),
    (json.dumps({**TASK, "reward": ""}), "'reward' must be the name of a reward"),
    (json.dumps({**TASK, "hint": "x"}), "unknown key 'hint'"),
    (json.dumps({**TASK, "prompt": [{"role": "assistant", "content": "a"}]}), "prompt ends with an assistant message"),
    (json.dumps({**TASK, "prompt": ""}), "prompt is an empty string"),
    ("{not json", "invalid JSON"),
])
def test_a_bad_line_is_one_line_naming_file_and_line(tmp_path, line, message):
    path = _write(tmp_path / "p.jsonl", [TASK, line])
    with pytest.raises(DataError, match=rf"^{path}:2: .*{message}") as caught:
        PromptDataset([path], BYTE)
    assert "\n" not in str(caught.value)


def test_a_prompt_with_no_room_for_a_reply_is_named(tmp_path):
    path = _write(tmp_path / "p.jsonl", [TASK, {**TASK, "prompt": "x" * 80}])
    with pytest.raises(DataError, match=rf"^{path}:2: the prompt is 104 tokens, no room for a reply within "
                                        r"data.seq_length 64$"):
        PromptDataset([path], BYTE).split_samples(DataConfig(seq_length=64))


@pytest.mark.parametrize(("reward", "completion", "answer", "expected"), [
    (exact_match, " Paris \n", "Paris", 1.0),
    (exact_match, "Paris.", "Paris", 0.0),
    (regex, "It is GENTLEMAN.", r"\bGENTLEMAN\b", 1.0),
    (regex, "GENTLEMANLY", r"\bGENTLEMAN\b", 0.0),
    (numeric, "37 + 10 = 47.", "47", 1.0),
    (numeric, "47 or 48", "47", 0.0),  # the last number counts
    (numeric, "about 1,234.50 in total", "1234.5", 1.0),
    (numeric, "-3e2", "-300", 1.0),
    (numeric, "no number", "4", 0.0),
    (numeric, "4", "four", 0.0),
])
def test_builtin_rewards(reward, completion, answer, expected):
    assert reward(completion=completion, answer=answer, prompt="") == expected


def half_credit(*, completion: str, answer: str, prompt: str) -> float:
    """A reward named by import path in the tests' configs."""
    return 0.5 if answer in completion else 0.0


class LengthReward:
    """An outside plugin's reward: registered through ``loongforge_register_rewards``."""

    @hookimpl
    def loongforge_register_rewards(self, registry):
        registry.register("short", lambda *, completion, answer, prompt: -len(completion) / 10.0)


def _config(*overrides):
    return load_config(None, ["model.name=llama-debug", "data.dataset=shipped-tasks", "training.phase=grpo",
                              *overrides])


def test_rewards_come_from_the_prompts_the_config_plugins_and_import_paths(register_plugin, tmp_path):
    prompts = PromptDataset([_write(tmp_path / "p.jsonl", [TASK, {**TASK, "answer": "x", "reward": "regex"}])],
                            BYTE).prompts
    assert set(resolve_rewards(_config(), get_host(), prompts)) == {"numeric", "regex"}
    register_plugin(LengthReward(), "length-reward")
    (short,) = resolve_rewards(_config("grpo.reward=short"), get_host(), prompts).values()
    assert score(short, completion="abc", answer="", prompt="", name="short", where="x") == pytest.approx(-0.3)
    path = f"{__name__}:half_credit"
    (half,) = resolve_rewards(_config(f"grpo.reward={path}"), get_host(), prompts).values()
    assert half is half_credit


def test_reward_problems_are_one_line_naming_the_prompt(tmp_path):
    path = _write(tmp_path / "p.jsonl", [TASK, {**TASK, "answer": "(", "reward": "regex"}, {**TASK, "reward": None}])
    prompts = PromptDataset([path], BYTE).prompts
    with pytest.raises(ConfigError, match=rf"^{path}:2: answer '\(' is not a regular expression"):
        resolve_rewards(_config(), get_host(), prompts[:2])
    with pytest.raises(ConfigError, match=rf"^{path}:3: the prompt names no reward and grpo.reward is null"):
        resolve_rewards(_config(), get_host(), prompts)
    with pytest.raises(LoongForgeError, match=r"Unknown reward 'nope' \(grpo.reward in .*\)\. Known: exact-match, "
                                              "numeric, regex"):
        resolve_rewards(_config("grpo.reward=nope"), get_host(), prompts)
    for bad in (math.nan, "1", None):
        with pytest.raises(ConfigError, match=rf"^{path}:1: reward 'odd' returned {bad!r}; a reward returns a finite"):
            score(lambda bad=bad, **_: bad, completion="", answer="", prompt="", name="odd", where=f"{path}:1")
    with pytest.raises(ConfigError, match=rf"^{path}:1: reward 'boom' failed: ZeroDivisionError"):
        score(lambda **_: 1 / 0, completion="", answer="", prompt="", name="boom", where=f"{path}:1")


@pytest.mark.parametrize(("overrides", "message"), [
    (["grpo.group_size=1"], "grpo.group_size: must be an integer >= 2"),
    (["grpo.max_new_tokens=0"], r"grpo.max_new_tokens: must be an integer in \[1, data.seq_length"),
    (["grpo.clip_low=1.0"], r"grpo.clip_low: must be a finite number in \[0, 1\)"),
    (["grpo.kl_coeff=-0.1"], "grpo.kl_coeff: must be a finite number >= 0"),
    (["grpo.rollout_correction_cap=0.5"], "grpo.rollout_correction_cap: must be a finite number >= 1"),
    (["grpo.kl_coeff=0.1", "grpo.reference=adapters_off"], "grpo.reference: adapters_off needs model.lora"),
    (["parallel.pp=2"], "parallel.pp: grpo samples replies through the whole model"),
    (["parallel.cp=2"], "parallel.cp: grpo keeps each reply in one row"),
    (["data.pack=true"], "data.pack: grpo samples each reply into its own row"),
    (["training.loss_normalization=global_tokens"], "grpo aggregates its token losses itself"),
    (["training.global_batch_size=6", "grpo.updates_per_step=4"], "grpo.updates_per_step: must divide"),
    (["training.phase=sft", "data.dataset=shipped-chat", "grpo.group_size=4"], "the grpo section applies to"),
])
def test_check_refuses_grpo_settings_that_cannot_work(overrides, message):
    with pytest.raises(ConfigError, match=rf"^command line \(.*\): .*{message}") as caught:
        check_grpo(_config(*overrides), "megatron")
    assert "\n" not in str(caught.value)


def test_grpo_settings_resolve_and_a_resume_must_keep_them():
    from loongforge.train.resume_settings import check_resume_settings, schedule_settings

    assert check_grpo(_config("model.lora.rank=4", "grpo.kl_coeff=0.05"), "megatron") == [
        "grpo: 8 replies per prompt, up to 32 tokens, reward per prompt, KL 0.05 (reference adapters_off), "
        "token_mean, 1 update(s) per step"]
    assert grpo_settings(_config())["grpo.reference"] == "none"  # no KL term: no reference model
    assert grpo_settings(_config("grpo.kl_coeff=0.1"))["grpo.reference"] == "frozen_copy"
    saved = schedule_settings(_config(), 8)
    assert not check_resume_settings(saved, _config(), 8, "ckpt")
    with pytest.raises(ConfigError, match=r"grpo.group_size 8 -> 4"):
        check_resume_settings(saved, _config("grpo.group_size=4"), 8, "ckpt")


@pytest.mark.parametrize(("phase", "dataset", "message"), [
    ("sft", "shipped-tasks", "is prompt data but training.phase is 'sft'"),
    ("grpo", "shipped-chat", "is chat data but training.phase is 'grpo'"),
])
def test_the_phase_must_match_the_data(phase, dataset, message):
    from loongforge.train.batches import open_dataset, split_dataset

    config = _config(f"training.phase={phase}", f"data.dataset={dataset}")
    with pytest.raises(ConfigError, match=message):
        split_dataset(open_dataset(get_host(), config, BYTE), config)


def test_loongforge_check_names_an_unknown_reward(tmp_path, capsys):
    from loongforge.cli import main

    data = _write(tmp_path / "p.jsonl", [TASK, TASK, {**TASK, "reward": "judge"}])
    config = tmp_path / "run.yaml"
    config.write_text(f"model: llama-debug\ndata: {{dataset: prompts, paths: [{data}], seq_length: 64}}\n"
                      f"training: {{phase: grpo}}\nrun: {{output_dir: {tmp_path / 'out'}}}\n")
    assert main(["check", str(config)]) == 2
    error = capsys.readouterr().err.strip()
    assert error == (f"error: {config}: Unknown reward 'judge' ({data}:3). Known: exact-match, numeric, regex.")


def test_shipped_tasks_are_what_the_generator_writes(tmp_path):
    from loongforge.cli import main

    out = tmp_path / "tasks.jsonl"
    assert main(["make-data", "verifiable-tasks", str(out)]) == 0
    assert out.read_bytes() == shipped_tasks_path().read_bytes()
    tasks = [json.loads(line) for line in out.read_text().splitlines()]
    assert {t["reward"] for t in tasks} == {"numeric"} and len(tasks) == 512
    for task in tasks:  # every shipped answer is what its own reward accepts
        reply = task["answer"] if task["reward"] == "numeric" else "x"
        if task["reward"] == "numeric":
            assert numeric(completion=f"= {reply}.", answer=task["answer"], prompt="") == 1.0


def test_the_generator_writes_the_kinds_asked_for_and_refuses_unknown_ones(tmp_path, capsys):
    from loongforge.cli import main
    from loongforge.data.verifiable_tasks import KINDS

    def question(task):
        return task["prompt"] if isinstance(task["prompt"], str) else task["prompt"][-1]["content"]

    starts = {"sums": "What is", "capitals": "Write", "backwards": "Spell", "letters": "How many letters",
              "author": "Who wrote", "published": "When was", "novel": "In which novel"}
    assert set(starts) == set(KINDS)
    shipped = [json.loads(line) for line in shipped_tasks_path().read_text().splitlines()]
    seen = {kind for task in shipped for kind, start in starts.items() if question(task).startswith(start)}
    assert seen == set(DEFAULT_KINDS)
    out = tmp_path / "two.jsonl"
    assert main(["make-data", "verifiable-tasks", str(out), "--count", "40", "--kinds", "sums,letters"]) == 0
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert written == tasks(40, 20261205, ("sums", "letters")) and len(written) == 40
    for task in written:
        word = re.fullmatch(r"How many letters are in '([a-z]+)'\?", question(task))
        a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\?", question(task)).groups()) if not word else (0, 0)
        assert task["answer"] == str(len(word[1]) if word else a + b) and task["reward"] == "numeric"
    assert main(["make-data", "verifiable-tasks", str(tmp_path / "x.jsonl"), "--kinds", "sums,poems"]) == 2
    assert "unknown or none (poems); known: sums, capitals" in capsys.readouterr().err
    assert main(["make-data", "verifiable-tasks", str(tmp_path / "x.jsonl"), "--kinds", "author,novel"]) == 2
    assert "none can be held out (author, novel, published are facts of three novels" in capsys.readouterr().err
    assert main(["make-data", "verifiable-tasks", str(tmp_path / "x.jsonl"), "--held-out", "600"]) == 2
    assert "--held-out 600: must be between 0 and --count 512" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.parametrize("kinds", [("letters", "author", "published", "novel"), ("sums", "capitals", "backwards",
                                                                                 "novel")])
def test_held_out_tasks_ask_nothing_the_training_tasks_ask(kinds):
    """The last eighth (``data.valid_fraction: 0.125``) are skills about words and numbers no training prompt names,
    and no facts of the novels (a policy is rewarded only into the facts it is asked about), so a held-out gain is
    not the same questions answered again. With --held-out 0 every kind is spread over the whole set."""
    def subject(task):  # the quoted word or the first number of a skill; "fact" for a question about the novels
        text = task["prompt"] if isinstance(task["prompt"], str) else task["prompt"][-1]["content"]
        skill = re.search(r"'([a-z]+)'|What is (\d+)", text)
        assert skill or re.match(r"Who wrote|When was|In which novel", text), text
        return skill.group(skill.lastindex) if skill else "fact"

    written = tasks(512, 7, kinds)
    training, held = {subject(t) for t in written[:-64]}, [subject(t) for t in written[-64:]]
    assert not training & set(held) and "fact" in training
    assert len(set(held)) >= 20  # varied
    mixed = tasks(512, 7, kinds, held_out=0)
    assert "fact" in {subject(t) for t in mixed[-64:]}
