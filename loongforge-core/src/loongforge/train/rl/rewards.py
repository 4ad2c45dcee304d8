"""Rewards: what scores a sampled reply against its prompt's ``answer`` (``loongforge_register_rewards``).

Why a registry of plain callables: a verifiable reward is a small, deterministic check users write themselves (a
unit-test runner, a math checker), so the contract is one function and plugins or a config's ``pkg.module:function``
add their own without touching core. Built-ins:

- ``exact-match``: 1 when the reply, stripped of surrounding white space, equals the answer, else 0;
- ``regex``: 1 when the answer, read as a Python regular expression, is found anywhere in the reply;
- ``numeric``: 1 when the last number in the reply equals the answer's number (to a relative 1e-9), else 0 -- the
  usual check of a maths reply that ends with its result.

Torch-free.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

from loongforge.errors import ConfigError

#: ``reward(completion=..., answer=..., prompt=...) -> float``.
Reward = Callable[..., float]

_NUMBER = re.compile(r"[-+]?(?:\d+(?:[.,]\d+)*(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?")


def exact_match(*, completion: str, answer: str, prompt: str = "") -> float:
    return float(completion.strip() == answer.strip())


@lru_cache(maxsize=4096)
def _compiled(pattern: str) -> re.Pattern:
    return re.compile(pattern)


def regex(*, completion: str, answer: str, prompt: str = "") -> float:
    return float(_compiled(answer).search(completion) is not None)


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def numeric(*, completion: str, answer: str, prompt: str = "") -> float:
    found = _NUMBER.findall(completion)
    expected = _number(answer.strip())
    if not found or expected is None:
        return 0.0
    got = _number(found[-1].rstrip("."))
    return float(got is not None and math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-12))


def register_builtin_rewards(registry: Any) -> None:
    registry.register("exact-match", "loongforge.train.rl.rewards:exact_match",
                      description="1 when the stripped reply equals the answer")
    registry.register("regex", "loongforge.train.rl.rewards:regex",
                      description="1 when the answer (a Python regular expression) is found in the reply")
    registry.register("numeric", "loongforge.train.rl.rewards:numeric",
                      description="1 when the reply's last number equals the answer's")


def resolve_rewards(config: Any, host: Any, prompts: Sequence[Any]) -> dict[str, Reward]:
    """Every reward the run's prompts are scored with, by name: ``grpo.reward``, or each prompt's own ``reward``
    (a prompt without one, when ``grpo.reward`` is null, is one line naming it). A ``regex`` answer that does not
    compile is found here, before the first step."""
    registry = host.registry("reward")
    chosen = config.grpo.reward
    names: dict[str, str] = {}
    for prompt in prompts:
        name = chosen or prompt.reward
        if name is None:
            raise ConfigError(f"{prompt.where}: the prompt names no reward and grpo.reward is null (add \"reward\" "
                              "to the line or set grpo.reward)")
        names.setdefault(name, prompt.where)
    rewards = {name: registry.load(name, where=f"grpo.reward in {config.source}" if chosen else where)
               for name, where in names.items()}
    for prompt in prompts:
        if rewards[chosen or prompt.reward] is regex:
            try:
                _compiled(prompt.answer)
            except re.error as exc:
                raise ConfigError(f"{prompt.where}: answer {prompt.answer!r} is not a regular expression ({exc})"
                                  ) from None
    return rewards


def score(reward: Reward, *, completion: str, answer: str, prompt: str, name: str, where: str) -> float:
    """``reward``'s score of one reply, checked finite (a reward that raises or returns something else is one line
    naming it and the prompt)."""
    try:
        value = reward(completion=completion, answer=answer, prompt=prompt)
    except Exception as exc:  # a user's reward: say which one failed on which prompt
        raise ConfigError(f"{where}: reward '{name}' failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{where}: reward '{name}' returned {value!r}; a reward returns a finite float")
    return float(value)
