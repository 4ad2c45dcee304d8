"""Ring attention (and its hybrid with Ulysses) equals whole-sequence attention: output and gradients.

One torchrun launch of 4 gloo processes (tests/core/ring_attention_worker.py) runs ring attention at cp=4 and
at cp=2 (two pairs of ranks), causal and bidirectional, with head counts that cp does not divide (GQA 6/2, MQA
3/1, 3/3), and hybrid cp=4 (Ulysses pairs x a ring of 2). The reference is torch's SDPA on the whole sequence in
fp64, so exact ring attention agrees to rounding (~1e-15); a wrong causal triangle, a missing log-sum-exp
rescale or a K/V gradient returned to the wrong rank is off by O(1). The same launch holds Ulysses' exchange to
leaving nothing allocated once its input and result are dropped (gloo's worker thread otherwise frees them at a
moment of its own, and a step's peak memory moved by up to a third from run to run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from loongforge.devices.ring_attention import member_pieces, zigzag_pieces

pytestmark = [pytest.mark.distributed]

WORKER = Path(__file__).with_name("ring_attention_worker.py")
CASES = {"ring-cp4-gqa", "ring-cp4-mqa", "ring-cp2-causal", "ring-cp2-full", "hybrid-cp4-a2a2", "ulysses-buffers"}


def _chunks(cp: int, a2a: int = 1) -> list[list[int]]:
    return [[piece.chunk for piece in member] for member in member_pieces(zigzag_pieces(cp, 2), 2, a2a)]


def test_ring_chunks_cover_the_sequence_in_load_balanced_pairs():
    assert _chunks(2) == [[0, 3], [1, 2]]
    assert _chunks(4) == [[0, 7], [1, 6], [2, 5], [3, 4]]
    # hybrid: member j gathers ranks 2j, 2j+1 (rank order), each holding its mirrored pair
    assert _chunks(4, a2a=2) == [[0, 7, 1, 6], [2, 5, 3, 4]]
    assert _chunks(4, a2a=4) == [[0, 7, 1, 6, 2, 5, 3, 4]]
    # the pieces follow each other in the gathered row
    assert [p.start for p in member_pieces(zigzag_pieces(4, 2), 2, 2)[1]] == [0, 1, 2, 3]


def test_context_parallel_attention_matches_whole_sequence_sdpa():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(WORKER)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert {(row["case"], row["rank"]) for row in rows} == {(case, rank) for case in CASES for rank in range(4)}
    buffers = [row.pop("bytes_left") for row in rows if row["case"] == "ulysses-buffers"]
    assert buffers == [0] * 4  # before: ~1 in 3 exchanges left their buffers to gloo's thread (peaks moved ~20%)
    for row in (row for row in rows if row["case"] != "ulysses-buffers"):
        for key in ("out", "dq", "dk", "dv"):
            assert row[key] < 1e-12, f"{row['case']} rank {row['rank']}: {key} max relative error {row[key]:.3g}"
