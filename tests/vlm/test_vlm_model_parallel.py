"""The composed VLM at tensor parallel 2 with sequence parallelism computes transformers' logits and loss.

Two gloo processes (torchrun runs this file as the worker): the encoder is replicated, the Qwen2 decoder is
split over the TP ranks and its input sequence scattered over them; the vocabulary-parallel logits, gathered,
must equal transformers' Qwen2-VL on the padded image + video batch, the vocabulary-parallel loss its loss, and
the replicated encoder's gradient must be the same on both ranks and equal to transformers'.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _worker(out_dir: Path) -> None:
    import torch
    import torch.distributed as dist
    from loongforge.devices.cpu import CPUBackend
    from loongforge.interop.sharding import load_full_state
    from loongforge.models.decoder_model import ParallelSettings
    from loongforge_vlm.model.flavors import FLAVORS
    from loongforge_vlm.model.hf_interop import from_hf
    from loongforge_vlm.model.vlm import build_vlm
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from vlm_reference import mixed_batch, reference_model

    dist.init_process_group("gloo")
    backend = CPUBackend()
    backend.apply_patches()
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    flavor = FLAVORS["qwen2-vl-tiny"]
    reference = reference_model(flavor)
    ours = build_vlm(flavor, backend=backend, parallel=ParallelSettings(tp=2, sequence_parallel=True))
    full = from_hf(reference.state_dict(), flavor)
    ours.encoder.load_state_dict({k[len("encoder."):]: v for k, v in full.items() if k.startswith("encoder.")})
    load_full_state([ours.language_model],
                    {k[len("language_model."):]: v for k, v in full.items() if k.startswith("language_model.")})
    # Distributed checkpoints see the whole model: the encoder as full tensors, the decoder as TP shards.
    sharded = ours.sharded_state_dict()
    encoder_entries = {k: v for k, v in sharded.items() if k.startswith("encoder.")}
    sharded_ok = (encoder_entries.keys() == {f"encoder.{k}" for k in ours.encoder.state_dict()}
                  and all(tuple(v.local_shape) == tuple(v.global_shape) for v in encoder_entries.values())
                  and any(k.startswith("language_model.decoder.") for k in sharded))

    batch = mixed_batch(flavor)
    keep = batch["attention_mask"].bool()
    vision = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")}
    expected = reference(**batch).logits
    with torch.no_grad():
        shard = ours.eval()(batch["input_ids"], attention_mask=batch["attention_mask"], **vision)
    pieces = [torch.empty_like(shard) for _ in range(2)]
    dist.all_gather(pieces, shard.contiguous(), group=ps.get_tensor_model_parallel_group())
    logits = torch.cat(pieces, dim=-1)[..., :flavor.foundation.vocab_size]

    targets = batch["input_ids"].roll(-1, dims=1)
    scored = keep & keep.roll(1, dims=1)
    scored[:, 0] = False
    ref_loss = reference(**batch, labels=batch["input_ids"].masked_fill(~scored, -100)).loss
    per_token = ours.train()(batch["input_ids"], attention_mask=batch["attention_mask"], labels=targets, **vision)
    loss = (per_token * scored.roll(-1, dims=1)).sum() / scored.sum()
    loss.backward()
    ref_loss.backward()
    grad = ours.encoder.patch_embed.weight.grad
    ref_grad = reference.model.visual.patch_embed.proj.weight.grad.reshape(grad.shape)
    grads = [torch.empty_like(grad) for _ in range(2)]
    dist.all_gather(grads, grad)
    result = {"sharded_ok": sharded_ok, "logit_diff": (logits - expected)[keep].abs().max().item(),
              "loss_diff": abs(loss.item() - ref_loss.item()), "loss": ref_loss.item(),
              "encoder_grad_equal": torch.equal(grads[0], grads[1]), "encoder_grad_norm": grad.norm().item(),
              "encoder_grad_rel": ((grad - ref_grad).norm() / ref_grad.norm()).item()}
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def test_tp2_sequence_parallel_matches_transformers(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        print(f"rank {rank}: {r}")
        assert r["sharded_ok"]
        assert r["logit_diff"] <= 1e-4
        assert r["loss_diff"] <= 1e-5 * r["loss"]
        assert r["encoder_grad_equal"] and r["encoder_grad_norm"] > 0 and r["encoder_grad_rel"] <= 1e-5


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    _worker(Path(sys.argv[1]))
