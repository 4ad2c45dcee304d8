"""Generated preference pairs with a verifiable right answer: what ``loongforge make-data preference-pairs OUT``
writes and what ``preference_data/pairs.jsonl`` (``data.dataset: shipped-preference``) holds.

Why these pairs: a tiny model fine-tuned on the shipped chat set (``configs/sft-tiny.yaml``) knows the question
formats, and DPO should teach it to prefer the right answer. Every chosen response is computed or taken from a fact
table, its rejected twin is the same sentence with the answer wrong, so held-out preference accuracy measures whether
the model learned to tell them apart, and starts at chance:

- adding 1 or 10 to a two-digit number (``What is 37 + 10?``: ``37 + 10 = 47.`` against ``37 + 10 = 57.``):
  a digit-wise rule, so held-out numbers can be right;
- facts about the three shipped Jane Austen novels -- author, first publication, which novel a character appears in --
  from the fact table of the chat set's script (``sft_data/make_chat.py``), against another author, year or novel;
- word tasks on frequent words of the shipped corpus: capitals (``SORRY`` against ``sorry``), spelling backwards (the
  reversed word against the word itself).

The four kinds come in equal shares. They are not equally hard for a tiny model: the facts and word tasks are learnt
in a few dozen steps, the sums stay near chance for a two-layer model (a measured breakdown is in
docs/post-training.md).

Every fourth pair is written in the chat-messages form (a system prompt in ``prompt``, ``chosen``/``rejected`` as
assistant messages), the others as plain strings, so both forms are shipped and read. The output is a pure function of
``(count, seed)`` and the shipped corpus (no network): ``python -m loongforge.data.preference_pairs OUT`` or the
command writes the shipped file byte for byte with the defaults, which a test checks.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from loongforge.data.generated_jsonl import add_generator_arguments, run_generator, write_jsonl
from loongforge.data.sft_data.make_chat import NOVELS, SYSTEM_PROMPTS, corpus_words

#: The shipped file's generator settings.
DEFAULT_COUNT, DEFAULT_SEED = 640, 20260301
#: Authors a novel was not written by.
WRONG_AUTHORS = ("Charles Dickens", "Charlotte Bronte", "George Eliot", "Walter Scott", "Mary Shelley")


def arithmetic(rng: random.Random) -> tuple[str, str, str]:
    a, step = rng.randint(10, 89), rng.choice((1, 10))
    wrong = a + step + rng.choice((-step, step, 11 - step))  # nothing added, added twice, or the other step too
    return f"What is {a} + {step}?", f"{a} + {step} = {a + step}.", f"{a} + {step} = {wrong}."


def fact(rng: random.Random) -> tuple[str, str, str]:
    novel = rng.choice(sorted(NOVELS))
    year, people = NOVELS[novel]
    kind = rng.randrange(3)
    if kind == 0:
        wrong = rng.choice(WRONG_AUTHORS)
        return f"Who wrote {novel}?", f"{novel} was written by Jane Austen.", f"{novel} was written by {wrong}."
    if kind == 1:
        wrong_year = year + rng.choice((-4, -2, -1, 1, 2, 5))
        question = f"When was {novel} first published?"
        return question, f"{novel} was first published in {year}.", f"{novel} was first published in {wrong_year}."
    person = rng.choice(people)
    other = rng.choice([n for n in sorted(NOVELS) if n != novel])
    return f"In which novel does {person} appear?", f"{person} appears in {novel}.", f"{person} appears in {other}."


def capitals(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    word = rng.choice(words)
    return f"Write '{word}' in capital letters.", word.upper(), word


def backwards(rng: random.Random, words: list[str]) -> tuple[str, str, str]:
    word = rng.choice(words)
    return f"Spell '{word}' backwards.", f"'{word}' backwards is '{word[::-1]}'.", f"'{word}' backwards is '{word}'."


def pairs(count: int = DEFAULT_COUNT, seed: int = DEFAULT_SEED) -> list[dict]:
    """``count`` pairs ``{"prompt", "chosen", "rejected"}``, a function of ``seed``."""
    rng = random.Random(seed)
    words = [w for w in corpus_words(200) if w != w[::-1]]  # a palindrome's reversal would be its own rejection
    makers = (lambda: arithmetic(rng), lambda: fact(rng), lambda: capitals(rng, words), lambda: backwards(rng, words))
    out = []
    for index in range(count):
        question, chosen, rejected = makers[rng.randrange(len(makers))]()
        if index % 4 == 3:  # the chat-messages form
            system = {"role": "system", "content": SYSTEM_PROMPTS[index % 2]}
            out.append({"prompt": [system, {"role": "user", "content": question}],
                        "chosen": [{"role": "assistant", "content": chosen}],
                        "rejected": [{"role": "assistant", "content": rejected}]})
        else:
            out.append({"prompt": question, "chosen": chosen, "rejected": rejected})
    return out


def write(out: str | Path, count: int = DEFAULT_COUNT, seed: int = DEFAULT_SEED) -> Path:
    """Write :func:`pairs` as JSON lines to ``out``; return its path."""
    return write_jsonl(out, pairs(count, seed))


def configure(parser: argparse.ArgumentParser) -> None:
    """``loongforge make-data preference-pairs``'s arguments."""
    add_generator_arguments(parser, unit="pairs", dataset="preference", count=DEFAULT_COUNT, seed=DEFAULT_SEED)


def run(args: argparse.Namespace) -> int:
    return run_generator(args, write, "preference pairs")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write generated preference pairs (default: the shipped set).")
    configure(parser)
    raise SystemExit(run(parser.parse_args()))
