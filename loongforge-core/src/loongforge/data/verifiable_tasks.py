"""Generated prompts with verifiable answers for ``training.phase: grpo``: what ``loongforge make-data
verifiable-tasks OUT`` writes and what ``task_data/tasks.jsonl`` (``data.dataset: shipped-tasks``) holds.

Why these tasks: reinforcement learning with verifiable rewards needs a model that already answers some prompts right
and some wrong when it samples -- a group of replies that all score alike carries no gradient. The tiny chat model of
``configs/sft-tiny.yaml`` knows the question formats of the shipped chat set but gets many answers wrong, so each task
here is one of those formats with its answer computed, and its ``reward`` names the built-in check
(:mod:`loongforge.train.rl.rewards`). ``--kinds`` picks among:

- ``letters``: how many letters a word has (``How many letters are in 'fortune'?``, answer ``7``, reward ``numeric``:
  the last number of the reply must equal it) -- a skill, so held-out words can be right;
- ``author``: who wrote one of the three shipped novels (answer ``Jane Austen``, reward ``regex``: found in the reply);
- ``published``: when one of them was first published (answer ``1817``, reward ``numeric``);
- ``novel``: in which of them a character appears (answer ``Persuasion``, reward ``regex``): nineteen characters, which
  the tiny SFT model places right about a third of the time -- the facts reinforcement learning has most to sharpen;
- ``sums``: adding 1 or 10 to a two-digit number (``What is 37 + 10?``, answer ``47``, ``numeric``);
- ``capitals``: a word in capitals (answer ``\\bGENTLEMAN\\b``, ``regex``);
- ``backwards``: a word spelt backwards (answer ``'nisuoc'``, ``regex``).

The shipped set (:data:`DEFAULT_KINDS`) is the first four: the tiny SFT model (150 steps) samples right answers to
them 11-71% of the time, and sums, capitals and backwards spelling (the rest) almost never, so their groups would all
score 0. The facts are a closed set (three novels, nineteen characters), so the same fact questions are in the
training and the held-out prompts; held-out words are drawn from the same 200 words as the training ones.

Every fourth task is written in the chat-messages form (a system prompt, then the question), the others as plain
strings. The output is a pure function of ``(count, seed, kinds)`` and the shipped corpus: ``python -m
loongforge.data.verifiable_tasks OUT`` with the defaults writes the shipped file byte for byte, which a test checks.
"""

from __future__ import annotations

import argparse
import random
import re
from collections.abc import Sequence
from pathlib import Path

from loongforge.data.generated_jsonl import add_generator_arguments, run_generator, write_jsonl
from loongforge.data.sft_data.make_chat import NOVELS, SYSTEM_PROMPTS, corpus_words
from loongforge.errors import ConfigError

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


def _letters(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    word = rng.choice(words)
    return f"How many letters are in '{word}'?", str(len(word)), "numeric"


def _author(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    return f"Who wrote {rng.choice(sorted(NOVELS))}?", "Jane Austen", "regex"


def _published(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    novel = rng.choice(sorted(NOVELS))
    return f"When was {novel} first published?", str(NOVELS[novel][0]), "numeric"


def _novel_of(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    novel = rng.choice(sorted(NOVELS))
    return f"In which novel does {rng.choice(NOVELS[novel][1])} appear?", re.escape(novel), "regex"


#: Every kind of task, by the name ``--kinds`` takes.
KINDS = {"sums": _sum, "capitals": _capitals, "backwards": _backwards, "letters": _letters, "author": _author,
         "published": _published, "novel": _novel_of}
#: The shipped mix: the kinds the tiny SFT model answers right some of the time when sampling (so that a group's
#: replies differ and carry a gradient); sums, capitals and backwards spelling it almost never gets right.
DEFAULT_KINDS = ("letters", "author", "published", "novel")


def tasks(count: int = DEFAULT_COUNT, seed: int = DEFAULT_SEED, kinds: Sequence[str] = DEFAULT_KINDS) -> list[dict]:
    """``count`` tasks ``{"prompt", "answer", "reward"}`` of ``kinds`` in about equal shares, a function of
    ``seed``."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise ConfigError(f"--kinds {','.join(kinds)}: unknown or none ({', '.join(unknown)}); known: "
                          f"{', '.join(KINDS)}")
    makers = [KINDS[kind] for kind in kinds]
    rng = random.Random(seed)
    words = [w for w in corpus_words(200) if w != w[::-1]]
    out = []
    for index in range(count):
        question, answer, reward = makers[rng.randrange(len(makers))](rng, words)
        prompt: str | list = question
        if index % 4 == 3:
            prompt = [{"role": "system", "content": SYSTEM_PROMPTS[index % 2]}, {"role": "user", "content": question}]
        out.append({"prompt": prompt, "answer": answer, "reward": reward})
    return out


def write(out: str | Path, count: int = DEFAULT_COUNT, seed: int = DEFAULT_SEED,
          kinds: Sequence[str] = DEFAULT_KINDS) -> Path:
    """Write :func:`tasks` as JSON lines to ``out``; return its path."""
    return write_jsonl(out, tasks(count, seed, kinds))


def configure(parser: argparse.ArgumentParser) -> None:
    """``loongforge make-data verifiable-tasks``'s arguments."""
    add_generator_arguments(parser, unit="tasks", dataset="prompts", count=DEFAULT_COUNT, seed=DEFAULT_SEED)
    parser.add_argument("--kinds", default=",".join(DEFAULT_KINDS),
                        help=f"comma-separated kinds of task, of {', '.join(KINDS)} (default "
                             f"{','.join(DEFAULT_KINDS)}: the shipped set)")


def run(args: argparse.Namespace) -> int:
    kinds = tuple(kind.strip() for kind in args.kinds.split(",") if kind.strip())
    tasks(1, args.seed, kinds)  # an unknown kind is one line before anything is written
    return run_generator(args, lambda out, count, seed: write(out, count, seed, kinds), "verifiable tasks")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write generated verifiable tasks (default: the shipped set).")
    configure(parser)
    raise SystemExit(run(parser.parse_args()))
