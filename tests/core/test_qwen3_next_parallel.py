"""The Qwen3-Next family across parallel layouts (gloo, two processes): each reproduces one process.

* Hugging Face weights of the tiny MoE model loaded at tp=2 + sequence parallel, pp=2 and ep=2 and gathered back
  give the same files bit for bit (whole DeltaNet key heads per tensor-parallel rank; the hybrid layers checkpointed
  one by one);
* ``loongforge train`` for 4 steps (global batch 4: two micro-batches of 2 in one process, one per data-parallel rank
  where the layout has two) at tp=2 + sequence parallel, pp=2 (the DeltaNet layers on one stage, a DeltaNet and the
  gated-attention layer on the other) and ep=2 matches one process (loss and grad norm within 1e-5); the dense
  variant at tp=2 too.
"""

from __future__ import annotations

import json

import pytest
import torch
from hf_layout_roundtrip import LAYOUTS, round_trip
from test_parallel_parity import RTOL, max_rel_diff, train

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hf_weights_through_a_layout_come_back_bitwise(tmp_path, layout):
    from safetensors.torch import load_file
    from test_qwen3_next import TINY, make_model

    reference = make_model("Qwen3NextConfig", "Qwen3NextForCausalLM", TINY)
    reference.save_pretrained(tmp_path / "hf")
    files = load_file(tmp_path / "hf" / "model.safetensors")  # as transformers writes them
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "layout").mkdir()
    back = round_trip(tmp_path / "layout", config, files, *LAYOUTS[layout])
    assert sorted(back) == sorted(files) and all(torch.equal(back[k], files[k]) for k in files)


CONFIG = """
run: {output_dir: OUT, seed: 11}
model: {name: qwen3-next-tiny}
data: {seq_length: 96}
optimizer: {lr: 0.002}
scheduler: {warmup_steps: 2}
training: {steps: 4, micro_batch_size: 2, global_batch_size: 4, threads: 1}
checkpoint: {save_at_end: false, resume: never, keep_last: 0}
logging: {interval: 10, progress: false, tensorboard: false}
"""
LAYOUT_OVERRIDES = {
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp2": ["parallel.pp=2"],
    "ep2": ["parallel.ep=2"],
    "dense-tp2": ["parallel.tp=2", "model.overrides.num_experts=null"],
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("qwen3-next-layouts")


@pytest.fixture(scope="module")
def references(root):
    """One process, for the MoE model and the dense one."""
    return {"moe": train(root, "one", config_text=CONFIG)[0],
            "dense": train(root, "one-dense", "model.overrides.num_experts=null", config_text=CONFIG)[0]}


@pytest.mark.parametrize("name", list(LAYOUT_OVERRIDES))
def test_layout_reproduces_one_process(root, references, name):
    rows, stdout = train(root, name, *LAYOUT_OVERRIDES[name], nproc=2, config_text=CONFIG)
    reference = references["dense" if name.startswith("dense") else "moe"]
    assert "world size 2" in stdout and sorted(rows) == [1, 2, 3, 4]
    for key in ("loss", "grad_norm"):
        assert max_rel_diff(rows, reference, key) <= RTOL, key
