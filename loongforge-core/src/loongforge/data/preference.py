"""Preference pairs ``.jsonl`` -> for each pair, the chosen and the rejected conversation as token ids with the mask
of their response tokens.

Input: one pair per line, ``{"prompt": P, "chosen": C, "rejected": R}`` (the explicit-prompt preference format of
TRL and OpenRLHF); other keys are ignored, except an optional ``tools`` list of function schemas, which goes to the
chat template like a chat line's:

- ``prompt``: a string (one user message) or a list of OpenAI-style messages (``system``/``user``/``assistant``/
  ``tool``, checked as chat lines are: :func:`loongforge.data.sft.parse_messages`) that does not end with an
  assistant message; assistant messages inside the prompt are context, never trained on;
- ``chosen`` / ``rejected``: a string (one assistant message) or a list of messages starting with an assistant
  message (a reply may go on with tool calls, tool outputs and more assistant messages); the two must differ.

Why through the SFT path: each side is the conversation ``prompt + response`` rendered with the tokenizer's chat
template and tokenized by :func:`loongforge.data.sft.tokenize_conversation`, so the prompt tokens are exactly those
inference feeds (and the same for both sides), and the mask covers the response's assistant turns with the template's
end-of-turn marker (and a final ``eos``), as SFT trains them. A bad line raises ``FILE:LINE: what is wrong``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loongforge.data.chat_template import ChatTemplate, Message
from loongforge.data.errors import DataError
from loongforge.data.sft import (
    ChatSample,
    Conversation,
    jsonl_lines,
    parse_json_line,
    parse_messages,
    parse_tools,
    tokenize_conversation,
)
from loongforge.data.tokenizers import Tokenizer

#: The keys every pair line must have.
PAIR_KEYS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class PairMessages:
    """One pair as messages: the prompt (and which of its messages are assistant turns, never trained), the two
    responses (``unsupervised``: their ``weight: 0`` assistant messages) and the tools offered."""

    prompt: list[Message]
    chosen: Conversation
    rejected: Conversation
    tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class PreferencePair:
    """One tokenized pair: the whole chosen and rejected conversations, each with its response mask."""

    chosen: ChatSample
    rejected: ChatSample


def read_pairs(path: str | Path) -> Iterator[tuple[int, PairMessages]]:
    """``(line number, pair)`` for every non-blank line of a preference ``.jsonl`` file, validated."""
    for lineno, line, where in jsonl_lines(path, "preference data"):
        yield lineno, parse_pair(line, where)


def parse_pair(line: str, where: str) -> PairMessages:
    """One JSON line ``{"prompt", "chosen", "rejected"}`` (see the module docstring)."""
    return pair_from_record(parse_json_line(line, where), where)


def pair_from_record(record: Any, where: str) -> PairMessages:
    """One pair from its decoded JSON value, checked as :func:`parse_pair` checks a line.

    Separate from the line reader so that a dataset kind whose records come from elsewhere (a plugin's image-text
    pairs, read from jsonl files or tar shards, their images taken out first) validates and renders its pairs by
    the same rules; ``where`` prefixes every error."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected an object with {', '.join(PAIR_KEYS)}")
    missing = [key for key in PAIR_KEYS if key not in record]
    if missing:
        raise DataError(f"{where}: missing '{missing[0]}' (a pair needs {', '.join(PAIR_KEYS)})")
    tools = parse_tools(record.get("tools"), where)
    prompt = message_side(record["prompt"], "user", f"{where}: prompt")
    if prompt.messages[-1]["role"] == "assistant":
        raise DataError(f"{where}: prompt ends with an assistant message; the response goes in chosen/rejected")
    chosen = message_side(record["chosen"], "assistant", f"{where}: chosen")
    rejected = message_side(record["rejected"], "assistant", f"{where}: rejected")
    if chosen.messages == rejected.messages:
        raise DataError(f"{where}: chosen and rejected are the same response (nothing to prefer)")
    return PairMessages(prompt.messages, chosen, rejected, tools)


def message_side(value: Any, role: str, where: str) -> Conversation:
    """A prompt or a response: a string is one message of ``role``; a list must be messages, a response's starting
    with an assistant message."""
    if isinstance(value, str):
        if not value:
            raise DataError(f"{where} is an empty string")
        return Conversation([{"role": role, "content": value}])
    side = parse_messages(value, where)
    if role == "assistant" and side.messages[0]["role"] != "assistant":
        raise DataError(f"{where}: a response must start with an assistant message, not {side.messages[0]['role']}")
    return side


def tokenize_pair(pair: PairMessages, tokenizer: Tokenizer, template: ChatTemplate, where: str) -> PreferencePair:
    """Both conversations of ``pair`` tokenized with the masks of their responses only."""
    context = frozenset(i for i, m in enumerate(pair.prompt) if m["role"] == "assistant")

    def side(response: Conversation, name: str) -> ChatSample:
        offset = len(pair.prompt)
        unsupervised = context | {offset + i for i in response.unsupervised}
        return tokenize_conversation(pair.prompt + response.messages, tokenizer, template, f"{where}: {name}",
                                     tools=pair.tools, unsupervised=frozenset(unsupervised))

    return PreferencePair(side(pair.chosen, "chosen"), side(pair.rejected, "rejected"))
