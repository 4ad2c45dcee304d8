"""Hugging Face Hub ids (``OWNER/NAME[@REV]``) wherever a Hugging Face directory is taken: ``convert``, ``generate``,
``eval``, ``model.load: hf:...`` and ``data.tokenizer: hf:...``, resolved through ``huggingface_hub``'s cache.

No hub is reachable here, so the cache is filled ahead of time the way ``huggingface_hub`` lays it out
(``models--OWNER--NAME/snapshots/COMMIT/`` and ``refs/main`` naming the commit) and every command runs as a user's
would, in its own process with ``HF_HUB_OFFLINE=1``: the id reads the same model as the local directory it was
copied from, a pinned revision is honoured, and an id that is not cached fails in one line that says so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import HF_TINY_CASES, make_hf_model, tiny_settings, word_tokenizer

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "tiny-org/tiny-llama"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """``(cache, local copy)``: a tiny Llama with a word tokenizer, both in a directory and in the Hub cache."""
    root = tmp_path_factory.mktemp("hub")
    local = root / "local"
    config_cls, model_cls, _ = HF_TINY_CASES["llama3-rope-untied"]
    make_hf_model(config_cls, model_cls, tiny_settings("llama3-rope-untied"), seed=5).save_pretrained(local)
    word_tokenizer(local, 384)
    cache = root / "cache"
    repo = cache / f"models--{REPO.replace('/', '--')}"
    shutil.copytree(local, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return cache, local


def run(hub, *args, cwd=None):
    cache, _ = hub
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "LOONGFORGE_PROGRESS": "off",
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "loongforge.cli", *args], env=env, capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def test_generate_and_eval_read_a_cached_hub_id_as_its_directory(hub, tmp_path):
    _, local = hub
    prompt = ["--prompt", "w5 w9 w12", "--max-new-tokens", "6", "--jsonl"]
    by_path = run(hub, "generate", str(local), *prompt)
    assert by_path.returncode == 0, by_path.stderr[-2000:]
    by_id = run(hub, "generate", f"{REPO}@{COMMIT}", *prompt)  # a pinned revision; eval below reads refs/main
    assert by_id.returncode == 0, by_id.stderr[-2000:]
    assert json.loads(by_id.stdout) == json.loads(by_path.stdout)
    text = tmp_path / "held-out.txt"
    text.write_text("w5 w9 w12 w3 w40 w41\n\nw6 w60 w66 w7\n")
    scores = {}
    for source in (REPO, str(local)):
        out = tmp_path / f"{source.replace('/', '_')}.json"
        done = run(hub, "eval", source, "--perplexity", str(text), "--output", str(out))
        assert done.returncode == 0, done.stderr[-2000:]
        scores[source] = json.loads(out.read_text())["results"]["loongforge_perplexity"]["word_perplexity,none"]
    assert scores[REPO] == scores[str(local)] > 1.0


def test_convert_and_a_run_config_take_a_cached_hub_id(hub, tmp_path):
    converted = run(hub, "convert", "hf-to-mcore", REPO, str(tmp_path / "ckpt"))
    assert converted.returncode == 0, converted.stderr[-2000:]
    assert (tmp_path / "ckpt" / "manifest.json").is_file()
    config = tmp_path / "run.yaml"
    config.write_text(f"model:\n  load: hf:{REPO}\ndata:\n  dataset: shipped-corpus\n  seq_length: 64\n"
                      "training:\n  steps: 1\n  micro_batch_size: 2\n")
    checked = run(hub, "check", str(config), "--print-config")
    assert checked.returncode == 0, checked.stderr[-2000:]
    snapshot = f"snapshots/{COMMIT}"
    for key in ("load", "tokenizer"):  # model.load and the tokenizer it brings (data.tokenizer): the snapshot
        assert f"  {key}: hf:{hub[0]}/models--tiny-org--tiny-llama/{snapshot}" in checked.stdout, checked.stdout


@pytest.mark.parametrize("args, message", [
    (["generate", "tiny-org/not-cached", "--prompt", "w5"], "as a Hugging Face Hub id it is not in the cache"),
    (["eval", f"{REPO}@v2", "--perplexity", "x.txt"], "it is not in the cache"),
    (["convert", "hf-to-mcore", "tiny-org/not-cached", "out"], "while HF_HUB_OFFLINE=1"),
])
def test_an_uncached_hub_id_offline_is_one_line(hub, tmp_path, args, message):
    done = run(hub, *args, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and message in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_uncached_hub_ids_in_a_config_name_their_key(hub, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model: llama-tiny\ndata:\n  tokenizer: hf:tiny-org/no-tokenizer\n")
    done = run(hub, "check", str(config))
    assert done.returncode == 2
    assert "data.tokenizer 'tiny-org/no-tokenizer' is no local directory" in done.stderr, done.stderr[-2000:]
