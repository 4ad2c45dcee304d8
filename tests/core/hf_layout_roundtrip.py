"""Hugging Face weights through a parallel layout and back (two gloo processes): what ``model.load: hf:`` and
``checkpoint.save_hf`` do at a layout. Shared by the families' layout tests.

The parent writes a Hugging Face directory's ``config.json`` and its tensors (``hf.pt``, as the family's adapter
writes them); each rank reads the model through the registered reader of that architecture, builds its chunk of
the layout, loads its slices and gathers the full state back; rank 0 writes the gathered files (``back.pt``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from conftest import free_port

WORKER = """
import os, sys
import torch, torch.distributed as dist

def worker(rank, port, out_dir, tp, pp, ep, sp):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tp, pp, ep, sp = int(tp), int(pp), int(ep), sp == "1"
    from loongforge.devices.cpu import CPUBackend
    from loongforge.interop import sharding
    from loongforge.models.chunks import ChunkBuild
    from loongforge.models.decoder_model import ParallelSettings, padded_vocab_size
    from loongforge.models.hf_format import read_hf_model
    from megatron.core import parallel_state, tensor_parallel
    backend = CPUBackend()
    backend.apply_patches()
    dist.init_process_group("gloo", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    family = read_hf_model(out_dir).family
    chunk = family.build_chunk(ChunkBuild(
        backend=backend, parallel=ParallelSettings(tp=tp, pp=pp, ep=ep, sequence_parallel=sp),
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        seed=None))
    adapter = family.hf_adapter()
    tensors = torch.load(os.path.join(out_dir, "hf.pt"))
    sharding.load_full_state([chunk], adapter.from_hf(tensors, padded_vocab_size=padded_vocab_size(
        family.decoder.vocab_size, tp)))
    full = sharding.gather_full_state([chunk])
    if rank == 0:
        torch.save(adapter.to_hf(full), os.path.join(out_dir, "back.pt"))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()

if __name__ == "__main__":
    import torch.multiprocessing as mp
    mp.spawn(worker, args=tuple(sys.argv[1:]), nprocs=2)
"""


def round_trip(directory: Path, config: dict, files: dict[str, torch.Tensor], tp: str, pp: str, ep: str,
               sp: str) -> dict[str, torch.Tensor]:
    """``files`` (with ``config`` as their config.json) loaded at the layout and gathered back, as rank 0 got them."""
    (directory / "config.json").write_text(json.dumps(config))
    torch.save(files, directory / "hf.pt")
    script = directory / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    done = subprocess.run([sys.executable, str(script), str(free_port()), str(directory), tp, pp, ep, sp],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return torch.load(directory / "back.pt")


#: The layouts the families are held to, as ``(tp, pp, ep, sequence parallel)`` (MoE at tp=2 needs sequence
#: parallelism).
LAYOUTS = {"tp2-sp": ("2", "1", "1", "1"), "pp2": ("1", "2", "1", "0"), "ep2": ("1", "1", "2", "0")}
