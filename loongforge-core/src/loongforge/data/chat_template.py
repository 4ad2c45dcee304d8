"""Chat templates: a list of ``{"role", "content"}`` messages -> the text a model is trained and prompted with.

Why the tokenizer's own template: a model fine-tuned on one turn format must be prompted with the same one,
and Hugging Face tokenizers carry it (``chat_template`` in ``tokenizer_config.json``, or the
``chat_template.jinja`` file newer ``save_pretrained`` writes). It is rendered by transformers' own renderer (the
``hf`` extra), the one ``apply_chat_template`` uses: everything real templates call -- ``raise_exception``,
``strftime_now``, the ``{% generation %}`` tag, ``tojson`` as transformers spells it, tool schemas -- renders
exactly as there; a template-free install trains on the byte tokenizer's template below.

The built-in byte tokenizer has no template file, so :class:`ByteChatTemplate` is ours, in plain Python so that
SFT works on a bare install (jinja2 comes with the ``hf`` extra)::

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}\\n

An assistant message's tool calls follow its content, one ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
line each; a tool's output is a ``<|tool|>`` turn; the tool list, when a conversation has one, is a ``<|tools|>``
turn first (its JSON).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from loongforge.data.errors import DataError
from loongforge.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, _special_tokens

#: ``{"role", "content"}``, plus ``tool_calls`` (``[{"type": "function", "function": {"name", "arguments": {...}}}]``)
#: on an assistant message that calls tools: the shape Hugging Face chat templates read.
Message = dict[str, Any]


class ChatTemplate(Protocol):
    """Renders messages (and the function schemas offered as ``tools``) as text; with ``add_generation_prompt`` the
    text ends where the assistant's reply begins."""

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = False,
               tools: list[dict[str, Any]] | None = None) -> str: ...


class ByteChatTemplate:
    """Our template for the byte tokenizer: a role tag line, then the content and a newline."""

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = False,
               tools: list[dict[str, Any]] | None = None) -> str:
        text = f"<|tools|>\n{json.dumps(tools, ensure_ascii=False)}\n" if tools else ""
        text += "".join(f"<|{m['role']}|>\n{_byte_body(m)}" for m in messages)
        return text + "<|assistant|>\n" if add_generation_prompt else text


def _byte_body(message: Message) -> str:
    calls = message.get("tool_calls") or []
    body = f"{message['content']}\n" if message["content"] or not calls else ""
    return body + "".join(
        f"<tool_call>{json.dumps(call['function'], ensure_ascii=False)}</tool_call>\n" for call in calls)


class JinjaChatTemplate:
    """A Hugging Face chat template (jinja2 source) with the tokenizer's special tokens as variables, rendered by
    transformers' ``render_jinja_template``."""

    def __init__(self, source: str, special_tokens: dict[str, str], where: str) -> None:
        try:
            import jinja2
            from transformers.utils.chat_template_utils import render_jinja_template
        except ImportError:
            raise DataError("chat templates are rendered by transformers, as apply_chat_template renders them: "
                            "pip install 'loongforge-core[hf]'") from None
        try:
            jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)  # syntax only, before any data
        except jinja2.TemplateSyntaxError as exc:
            if "generation" not in str(exc):  # transformers adds the {% generation %} tag this bare parser lacks
                raise DataError(f"chat template of {where} does not compile: {exc}") from None
        self._render_jinja = render_jinja_template
        self._source = source
        self._special = special_tokens
        self._where = where

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = False,
               tools: list[dict[str, Any]] | None = None) -> str:
        import jinja2

        try:
            rendered, _ = self._render_jinja([list(messages)], tools=tools, chat_template=self._source,
                                             add_generation_prompt=add_generation_prompt, **self._special)
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            raise DataError(f"chat template of {self._where} failed: {exc}") from None
        return rendered[0]


def chat_template_for(tokenizer: Tokenizer) -> ChatTemplate:
    """The template that belongs to ``tokenizer``: ours for ``byte``, the directory's for a HF tokenizer.

    A plugin tokenizer can provide one as a ``chat_template`` attribute (jinja2 source).
    """
    if isinstance(tokenizer, ByteTokenizer):
        return ByteChatTemplate()
    source = getattr(tokenizer, "chat_template", None)
    if isinstance(source, str):
        return JinjaChatTemplate(source, {}, repr(tokenizer))
    if isinstance(tokenizer, HFTokenizer):
        return _hf_directory_template(tokenizer.directory)
    raise DataError(f"tokenizer {tokenizer.name!r} has no chat template (needed for chat datasets)")


def _hf_directory_template(directory: Path) -> JinjaChatTemplate:
    config_path = directory / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise DataError(f"cannot read {config_path}: {exc}") from None
    source = config.get("chat_template")
    if isinstance(source, list):  # several named templates: the ``default`` one is the chat template
        named = {entry.get("name"): entry.get("template") for entry in source if isinstance(entry, dict)}
        source = named.get("default")
    jinja_file = directory / "chat_template.jinja"
    if not isinstance(source, str) and jinja_file.is_file():
        source = jinja_file.read_text(encoding="utf-8")
    if not isinstance(source, str):
        raise DataError(f"{directory} has no chat template (no chat_template in tokenizer_config.json and no "
                        "chat_template.jinja)")
    found = _special_tokens(directory)
    special = {key: found.get(key, "") for key in ("bos_token", "eos_token", "pad_token")}
    return JinjaChatTemplate(source, special, str(directory))
