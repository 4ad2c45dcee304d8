"""Generated prompts with verifiable answers for ``training.phase: grpo``: what ``loongforge make-data
verifiable-tasks OUT`` writes and what ``task_data/tasks.jsonl`` (``data.dataset: shipped-tasks``) holds.

Why these tasks: reinforcement learning with verifiable rewards needs a model that already answers some prompts right
and some wrong, and a checker that tells them apart without a judge. The tiny chat model of ``configs/sft-tiny.yaml``
knows the question formats of the shipped chat set but gets many answers wrong, so each task here is one of those
formats with its answer computed, and its ``reward`` names the built-in check (:mod:`loongforge.train.rl.rewards`):

- adding 1 or 10 to a two-digit number (``What is 37 + 10?``, answer ``47``, reward ``numeric``: the last number of
  the reply must equal it) -- a digit-wise rule, so held-out sums can be right;
- writing a word in capitals (answer ``\\bGENTLEMAN\\b``, reward ``regex``: found in the reply);
- spelling a word backwards (answer ``'nisuoc'``, reward ``regex``);
- who wrote one of the three shipped novels (answer ``Jane Austen``, reward ``regex``);
- when one of them was first published (answer ``1817``, reward ``numeric``);
- in which of them a character appears (answer ``Persuasion``, reward ``regex``): nineteen characters, which the
  tiny SFT model places right about half the time -- the facts reinforcement learning has most to sharpen.

The facts are a closed set (three novels, nineteen characters), so the same fact questions are in the training and
the held-out prompts; held-out words and sums are new.

Every fourth task is written in the chat-messages form (a system prompt, then the question), the others as plain
strings. The output is a pure function of ``(count, seed)`` and the shipped corpus: ``python -m
loongforge.data.verifiable_tasks OUT`` with the defaults writes the shipped file byte for byte, which a test checks.
"""

from __future__ import annotations

import argparse
import random
import re
from pathlib import Path

from loongforge.data.generated_jsonl import add_generator_arguments, run_generator, write_jsonl
from loongforge.data.sft_data.make_chat import NOVELS, SYSTEM_PROMPTS, corpus_words

#: The shipped file's generator settings.
DEFAULT_COUNT, DEFAULT_SEED = 512, 20261205


def _sum(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    a, step = rng.randint(10, 89), rng.choice((1, 10))
    return f"What is {a} + {step}?", str(a + step), "numeric"


def _capitals(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    word = rng.choice(words)
    return f"Write '{word}' in capital letters.", rf"\b{re.escape(word.upper())}\b", "regex"


def _backwards(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    word = rng.choice(words)
    return f"Spell '{word}' backwards.", re.escape(f"'{word[::-1]}'"), "regex"


def _author(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    return f"Who wrote {rng.choice(sorted(NOVELS))}?", "Jane Austen", "regex"


def _published(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    novel = rng.choice(sorted(NOVELS))
    return f"When was {novel} first published?", str(NOVELS[novel][0]), "numeric"


def _novel_of(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    novel = rng.choice(sorted(NOVELS))
    return f"In which novel does {rng.choice(NOVELS[novel][1])} appear?", re.escape(novel), "regex"


TASKS = (_sum, _capitals, _backwards, _author, _published, _novel_of)


def tasks(count: int = DEFAULT_COUNT, seed: int = DEFAULT_SEED) -> list[dict]:
    """``count`` tasks ``{"prompt", "answer", "reward"}``, a function of ``seed``."""
    rng = random.Random(seed)
    words = [w for w in corpus_words(200) if w != w[::-1]]
    out = []
    for index in range(count):
        question, answer, reward = TASKS[rng.randrange(len(TASKS))](rng, words)
        prompt: str | list = question
        if index % 4 == 3:
            prompt = [{"role": "system", "content": SYSTEM_PROMPTS[index % 2]}, {"role": "user", "content": question}]
        out.append({"prompt": prompt, "answer": answer, "reward": reward})
    return out


def write(out: str | Path, count: int = DEFAULT_COUNT, seed: int = DEFAULT_SEED) -> Path:
    """Write :func:`tasks` as JSON lines to ``out``; return its path."""
    return write_jsonl(out, tasks(count, seed))


def configure(parser: argparse.ArgumentParser) -> None:
    """``loongforge make-data verifiable-tasks``'s arguments."""
    add_generator_arguments(parser, unit="tasks", dataset="prompts", count=DEFAULT_COUNT, seed=DEFAULT_SEED)


def run(args: argparse.Namespace) -> int:
    return run_generator(args, write, "verifiable tasks")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write generated verifiable tasks (default: the shipped set).")
    configure(parser)
    raise SystemExit(run(parser.parse_args()))
