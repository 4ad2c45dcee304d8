"""Experts with per-step clones compute exactly what plain expert parallelism and a dense MoE compute.

2 and 4 gloo processes (torchrun runs this file as the worker): skewed routing makes the planner clone hot
experts; the replicated layer's output, and the gradients of tokens, router probabilities and home expert
weights, must equal the same layer without spare slots and a single-process dense reference (fp32). A
megatron Mixtral (ep=2) switched to TAOT through the ``taot`` optimization must give the loss and every
parameter gradient of the unmodified megatron ``MoELayer``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.needs_plugins]

TOL = 1e-5  # relative to the largest entry, fp32: the paths sum in different orders


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(nproc: int, out_dir, check: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(_free_port()), __file__, str(out_dir), check]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.parametrize("nproc", [2, 4])
def test_replicated_experts_match_plain_and_dense(tmp_path, nproc):
    ranks = _run(nproc, tmp_path, "functional")
    clones = ranks[0]["clones"]
    assert clones >= nproc // 2  # the skew made the planner clone (all ranks hold the same plan)
    assert all(r["clones"] == clones for r in ranks)
    for r in ranks:
        assert set(r["diffs"]) == {f"{what}_{ref}" for what in ("out", "x", "probs", "fc1", "fc2")
                                   for ref in ("plain", "dense")}
        assert max(r["diffs"].values()) <= TOL, r["diffs"]


@pytest.mark.slow
def test_taot_optimization_matches_megatron_moe_layer(tmp_path):
    for r in _run(2, tmp_path, "megatron"):
        assert r["swapped_layers"] == 2 and r["clones"] >= 1
        assert abs(r["loss_taot"] - r["loss_plain"]) <= TOL * abs(r["loss_plain"])
        assert r["grad_max_rel"] <= TOL, r
        # embedding, final norm, output + 2 x (2 norms, qkv, proj, router, 2 x 2 local expert weights)
        assert r["grads_compared"] == 21


# ---------------------------------------------------------------------------------------------------------
# Worker (run by torchrun).
# ---------------------------------------------------------------------------------------------------------


def _functional_check() -> dict:
    import torch
    import torch.distributed as dist
    from loongforge_balance.taot.layer import ReplicaSettings, replicated_experts, swiglu

    ranks, me = dist.get_world_size(), dist.get_rank()
    local, hidden, ffn, tokens_per_rank, topk = 2, 16, 24, 40, 2
    experts = ranks * local
    gen = torch.Generator().manual_seed(0)
    fc1_all = torch.randn(experts, 2 * ffn, hidden, generator=gen) * 0.3
    fc2_all = torch.randn(experts, hidden, ffn, generator=gen) * 0.3
    bias = torch.zeros(experts)
    bias[0], bias[local + 1] = 3.0, 2.0  # two hot experts on different ranks
    xs = torch.randn(ranks, tokens_per_rank, hidden, generator=gen)
    logits = torch.randn(ranks, tokens_per_rank, experts, generator=gen) + bias
    top, chosen = logits.topk(topk, dim=-1)
    routing_all = torch.zeros(ranks, tokens_per_rank, experts, dtype=torch.bool).scatter(2, chosen, True)
    probs_all = torch.zeros(ranks, tokens_per_rank, experts).scatter(2, chosen, torch.softmax(top, dim=-1))
    targets = torch.randn(ranks, tokens_per_rank, hidden, generator=gen)

    def replicated(spare_slots: int) -> tuple[dict, int]:
        x = xs[me].clone().requires_grad_()
        probs = probs_all[me].clone().requires_grad_()
        fc1 = fc1_all[me * local:(me + 1) * local].clone().requires_grad_()
        fc2 = fc2_all[me * local:(me + 1) * local].clone().requires_grad_()
        settings = ReplicaSettings(spare_slots=spare_slots, topology_weight=0.5, ranks_per_node=2)
        out, plan = replicated_experts(x, probs, routing_all[me], fc1, fc2, settings)
        (out * targets[me]).sum().backward()
        grads = {"out": out.detach(), "x": x.grad, "probs": probs.grad, "fc1": fc1.grad, "fc2": fc2.grad}
        return grads, int((plan.slot_expert >= 0).sum())

    def dense() -> dict:
        x = xs.clone().requires_grad_()
        probs = probs_all.clone().requires_grad_()
        fc1, fc2 = fc1_all.clone().requires_grad_(), fc2_all.clone().requires_grad_()
        out = torch.zeros_like(x)
        for e in range(experts):
            out = out + probs[..., e:e + 1] * routing_all[..., e:e + 1] * swiglu(x, fc1[e], fc2[e])
        (out * targets).sum().backward()
        mine = slice(me * local, (me + 1) * local)
        return {"out": out[me].detach(), "x": x.grad[me], "probs": probs.grad[me], "fc1": fc1.grad[mine],
                "fc2": fc2.grad[mine]}

    with_clones, clones = replicated(spare_slots=2)
    references = {"plain": replicated(spare_slots=0)[0], "dense": dense()}
    diffs = {f"{what}_{name}": ((with_clones[what] - ref[what]).abs().max() / ref[what].abs().max()).item()
             for name, ref in references.items() for what in with_clones}
    return {"clones": clones, "diffs": diffs}


def _megatron_check() -> dict:
    import torch
    import torch.distributed as dist
    from loongforge.devices.cpu import CPUBackend
    from loongforge.models.decoder_model import ParallelSettings, build_model
    from loongforge.models.moe import FLAVORS
    from loongforge_balance.taot.optimization import TAOTOptimization
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    backend = CPUBackend()
    backend.apply_patches()
    ps.initialize_model_parallel(expert_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    torch.manual_seed(7)
    flavor = FLAVORS["mixtral-tiny"].with_overrides(num_layers=2, hidden_size=64, ffn_hidden_size=128,
                                                    moe_ffn_hidden_size=96)
    model = build_model(flavor, backend=backend, parallel=ParallelSettings(ep=2))
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    data = torch.randint(0, 384, (2, 33), generator=gen)
    position_ids = torch.arange(32).expand(2, -1)

    def loss_and_grads() -> tuple[float, dict]:
        model.zero_grad(set_to_none=True)
        loss = model(data[:, :-1], position_ids, None, labels=data[:, 1:]).float().mean()
        loss.backward()
        return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    loss_plain, grads_plain = loss_and_grads()
    optimization = TAOTOptimization({"spare_slots": 1, "topology_weight": 0.5, "ranks_per_node": 1})
    optimization.loongforge_modify_model([model], None)
    loss_taot, grads_taot = loss_and_grads()
    assert grads_taot.keys() == grads_plain.keys()
    rel = max(((grads_taot[k] - grads_plain[k]).abs().max() / grads_plain[k].abs().max().clamp(min=1e-12)).item()
              for k in grads_plain)
    clones = sum(int((layer.taot_last_plan.slot_expert >= 0).sum()) for layer in optimization.layers)
    ps.destroy_model_parallel()
    return {"swapped_layers": len(optimization.layers), "clones": clones, "loss_plain": loss_plain,
            "loss_taot": loss_taot, "grad_max_rel": rel, "grads_compared": len(grads_plain)}


def _worker(out_dir: str, check: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    record = _functional_check() if check == "functional" else _megatron_check()
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(record, f)
    dist.barrier()  # no rank tears gloo down while another still finishes its last exchange (a rare SIGABRT)
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
