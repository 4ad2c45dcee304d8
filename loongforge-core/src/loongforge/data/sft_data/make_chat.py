"""Generate ``chat.jsonl``, the small chat set shipped with loongforge-core (see README.md here).

Run ``python make_chat.py [OUT]`` (default: ``chat.jsonl`` beside this script). The output is a pure function of
this script and the shipped corpus (fixed seed, no network), so a test regenerates it and compares bytes.
Every answer is computed or taken from the fact table below, so the set is ours to license with the project.
"""

from __future__ import annotations

import json
import random
import re
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 20240611
SYSTEM_PROMPTS = ("You are a concise assistant.", "Answer in one short sentence.")

NOVELS = {
    "Sense and Sensibility": (1811, ["Elinor Dashwood", "Marianne Dashwood", "Edward Ferrars", "Colonel Brandon",
                                     "John Willoughby", "Lucy Steele"]),
    "Pride and Prejudice": (1813, ["Elizabeth Bennet", "Fitzwilliam Darcy", "Jane Bennet", "Charles Bingley",
                                   "Mr. Collins", "George Wickham", "Lady Catherine de Bourgh"]),
    "Persuasion": (1817, ["Anne Elliot", "Frederick Wentworth", "Sir Walter Elliot", "Lady Russell",
                          "Louisa Musgrove", "William Elliot"]),
}


def corpus_words(count: int) -> list[str]:
    """The ``count`` most frequent lower-case words of 5-9 letters in the shipped novels."""
    text = " ".join(p.read_text(encoding="utf-8") for p in sorted((HERE.parent / "corpus").glob("*.txt")))
    counts = Counter(re.findall(r"\b[a-z]{5,9}\b", text))
    return [word for word, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:count]]


def arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice("+-*")
    if op == "-" and b > a:
        a, b = b, a
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return f"What is {a} {op} {b}?", f"{a} {op} {b} = {value}."


def fact(rng: random.Random) -> tuple[str, str]:
    novel = rng.choice(sorted(NOVELS))
    year, people = NOVELS[novel]
    kind = rng.randrange(3)
    if kind == 0:
        return f"Who wrote {novel}?", f"{novel} was written by Jane Austen."
    if kind == 1:
        return f"When was {novel} first published?", f"{novel} was first published in {year}."
    person = rng.choice(people)
    return f"In which novel does {person} appear?", f"{person} appears in {novel}."


def word_task(rng: random.Random, words: list[str]) -> tuple[str, str]:
    word = rng.choice(words)
    kind = rng.randrange(3)
    if kind == 0:
        return f"Spell '{word}' backwards.", f"'{word}' backwards is '{word[::-1]}'."
    if kind == 1:
        return f"How many letters are in '{word}'?", f"'{word}' has {len(word)} letters."
    return f"Write '{word}' in capital letters.", f"{word.upper()}"


def conversations() -> list[dict]:
    rng = random.Random(SEED)
    words = corpus_words(200)
    makers = (lambda: arithmetic(rng), lambda: fact(rng), lambda: word_task(rng, words))
    out = []
    for index in range(400):
        messages = []
        if index % 5 == 0:
            messages.append({"role": "system", "content": SYSTEM_PROMPTS[index % 2]})
        for _ in range(2 if index % 4 == 0 else 1):  # every fourth conversation has two turns
            question, answer = makers[rng.randrange(3)]()
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        out.append({"messages": messages})
    return out


def main(argv: list[str]) -> None:
    out = Path(argv[0]) if argv else HERE / "chat.jsonl"
    lines = [json.dumps(c, ensure_ascii=False) for c in conversations()]
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:])
