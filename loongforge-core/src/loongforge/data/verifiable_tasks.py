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

The shipped set (:data:`DEFAULT_KINDS`) is letter counts alone. The tiny SFT model (150 steps) samples right answers
to the first four kinds 11-71% of the time, and sums, capitals and backwards spelling almost never, so their groups
would all score 0; of those four, only letter counts are a skill that a held-out split can test on new words (see
below), and a policy trained on them alone gains on the held-out words with every seed tried, while one trained on
all four did not (docs/post-training.md, "Measured").

The held-out split asks nothing the training prompts ask: the last ``count / 8`` tasks (what ``data.valid_fraction:
0.125`` holds out) are skills -- letter counts of every fourth corpus word and, when asked for, sums, capitals and
backwards spellings of those words or of numbers ending in 3 or 7 -- none of which a training prompt uses
(:func:`pools`). The facts (who wrote the novels, when, where a character appears) are training prompts only: a
policy is rewarded into the facts it is asked about and no others, so a held-out fact measures only what training
on the other facts did to it. A held-out gain is then a skill answered better on words it was not trained on.

Every fourth task is written in the chat-messages form (a system prompt, then the question), the others as plain
strings. The output is a pure function of ``(count, seed, kinds)`` and the shipped corpus: ``python -m
loongforge.data.verifiable_tasks OUT`` with the defaults writes the shipped file byte for byte, which a test checks.
"""

from __future__ import annotations

import argparse
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from loongforge.data.generated_jsonl import add_generator_arguments, run_generator, write_jsonl
from loongforge.data.sft_data.make_chat import NOVELS, SYSTEM_PROMPTS, corpus_words
from loongforge.errors import ConfigError

#: The shipped file's generator settings.
DEFAULT_COUNT, DEFAULT_SEED = 512, 20261205


@dataclass(frozen=True)
class Pool:
    """What one side of the split draws its questions from: the training prompts' words and numbers, or the held-out
    prompts' (none shared)."""

    words: tuple[str, ...]
    numbers: tuple[int, ...]


def pools() -> tuple[Pool, Pool]:
    """``(training, held-out)``: every fourth corpus word and the numbers ending in 3 or 7 are held out."""
    words = [w for w in corpus_words(200) if w != w[::-1]]
    held_word = [index % 4 == 3 for index in range(len(words))]
    held_number = {n: n % 10 in (3, 7) for n in range(10, 90)}
    return tuple(Pool(tuple(w for w, held in zip(words, held_word, strict=True) if held == side),
                      tuple(n for n, held in held_number.items() if held == side)) for side in (False, True))


def _sum(rng: random.Random, pool: Pool) -> tuple[str, str, str]:
    a, step = rng.choice(pool.numbers), rng.choice((1, 10))
    return f"What is {a} + {step}?", str(a + step), "numeric"


def _capitals(rng: random.Random, pool: Pool) -> tuple[str, str, str]:
    word = rng.choice(pool.words)
    return f"Write '{word}' in capital letters.", rf"\b{re.escape(word.upper())}\b", "regex"


def _backwards(rng: random.Random, pool: Pool) -> tuple[str, str, str]:
    word = rng.choice(pool.words)
    return f"Spell '{word}' backwards.", re.escape(f"'{word[::-1]}'"), "regex"


def _letters(rng: random.Random, pool: Pool) -> tuple[str, str, str]:
    word = rng.choice(pool.words)
    return f"How many letters are in '{word}'?", str(len(word)), "numeric"


def _author(rng: random.Random, pool: Pool) -> tuple[str, str, str]:
    return f"Who wrote {rng.choice(sorted(NOVELS))}?", "Jane Austen", "regex"


def _published(rng: random.Random, pool: Pool) -> tuple[str, str, str]:
    novel = rng.choice(sorted(NOVELS))
    return f"When was {novel} first published?", str(NOVELS[novel][0]), "numeric"


def _novel_of(rng: random.Random, pool: Pool) -> tuple[str, str, str]:
    novel = rng.choice(sorted(NOVELS))
    return f"In which novel does {rng.choice(NOVELS[novel][1])} appear?", re.escape(novel), "regex"


#: Every kind of task, by the name ``--kinds`` takes.
KINDS = {"sums": _sum, "capitals": _capitals, "backwards": _backwards, "letters": _letters, "author": _author,
         "published": _published, "novel": _novel_of}
#: Facts about the three shipped novels: a policy can only be rewarded into facts it is asked about (a character
#: no training prompt names is not learnt by reinforcement), so they are training prompts only; the held-out split
#: asks the other kinds, skills, about words and numbers no training prompt uses.
FACTS = frozenset({"author", "published", "novel"})
#: The shipped set: the one skill the tiny SFT model answers right some of the time when sampling (so that a
#: group's replies differ and carry a gradient); sums, capitals and backwards spelling it almost never gets right.
DEFAULT_KINDS = ("letters",)


def check(kinds: Sequence[str], held_out: int, count: int) -> None:
    """One line for unknown kinds, a held-out count outside ``[0, count]`` or held-out tasks of closed kinds only."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise ConfigError(f"--kinds {','.join(kinds)}: unknown or none ({', '.join(unknown)}); known: "
                          f"{', '.join(KINDS)}")
    if not 0 <= held_out <= count:
        raise ConfigError(f"--held-out {held_out}: must be between 0 and --count {count}")
    if held_out and set(kinds) <= FACTS:
        skills = ", ".join(kind for kind in KINDS if kind not in FACTS)
        raise ConfigError(f"--kinds {','.join(kinds)}: none can be held out ({', '.join(sorted(FACTS))} are facts of "
                          f"three novels, training prompts only); add a skill ({skills}) or --held-out 0")


def tasks(count: int = DEFAULT_COUNT, seed: int = DEFAULT_SEED, kinds: Sequence[str] = DEFAULT_KINDS,
          held_out: int | None = None) -> list[dict]:
    """``count`` tasks ``{"prompt", "answer", "reward"}`` of ``kinds`` in about equal shares, a function of
    ``seed``; the last ``held_out`` (default ``count // 8``, what ``data.valid_fraction: 0.125`` holds out) ask
    about words and numbers no earlier task asks about, and none of the :data:`FACTS`."""
    held_out = count // 8 if held_out is None else held_out
    check(kinds, held_out, count)
    skills = [kind for kind in kinds if kind not in FACTS]
    training, testing = pools()
    rng = random.Random(seed)
    out = []
    for index in range(count):
        pool, names = (testing, skills) if index >= count - held_out else (training, kinds)
        question, answer, reward = KINDS[names[rng.randrange(len(names))]](rng, pool)
        prompt: str | list = question
        if index % 4 == 3:
            prompt = [{"role": "system", "content": SYSTEM_PROMPTS[index % 2]}, {"role": "user", "content": question}]
        out.append({"prompt": prompt, "answer": answer, "reward": reward})
    return out


def write(out: str | Path, count: int = DEFAULT_COUNT, seed: int = DEFAULT_SEED,
          kinds: Sequence[str] = DEFAULT_KINDS, held_out: int | None = None) -> Path:
    """Write :func:`tasks` as JSON lines to ``out``; return its path."""
    return write_jsonl(out, tasks(count, seed, kinds, held_out))


def configure(parser: argparse.ArgumentParser) -> None:
    """``loongforge make-data verifiable-tasks``'s arguments."""
    add_generator_arguments(parser, unit="tasks", dataset="prompts", count=DEFAULT_COUNT, seed=DEFAULT_SEED)
    parser.add_argument("--kinds", default=",".join(DEFAULT_KINDS),
                        help=f"comma-separated kinds of task, of {', '.join(KINDS)} (default "
                             f"{','.join(DEFAULT_KINDS)}: the shipped set)")
    parser.add_argument("--held-out", type=int, default=None, metavar="N",
                        help="the last N tasks ask only about words, characters and numbers no earlier task asks "
                             "about (default: count / 8, what data.valid_fraction: 0.125 holds out)")


def run(args: argparse.Namespace) -> int:
    kinds = tuple(kind.strip() for kind in args.kinds.split(",") if kind.strip())
    check(kinds, args.count // 8 if args.held_out is None else args.held_out, args.count)  # before writing anything
    return run_generator(args, lambda out, count, seed: write(out, count, seed, kinds, args.held_out),
                         "verifiable tasks")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write generated verifiable tasks (default: the shipped set).")
    configure(parser)
    raise SystemExit(run(parser.parse_args()))
