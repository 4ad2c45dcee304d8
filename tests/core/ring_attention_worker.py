"""Worker for tests/core/test_ring_attention.py (run by torchrun, 4 gloo processes; rank 0 prints one JSON line per
case and rank -- gathered first, since lines printed by several processes can interleave).

Every rank builds the same full-sequence query/key/value (fp64), takes its load-balanced chunks (rank ``c`` of
``cp``: chunks ``c`` and ``2cp-1-c``, :func:`loongforge.parallel.context.split_for_rank`), runs context-parallel
attention and back-propagates a fixed random weighting of its output. The reference is torch's own
``scaled_dot_product_attention`` on the whole sequence (``enable_gqa``), and the same loss; each rank compares
its slice of the output and of the query/key/value gradients.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from loongforge.devices.ring_attention import context_parallel_attention
from loongforge.devices.ulysses import heads_to_seq
from loongforge.parallel.context import hybrid_groups, split_for_rank
from loongforge.train.measure import profiled_live_bytes
from torch.profiler import ProfilerActivity, profile

SEQ, BATCH, DIM, VALUE_DIM = 48, 2, 8, 6


def full_inputs(heads: int, groups: int, seed: int) -> tuple[torch.Tensor, ...]:
    """``[s, b, n, d]`` query, key, value and output weighting, identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(heads, DIM), (groups, DIM), (groups, VALUE_DIM), (heads, VALUE_DIM)]
    return tuple(torch.randn(SEQ, BATCH, n, d, generator=gen, dtype=torch.float64) for n, d in shapes)


def reference(query, key, value, weight, causal):
    """Output and gradients of the whole-sequence attention (torch's SDPA), ``[s, b, n, d]``."""
    leaves = [t.clone().requires_grad_() for t in (query, key, value)]
    q, k, v = (t.permute(1, 2, 0, 3) for t in leaves)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True, scale=0.3).permute(2, 0, 1, 3)
    (out * weight).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def my_chunks(x: torch.Tensor, cp_rank: int, cp: int) -> torch.Tensor:
    """This rank's load-balanced chunks of a ``[s, ...]`` tensor, cut by the trainer's own data split."""
    index = torch.arange(x.shape[0]).unsqueeze(0)
    batch = {key: index for key in ("tokens", "labels", "loss_mask", "position_ids")}
    return x.index_select(0, split_for_rank(batch, cp_rank, cp)["tokens"][0])


def run_case(name, heads, groups, causal, cp_rank, cp, ring_group, a2a_group=None) -> dict:
    query, key, value, weight = full_inputs(heads, groups, seed=heads * 10 + groups)
    expected = reference(query, key, value, weight, causal)
    leaves = [my_chunks(t, cp_rank, cp).requires_grad_() for t in (query, key, value)]
    out = context_parallel_attention(*leaves, ring_group, a2a_group, causal=causal, scale=0.3)
    (out * my_chunks(weight, cp_rank, cp)).sum().backward()
    got = [out.detach()] + [t.grad for t in leaves]
    errors = {label: ((g - my_chunks(e, cp_rank, cp)).abs().max() / e.abs().max()).item()
              for label, g, e in zip(("out", "dq", "dk", "dv"), got, expected, strict=True)}
    return {"case": name, "rank": dist.get_rank(), **errors}


def exchange_bytes_left(group, trials: int = 30) -> int:
    """The most bytes still allocated after an Ulysses exchange whose input and result are dropped at once: gloo's
    worker thread lets go of a finished collective's tensors at a moment of its own, and whatever it was handed that
    the exchange did not release itself outlived the exchange in some of the trials."""
    most = 0
    for trial in range(trials):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            x = torch.randn(4 * SEQ, BATCH, 6, 64, generator=torch.Generator().manual_seed(trial))
            heads_to_seq(x, group)
            del x
        most = max(most, profiled_live_bytes(prof))
    return most


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == 4
    world = dist.new_group(list(range(4)))
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    a2a_group, ring_group = hybrid_groups([list(range(4))], a2a=2)
    rows = [
        # cp=4: 6 heads over 2 K/V groups (GQA), neither divisible by 4; 3 heads sharing one K/V head (MQA).
        run_case("ring-cp4-gqa", 6, 2, True, rank, 4, world),
        run_case("ring-cp4-mqa", 3, 1, True, rank, 4, world),
        # cp=2 twice over (ranks 0,1 and 2,3): 3 heads; causal and bidirectional.
        run_case("ring-cp2-causal", 3, 3, True, rank % 2, 2, pairs[rank // 2]),
        run_case("ring-cp2-full", 3, 1, False, rank % 2, 2, pairs[rank // 2]),
        # Hybrid cp=4: Ulysses over pairs {0,1},{2,3} (6 heads / 2 groups split in two), ring across them.
        run_case("hybrid-cp4-a2a2", 6, 2, True, rank, 4, ring_group, a2a_group),
    ]
    rows.append({"case": "ulysses-buffers", "rank": rank, "bytes_left": exchange_bytes_left(world)})
    every = [None] * 4
    dist.all_gather_object(every, rows)
    if rank == 0:
        for row in (row for ranks in every for row in ranks):
            print(json.dumps(row))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
