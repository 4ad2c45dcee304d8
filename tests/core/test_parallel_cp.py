"""Context parallelism reproduces the single-process run: per-step loss and grad norm within 1e-5 (fp32, gloo).

Every mode trains the ``test_parallel_parity`` model and data (its single-process reference fixture is reused):
each rank holds 2 of the 2*cp sequence chunks, the loss averages over all ranks' tokens and gradients are reduced
over dp*cp. Attention sees the whole sequence three ways: Ulysses at cp=2 (heads gathered per head group: the
cp x pp runs below), ring at cp=4 (K/V blocks around the ring: the model's 2 query groups do not divide by 4,
which Ulysses refuses) and hybrid at cp=4 (Ulysses in pairs, a ring of 2 across them).
Each launch of 4 processes on a 2-core CI machine costs minutes, so every layout is run once. Any of a wrong chunk
order, wrong RoPE positions, a missing causal reorder, a wrong causal block or a loss/gradient scaled by cp moves
the numbers far beyond 1e-5.

Packed chat rows (``data.pack``) are split per sequence (docs/long-context.md) and compared with the packed
single-process run (which tests/core/test_sft_packing.py ties to the unpacked samples): Ulysses cp=2 x pp=2 (the
stages exchange each micro-batch's shape first: rows re-laid per sequence vary in length), and ring cp=2 with
dynamic CP on, whose threshold leaves some micro-batches whole and splits the others. A wrong chunk order of a
sequence, positions not restarting per sequence, attention across sequences or a fixed pipeline shape breaks them.

Combined with model parallelism (4 processes), cp reproduces one process too: cp=2 x tp=2 with sequence parallelism
(ring: the 2 query groups do not divide by tp*cp=4) and the distributed optimizer, whose Adam state megatron shards
over dp*cp (here the 2 cp ranks) and whose gradients it reduce-scatters there; and cp=2 x pp=2, where stages pass
activations of the cp-split sequence and the last stage's loss reads labels split like the first stage's tokens.
The cp x tp run's step-5 checkpoint resumes at cp=1 (one process, plain optimizer: Adam state gathered whole, tp
merged) and at cp=4 (ring, distributed optimizer over 4 cp ranks), and the continued steps match the uninterrupted
run. cp x ep is in tests/core/test_parallel_moe.py. Mutants these catch: gradients reduced over dp without cp (cp x
tp), last-stage labels not split like the tokens (cp x pp), the distributed optimizer's group without cp (training is
unchanged, but the checkpoint gathers half the Adam state: the resumes) and a resume that drops the Adam state.
"""

from __future__ import annotations

import pytest
from test_parallel_parity import CONFIG, STEPS, assert_parity, reference, root, train  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

MODES = {
    "cp4-ring": (4, ["parallel.cp=4", "parallel.cp_mode=ring"], "cp=4 ring dp=1"),
    "cp4-hybrid-a2a2": (4, ["parallel.cp=4", "parallel.cp_mode=hybrid", "parallel.cp_a2a_size=2"],
                        "cp=4 hybrid a2a=2 dp=1"),
}


@pytest.mark.parametrize("name", list(MODES))
def test_cp_matches_single_process(root, reference, name):  # noqa: F811
    nproc, overrides, layout = MODES[name]
    rows, stdout = train(root, name, *overrides, nproc=nproc)
    assert layout in stdout and f"world size {nproc}" in stdout
    assert_parity(rows, reference, range(1, STEPS + 1))


PACKED_CONFIG = CONFIG.replace("data: {seq_length: 32}", "data: {dataset: shipped-chat, seq_length: 128, pack: true}") \
    .replace("training: {", "training: {phase: sft, ")
PACKED_MODES = {  # name: (processes, overrides)
    "cp2-pp2-ulysses-packed": (4, ["parallel.cp=2", "parallel.pp=2"]),
    "cp2-ring-packed-dynamic": (2, ["parallel.cp=2", "parallel.cp_mode=ring", "parallel.dynamic_cp_threshold=100"]),
}


@pytest.fixture(scope="module")
def packed_reference(root):  # noqa: F811
    rows, _ = train(root, "packed-single", config_text=PACKED_CONFIG)
    assert rows[STEPS]["loss"] < rows[1]["loss"] - 0.05
    return rows


@pytest.mark.parametrize("name", list(PACKED_MODES))
def test_packed_cp_matches_single_process(root, packed_reference, name):  # noqa: F811
    nproc, overrides = PACKED_MODES[name]
    rows, stdout = train(root, name, *overrides, nproc=nproc, config_text=PACKED_CONFIG)
    assert f"world size {nproc}" in stdout
    assert_parity(rows, packed_reference, range(1, STEPS + 1))
    if "dynamic" in name:  # 20 micro-batches per rank: some dealt whole, the others split
        whole = sum(row["cp_whole_micro_batches"] for row in rows.values())
        assert 0 < whole < 2 * STEPS, whole


@pytest.fixture(scope="module")
def cp2_tp2_distributed_optimizer(root):  # noqa: F811
    """cp=2 x tp=2 (sequence parallel, ring) with the distributed optimizer, checkpointing at step 5."""
    rows, stdout = train(root, "cp2-tp2-sp-ring-distopt", "parallel.cp=2", "parallel.cp_mode=ring", "parallel.tp=2",
                         "parallel.sequence_parallel=true", "parallel.distributed_optimizer=true",
                         "checkpoint.interval=5", nproc=4)
    assert "tp=2 pp=1 cp=2 ring dp=1" in stdout
    return rows, root / "cp2-tp2-sp-ring-distopt" / "checkpoints" / "step-0000005"


def test_cp_with_tp_and_distributed_optimizer_matches_single_process(
    reference, cp2_tp2_distributed_optimizer  # noqa: F811
):
    rows, _ = cp2_tp2_distributed_optimizer
    assert_parity(rows, reference, range(1, STEPS + 1))


def test_cp_with_pp_matches_single_process(root, reference):  # noqa: F811
    rows, stdout = train(root, "cp2-pp2", "parallel.cp=2", "parallel.pp=2", nproc=4)
    assert "tp=1 pp=2 cp=2 ulysses dp=1" in stdout
    assert_parity(rows, reference, range(1, STEPS + 1))


RESUMED_AT = {
    "cp1-from-cp2": ([], 1, "tp=1 pp=1 dp=1"),
    "cp4-ring-from-cp2": (["parallel.cp=4", "parallel.cp_mode=ring", "parallel.distributed_optimizer=true"], 4,
                          "cp=4 ring dp=1"),
}


@pytest.mark.parametrize("name", list(RESUMED_AT))
def test_cp2_checkpoint_resumes_at_another_cp(root, reference, cp2_tp2_distributed_optimizer, name):  # noqa: F811
    uninterrupted, checkpoint = cp2_tp2_distributed_optimizer
    overrides, nproc, layout = RESUMED_AT[name]
    rows, stdout = train(root, name, *overrides, f"checkpoint.resume={checkpoint}", nproc=nproc)
    assert "at step 5" in stdout and layout in stdout
    assert_parity(rows, reference, range(6, STEPS + 1))
    assert_parity(rows, uninterrupted, range(6, STEPS + 1))
