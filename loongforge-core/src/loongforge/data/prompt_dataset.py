"""The ``prompts`` and ``shipped-tasks`` dataset kinds: prompts with checkable answers for ``training.phase: grpo``.

A line is ``{"prompt": ..., "answer": ..., "reward": ...}``: ``prompt`` a string (one user message) or chat messages
ending with a user (or tool) message, ``answer`` the string a reward checks a reply against, and ``reward`` (optional)
the name of the reward that scores this prompt's replies (``grpo.reward`` names one for every prompt instead). Bad
lines raise ``FILE:LINE: what is wrong``.

Why prompts, not rows of tokens: the replies are sampled by the policy during training, so a row here is only what
the model is given -- the prompt rendered with the chat template up to where the reply begins (exactly what
``loongforge generate --chat`` feeds) -- and what the reward needs. :class:`PromptRows` is a map-style dataset of
prompts whose ``batch(indices)`` holds ``prompt_index``; the step engine reads the prompts themselves from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loongforge.data.chat_dataset import hold_out
from loongforge.data.chat_template import chat_template_for
from loongforge.data.contracts import PromptSet
from loongforge.data.errors import DataError
from loongforge.data.preference import message_side
from loongforge.data.sft import jsonl_lines, parse_json_line
from loongforge.data.tokenizers import Tokenizer

#: The batch key holding each row's prompt index.
PROMPT_INDEX = "prompt_index"
#: Keys a prompt line may have.
PROMPT_KEYS = ("prompt", "answer", "reward")


@dataclass(frozen=True)
class Prompt:
    """One prompt: its ids (the rendered template up to the reply), text, answer, reward name (``None``: the
    config's) and where it was read (``FILE:LINE``)."""

    ids: np.ndarray
    text: str
    answer: str
    reward: str | None
    where: str


def parse_prompt(line: str, where: str, tokenizer: Tokenizer, template: Any) -> Prompt:
    """One JSON line (see the module docstring), rendered and tokenized."""
    record = parse_json_line(line, where)
    if not isinstance(record, dict) or "prompt" not in record:
        raise DataError(f"{where}: expected an object with 'prompt' and 'answer' (and optionally 'reward')")
    unknown = sorted(set(record) - set(PROMPT_KEYS))
    if unknown:
        raise DataError(f"{where}: unknown key '{unknown[0]}' (a prompt line has {', '.join(PROMPT_KEYS)})")
    answer, reward = record.get("answer"), record.get("reward")
    if not isinstance(answer, str):
        raise DataError(f"{where}: 'answer' must be a string (what the reward checks), got {answer!r}")
    if reward is not None and (not isinstance(reward, str) or not reward):
        raise DataError(f"{where}: 'reward' must be the name of a reward, got {reward!r}")
    messages = message_side(record["prompt"], "user", f"{where}: prompt").messages
    if messages[-1]["role"] == "assistant":
        raise DataError(f"{where}: prompt ends with an assistant message; the reply is what the policy samples")
    text = template.render(messages, add_generation_prompt=True)
    ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    if ids.size == 0:
        raise DataError(f"{where}: the prompt renders to no tokens")
    return Prompt(ids, text, answer, reward, where)


class PromptRows:
    """Prompts as rows; ``batch(indices)`` is ``{prompt_index}``."""

    def __init__(self, prompts: Sequence[Prompt]) -> None:
        self.prompts = list(prompts)

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> Prompt:
        return self.prompts[index]

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        return {PROMPT_INDEX: torch.as_tensor(np.asarray(indices, dtype=np.int64))}


class PromptDataset(PromptSet):
    """Prompts of one or more ``.jsonl`` files, in file and line order."""

    def __init__(self, paths: Sequence[str | Path], tokenizer: Tokenizer) -> None:
        if not paths:
            raise DataError("a prompt dataset needs at least one .jsonl file in data.paths")
        template = chat_template_for(tokenizer)
        self.paths = [Path(p).expanduser() for p in paths]
        self.prompts = [parse_prompt(line, where, tokenizer, template)
                        for path in self.paths for _, line, where in jsonl_lines(path, "prompt data")]
        if not self.prompts:
            raise DataError(f"no prompts in {', '.join(map(str, self.paths))}")

    def __len__(self) -> int:
        return len(self.prompts)

    def split_samples(self, data: Any) -> tuple[PromptRows, PromptRows | None]:
        """Training and validation prompts: the last ``valid_fraction`` held out. A prompt longer than
        ``seq_length`` leaves no room for a reply: one line naming it."""
        if data.pack:
            raise DataError("data.pack does not apply to prompts (each reply is sampled into its own row)")
        for prompt in self.prompts:
            if len(prompt.ids) >= data.seq_length:
                raise DataError(f"{prompt.where}: the prompt is {len(prompt.ids)} tokens, no room for a reply within "
                                f"data.seq_length {data.seq_length}")
        train, valid = hold_out(self.prompts, data.valid_fraction, f"{self.paths[0]}", "prompt(s)")
        return PromptRows(train), PromptRows(valid) if valid else None


def shipped_tasks_path() -> Path:
    """The verifiable tasks shipped with loongforge-core (see ``task_data/README.md``)."""
    return Path(__file__).with_name("task_data") / "tasks.jsonl"


def prompt_dataset(
    paths: Sequence[str | Path],
    tokenizer: Tokenizer,
    *,
    text_key: str = "text",
    cache_dir: str | Path | None = None,
    progress: bool = False,
) -> PromptDataset:
    """Prompt ``.jsonl`` files (``{"prompt", "answer", "reward"}`` per line) for ``training.phase: grpo``."""
    return PromptDataset(paths, tokenizer)


def shipped_tasks(
    paths: Sequence[str | Path],
    tokenizer: Tokenizer,
    *,
    text_key: str = "text",
    cache_dir: str | Path | None = None,
    progress: bool = False,
) -> PromptDataset:
    """The small generated verifiable tasks shipped with loongforge-core."""
    if paths:
        raise DataError("dataset 'shipped-tasks' takes no paths (use dataset 'prompts' for your own files)")
    return PromptDataset([shipped_tasks_path()], tokenizer)
