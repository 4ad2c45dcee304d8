"""MoE layouts reproduce the single-process run: per-step loss and grad norm within 1e-5 (fp32, gloo).

A small Mixtral (2 layers, 4 experts, top-2, aux loss on) trains 10 steps through the real CLI with the
model infrastructure of ``test_parallel_parity``; expert parallelism with either token dispatcher, and
tp=2 + sequence parallel + ep=2 with whole experts (etp=1, so it fits in two processes), must match one
process. Equal starts need experts initialised by their global index (``parallel.init``). Context
parallelism with ep (cp=2 x ep=2) matches too: every cp chunk's tokens reach the other rank's experts, and the
router counts its load-balancing statistics over the tokens of all cp ranks (counted over the local chunk alone, the
aux loss and the gradients move beyond 1e-5).
"""

from __future__ import annotations

import pytest
from test_parallel_parity import CONFIG, RTOL, STEPS, assert_parity, max_rel_diff, train

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

MOE_MODEL = ("model: {name: mixtral-tiny, overrides: {num_layers: 2, hidden_size: 64, ffn_hidden_size: 128, "
             "moe_ffn_hidden_size: 96}}")
MOE_CONFIG = CONFIG.replace("model: {name: llama-debug, overrides: {num_layers: 4}}", MOE_MODEL)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("moe-parity")


def train_moe(root, name, *overrides, nproc=1):
    return train(root, name, *overrides, nproc=nproc, config_text=MOE_CONFIG)


@pytest.fixture(scope="module")
def reference(root):
    rows, stdout = train_moe(root, "single")
    assert "mixtral-tiny" in stdout and "2 micro-batches/step" in stdout
    assert rows[STEPS]["loss"] < rows[1]["loss"] - 0.05
    assert all(0.9 < row["moe_aux_loss"] < 2.0 for row in rows.values())  # ~1 when balanced, <= num_experts
    return rows


LAYOUTS = {
    "ep2-alltoall": ["parallel.ep=2", "parallel.moe_dispatcher=alltoall"],
    "ep2-allgather": ["parallel.ep=2", "parallel.moe_dispatcher=allgather"],
    "tp2-sp-ep2-etp1": ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2", "parallel.etp=1"],
    "cp2-ep2": ["parallel.cp=2", "parallel.ep=2", "parallel.moe_dispatcher=alltoall"],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layout_matches_single_process(root, reference, name):
    rows, stdout = train_moe(root, name, *LAYOUTS[name], nproc=2)
    assert "ep=2" in stdout and "world size 2" in stdout
    assert_parity(rows, reference, range(1, STEPS + 1))
    assert max_rel_diff(rows, reference, "moe_aux_loss") <= RTOL  # the logged load-balancing loss agrees too


def test_ep2_distributed_optimizer_checkpoint_resumes_at_ep1(root, reference):
    """Experts (and their Adam state) are checkpointed by global index: ep=2 with the distributed optimizer
    saves at step 5, one process with the plain optimizer resumes, and the remaining steps match."""
    rows, _ = train_moe(root, "ep2-distopt", "parallel.ep=2", "parallel.distributed_optimizer=true",
                        "checkpoint.interval=5", nproc=2)
    assert_parity(rows, reference, range(1, STEPS + 1))
    checkpoint = root / "ep2-distopt" / "checkpoints" / "step-0000005"
    resumed, stdout = train_moe(root, "ep1-from-ep2", f"checkpoint.resume={checkpoint}")
    assert "at step 5" in stdout
    assert_parity(resumed, reference, range(6, STEPS + 1), rtol=1e-6)
