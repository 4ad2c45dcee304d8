"""Balancing moves samples between real gloo ranks without changing the math.

One ``torchrun`` of 4 processes checks the whole group and two groups of 2 (``[0, 1]``, ``[2, 3]``): each group
trains a tiny attention model on a variable-length global batch, once on the sampler's placement and once on the
samples the ``loongforge_balance_samples`` hook (the ``dp-balance`` optimization, registered in a plugin host)
hands each rank. The loss is normalised by the global token count, so the all-reduced gradients agree to fp32
summation order, and the balanced global batch is the same multiset of samples. A second optimization warms up
on synthetic step times, fits the cost model, and every rank ends with the same coefficients.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.distributed]

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import torch, torch.distributed as dist
    import torch.nn.functional as F
    from loongforge.plugins import PluginHost
    from loongforge_balance.dp_balance import CostModel
    from loongforge_balance.dp_balance.optimization import DPBalanceOptimization
    from loongforge_balance.dp_balance.synthetic import vlm_lengths

    VOCAB, DIM = 40, 16
    TRUE = CostModel(a=4e-4, b=1e-2, c=0.5)  # "seconds" of the synthetic warm-up steps

    def global_batch(seed, size):
        # the same on every rank; lengths 3-80 tokens from the video mix (scaled down for a tiny model)
        gen = torch.Generator().manual_seed(seed)
        out = []
        for i, n in enumerate(np.maximum(vlm_lengths(size, "video", seed) // 200, 3).tolist()):
            tokens = torch.randint(0, VOCAB, (n,), generator=gen)
            labels = torch.randint(0, VOCAB, (n,), generator=gen)
            mask = torch.rand(n, generator=gen) > 0.2
            out.append({"id": torch.tensor([i]), "tokens": tokens, "labels": labels, "loss_mask": mask})
        return out

    def sampler_slice(batch, rank, size):
        # ragged on purpose: rank r gets a slice of its own length
        cuts = np.linspace(0, len(batch), size + 1).astype(int)
        cuts[1:-1] += np.arange(1, size)
        return batch[cuts[rank]:cuts[rank + 1]]

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, DIM)
            self.qkv = torch.nn.Linear(DIM, 3 * DIM)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.GELU(), torch.nn.Linear(32, DIM))
            self.head = torch.nn.Linear(DIM, VOCAB)

        def forward(self, tokens):
            x = self.embed(tokens)[None]
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.head(x + self.mlp(x))[0]

    def grads(model, samples, global_tokens, group):
        # sum of per-token losses / the global batch's supervised tokens, then the data-parallel all-reduce
        model.zero_grad()
        loss = sum((F.cross_entropy(model(s["tokens"]), s["labels"], reduction="none") * s["loss_mask"]).sum()
                   for s in samples)
        (loss / global_tokens).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        if group is not False:
            dist.all_reduce(flat, group=group)
        return flat

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    def check_group(name, group, rank, size, model, out):
        batch = global_batch(seed=size, size=12 * size)
        local = sampler_slice(batch, rank, size)
        global_tokens = sum(int(s["loss_mask"].sum()) for s in batch)
        host = PluginHost(autoload=False)
        optimization = DPBalanceOptimization({"cost": TRUE.as_dict()})
        host.register(optimization, "optimization:dp-balance")
        mine = host.balance_samples(local, group)
        held = [None] * size
        dist.all_gather_object(held, [int(s["id"]) for s in mine], group=group)
        payload_ok = all(all(torch.equal(s[k], batch[int(s["id"])][k]) for k in s) for s in mine)
        reference = grads(model, batch, global_tokens, group=False)
        unbalanced = grads(model, local, global_tokens, group)
        balanced = grads(model, mine, global_tokens, group)
        out[name] = {"held": held, "num_samples": len(batch), "payload_ok": payload_ok,
                     "moved": sorted(int(s["id"]) for s in mine) != sorted(int(s["id"]) for s in local),
                     "balanced_vs_unbalanced": rel(balanced, unbalanced),
                     "balanced_vs_reference": rel(balanced, reference), "imbalance": optimization.last_imbalance}

    def check_warmup(group, rank, size, out):
        host = PluginHost(autoload=False)
        optimization = DPBalanceOptimization({"warmup_steps": 8})
        host.register(optimization, "optimization:dp-balance")
        for step in range(1, 11):
            batch = global_batch(seed=100 + step, size=6 * size + step)  # counts vary: c is told from the overhead
            slices = [sampler_slice(batch, r, size) for r in range(size)]
            mine = host.balance_samples(slices[rank], group)
            # synthetic step time: the slowest rank of the placement that was trained (+ an overhead)
            seconds = max(TRUE.costs([len(s["tokens"]) for s in part]).sum() for part in slices) + 0.25
            metrics = {"step_time": seconds - 1e-3 * rank}  # ranks time a step slightly differently: the max counts
            host.pm.hook.loongforge_on_step_end(trainer=None, step=step, metrics=metrics)
        everyone = [None] * size
        dist.all_gather_object(everyone, optimization.cost.as_dict(), group=group)
        out["warmup"] = {"fitted": everyone, "observations": len(optimization.observations),
                         "balanced_last_step": optimization.last_imbalance is not None, "kept": len(mine) > 0}

    def main():
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        torch.manual_seed(0)
        model = Tiny()
        out = {}
        check_group("world", None, rank, world, model, out)
        check_group("pair", pairs[rank // 2], rank % 2, 2, model, out)
        check_warmup(pairs[rank // 2], rank % 2, 2, out)
        with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
            json.dump(out, f)
        dist.destroy_process_group()

    main()
    """
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp_balance")
    script = out / "exchange.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(script),
           str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.parametrize("group", ["world", "pair"])
def test_same_multiset_and_payloads(ranks, group):
    results = [r[group] for r in ranks]
    for result in results:
        ids = [i for held in result["held"] for i in held]
        assert sorted(ids) == list(range(result["num_samples"]))  # every sample exactly once
        assert result["payload_ok"]  # and each arrives with its own tensors
    assert any(result["moved"] for result in results)  # the plan did move samples


@pytest.mark.parametrize("group", ["world", "pair"])
def test_gradients_equal_the_unbalanced_run(ranks, group):
    for result in (r[group] for r in ranks):
        assert result["balanced_vs_unbalanced"] <= 1e-6
        assert result["balanced_vs_reference"] <= 1e-6  # and the single-process gradient of the whole batch
        before, after = result["imbalance"]
        assert after < before


def test_warmup_fits_the_same_coefficients_on_every_rank(ranks):
    for pair in (ranks[:2], ranks[2:]):
        fitted = [r["warmup"]["fitted"] for r in pair]
        assert fitted[0] == fitted[1] and all(f == fitted[0][0] for f in fitted[0])  # bit-identical everywhere
    for result in (r["warmup"] for r in ranks):
        assert result["observations"] == 8  # steps 2-9: the first step of a process is not measured
        assert result["balanced_last_step"] and result["kept"]
        coefficients = result["fitted"][0]
        for key, true in {"a": 4e-4, "b": 1e-2, "c": 0.5}.items():  # noise-free synthetic times: near exact
            assert coefficients[key] == pytest.approx(true, rel=1e-3)
