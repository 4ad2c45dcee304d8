"""The CPU patches cover tensor, sequence and pipeline parallel paths under torchrun (gloo), and a dist-checkpoint
of model and optimizer reloads exactly.

Two processes train llama-debug for two steps with megatron DDP, the megatron optimizer and clipping, save a
dist-checkpoint, and train two more steps. A second model and optimizer, built from other seeds, load that
checkpoint: every parameter and every optimizer state entry (Adam's moments and step count, the parameter groups)
must equal what was saved, bit for bit, and the two steps taken from the loaded state must give the uninterrupted
run's losses and gradient norms (the fourth step's loss follows an update made with the loaded Adam state) and end
at the same weights. Layout parity (TP/PP reproducing TP=1 numbers) is tested elsewhere.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import free_port  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist

    def flatten(value, prefix=""):
        # a nested state dict as {path: value}, tensors cloned (the optimizer updates its state in place)
        if isinstance(value, dict):
            return {k: v for key, item in value.items() for k, v in flatten(item, f"{prefix}/{key}").items()}
        if isinstance(value, (list, tuple)):
            return {k: v for i, item in enumerate(value) for k, v in flatten(item, f"{prefix}/{i}").items()}
        return {prefix: value.detach().clone() if torch.is_tensor(value) else value}

    def same(a, b):
        if torch.is_tensor(a) or torch.is_tensor(b):
            return (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                    and torch.equal(a, b))
        return a == b

    def differing(saved, other):
        return sorted(k for k in saved.keys() | other.keys() if k not in saved or k not in other
                      or not same(saved[k], other[k]))

    def main():
        tp, pp, sp, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
        dist.init_process_group("gloo")
        from loongforge.devices.cpu import CPUBackend
        backend = CPUBackend()
        backend.apply_patches()
        from megatron.core import dist_checkpointing, parallel_state as ps, tensor_parallel
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from loongforge.models.decoder_model import ParallelSettings, build_model
        from loongforge.models.llama import FLAVORS

        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)

        def build(seed):
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
            torch.manual_seed(seed)
            model = build_model(FLAVORS["llama-debug"], backend=backend,
                                parallel=ParallelSettings(tp=tp, pp=pp, sequence_parallel=sp),
                                pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
            model = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
            model.config.finalize_model_grads_func = finalize_model_grads
            return model, get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0), [model])

        gen = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, 256, (2, 33), generator=gen) for _ in range(8)]  # 4 steps x 2 micro-batches

        def forward_step(it, model):
            x = next(it)
            out = model(x[:, :-1], torch.arange(32).expand(2, -1), None, labels=x[:, 1:])
            return out, lambda o: (o.float().mean(), {"loss": o.float().mean().detach().clone()})

        def train_step(model, optimizer, step):
            model.zero_grad_buffer()
            optimizer.zero_grad()
            losses = get_forward_backward_func()(forward_step_func=forward_step,
                data_iterator=iter(batches[2 * step:2 * step + 2]), model=[model], num_microbatches=2,
                seq_length=32, micro_batch_size=2, forward_only=False)
            ok, grad_norm, _ = optimizer.step()
            return {"ok": ok, "grad_norm": grad_norm,
                    "loss": torch.stack([l["loss"] for l in losses]).mean().item() if losses else None}

        def snapshot(model, optimizer):
            params = {name: p.detach().clone() for name, p in model.module.named_parameters()}
            return params, flatten(optimizer.state_dict())

        model, optimizer = build(7)
        records = [train_step(model, optimizer, step) for step in range(2)]
        saved_params, saved_state = snapshot(model, optimizer)
        state = {"model": model.module.sharded_state_dict()}
        state["optimizer"] = optimizer.sharded_state_dict(state["model"])
        dist_checkpointing.save(state, os.path.join(out, "ckpt"))
        records += [train_step(model, optimizer, step) for step in (2, 3)]  # the uninterrupted run goes on
        final_params, _ = snapshot(model, optimizer)

        fresh, fresh_optimizer = build(8)
        fresh_params, fresh_state = snapshot(fresh, fresh_optimizer)
        template = {"model": fresh.module.sharded_state_dict()}
        template["optimizer"] = fresh_optimizer.sharded_state_dict(template["model"], is_loading=True)
        loaded = dist_checkpointing.load(template, os.path.join(out, "ckpt"))
        fresh.module.load_state_dict(loaded["model"])
        fresh_optimizer.load_state_dict(loaded["optimizer"])
        loaded_params, loaded_state = snapshot(fresh, fresh_optimizer)
        report = {
            "records": records,
            "parameters": sorted(saved_params),
            "optimizer_entries": sorted(k for k, v in saved_state.items() if torch.is_tensor(v)),
            "differ_before_load": {"parameters": differing(saved_params, fresh_params),
                                   "optimizer": differing(saved_state, fresh_state)},
            "differ_after_load": {"parameters": differing(saved_params, loaded_params),
                                  "optimizer": differing(saved_state, loaded_state)},
            "resumed_steps": [train_step(fresh, fresh_optimizer, step) for step in (2, 3)],
        }
        report["differ_at_the_end"] = differing(final_params, snapshot(fresh, fresh_optimizer)[0])
        with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
            json.dump(report, f)
        ps.destroy_model_parallel()
        dist.destroy_process_group()

    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.parametrize("tp,pp,sp", [(2, 1, True), (1, 2, False)], ids=["tp2-sp", "pp2"])
def test_two_process_layout_trains_and_reloads_exactly(tmp_path, tp, pp, sp):
    script = tmp_path / "smoke.py"
    script.write_text(SCRIPT)
    (tmp_path / "ckpt").mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(script), str(tp), str(pp), "1" if sp else "0", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for report in ranks:
        records = report["records"]
        assert all(r["ok"] and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in records)
        # Adam keeps both moments for every parameter of this rank's shard or stage
        entries = report["optimizer_entries"]
        for moment in ("exp_avg", "exp_avg_sq"):
            assert sum(e.endswith("/" + moment) for e in entries) == len(report["parameters"]) > 0
        # the fresh model and optimizer really started elsewhere: every weight differs, Adam has no state yet
        assert report["differ_before_load"]["parameters"] == report["parameters"]
        assert set(entries) <= set(report["differ_before_load"]["optimizer"])
        # ... and after loading, every parameter and optimizer entry is exactly what was saved
        assert report["differ_after_load"] == {"parameters": [], "optimizer": []}
        # the steps after the reload are the uninterrupted run's third and fourth steps, to the bit
        assert report["resumed_steps"] == records[2:] and report["differ_at_the_end"] == []
    # Grad norms are all-reduced over the model-parallel group: every rank reports the same value.
    assert [r["grad_norm"] for r in ranks[0]["records"]] == [r["grad_norm"] for r in ranks[1]["records"]]
    last_stage_losses = [r["loss"] for r in ranks[1]["records"]]
    assert all(abs(loss - math.log(384)) < 0.1 for loss in last_stage_losses)  # random init: ~ln(vocab)
    if tp == 2:
        assert [r["loss"] for r in ranks[0]["records"]] == last_stage_losses
    else:
        assert all(r["loss"] is None for r in ranks[0]["records"])  # the first stage computes no loss
