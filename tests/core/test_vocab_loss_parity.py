"""The training loss is transformers' loss when the vocabulary is not a multiple of megatron's padding.

Megatron pads the vocabulary to a multiple of 128 and its cross-entropy runs over every row, so before the padded
rows were masked the loss differed from transformers' by 0.011 nats at vocabulary 1000 and 0.63 at 130. Tiny
random Llama, Qwen2, Qwen3, Mixtral and Qwen3-MoE models with vocabularies 130, 777 and 1000 (padded to 256, 896
and 1024) are loaded through ``model.load: hf:`` at tp=2 and then tp=1 in one two-process torchrun launch (MoE at
tp=2 with sequence parallelism, as megatron requires); megatron's ``labels=`` loss on a batch must equal
transformers' ``labels=`` loss within 1e-6 relative. The gradient reaching the padded rows of an untied LM head
must be exactly zero (they never receive probability), which a mask applied only to the reported loss would fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import HF_TINY_CASES, free_port, make_hf_model, tiny_settings

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

FAMILIES = ("llama3-rope-untied", "qwen2-bias-tied", "qwen3-qknorm-untied", "mixtral-top2", "qwen3-moe-top4")
VOCABS = (130, 777, 1000)
TOL = 1e-6  # relative, fp32


def _case_dir(root, family: str, vocab: int):
    return root / f"{family}-v{vocab}"


def test_loss_equals_transformers_at_unpadded_vocabularies(tmp_path):
    expected = {}
    for family in FAMILIES:
        for vocab in VOCABS:
            config_cls, model_cls, _ = HF_TINY_CASES[family]
            hf = make_hf_model(config_cls, model_cls, {**tiny_settings(family), "vocab_size": vocab})
            directory = _case_dir(tmp_path, family, vocab)
            hf.save_pretrained(directory)
            tokens = torch.randint(0, vocab, (2, 25), generator=torch.Generator().manual_seed(vocab))
            torch.save(tokens, directory / "tokens.pt")
            with torch.no_grad():
                expected[(family, vocab)] = hf(tokens, labels=tokens).loss.item()
    cases = [str(_case_dir(tmp_path, f, v)) for f in FAMILIES for v in VOCABS]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), __file__, str(tmp_path / "out.json"), *cases]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-6000:]
    measured = json.loads((tmp_path / "out.json").read_text())
    assert len(measured) == 2 * len(cases)
    for family in FAMILIES:
        for vocab in VOCABS:
            reference = expected[(family, vocab)]
            for tp in (1, 2):
                row = measured[f"{family}-v{vocab}/tp{tp}"]
                rel = abs(row["loss"] - reference) / reference
                print(f"{family} vocab {vocab} tp{tp}: loss {row['loss']:.7f} transformers {reference:.7f} "
                      f"rel {rel:.1e}")
                assert rel <= TOL, (family, vocab, tp, row["loss"], reference)
                if row["padded_grad_max"] is not None:  # untied heads: the padded rows are parameters of their own
                    assert row["padded_grad_max"] == 0.0, (family, vocab, tp)
                    assert row["true_grad_max"] > 0.0


# ---------------------------------------------------------------------------------------------------------
# Worker (run by torchrun, two gloo ranks).
# ---------------------------------------------------------------------------------------------------------


def _loss_and_head_grads(directory: str, tp: int, backend) -> dict:
    from loongforge import load_config
    from loongforge.interop.online import load_initial_weights
    from loongforge.models.decoder_model import ParallelSettings, build_model
    from loongforge.models.hf_adopt import name_model
    from loongforge.models.hf_format import read_hf_model
    from megatron.core import parallel_state as ps

    flavor = read_hf_model(directory).family
    name, overrides = name_model(flavor, None, directory)
    config = load_config(None, [f"model.name={name}", f"model.load=hf:{directory}"])
    config.model.overrides = overrides
    layout = ParallelSettings(tp=tp, sequence_parallel=tp > 1 and flavor.is_moe)
    model = build_model(flavor, backend=backend, parallel=layout)
    load_initial_weights([model], config)
    tokens = torch.load(os.path.join(directory, "tokens.pt"), weights_only=True)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(inputs.shape[1]).unsqueeze(0).expand(inputs.shape[0], -1)
    loss = model(inputs, positions, None, labels=labels).mean()
    loss.backward()
    row = {"loss": loss.item(), "padded_grad_max": None, "true_grad_max": None}
    if not flavor.tie_word_embeddings:
        grad = model.output_layer.weight.grad  # this rank's rows of the padded vocabulary
        start = ps.get_tensor_model_parallel_rank() * grad.shape[0]
        true_rows = max(0, min(grad.shape[0], flavor.vocab_size - start))
        row["padded_grad_max"] = grad[true_rows:].abs().max().item() if true_rows < grad.shape[0] else 0.0
        row["true_grad_max"] = grad[:true_rows].abs().max().item() if true_rows else 1.0
    return row


def _worker(out_path: str, cases: list[str]) -> None:
    import torch.distributed as dist
    from loongforge.devices.cpu import CPUBackend
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    dist.init_process_group("gloo")
    backend = CPUBackend()
    backend.apply_patches()
    rows: dict[str, dict] = {}
    for tp in (2, 1):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        for directory in cases:
            row = _loss_and_head_grads(directory, tp, backend)
            if tp == 2:  # each rank saw its own shard of the head: the padded rows live on the last one
                padded = [None] * 2
                dist.all_gather_object(padded, (row["padded_grad_max"], row["true_grad_max"]))
                if row["padded_grad_max"] is not None:
                    row["padded_grad_max"] = max(p for p, _ in padded)
                    row["true_grad_max"] = min(t for _, t in padded)
            rows[f"{os.path.basename(directory)}/tp{tp}"] = row
        ps.destroy_model_parallel()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2:])
