"""KV-cache decoding computes what full recomputation computes; a batch computes what its prompts do one by one.

Tiny random Hugging Face models (conftest's ``HF_TINY_CASES``) are loaded into our megatron models the way
``loongforge generate`` loads a directory. Tokens alone could hide a broken cache (a saturated random model
repeats one token whatever its context), so every test also records the logits each token was chosen from, at
the LM head, and compares them step by step: cached prompts batched with left padding against each prompt
recomputed alone, across RoPE, learned absolute positions, parallel residuals, MoE and Gemma-2's sliding window
(8 tokens, passed after a few steps) with soft-capping.
"""

from __future__ import annotations

import json

import pytest
import torch
from loongforge.cli import main
from loongforge.data.chat_template import ByteChatTemplate
from loongforge.data.tokenizers import ByteTokenizer
from loongforge.interop.generate import generate_from_checkpoint
from loongforge.models.generate import generate_batch, supports_kv_cache

CASES = ("llama3-rope-untied", "gpt2-tied", "pythia-parallel-rotary", "mixtral-top2", "gemma2-softcap-window")
LENGTHS = (11, 3, 7)
STEPS = 24


@pytest.fixture
def world():
    """The CPU backend in a one-process megatron world (what ``loongforge generate`` builds its model in)."""
    from loongforge.interop.world import standalone_world

    with standalone_world() as backend:
        yield backend


def _load(directory, backend):
    """The megatron model of a HF directory filled as ``loongforge generate`` fills it, and its vocabulary size."""
    from loongforge.interop.hf_checkpoint import index_hf_tensors, load_hf_tensors
    from loongforge.interop.sharding import load_full_state
    from loongforge.models.chunks import build_standalone
    from loongforge.models.hf_format import read_hf_model

    flavor = read_hf_model(directory).family
    model = build_standalone(flavor, backend)
    load_full_state([model], flavor.hf_adapter().from_hf(load_hf_tensors(index_hf_tensors(directory))))
    return model, flavor.vocab_size


def _prompts(vocab: int, lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    draw = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=draw).tolist() for n in lengths]


def _run(model, prompts, vocab, steps=STEPS, **options):
    """``(new ids per prompt, [steps, prompts, vocab] logits each choice was made from)``."""
    seen: list[torch.Tensor] = []
    hook = model.output_layer.register_forward_hook(
        lambda module, args, output: seen.append(output[0][-1, :, :vocab].clone()))  # [s, b, v]: the last position
    try:
        new = generate_batch(model, prompts, steps, vocab_size=vocab, max_positions=256, **options)
    finally:
        hook.remove()
    return new, torch.stack(seen)


@pytest.mark.parametrize("case", CASES)
def test_cached_batch_equals_each_prompt_recomputed(case, hf_tiny, world):
    model, vocab = _load(hf_tiny(case)[0], world)
    assert supports_kv_cache(model)
    prompts = _prompts(vocab)
    cached, cached_logits = _run(model, prompts, vocab)
    for row, prompt in enumerate(prompts):
        alone, alone_logits = _run(model, [prompt], vocab, use_cache=False)
        assert cached[row] == alone[0]
        assert len(alone[0]) == STEPS
        diff = (cached_logits[:, row] - alone_logits[:, 0]).abs().max()
        assert diff.item() <= 1e-4, f"prompt {row}: cached batch logits differ from recomputation by {diff}"
    assert alone_logits.std() > 0.1  # the comparison is not of near-constant numbers


def test_the_cache_feeds_one_new_token_per_step(hf_tiny, world):
    model, vocab = _load(hf_tiny("llama3-rope-untied")[0], world)
    widths: list[tuple[int, int]] = []
    hook = model.embedding.register_forward_pre_hook(lambda module, args, kwargs: widths.append(
        tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    prompts = _prompts(vocab)
    generate_batch(model, prompts, 5, vocab_size=vocab, max_positions=256)
    assert widths == [(3, 11)] + [(3, 1)] * 4  # the left-padded prompts once, then one token per prompt
    widths.clear()
    generate_batch(model, prompts, 3, vocab_size=vocab, max_positions=256, use_cache=False)
    assert widths == [(3, 11), (3, 12), (3, 13)]
    hook.remove()


def test_a_stopped_prompt_leaves_the_others_unchanged(hf_tiny, world):
    model, vocab = _load(hf_tiny("mixtral-top2")[0], world)
    prompts = _prompts(vocab)
    free = _run(model, prompts, vocab)[0]
    stop = next(token for index, token in enumerate(free[0]) if index >= 3 and token not in free[0][:index])
    stopped, logits = _run(model, prompts, vocab, stop_ids={stop})
    assert stopped[0] == free[0][: free[0].index(stop)]
    for row, prompt in enumerate(prompts):
        alone, alone_logits = _run(model, [prompt], vocab, stop_ids={stop}, use_cache=False)
        assert stopped[row] == alone[0]
        steps = len(alone_logits)  # rows run on after a stop: compare the steps this prompt took
        assert (logits[:steps, row] - alone_logits[:, 0]).abs().max().item() <= 1e-4
    assert len(logits) > len(stopped[0]) + 1  # the batch went on after prompt 0 stopped


def test_sampling_does_not_depend_on_the_batch_or_the_cache(hf_tiny, world):
    model, vocab = _load(hf_tiny("qwen3-moe-top4")[0], world)
    prompts = _prompts(vocab)
    options = dict(temperature=1.0, top_k=50, seed=7, steps=12)
    batch = _run(model, prompts, vocab, **options)[0]
    assert batch == [_run(model, [prompt], vocab, use_cache=False, **options)[0][0] for prompt in prompts]
    assert _run(model, prompts, vocab, **{**options, "seed": 8})[0] != batch
    assert batch != _run(model, prompts, vocab, steps=12)[0]  # sampled, not greedy


def test_contexts_past_max_positions_slide_as_recomputation_does(hf_tiny, world):
    model, vocab = _load(hf_tiny("qwen3-qknorm-untied")[0], world)
    prompts = _prompts(vocab, lengths=(14, 3, 9))
    options = dict(vocab_size=vocab, max_positions=24)
    cached = generate_batch(model, prompts, 16, **options)  # 10 steps in the cache, then a sliding window
    assert cached == [generate_batch(model, [p], 16, use_cache=False, **options)[0] for p in prompts]
    long = _prompts(vocab, lengths=(30,), seed=1)[0]
    assert generate_batch(model, [long], 4, **options) == generate_batch(model, [long[-24:]], 4, **options)


SAMPLE_RUN = """
run: {output_dir: OUT, seed: 11}
model: {name: llama-debug}
data: {seq_length: 32}
training: {steps: 2, micro_batch_size: 2, global_batch_size: 4, threads: 1, sample_tokens: 24, sample_prompt: Elizabeth}
checkpoint: {save_at_end: false, resume: never, keep_last: 0}
logging: {interval: 1, progress: false, tensorboard: false}
"""


@pytest.mark.slow
@pytest.mark.distributed
def test_a_training_runs_sample_is_the_same_at_every_tensor_parallel_layout(tmp_path):
    """The end-of-run sample at tp=2 (cached, logits gathered over the ranks) and at tp=2 with sequence parallelism
    (recomputed, the 9-token prompt left-padded to a multiple of 2) is the single-process one."""
    import os
    import subprocess
    import sys

    samples = {}
    for name, extra in (("tp1", []), ("tp2", ["parallel.tp=2", "--nproc", "2"]),
                        ("tp2-sp", ["parallel.tp=2", "parallel.sequence_parallel=true", "--nproc", "2"])):
        config = tmp_path / f"{name}.yaml"
        config.write_text(SAMPLE_RUN.replace("OUT", str(tmp_path / name)))
        done = subprocess.run([sys.executable, "-m", "loongforge.cli", "train", str(config), *extra],
                              capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
        samples[name] = done.stdout.split("[loongforge] sample:\n")[1].split("\n[loongforge] done")[0]
    assert samples["tp1"].startswith("Elizabeth") and len(samples["tp1"]) > len("Elizabeth") + 5
    assert samples["tp2"] == samples["tp1"] and samples["tp2-sp"] == samples["tp1"]


# -- the command ----------------------------------------------------------------------------------------------


def test_several_prompts_print_what_each_prints_alone(hf_tiny, tmp_path, capsys):
    directory = hf_tiny("qwen2-bias-tied")[0]
    (tmp_path / "prompts.txt").write_text("It is a truth\n\n  universally\n")
    prompts = ["Elizabeth", "It is a truth", "  universally"]
    alone = [generate_from_checkpoint(directory, p, tokens=8, tokenizer="byte", ignore_eos=True) for p in prompts]
    argv = ["generate", str(directory), "--tokenizer", "byte", "--prompt", "Elizabeth", "--prompts-file",
            str(tmp_path / "prompts.txt"), "--max-new-tokens", "8", "--ignore-eos"]
    for extra in ([], ["--no-kv-cache"]):
        assert main(argv + extra) == 0
        assert capsys.readouterr().out == "\n\n".join(alone) + "\n"
    assert all(len(text) > len(prompt) for text, prompt in zip(alone, prompts, strict=True))


def test_chat_renders_byte_prompts_with_our_template(hf_tiny, tmp_path, capsys):
    directory = hf_tiny("qwen3-qknorm-tied")[0]
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                    {"role": "user", "content": "Who?"}]
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": conversation}) + "\n" + json.dumps("Why?") + "\n")
    assert main(["generate", str(directory), "--tokenizer", "byte", "--chat", "--system", "Be brief.", "--prompt",
                 "Hi", "--prompts-file", str(tmp_path / "chats.jsonl"), "--max-new-tokens", "6", "--jsonl"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    system = {"role": "system", "content": "Be brief."}
    template = ByteChatTemplate()
    expected = [template.render([system, *messages], add_generation_prompt=True) for messages in
                ([{"role": "user", "content": "Hi"}], conversation, [{"role": "user", "content": "Why?"}])]
    assert [row["prompt"] for row in rows] == expected
    assert expected[0] == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    tok = ByteTokenizer()
    for row in rows:  # the reply is what the model writes after the rendered text
        assert row["completion"] == tok.decode(row["tokens"])
        assert generate_from_checkpoint(directory, row["prompt"], tokens=6, tokenizer="byte") == (
            row["prompt"] + row["completion"])


def test_chat_uses_the_hf_tokenizers_own_template(hf_tiny, capsys):
    import tokenizers

    directory = hf_tiny("llama3-rope-untied")[0]
    words = ["<eos>", "<unk>", "system", "user", "assistant", "be", "nice", "the", "cat", "sat"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}assistant{% endif %}")
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": template}))
    assert main(["generate", str(directory), "--chat", "--system", "be nice", "--prompt", "the cat",
                 "--max-new-tokens", "5", "--jsonl"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["prompt"] == "system be nice user the cat assistant"
    assert main(["generate", str(directory), "--prompt", row["prompt"], "--max-new-tokens", "5", "--jsonl"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["tokens"] == row["tokens"] and plain["completion"] == row["completion"]
    assert main(["generate", str(directory), "--chat", "--system", "be nice", "--prompt", "the cat",
                 "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out == row["completion"] + "\n"  # the reply alone, without the rendered prompt
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    assert main(["generate", str(directory), "--chat", "--prompt", "the cat"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: {directory} has no chat template" in err


@pytest.mark.parametrize("args, file_text, message", [
    ([], None, "loongforge generate needs a prompt: --prompt TEXT or --prompts-file FILE"),
    (["--prompt", "x", "--system", "s"], None, "--system is a chat message: use it with --chat"),
    (["--prompts-file", "{file}"], '"fine"\n{"prompt": 3}\n', "{file}:2: expected a JSON string"),
    (["--prompts-file", "{file}"], '"fine"\nnot json\n', "{file}:2: not JSON"),
    (["--prompts-file", "{file}"], "\n\n", "the prompts file {file} holds no prompt"),
    (["--prompts-file", "{file}"], json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n",
     "a prompt given as chat messages needs chat mode (--chat)"),
    (["--prompt", "x", "--max-new-tokens", "-1"], None, "the number of new tokens must be >= 0, got -1"),
])
def test_bad_input_is_one_line(hf_tiny, tmp_path, capsys, args, file_text, message):
    directory = hf_tiny("qwen3-qknorm-tied")[0]
    prompts = tmp_path / "prompts.jsonl"
    if file_text is not None:
        prompts.write_text(file_text)
    args = [arg.replace("{file}", str(prompts)) for arg in args]
    capsys.readouterr()  # save_pretrained's progress output
    assert main(["generate", str(directory), "--tokenizer", "byte", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message.replace("{file}", str(prompts)) in err
