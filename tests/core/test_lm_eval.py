"""``loongforge eval --tasks`` against lm-evaluation-harness's own ``hf`` model class (transformers) on the same model.

Two models: the quickstart recipe's checkpoint (llama-tiny trained a few steps on the shipped corpus with the byte
tokenizer), exported with ``loongforge convert mcore-to-hf``; and a tiny Llama built by transformers from a config,
weights drawn away from init, with a word-level tokenizer. For the export, lm-eval's ``hf`` class needs a tokenizer
transformers loads: the test writes the byte tokenizer as a ``tokenizers`` byte-level BPE without merges (ids 0-255
the bytes, then ``<bos>``, ``<eos>``, ``<pad>``), from the GPT-2 byte-to-character table written out here.

The tasks are written by the test in lm-eval's YAML format on local jsonl files: multiple choice (acc, acc_norm),
generation (exact match after a regex filter) and ``--perplexity`` (rolling log-likelihood). Asserted: every metric
within 1e-4 (accuracies) or 1e-5 relative (perplexities), each request's log-likelihood within 1e-5 relative and its
greedy flag equal, the generated strings equal -- at tp=1 in-process and at tp=2 under torchrun.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port, make_hf_model, word_tokenizer
from loongforge.cli import main

ROOT = Path(__file__).resolve().parents[2]

MC_DOCS = [
    {"question": "It is a truth universally acknowledged, that a single man in possession of a good fortune, must "
                 "be in want of a", "choices": [" wife", " horse", " house", " letter"], "answer": 0},
    {"question": "Mr. and Mrs. Bennet had five", "choices": [" daughters", " sons", " dogs"], "answer": 0},
    {"question": "Elizabeth walked to", "choices": [" Netherfield", " London", " the sea"], "answer": 0},
    {"question": "Who wrote Persuasion?", "choices": [" Jane Austen", " Charles Dickens"], "answer": 0},
    {"question": "The sun rose over the", "choices": [" hills", " quiet house", " man"], "answer": 1},
]
WORD_DOCS = [
    {"question": "w5 w9 w12 w3", "choices": [" w7", " w8 w9", " w100"], "answer": 1},
    {"question": "w40 w41", "choices": [" w42", " w2", " w77 w78 w79"], "answer": 0},
    {"question": "w200 w13 w13 w13", "choices": [" w13", " w14"], "answer": 0},
    {"question": "w6", "choices": [" w6", " w60", " w66"], "answer": 2},
]


def byte_level_tokenizer(directory: Path) -> None:
    """The byte tokenizer (ids 0-255 = bytes, 256 <bos>, 257 <eos>, 258 <pad>) as a Hugging Face tokenizer."""
    import tokenizers

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):  # GPT-2's table: printable bytes map to themselves, the rest to 256 + n
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    vocab = {table[byte]: byte for byte in range(256)}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(["<bos>", "<eos>", "<pad>"])
    assert [tok.token_to_id(t) for t in ("<bos>", "<eos>", "<pad>")] == [256, 257, 258]
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "tokenizer_class": "PreTrainedTokenizerFast"}))


def write_tasks(directory: Path, docs: list[dict], stop: str) -> list[str]:
    """Multiple-choice and generation task YAMLs over ``docs`` (relative data_files, as a user writes them)."""
    (directory / "docs.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: docs.jsonl\ntest_split: test\n"
    (directory / "mc.yaml").write_text(
        "task: test_mc\n" + common + "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (directory / "gen.yaml").write_text(
        "task: test_gen\n" + common + "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
        "doc_to_target: '{{choices[answer]}}'\n"
        f"generation_kwargs:\n  until: [{json.dumps(stop)}]\n  max_gen_toks: 12\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    return [str(directory / "mc.yaml"), str(directory / "gen.yaml")]


def write_corpus(path: Path, words: bool) -> Path:
    if words:
        text = "\n\n".join(" ".join(f"w{(7 * i + j * j) % 300 + 2}" for j in range(40 + 9 * i)) for i in range(3))
    else:
        corpus = (ROOT / "loongforge-core/src/loongforge/data/corpus").glob("*.txt")
        text = "\n\n".join(p.read_text(encoding="utf-8")[-1500:] for p in sorted(corpus)[:2])
    path.write_text(text + "\n")
    return path


def hf_scores(hf_dir: Path, tasks: list[str], perplexity: Path) -> dict:
    """lm-eval's own ``hf`` model class on ``hf_dir``, the same task files through lm-eval's task manager."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    from loongforge.evaluation.harness import task_directory

    with task_directory(tasks, perplexity) as (names, directory):
        return lm_eval.simple_evaluate(
            model="hf", model_args=f"pretrained={hf_dir},dtype=float32,device=cpu", tasks=names,
            task_manager=TaskManager(include_path=str(directory)), log_samples=True, bootstrap_iters=0,
            random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0, batch_size=4)


def our_scores(tmp: Path, source: Path, tasks: list[str], perplexity: Path, name: str) -> dict:
    out = tmp / f"{name}.json"
    args = ["eval", str(source), "--tasks", ",".join(tasks), "--perplexity", str(perplexity), "--batch-size", "3",
            "--output", str(out)]
    assert main(args) == 0
    return json.loads(out.read_text())["results"]


def assert_same_scores(ours: dict, reference: dict) -> None:
    reference = reference["results"]
    assert set(ours) == set(reference)
    checked = 0
    for task, metrics in reference.items():
        for key, value in metrics.items():
            if not isinstance(value, float) or "stderr" in key:
                continue
            if "perplexity" in key or "bits_per_byte" in key:
                assert ours[task][key] == pytest.approx(value, rel=1e-5), (task, key)
                assert value > 1.0 or "bits" in key
            else:
                assert abs(ours[task][key] - value) <= 1e-4, (task, key, ours[task][key], value)
            checked += 1
    assert checked >= 6


def assert_same_requests(hf_dir: Path, source: Path, docs: list[dict], prompt_for_gen: list[str]) -> None:
    """Each (context, continuation) log-likelihood and greedy flag, and each greedy generation, request by request:
    LoongForge's model class against lm-eval's ``hf`` class."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from loongforge.evaluation.harness import loaded_model
    from loongforge.evaluation.lm import LoongForgeLM
    from loongforge.interop.generate import source_tokenizer

    pairs = [(doc["question"], choice) for doc in docs for choice in doc["choices"]] + [("", docs[0]["question"])]
    scoring = [Instance("loglikelihood", {}, pair, index) for index, pair in enumerate(pairs)]
    generating = [Instance("generate_until", {}, (text, {"until": ["."], "max_gen_toks": 10, "do_sample": False}),
                           index) for index, text in enumerate(prompt_for_gen)]
    reference = HFLM(pretrained=str(hf_dir), dtype="float32", device="cpu", batch_size=4)
    want_scores, want_texts = reference.loglikelihood(scoring), reference.generate_until(generating)
    with loaded_model(str(source), trust_code=False) as (model, info):
        _, tok = source_tokenizer(info)
        ours = LoongForgeLM(model, tok, vocab_size=info.family.decoder.vocab_size,
                            max_length=info.family.decoder.max_position_embeddings, stop_ids=[], batch_size=5)
        got_scores, got_texts = ours.loglikelihood(scoring), ours.generate_until(generating)
    for (got, greedy), (want, want_greedy), pair in zip(got_scores, want_scores, pairs, strict=True):
        assert got == pytest.approx(want, rel=1e-5), pair
        assert greedy == want_greedy, pair
    assert len({round(score, 3) for score, _ in want_scores}) > len(pairs) // 2  # distinct scores: a real model
    assert got_texts == want_texts
    assert any(text.strip() for text in want_texts)


@pytest.fixture(scope="module")
def quickstart_export(tmp_path_factory):
    """(checkpoint, HF export with a byte-level HF tokenizer) of the quickstart recipe trained 30 steps."""
    root = tmp_path_factory.mktemp("quickstart")
    assert main(["train", str(ROOT / "configs/quickstart.yaml"), f"run.output_dir={root / 'run'}", "training.steps=30",
                 "training.micro_batch_size=4", "training.sample_tokens=0", "scheduler.warmup_steps=2",
                 "checkpoint.interval=0", "checkpoint.save_at_end=true", "logging.interval=30"]) == 0
    checkpoint = root / "run" / "checkpoints"
    export = root / "hf"
    assert main(["convert", "mcore-to-hf", str(checkpoint), str(export)]) == 0
    byte_level_tokenizer(export)
    return checkpoint, export


def test_quickstart_checkpoint_scores_as_lm_eval_hf_scores_its_export(tmp_path, quickstart_export):
    checkpoint, export = quickstart_export
    tasks = write_tasks(tmp_path, MC_DOCS, stop=".")
    corpus = write_corpus(tmp_path / "held-out.txt", words=False)
    assert_same_scores(our_scores(tmp_path, checkpoint, tasks, corpus, "ours"), hf_scores(export, tasks, corpus))
    assert_same_requests(export, checkpoint, MC_DOCS, ["Mr. Darcy", "It is a truth", "Who wrote Persuasion?\n"])


def test_tiny_transformers_model_scores_as_lm_eval_hf_scores_it(tmp_path):
    hf_dir = tmp_path / "hf-llama"
    settings = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=320, max_position_embeddings=256, rms_norm_eps=1e-6)
    make_hf_model("LlamaConfig", "LlamaForCausalLM", settings, seed=3).save_pretrained(hf_dir)
    word_tokenizer(hf_dir, 320)
    tasks = write_tasks(tmp_path, WORD_DOCS, stop=" w2")
    corpus = write_corpus(tmp_path / "held-out.txt", words=True)
    assert_same_scores(our_scores(tmp_path, hf_dir, tasks, corpus, "ours"), hf_scores(hf_dir, tasks, corpus))
    assert_same_requests(hf_dir, hf_dir, WORD_DOCS, ["w5 w9", "w40 w41 w42", "w300"])


@pytest.mark.distributed
def test_tensor_parallel_two_scores_as_one_process(tmp_path, quickstart_export):
    """torchrun, two processes: the checkpoint resharded to tp=2 gives tp=1's scores (and lm-eval's hf class's)."""
    checkpoint, export = quickstart_export
    tasks = write_tasks(tmp_path, MC_DOCS, stop=".")
    corpus = write_corpus(tmp_path / "held-out.txt", words=False)
    out = tmp_path / "tp2.json"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), "-m", "loongforge.cli", "eval", str(checkpoint), "--tasks", ",".join(tasks),
         "--perplexity", str(corpus), "--output", str(out)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("test_mc") == 1  # one table, from rank 0
    assert "at tensor-parallel size 2" in done.stderr
    assert_same_scores(json.loads(out.read_text())["results"], hf_scores(export, tasks, corpus))


def test_eval_refuses_what_it_cannot_score(tmp_path, capsys, quickstart_export):
    checkpoint, _ = quickstart_export
    bad = tmp_path / "bad.yaml"
    bad.write_text("dataset_path: json\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": 3}\n')
    for args, message in (([], "nothing to evaluate: give --tasks and/or --perplexity"),
                          (["--tasks", str(bad)], "bad.yaml: no 'task: NAME' at its top level"),
                          (["--tasks", str(tmp_path / "missing.yaml")], "missing.yaml not found"),
                          (["--perplexity", str(empty)], "empty.jsonl:1: no string field 'text'"),
                          (["--tasks", str(bad), "--batch-size", "0"], "--batch-size must be >= 1")):
        assert main(["eval", str(checkpoint), *args]) == 2
        assert message in capsys.readouterr().err


def test_evaluation_tasks_score_the_training_weights_as_eval_scores_the_checkpoint(tmp_path):
    """``evaluation.tasks`` during a run: the scores logged at a step equal ``loongforge eval`` of the checkpoint
    saved at that step (the same weights, read back), and reach metrics.jsonl and the step line."""
    tasks = write_tasks(tmp_path, MC_DOCS, stop=".")[:1]
    out = tmp_path / "run"
    assert main(["train", str(ROOT / "configs/quickstart.yaml"), f"run.output_dir={out}", "training.steps=8",
                 "training.micro_batch_size=4", "training.sample_tokens=0", "scheduler.warmup_steps=2",
                 "data.valid_fraction=0.02", "evaluation.interval=8", "evaluation.steps=1",
                 f"evaluation.tasks=[{tasks[0]}]", "checkpoint.interval=0", "logging.interval=8"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = {key[4:]: value for key, value in rows[-1].items() if key.startswith("val_test_mc/")}
    assert set(logged) == {"test_mc/acc", "test_mc/acc_norm"}
    scored = tmp_path / "scores.json"
    assert main(["eval", str(out / "checkpoints"), "--tasks", tasks[0], "--output", str(scored)]) == 0
    offline = json.loads(scored.read_text())["results"]["test_mc"]
    assert logged == pytest.approx({"test_mc/acc": offline["acc,none"], "test_mc/acc_norm": offline["acc_norm,none"]},
                                   abs=1e-4)


@pytest.mark.parametrize("overrides, message", [
    (["evaluation.interval=0"], "evaluation.tasks is set but evaluation.interval is 0"),
    (["training.phase=dpo", "data.dataset=shipped-preference"], "scores pretraining and SFT runs"),
    (["evaluation.tasks=[missing.yaml]"], "evaluation.tasks: task file missing.yaml not found"),
])
def test_evaluation_tasks_a_run_cannot_score_are_refused_by_check(tmp_path, capsys, overrides, message):
    task = write_tasks(tmp_path, MC_DOCS, stop=".")[0]
    assert main(["check", str(ROOT / "configs/quickstart.yaml"), "evaluation.interval=10", "data.valid_fraction=0.05",
                 f"evaluation.tasks=[{task}]", *overrides]) == 2
    assert message in capsys.readouterr().err
