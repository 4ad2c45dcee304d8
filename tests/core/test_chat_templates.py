"""Chat templates render exactly as ``transformers.apply_chat_template`` renders them, including what real templates
use that a plain jinja2 environment lacks: ``strftime_now`` (Llama 3's date line), the ``{% generation %}`` tag
(templates that mark assistant tokens), tool calls whose ``arguments`` are JSON text (re-serialised by transformers'
``tojson``), ``raise_exception`` (Mistral-style alternation checks). The templates are written here in the styles of
those families; the reference is transformers' tokenizer loaded from the same directory."""

from __future__ import annotations

import json

import pytest
from loongforge.data.chat_template import chat_template_for
from loongforge.data.errors import DataError
from loongforge.data.tokenizers import HFTokenizer

DATED = (  # a Llama-3-style header with today's date
    "{{ bos_token }}{% set date = strftime_now('%d %b %Y') %}<|start_header_id|>system<|end_header_id|>\n\n"
    "Today Date: {{ date }}\n{% if tools %}{{ tools | tojson(indent=2) }}\n{% endif %}<|eot_id|>"
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{% if m.tool_calls %}{% for call in m.tool_calls %}{{ call.function | tojson }}{% endfor %}"
    "{% else %}{{ m.content | trim }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
MARKED = (  # assistant turns wrapped in the generation tag (what training masks read)
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
    "{{ m.content }}<|im_end|>{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ALTERNATING = (  # Mistral-style: user and assistant must alternate
    "{{ bos_token }}{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]{% else %}{{ m.content }}{{ eos_token }}{% endif %}"
    "{% endfor %}")

CONVERSATION = [
    {"role": "user", "content": "What is 3 + 4?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": "{\"a\": 3, \"b\": 4}"}}]},
    {"role": "tool", "content": "7"},
    {"role": "assistant", "content": "It is 7."},
]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]


def _tokenizer_dir(directory, template: str):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<s>", "</s>", "<unk>", "hello"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "chat_template": template,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory


@pytest.mark.parametrize("template", [DATED, MARKED, ALTERNATING], ids=["strftime-tools", "generation-tag",
                                                                       "alternation"])
def test_templates_render_as_transformers_renders_them(template, tmp_path):
    from transformers import AutoTokenizer

    directory = _tokenizer_dir(tmp_path / "tok", template)
    ours = chat_template_for(HFTokenizer(directory))
    reference = AutoTokenizer.from_pretrained(directory)
    conversation = CONVERSATION if template != ALTERNATING else [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}]
    for prompt in (False, True):
        expected = reference.apply_chat_template(conversation, tools=TOOLS, tokenize=False,
                                                 add_generation_prompt=prompt)
        assert ours.render(conversation, tools=TOOLS, add_generation_prompt=prompt) == expected
    if template == DATED:
        assert '"arguments": "{\\"a\\": 3, \\"b\\": 4}"' in expected  # the JSON text kept as transformers keeps it


def test_a_template_that_raises_is_one_line(tmp_path):
    ours = chat_template_for(HFTokenizer(_tokenizer_dir(tmp_path / "tok", ALTERNATING)))
    with pytest.raises(DataError) as raised:
        ours.render([{"role": "assistant", "content": "first"}])
    assert "roles must alternate" in str(raised.value) and "\n" not in str(raised.value)
