"""The chunked pipeline (``parallel.seq_chunks``) trains exactly as the unchunked run.

Three levels. The chunk attention against torch's causal SDPA over the whole sequence (fp64, grouped K/V, tiles
smaller than a chunk): every chunk's output and the gradients of all queries, keys and values, with the replay run
last chunk first as the engine runs it. One process: SFT rows (loss masks that differ between chunks, so a loss
normalised per chunk instead of over the micro-batch moves the numbers) with 4 chunks against the same run
unchunked, loss and grad norm over 3 steps within 1e-6. Two processes (pp=2, torchrun + gloo, one launch for both
runs): 4 chunks against unchunked pp=2, within 1e-6. Forgetting the earlier chunks' K/V, RoPE at chunk-local
positions or a per-chunk loss normalisation each fail them (tried as mutants).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from loongforge.config import load_config
from loongforge.errors import ConfigError
from loongforge.testing.runs import train

CONFIG = """
run: {seed: 11}
model: {name: llama-debug, overrides: {num_layers: 4}}
data: {dataset: shipped-chat, seq_length: 128}
optimizer: {lr: 0.002}
scheduler: {warmup_steps: 1}
training: {phase: sft, steps: 3, micro_batch_size: 2, global_batch_size: 4, threads: 1}
checkpoint: {save_at_end: false, resume: never, keep_last: 0}
logging: {interval: 10, progress: false, tensorboard: false}
"""
RTOL = 1e-6
WORKER = Path(__file__).with_name("chunk_pipeline_worker.py")


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_same_run(rows: list[dict], reference: list[dict]) -> None:
    assert [r["step"] for r in rows] == [r["step"] for r in reference] == [1, 2, 3]
    for key in ("loss", "grad_norm"):
        diffs = [abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(rows, reference, strict=True)]
        assert max(diffs) <= RTOL, f"{key}: relative differences {diffs}"
    assert reference[-1]["loss"] < reference[0]["loss"]  # it trains: the comparison is not of constants


def test_chunk_attention_matches_causal_sdpa(monkeypatch):
    from loongforge.devices import chunk_attention
    from loongforge.parallel.sequence_chunks import ChunkKV, SequenceChunk

    monkeypatch.setattr(chunk_attention, "TILE", 3)  # chunks of 6 tokens in tiles of 3
    torch.manual_seed(0)
    seq, rows, heads, groups, dim, count, scale = 24, 2, 4, 2, 8, 4, 0.3
    query, key, value = (torch.randn(seq, rows, n, dim, dtype=torch.float64, requires_grad=True)
                         for n in (heads, groups, groups))
    grad_out = torch.randn(seq, rows, heads, dim, dtype=torch.float64)

    def whole(q, k, v):  # [s, b, n, d] -> SDPA's [b, n, s, d], K/V groups repeated for the heads that read them
        k, v = (t.permute(1, 2, 0, 3).repeat_interleave(heads // groups, dim=1) for t in (k, v))
        return F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k, v, is_causal=True,
                                              scale=scale).permute(2, 0, 1, 3)

    expected = whole(query, key, value)
    expected.backward(grad_out)
    expected_grads = [t.grad.clone() for t in (query, key, value)]
    for t in (query, key, value):
        t.grad = None
    store, layer, length = ChunkKV(count), object(), seq // count
    part = [slice(i * length, (i + 1) * length) for i in range(count)]
    with torch.no_grad():
        for i in range(count):
            chunk_attention.chunk_attention(query[part[i]], key[part[i]], value[part[i]], layer,
                                            SequenceChunk(index=i, count=count, kv=store, recording=True), scale)
    outputs = [None] * count
    for i in reversed(range(count)):  # the replay: last chunk first
        out = chunk_attention.chunk_attention(query[part[i]], key[part[i]], value[part[i]], layer,
                                              SequenceChunk(index=i, count=count, kv=store), scale)
        out.backward(grad_out[part[i]])
        outputs[i] = out.detach()
    torch.testing.assert_close(torch.cat(outputs), expected.detach(), rtol=1e-12, atol=1e-12)
    for name, tensor, grad in zip("qkv", (query, key, value), expected_grads, strict=True):
        torch.testing.assert_close(tensor.grad, grad, rtol=1e-12, atol=1e-12, msg=f"d{name}")


def test_seq_chunks_refusals_name_the_key(tmp_path):
    from loongforge.config.chunk_settings import check_seq_chunks
    from loongforge.plugins import get_host
    from loongforge.resolve import resolve_model_flavor

    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    config = load_config(str(path), ["parallel.seq_chunks=4"])
    decoder = resolve_model_flavor(config, get_host()).decoder
    check_seq_chunks(config, decoder, cp=1, vpp=None)  # the run the tests train
    cases = {
        "does not divide into 3 equal chunks": (["parallel.seq_chunks=3"], 1, None),
        "parallel.cp > 1": ([], 2, None),
        "parallel.vpp": ([], 1, 2),
        "data.pack": (["data.pack=true"], 1, None),
        "mixture-of-experts": (["model.overrides.num_experts=4", "model.overrides.moe_ffn_hidden_size=32"], 1, None),
    }
    for reason, (overrides, cp, vpp) in cases.items():
        config = load_config(str(path), ["parallel.seq_chunks=4", *overrides])
        decoder = resolve_model_flavor(config, get_host()).decoder
        with pytest.raises(ConfigError, match=f"parallel.seq_chunks \\(\\d\\): .*{reason}"):
            check_seq_chunks(config, decoder, cp=cp, vpp=vpp)


def test_one_process_chunks_equal_unchunked(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    train(path, tmp_path / "whole", [])
    train(path, tmp_path / "chunks", ["parallel.seq_chunks=4"])
    _assert_same_run(_metrics(tmp_path / "chunks"), _metrics(tmp_path / "whole"))


@pytest.mark.slow
@pytest.mark.distributed
def test_pp2_chunks_equal_unchunked_pp2(tmp_path):
    """One torchrun launch (2 processes) trains pp=2 unchunked, then pp=2 with 4 chunks."""
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
         str(path), str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "pp=2" in done.stdout
    _assert_same_run(_metrics(tmp_path / "pp2-chunks"), _metrics(tmp_path / "pp2-whole"))
