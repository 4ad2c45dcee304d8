"""Chat ``.jsonl`` files -> token ids with a mask of the tokens the loss is taken on (the assistant's).

Input: one conversation per line, in either of the two formats chat data is shared in (a bad line raises
:class:`DataError` naming the file, line and turn):

- **OpenAI** ``{"messages": [...], "tools": [...]}``: roles ``system``, ``user``, ``assistant`` and ``tool``;
  ``content`` a string (or a list of ``{"type": "text", "text": ...}`` parts, joined); an assistant message may
  carry ``tool_calls`` (``[{"type": "function", "function": {"name": ..., "arguments": ...}}]``, the arguments a
  JSON object or its text) and then needs no content; ``weight: 0`` on an assistant message leaves it
  unsupervised (as in OpenAI's fine-tuning format). The optional ``tools`` (function schemas) go to the template.
- **ShareGPT** ``{"conversations": [{"from": ..., "value": ...}], "system": ..., "tools": ...}``: ``from`` is
  ``human`` (user), ``gpt`` (assistant), ``system``, ``function_call`` (an assistant tool call, ``value`` the JSON
  of ``{"name", "arguments"}`` or a list of them) or ``observation`` (a tool's output); a top-level ``system``
  string comes first, ``tools`` is a list or its JSON text.

Both become the same messages (tool calls as ``{"function": {"name", "arguments": {...}}}``, the form Hugging Face
chat templates read), so they tokenize and mask identically.

**Loss mask rules.** The loss is taken on every assistant turn -- its text, its tool calls, and the template's
end-of-turn marker after it -- unless that message has ``weight: 0``; never on system prompts, user turns, tool
outputs, the tool list, or the template's role headers. A conversation needs at least one supervised assistant turn.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loongforge.data.chat_template import ChatTemplate, Message
from loongforge.data.errors import DataError
from loongforge.data.tokenizers import Tokenizer

ROLES = ("system", "user", "assistant", "tool")
#: ShareGPT ``from`` values and the role each becomes (``function_call`` turns are assistant tool calls).
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "function_call": "assistant",
                  "observation": "tool"}


@dataclass(frozen=True)
class ChatSample:
    """One tokenized conversation: ``ids`` and, per id, whether it is a training target."""

    ids: np.ndarray  # int64 [n]
    supervised: np.ndarray  # bool [n]


@dataclass(frozen=True)
class Conversation:
    """Messages in one form whatever the file's format; ``unsupervised`` holds the indices of assistant messages
    with ``weight: 0``; ``tools`` are the function schemas offered to the model, if any."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    unsupervised: frozenset[int] = field(default_factory=frozenset)


def read_conversations(path: str | Path) -> Iterator[tuple[int, Conversation]]:
    """``(line number, conversation)`` for every non-blank line of a chat ``.jsonl`` file, validated."""
    for lineno, line, where in jsonl_lines(path, "chat data"):
        yield lineno, parse_conversation(line, where)


def jsonl_lines(path: str | Path, kind: str) -> Iterator[tuple[int, str, str]]:
    """``(line number, text, "FILE:LINE")`` of every non-blank line of a UTF-8 ``.jsonl`` file of ``kind`` (named
    when the file is missing)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"{kind} file not found: {path}")
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid UTF-8 (byte {exc.start})") from None
            if line:
                yield lineno, line, f"{path}:{lineno}"


def parse_json_line(line: str, where: str) -> Any:
    """One line's JSON value; a one-line :class:`DataError` naming ``where`` when it is not JSON."""
    try:
        return json.loads(line)
    except ValueError as exc:
        raise DataError(f"{where}: invalid JSON: {exc}") from None
    except RecursionError:
        raise DataError(f"{where}: invalid JSON: nested too deeply to read") from None


def parse_messages(messages: Any, where: str, tools: Any = None) -> Conversation:
    """A list of OpenAI-style messages checked as a ``messages`` line's are (roles, content, tool calls, weights),
    without asking for an assistant turn: a part of a conversation (a preference pair's prompt or response)."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: expected a string or a non-empty list of messages")
    return _openai({"messages": messages, "tools": tools}, where)


def parse_conversation(line: str, where: str) -> Conversation:
    """One JSON line in the OpenAI or the ShareGPT format (see the module docstring)."""
    record = parse_json_line(line, where)
    if isinstance(record, dict) and isinstance(record.get("conversations"), list) and record["conversations"]:
        conversation = _sharegpt(record, where)
    elif isinstance(record, dict) and isinstance(record.get("messages"), list) and record["messages"]:
        conversation = _openai(record, where)
    else:
        raise DataError(f"{where}: expected {{\"messages\": [...]}} (OpenAI) or {{\"conversations\": [...]}} "
                        "(ShareGPT) with at least one message")
    supervised = [i for i, m in enumerate(conversation.messages)
                  if m["role"] == "assistant" and i not in conversation.unsupervised]
    if not supervised:
        raise DataError(f"{where}: no assistant message (nothing to train on)")
    return conversation


def _openai(record: dict[str, Any], where: str) -> Conversation:
    messages: list[Message] = []
    unsupervised = set()
    for index, message in enumerate(record["messages"]):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise DataError(f"{where}: message {index} needs a role of {', '.join(ROLES)}")
        role = message["role"]
        calls = message.get("tool_calls")
        if calls is not None and role != "assistant":
            raise DataError(f"{where}: message {index} ({role}) has tool_calls; only assistant messages call tools")
        content = _content(message.get("content"), allow_none=calls is not None)
        if content is None:
            raise DataError(f"{where}: message {index} ({role}) has no string 'content'")
        messages.append(_message(role, content, [_tool_call(c, f"{where}: message {index}") for c in calls or []]))
        if role == "tool":  # which call this answers, for templates that show it
            messages[-1].update({k: message[k] for k in ("tool_call_id", "name") if isinstance(message.get(k), str)})
        weight = message.get("weight", 1)
        if weight not in (0, 1) or isinstance(weight, bool):
            raise DataError(f"{where}: message {index} has weight {weight!r}; use 0 or 1")
        if role == "assistant" and weight == 0:
            unsupervised.add(index)
    return Conversation(messages, parse_tools(record.get("tools"), where), frozenset(unsupervised))


def _sharegpt(record: dict[str, Any], where: str) -> Conversation:
    messages: list[Message] = []
    system = record.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise DataError(f"{where}: 'system' must be a string")
        if system:
            messages.append(_message("system", system))
    for index, turn in enumerate(record["conversations"]):
        if not isinstance(turn, dict) or turn.get("from") not in SHAREGPT_ROLES:
            raise DataError(f"{where}: turn {index} needs 'from' of {', '.join(SHAREGPT_ROLES)}")
        value = turn.get("value")
        if not isinstance(value, str):
            raise DataError(f"{where}: turn {index} ({turn['from']}) has no string 'value'")
        if turn["from"] == "function_call":
            calls = _json_value(value, f"{where}: turn {index} (function_call)")
            calls = calls if isinstance(calls, list) else [calls]
            messages.append(_message("assistant", "", [_tool_call(c, f"{where}: turn {index}") for c in calls]))
        else:
            messages.append(_message(SHAREGPT_ROLES[turn["from"]], value))
    tools = record.get("tools")
    if isinstance(tools, str):
        tools = _json_value(tools, f"{where}: 'tools'") if tools.strip() else None
    return Conversation(messages, parse_tools(tools, where))


def _message(role: str, content: str, calls: list[dict[str, Any]] | None = None) -> Message:
    return {"role": role, "content": content, **({"tool_calls": calls} if calls else {})}


def _content(content: Any, *, allow_none: bool) -> str | None:
    """Message text: a string, or OpenAI's list of text parts joined; ``""`` for a tool-calling message without."""
    if content is None and allow_none:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    return content if isinstance(content, str) else None


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    """``{"type": "function", "function": {"name", "arguments": {...}}}`` from OpenAI's form (arguments as JSON
    text) or ShareGPT's bare ``{"name", "arguments"}``."""
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise DataError(f"{where}: a tool call needs a function name")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        arguments = _json_value(arguments, f"{where}: arguments of tool call {function['name']!r}")
    if not isinstance(arguments, dict):
        raise DataError(f"{where}: arguments of tool call {function['name']!r} must be a JSON object")
    ids = {"id": call["id"]} if isinstance(call.get("id"), str) else {}
    return {"type": "function", **ids, "function": {"name": function["name"], "arguments": arguments}}


def parse_tools(tools: Any, where: str) -> list[dict[str, Any]] | None:
    """A line's ``tools`` (function schemas for the template): ``None`` when absent or empty."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(f"{where}: 'tools' must be a list of function schemas (JSON objects)")
    return tools or None


def _json_value(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise DataError(f"{where}: not valid JSON: {exc}") from None


def render_spans(messages: Sequence[Message], template: ChatTemplate, where: str, *,
                 tools: list[dict[str, Any]] | None = None,
                 unsupervised: frozenset[int] = frozenset()) -> list[tuple[str, bool]]:
    """The rendered conversation as consecutive ``(text, is_reply)`` spans (see the module docstring); assistant
    messages whose index is in ``unsupervised`` are not replies to learn."""
    spans: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = template.render(messages[:i], add_generation_prompt=True, tools=tools)
        full = template.render(messages[: i + 1], tools=tools)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise DataError(f"{where}: the chat template is not incremental at message {i} (rendering more "
                            "messages changed the text of earlier ones), so the reply cannot be located")
        spans += [(prompt[len(done):], False), (full[len(prompt):], i not in unsupervised)]
        done = full
    whole = template.render(messages, tools=tools)
    if not whole.startswith(done):
        raise DataError(f"{where}: the chat template is not incremental (the whole conversation does not start "
                        "with its rendered turns)")
    spans.append((whole[len(done):], False))
    return [(text, reply) for text, reply in spans if text]


def tokenize_conversation(
    messages: Sequence[Message], tokenizer: Tokenizer, template: ChatTemplate, where: str, *,
    tools: list[dict[str, Any]] | None = None, unsupervised: frozenset[int] = frozenset(),
) -> ChatSample:
    """Token ids of the rendered conversation and the mask of its reply tokens (plus a final ``eos``)."""
    ids: list[int] = []
    supervised: list[bool] = []
    for text, reply in render_spans(messages, template, where, tools=tools, unsupervised=unsupervised):
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
