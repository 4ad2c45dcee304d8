"""Language annotations of a LeRobotDataset as the text they stand for: LeRobot 0.6's language columns and
LeRobot 0.4's ``subtask_index``.

LeRobot 0.6 (still ``codebase_version`` v3.0) replaced the per-frame ``subtask_index`` column and
``meta/subtasks.parquet`` of 0.4 with two columns of chat-style rows ``{role, content, style, camera, tool_calls}``:

- ``language_persistent``: the same list on every frame of an episode; each row has a ``timestamp`` and holds from
  then until a later row of its style replaces it (styles ``subtask``, ``plan``, ``memory``, ``motion``,
  ``task_aug``);
- ``language_events``: on each frame, the rows that happen at that frame (``interjection``, ``vqa``, ``trace``, tool
  calls such as ``say``).

LeRobot's recipes bind ``${subtask}``, ``${plan}`` and ``${memory}`` to the row of that style active at the
frame's time (``active_at(t, style=...)``: the latest row at or before ``t``). :func:`active_texts` gives the same
three as plain strings, so a frame carries ``subtask`` whether the dataset came from LeRobot 0.4 or 0.6. The
task text itself stays ``meta/tasks.parquet``'s, as in LeRobot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

#: The persistent styles whose active row a frame carries as text (LeRobot's default recipe bindings).
ACTIVE_STYLES = ("subtask", "plan", "memory")
#: LeRobot 0.4: the per-frame subtask column and the table of subtask texts it indexes.
SUBTASK_INDEX = "subtask_index"
SUBTASKS_PARQUET = "meta/subtasks.parquet"
LANGUAGE_PERSISTENT = "language_persistent"
LANGUAGE_EVENTS = "language_events"
#: info.json's entries of the two columns, as LeRobot 0.6 declares them (``language_feature_info``).
LANGUAGE_FEATURES = {key: {"dtype": "language", "shape": [1], "names": None}
                     for key in (LANGUAGE_PERSISTENT, LANGUAGE_EVENTS)}


def _row_type(*, timestamp: bool, json: pa.DataType) -> pa.StructType:
    """One language row as LeRobot 0.6 declares it: persistent rows carry their float32 ``timestamp``; tool calls
    are ``json`` values (Arrow's JSON type where pyarrow has it)."""
    fields = [pa.field("role", pa.string(), nullable=False), pa.field("content", pa.string()),
              pa.field("style", pa.string())]
    fields += [pa.field("timestamp", pa.float32(), nullable=False)] if timestamp else []
    return pa.struct([*fields, pa.field("camera", pa.string()), pa.field("tool_calls", pa.list_(json))])


def _column(rows: list[list[dict[str, Any]]], *, timestamp: bool) -> pa.Array:
    """``rows`` (one list per frame) as a column of LeRobot's type (built with string tool calls, which pyarrow
    can convert from Python, then cast to the JSON type)."""
    built = pa.array(rows, pa.list_(_row_type(timestamp=timestamp, json=pa.string())))
    return built.cast(pa.list_(_row_type(timestamp=timestamp, json=pa.json_()))) if hasattr(pa, "json_") else built


def language_columns(subtasks: Sequence[tuple[float, str]], length: int) -> dict[str, pa.Array]:
    """The two LeRobot 0.6 columns of an episode of ``length`` frames whose subtasks start at the given times: the
    subtask rows (role ``assistant``, as LeRobot's annotation pipeline writes them) on every frame, no events."""
    rows = [{"role": "assistant", "content": text, "style": "subtask", "timestamp": float(start), "camera": None,
             "tool_calls": None} for start, text in subtasks]
    return {LANGUAGE_PERSISTENT: _column([rows] * length, timestamp=True),
            LANGUAGE_EVENTS: _column([[]] * length, timestamp=False)}


def subtask_at(subtasks: Sequence[tuple[float, str]], t: float) -> str:
    """The text of the subtask running at time ``t`` (the last to start at or before it)."""
    started = [text for start, text in subtasks if start <= t]
    if not started:
        raise ValueError(f"no subtask has started at {t} s (the first starts at {subtasks[0][0]} s)")
    return started[-1]


def active_text(persistent: Sequence[dict[str, Any]], style: str, t: float) -> str:
    """The ``content`` of the ``style`` row active at time ``t`` (the latest whose timestamp is at most ``t``),
    or ``""`` when none is; several rows of the style at that latest time are ambiguous (LeRobot refuses them too)."""
    rows = [row for row in persistent if row.get("style") == style and float(row["timestamp"]) <= t]
    if not rows:
        return ""
    latest = max(float(row["timestamp"]) for row in rows)
    current = [row for row in rows if float(row["timestamp"]) == latest]
    if len(current) > 1:
        raise ValueError(f"{len(current)} '{style}' rows start at {latest} s; which one holds is ambiguous")
    return str(current[0].get("content") or "")


def active_texts(persistent: Sequence[dict[str, Any]], t: float) -> dict[str, str]:
    """``{"subtask": ..., "plan": ..., "memory": ...}`` active at time ``t`` (``""`` where none is)."""
    return {style: active_text(persistent, style, t) for style in ACTIVE_STYLES}
