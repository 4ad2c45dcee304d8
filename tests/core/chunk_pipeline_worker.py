"""Two pp=2 runs of one config in one torchrun launch (tests/core/test_chunk_pipeline.py): unchunked, then with
``parallel.seq_chunks=4``; each writes its metrics under the output root given. The process group is created here,
once: a run finds it and keeps it (``init_distributed``), so the second run does not rendezvous again."""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist
from loongforge.testing.runs import train

if __name__ == "__main__":
    config, root = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    try:
        train(config, root / "pp2-whole", ["parallel.pp=2"])
        train(config, root / "pp2-chunks", ["parallel.pp=2", "parallel.seq_chunks=4"])
    finally:
        dist.destroy_process_group()
