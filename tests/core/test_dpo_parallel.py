"""DPO at tp=2 (megatron's vocabulary-split logits: the response log-probs come from its vocab-parallel
cross-entropy), at pp=2 (a pair's two rows cross the pipeline together and the last stage scores them; the reference
pass is pipelined too) and at dp=2 equals one process: every step's loss, gradient norm and ``dpo/*`` metrics and the
held-out numbers within 1e-5, through the real CLI (``torchrun`` for tp=2, ``--nproc 2`` for the others).

The single process accumulates two micro-batches of two pairs per step, so dp=2 compares one micro-batch per rank
with gradient accumulation. The run starts from the seed's weights; its reference is their frozen copy (LoRA's
adapters-off reference at pp=2).
"""

from __future__ import annotations

import math

import pytest
from test_parallel_parity import train

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

CONFIG = """
run: {output_dir: OUT, seed: 11}
model: {name: llama-debug}
data: {dataset: shipped-preference, seq_length: 96, valid_fraction: 0.05}
optimizer: {lr: 0.01, weight_decay: 0.0}
scheduler: {warmup_steps: 1}
training: {phase: dpo, steps: 4, micro_batch_size: 2, global_batch_size: 4, threads: 1}
dpo: {beta: 0.5}
evaluation: {interval: 4, steps: 2}
checkpoint: {save_at_end: false, resume: never}
logging: {interval: 4, progress: false, tensorboard: false}
"""
COMPARED = ("loss", "grad_norm", "dpo/accuracy", "dpo/reward_margin", "dpo/chosen_reward", "dpo/rejected_reward",
            "dpo/chosen_logp", "dpo/rejected_logp", "val_loss", "val_dpo/accuracy", "val_dpo/reward_margin")
LAYOUTS = {"tp2": ["parallel.tp=2"], "pp2-lora": ["parallel.pp=2", "model.lora.rank=4"], "dp2": []}


def _assert_same(rows, reference):
    assert sorted(rows) == sorted(reference) == [1, 2, 3, 4]
    for step, row in rows.items():
        for key in COMPARED:
            if key in reference[step]:
                assert math.isclose(row[key], reference[step][key], rel_tol=1e-5, abs_tol=1e-7), (step, key, row[key],
                                                                                                  reference[step][key])


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("dpo-parity")


@pytest.fixture(scope="module")
def single(root):
    return {name: train(root, name, *extra, config_text=CONFIG)[0]
            for name, extra in (("single", []), ("single-lora", ["model.lora.rank=4"]))}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_one_process(root, single, layout):
    extra = LAYOUTS[layout]
    rows, stdout = train(root, layout, *extra, nproc=2, torchrun=layout == "tp2", config_text=CONFIG)
    assert "world size 2" in stdout
    reference = single["single-lora" if "lora" in layout else "single"]
    # it trains: the policy has left its reference (the first steps are exact ties, ln 2), on held-out pairs too
    assert reference[1]["loss"] == math.log(2) and abs(reference[4]["loss"] - math.log(2)) > 1e-3
    assert abs(reference[4]["val_dpo/reward_margin"]) > 1e-3
    _assert_same(rows, reference)
