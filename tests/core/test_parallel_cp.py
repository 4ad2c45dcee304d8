"""Context parallelism reproduces the single-process run: per-step loss and grad norm within 1e-5 (fp32, gloo).

cp=2 trains the ``test_parallel_parity`` model and data (its single-process reference fixture is reused):
each rank holds 2 of the 4 sequence chunks, attention gathers whole sequences per head group (Ulysses), the
loss averages over both ranks' tokens and gradients are reduced over dp*cp. Any of a wrong chunk order, wrong
RoPE positions, a missing causal reorder or a loss/gradient scaled by cp moves the numbers far beyond 1e-5.
"""

from __future__ import annotations

import pytest
from test_parallel_parity import STEPS, assert_parity, reference, root, train  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_cp2_matches_single_process(root, reference):  # noqa: F811
    rows, stdout = train(root, "cp2", "parallel.cp=2", nproc=2)
    assert "cp=2 dp=1" in stdout and "world size 2" in stdout
    assert_parity(rows, reference, range(1, STEPS + 1))
