"""Small GRPO runs the tests share: a prompts file whose replies a tiny untrained model already gets right sometimes
(``regex`` answer ``[aeiou]``: the reply holds a vowel -- about one reply in five of random bytes), and the config
that trains on it."""

from __future__ import annotations

import json
from pathlib import Path

#: The words the prompts ask about (any: the reward only looks for a vowel).
WORDS = ("cat", "dog", "sun", "map", "pen", "cup", "box", "hat", "kit", "jam", "fog", "rug", "web", "zip", "van", "net")


def write_vowel_prompts(path: Path) -> Path:
    """32 prompts ``Say a word like '<w>'.`` answered by any reply holding a vowel (built-in ``regex``)."""
    lines = [{"prompt": f"Say a word like '{word}'." if i < 16 else [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": f"A word like '{word}'?"}],
        "answer": "[aeiou]", "reward": "regex"} for i, word in enumerate(WORDS * 2)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def grpo_overrides(out: Path, prompts: Path, *extra: str) -> list[str]:
    """A few GRPO steps of llama-debug on ``prompts``: 2 prompts x 4 replies per micro-batch, 2 micro-batches."""
    return [f"run.output_dir={out}", "run.seed=5", "model.name=llama-debug", "data.dataset=prompts",
            f"data.paths=[{prompts}]", "data.tokenizer=byte", "data.seq_length=80", "data.valid_fraction=0.25",
            "training.phase=grpo", "training.steps=4", "training.micro_batch_size=2", "training.global_batch_size=4",
            "training.threads=1", "grpo.group_size=4", "grpo.max_new_tokens=14", "optimizer.lr=0.01",
            "optimizer.weight_decay=0.0", "scheduler.warmup_steps=1", "evaluation.interval=0",
            "logging.progress=false", "logging.trackers=[]", "training.sample_tokens=0", "checkpoint.resume=never",
            "checkpoint.save_at_end=false", *extra]


def rows(out: Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
