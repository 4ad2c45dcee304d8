"""Chat ``.jsonl`` files -> token ids with a mask of the tokens the loss is taken on (the assistant's).

Input: one conversation per line, ``{"messages": [{"role": "system|user|assistant", "content": "..."}, ...]}``
with at least one assistant message. A bad line raises :class:`DataError` naming the file and line.

How the mask is found, for any template: the conversation is rendered *incrementally*. For each assistant
message ``i`` the template renders ``messages[:i]`` with the generation prompt (the prompt the model sees at
inference) and ``messages[:i+1]`` (prompt plus reply); the reply span is the difference. The spans are
tokenized one by one, so the prompt tokens are exactly what inference would feed and the reply tokens start
where generation starts; the reply span also holds the template's end-of-turn marker, so the model learns to
stop. A template whose renderings are not prefixes of each other (e.g. one that rewrites earlier turns) is
refused with that reason. If the last reply contains no ``eos`` token (the byte template), ``eos`` is appended
to it and supervised, so every trained reply ends the way generation stops.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loongforge.data.chat_template import ChatTemplate, Message
from loongforge.data.errors import DataError
from loongforge.data.tokenizers import Tokenizer

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatSample:
    """One tokenized conversation: ``ids`` and, per id, whether it is a training target."""

    ids: np.ndarray  # int64 [n]
    supervised: np.ndarray  # bool [n]


def read_conversations(path: str | Path) -> Iterator[tuple[int, list[Message]]]:
    """``(line number, messages)`` for every non-blank line of a chat ``.jsonl`` file, validated."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"chat data file not found: {path}")
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid UTF-8 (byte {exc.start})") from None
            if line:
                yield lineno, _messages(line, f"{path}:{lineno}")


def _messages(line: str, where: str) -> list[Message]:
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise DataError(f"{where}: invalid JSON: {exc}") from None
    except RecursionError:
        raise DataError(f"{where}: invalid JSON: nested too deeply to read") from None
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: expected {{\"messages\": [...]}} with at least one message")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise DataError(f"{where}: message {index} needs a role of {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise DataError(f"{where}: message {index} ({message['role']}) has no string 'content'")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant message (nothing to train on)")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def render_spans(messages: Sequence[Message], template: ChatTemplate, where: str) -> list[tuple[str, bool]]:
    """The rendered conversation as consecutive ``(text, is_reply)`` spans (see the module docstring)."""
    spans: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = template.render(messages[:i], add_generation_prompt=True)
        full = template.render(messages[: i + 1])
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise DataError(f"{where}: the chat template is not incremental at message {i} (rendering more "
                            "messages changed the text of earlier ones), so the reply cannot be located")
        spans += [(prompt[len(done):], False), (full[len(prompt):], True)]
        done = full
    whole = template.render(messages)
    if not whole.startswith(done):
        raise DataError(f"{where}: the chat template is not incremental (the whole conversation does not start "
                        "with its rendered turns)")
    spans.append((whole[len(done):], False))
    return [(text, reply) for text, reply in spans if text]


def tokenize_conversation(
    messages: Sequence[Message], tokenizer: Tokenizer, template: ChatTemplate, where: str
) -> ChatSample:
    """Token ids of the rendered conversation and the mask of its reply tokens (plus a final ``eos``)."""
    ids: list[int] = []
    supervised: list[bool] = []
    for text, reply in render_spans(messages, template, where):
        piece = tokenizer.encode(text)
        ids += piece
        supervised += [reply] * len(piece)
    last_reply = [i for i, flag in enumerate(supervised) if flag]
    if not last_reply:
        raise DataError(f"{where}: the assistant replies render to no tokens")
    ends_with_reply = last_reply[-1] == len(ids) - 1
    if ends_with_reply and tokenizer.eos_id not in _last_run(ids, supervised):
        ids.append(tokenizer.eos_id)
        supervised.append(True)
    return ChatSample(np.asarray(ids, dtype=np.int64), np.asarray(supervised, dtype=bool))


def _last_run(ids: list[int], supervised: list[bool]) -> list[int]:
    """The ids of the final run of supervised tokens (the last reply)."""
    end = len(ids)
    start = end
    while start > 0 and supervised[start - 1]:
        start -= 1
    return ids[start:end]
