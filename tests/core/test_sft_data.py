"""Chat data for SFT: templates, loss masks counted independently, bad lines, the shipped set, packing layout."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from loongforge.config import load_config
from loongforge.config.schema import DataConfig
from loongforge.data.chat_dataset import ChatDataset, shipped_chat, shipped_chat_path
from loongforge.data.chat_template import ByteChatTemplate, chat_template_for
from loongforge.data.errors import DataError
from loongforge.data.packing import ChatRowDataset, pack_rows
from loongforge.data.sft import read_conversations, render_spans, tokenize_conversation
from loongforge.data.tokenizers import ByteTokenizer, HFTokenizer
from loongforge.errors import ConfigError
from loongforge.parallel.packed_rows import PackedRows
from loongforge.train.batches import split_dataset

BYTE = ByteTokenizer()
CHATML = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Who wrote Persuasion?"},
    {"role": "assistant", "content": "Jane Austen wrote it."},
    {"role": "user", "content": "When was it published?"},
    {"role": "assistant", "content": "It was published in 1817."},
]


def _write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


def test_byte_template_masks_match_an_independent_count_on_the_shipped_set():
    """Supervised tokens = every assistant content + its newline (bytes), + one eos per conversation."""
    dataset = shipped_chat([], BYTE)
    records = [json.loads(line) for line in shipped_chat_path().read_text(encoding="utf-8").splitlines()]
    assert len(dataset) == len(records) == 400
    expected_total = 0
    for record, sample in zip(records, dataset.samples, strict=True):
        replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
        expected = sum(len((r + "\n").encode()) for r in replies) + 1
        expected_total += expected
        assert int(sample.supervised.sum()) == expected
        supervised_ids = sample.ids[sample.supervised]
        assert supervised_ids[-1] == BYTE.eos_id and BYTE.decode(supervised_ids) == "".join(r + "\n" for r in replies)
        # Everything unsupervised is template and prompt text: the rendered conversation minus the replies.
        assert BYTE.decode(sample.ids) == ByteChatTemplate().render(record["messages"])
    assert expected_total == 14404


def _chatml_tokenizer_dir(directory):
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = FastTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([m["content"] for m in CONVERSATION] * 5, trainer)
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "<|im_end|>", "chat_template": CHATML,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_hf_chat_template_renders_like_transformers_and_masks_the_replies(tmp_path):
    from transformers import AutoTokenizer

    directory = _chatml_tokenizer_dir(tmp_path / "tok")
    tokenizer = HFTokenizer(directory)
    template = chat_template_for(tokenizer)
    reference = AutoTokenizer.from_pretrained(directory)
    for prompt in (True, False):
        assert template.render(CONVERSATION, add_generation_prompt=prompt) == reference.apply_chat_template(
            CONVERSATION, tokenize=False, add_generation_prompt=prompt
        )
    sample = tokenize_conversation(CONVERSATION, tokenizer, template, "conv")
    replies = [m["content"] + "<|im_end|>\n" for m in CONVERSATION if m["role"] == "assistant"]
    # Independent count: each reply (with its end-of-turn marker) tokenized on its own by the raw library.
    assert int(sample.supervised.sum()) == sum(len(tokenizer.encode(r)) for r in replies) == 15
    # eos (<|im_end|>) already ends the reply, so none is appended; the ids are the whole text's.
    assert sample.ids.tolist() == tokenizer.encode(template.render(CONVERSATION))
    pieces = np.split(sample.ids, np.flatnonzero(np.diff(sample.supervised.astype(int))) + 1)
    assert [tokenizer._tok.decode(p.tolist(), skip_special_tokens=False) for p in pieces[1::2]] == replies


def test_a_template_that_rewrites_earlier_turns_is_refused():
    class Rewriting:
        def render(self, messages, *, add_generation_prompt=False, tools=None):
            return f"{len(messages)} turns: " + "|".join(m["content"] for m in messages)

    with pytest.raises(DataError, match=r"conv:3: the chat template is not incremental at message 2"):
        render_spans(CONVERSATION, Rewriting(), "conv:3")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "invalid JSON"),
        (json.dumps({"text": "hello"}), 'expected {"messages": \\[...\\]}'),
        (json.dumps({"messages": [{"role": "robot", "content": "x"}]}), "message 0 needs a role of system, user"),
        (json.dumps({"messages": [{"role": "assistant", "content": 3}]}), "message 0 \\(assistant\\) has no string"),
        (json.dumps({"messages": [{"role": "user", "content": "hi"}]}), "no assistant message"),
    ],
)
def test_a_bad_line_names_file_and_line(tmp_path, line, message):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path = _write_jsonl(tmp_path / "chat.jsonl", [good, "", line])
    with pytest.raises(DataError, match=rf"^{path}:3: {message}"):
        ChatDataset([path], BYTE)
    assert [n for n, _ in read_conversations(_write_jsonl(tmp_path / "ok.jsonl", [good, "", good]))] == [1, 3]


def test_shipped_set_is_what_its_script_generates(tmp_path):
    script = shipped_chat_path().with_name("make_chat.py")
    out = tmp_path / "chat.jsonl"
    subprocess.run([sys.executable, str(script), str(out)], check=True, timeout=60)
    assert out.read_bytes() == shipped_chat_path().read_bytes()


def test_pack_rows_best_fit_keeps_every_sample_once_within_capacity():
    lengths = [5, 9, 3, 7, 2, 10, 4, 6]
    rows = pack_rows(lengths, 10)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 10 for row in rows)
    assert rows == [[0, 2, 4], [1], [3], [5], [6, 7]]  # 3 and 2 join sample 0 (best fit); 6 goes with 4
    with pytest.raises(DataError, match="sample 1 has 11 tokens"):
        pack_rows([3, 11], 10)


def test_packed_rows_restart_positions_confine_attention_and_keep_every_target():
    dataset = shipped_chat([], BYTE)
    data = DataConfig(seq_length=256)
    plain, _ = dataset.split_samples(data)
    packed, _ = dataset.split_samples(DataConfig(seq_length=256, pack=True))
    assert len(plain) == 400 and len(packed) == 186
    # Truncation to seq_length + 1 ids is the same in both layouts, so they supervise the same tokens.
    total_plain = plain.batch(np.arange(len(plain)))["loss_mask"].sum()
    full = packed.batch(np.arange(len(packed)))
    assert full["loss_mask"].sum() == total_plain
    row = packed.rows[1]
    assert len(row) == 3
    lengths = [len(packed.samples[i].ids) - 1 for i in row]
    positions = full["position_ids"][1]
    starts = np.cumsum([0, *lengths])
    for start, n in zip(starts[:-1], lengths, strict=True):
        assert positions[start : start + n].tolist() == list(range(n))
    # the boundaries of row 1's samples, and of its padding tail, over the flattened rows
    assert [b - 256 for b in full["cu_seqlens"].tolist() if 256 <= b <= 512] == sorted({*starts.tolist(), 256})
    mask = PackedRows.from_cu_seqlens(full["cu_seqlens"], len(packed), 256).dense_mask()[1, 0]
    assert mask.shape == (256, 256) and mask.dtype == torch.bool
    first, second = starts[1] - 1, starts[1]  # last token of sample 0, first of sample 1
    assert not mask[second, second] and mask[second, first] and not mask[first, 0] and mask[0, 1]
    assert not mask.all(dim=1).any()  # every query attends somewhere (padding attends to padding)


def test_phase_must_match_the_data(tmp_path):
    chat = shipped_chat([], BYTE)
    with pytest.raises(ConfigError, match="'shipped-chat' is chat data but training.phase is 'pretrain'"):
        split_dataset(chat, load_config(None, ["data.dataset=shipped-chat"]))
    with pytest.raises(ConfigError, match="training.phase must be one of pretrain, sft, dpo, grpo, got 'rlhf'"):
        split_dataset(chat, load_config(None, ["training.phase=rlhf"]))
    train, valid = split_dataset(chat, load_config(None, ["training.phase=sft", "data.valid_fraction=0.1"]))
    assert isinstance(train, ChatRowDataset) and (len(train), len(valid)) == (360, 40)


# -- OpenAI messages and ShareGPT, with tool calls ------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
OPENAI_TOOLS = {
    "tools": [WEATHER],
    "messages": [
        {"role": "system", "content": "You may call tools."},
        {"role": "user", "content": "Weather in Bath?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Bath"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain, 9 C"},
        {"role": "assistant", "content": "It is raining in Bath."},
        {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "tomorrow?"}]},
        {"role": "assistant", "content": "I cannot tell."},
    ],
}
SHAREGPT_TOOLS = {
    "system": "You may call tools.",
    "tools": json.dumps([WEATHER]),
    "conversations": [
        {"from": "human", "value": "Weather in Bath?"},
        {"from": "function_call", "value": json.dumps({"name": "weather", "arguments": {"city": "Bath"}})},
        {"from": "observation", "value": "rain, 9 C"},
        {"from": "gpt", "value": "It is raining in Bath."},
        {"from": "human", "value": "And tomorrow?"},
        {"from": "gpt", "value": "I cannot tell."},
    ],
}
CALL = '<tool_call>{"name": "weather", "arguments": {"city": "Bath"}}</tool_call>\n'


def _samples(tmp_path, tokenizer, *records):
    return ChatDataset([_write_jsonl(tmp_path / "chat.jsonl", records)], tokenizer).samples


def test_openai_and_sharegpt_tool_conversations_train_the_same_tokens(tmp_path):
    """The loss covers the assistant's tool call and replies (and the final eos); never the system prompt, the
    tool list, the user turns or the tool's output."""
    openai, sharegpt = _samples(tmp_path, BYTE, OPENAI_TOOLS, SHAREGPT_TOOLS)
    assert openai.ids.tolist() == sharegpt.ids.tolist()
    assert openai.supervised.tolist() == sharegpt.supervised.tolist()
    text = BYTE.decode(openai.ids)
    assert text == ("<|tools|>\n" + json.dumps([WEATHER]) + "\n<|system|>\nYou may call tools.\n"
                    "<|user|>\nWeather in Bath?\n<|assistant|>\n" + CALL + "<|tool|>\nrain, 9 C\n"
                    "<|assistant|>\nIt is raining in Bath.\n<|user|>\nAnd tomorrow?\n<|assistant|>\nI cannot tell.\n")
    supervised = openai.ids[openai.supervised]
    assert BYTE.decode(supervised) == CALL + "It is raining in Bath.\n" + "I cannot tell.\n"
    assert supervised[-1] == BYTE.eos_id
    assert int(openai.supervised.sum()) == len((CALL + "It is raining in Bath.\nI cannot tell.\n").encode()) + 1


def test_weight_zero_leaves_an_assistant_message_unsupervised(tmp_path):
    record = {"messages": [{"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": "Bad reply", "weight": 0},
                           {"role": "user", "content": "Again"},
                           {"role": "assistant", "content": "Good", "weight": 1}]}
    (sample,) = _samples(tmp_path, BYTE, record)
    assert BYTE.decode(sample.ids[sample.supervised]) == "Good\n"
    assert "Bad reply" in BYTE.decode(sample.ids)


def _tool_chatml_dir(directory):
    directory = _chatml_tokenizer_dir(directory)
    template = (
        "{% if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
        "<|im_end|>\n{% endif %}"
        "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
        "{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>{{ call.function | tojson }}"
        "</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return directory


def test_tool_calls_render_as_transformers_renders_them_and_mask_the_calls(tmp_path):
    from loongforge.data.sft import parse_conversation
    from transformers import AutoTokenizer

    directory = _tool_chatml_dir(tmp_path / "tok")
    tokenizer = HFTokenizer(directory)
    chat = parse_conversation(json.dumps(SHAREGPT_TOOLS), "conv")
    reference = AutoTokenizer.from_pretrained(directory)
    assert chat_template_for(tokenizer).render(chat.messages, tools=chat.tools) == reference.apply_chat_template(
        chat.messages, tools=chat.tools, tokenize=False)
    (sample,) = _samples(tmp_path, tokenizer, SHAREGPT_TOOLS)
    replies = ['<tool_call>{"name": "weather", "arguments": {"city": "Bath"}}</tool_call><|im_end|>\n',
               "It is raining in Bath.<|im_end|>\n", "I cannot tell.<|im_end|>\n"]
    pieces = np.split(sample.ids, np.flatnonzero(np.diff(sample.supervised.astype(int))) + 1)
    assert [tokenizer._tok.decode(p.tolist(), skip_special_tokens=False) for p in pieces[1::2]] == replies


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"conversations": [{"from": "bot", "value": "x"}]}, "turn 0 needs 'from' of human, gpt, system"),
        ({"conversations": [{"from": "human", "value": 3}]}, r"turn 0 \(human\) has no string 'value'"),
        ({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "{oops"}]},
         r"turn 1 \(function_call\): not valid JSON"),
        ({"conversations": [{"from": "function_call", "value": '{"arguments": {}}'}]},
         "turn 0: a tool call needs a function name"),
        ({"conversations": [{"from": "human", "value": "q"}], "system": 5}, "'system' must be a string"),
        ({"conversations": [{"from": "gpt", "value": "a"}], "tools": "[1, 2]"}, "'tools' must be a list of function"),
        ({"conversations": [{"from": "human", "value": "only a question"}]}, "no assistant message"),
        ({"messages": [{"role": "user", "content": "q", "tool_calls": []}]}, r"message 0 \(user\) has tool_calls"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]},
         "message 0: arguments of tool call 'f' must be a JSON object"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
         "message 0: arguments of tool call 'f': not valid JSON"),
        ({"messages": [{"role": "tool"}]}, r"message 0 \(tool\) has no string 'content'"),
        ({"messages": [{"role": "assistant", "content": "a", "weight": 0.5}]}, "message 0 has weight 0.5; use 0 or 1"),
        ({"messages": [{"role": "assistant", "content": "a", "weight": 0}]}, "no assistant message"),
    ],
)
def test_a_malformed_conversation_names_file_line_and_turn(tmp_path, record, message):
    path = _write_jsonl(tmp_path / "chat.jsonl", ["", record])
    with pytest.raises(DataError, match=rf"^{path}:2: {message}") as info:
        ChatDataset([path], BYTE)
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_sharegpt_tool_calling_conversations_train(tmp_path):
    from data_training import assert_learns, train_losses

    records = []
    for i in range(48):
        a, b = i % 7 + 2, i % 5 + 3
        call = json.dumps({"name": "add", "arguments": {"a": a, "b": b}})
        records.append({"system": "Use the calculator.", "tools": [{"type": "function", "function": {"name": "add"}}],
                        "conversations": [{"from": "human", "value": f"What is {a} + {b}?"},
                                          {"from": "function_call", "value": call},
                                          {"from": "observation", "value": str(a + b)},
                                          {"from": "gpt", "value": f"{a} + {b} = {a + b}."}]})
    path = _write_jsonl(tmp_path / "tools.jsonl", records)
    losses = train_losses(tmp_path, {"dataset": "sft", "paths": [str(path)], "seq_length": 256}, phase="sft")
    assert_learns(losses)
