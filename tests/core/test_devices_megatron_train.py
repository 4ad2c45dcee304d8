"""megatron-core trains on CPU with the patches: DDP, megatron optimizers, clipping, LR schedule, checkpoints.

One process (gloo world of one, TP=PP=1). Multi-process layouts are smoke-tested in
``test_devices_torchrun.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from loongforge.models.decoder_model import build_model  # noqa: E402
from loongforge.models.llama import FLAVORS  # noqa: E402

SEQ, MICRO_BATCH, MICROBATCHES = 32, 2, 2
FLAVOR = FLAVORS["llama-debug"]


def _setup(backend, dtype="fp32"):
    """A DDP-wrapped llama-debug, its megatron Adam optimizer and a warmup+cosine scheduler."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    torch.manual_seed(42)
    model = build_model(FLAVOR, backend=backend, params_dtype=dtype)
    model = DistributedDataParallel(
        model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model
    )
    model.config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-3, min_lr=3e-4, weight_decay=0.01, clip_grad=0.5,
                        bf16=dtype == "bf16", params_dtype=model.config.params_dtype),
        [model],
    )
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=3e-3, min_lr=3e-4, lr_warmup_steps=2, lr_decay_steps=20,
        lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=20, wd_incr_style="constant",
    )
    return model, optimizer, scheduler


def _batches(n):
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (MICRO_BATCH, SEQ + 1), generator=gen) for _ in range(n)]


def _step(model, optimizer, scheduler, batches):
    """One optimizer step over ``MICROBATCHES`` micro-batches; returns (mean loss, grad norm, lr)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        sample = next(data_iterator)
        tokens, labels = sample[:, :-1], sample[:, 1:]
        positions = torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, -1)
        per_token = model(tokens, positions, None, labels=labels)

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach().clone()}  # megatron divides `loss` in place afterwards

        return per_token, loss_func

    model.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batches), model=[model], num_microbatches=MICROBATCHES,
        seq_length=SEQ, micro_batch_size=MICRO_BATCH, forward_only=False,
    )
    ok, grad_norm, _ = optimizer.step()
    assert ok
    scheduler.step(1)
    return torch.stack([x["loss"] for x in losses]).mean().item(), grad_norm, optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_training_steps_reduce_loss(megatron_cpu_world, dtype):
    model, optimizer, scheduler = _setup(megatron_cpu_world, dtype)
    batches = _batches(MICROBATCHES)
    history = [_step(model, optimizer, scheduler, batches) for _ in range(8)]
    losses = [h[0] for h in history]
    # Random init over a 384-way vocabulary: the first loss is close to ln(384) = 5.95.
    assert abs(losses[0] - 5.95) < 0.1
    assert losses[-1] < losses[0] - 0.5  # the same batch is memorised quickly
    assert all(h[1] > 0.5 for h in history[:2])  # early grad norms exceed clip_grad=0.5, so clipping is active
    # Linear warmup over 2 steps, then cosine from 3e-3 to 3e-4 over the remaining 18.
    cosine_step_1 = 3e-4 + 2.7e-3 * 0.5 * (1 + math.cos(math.pi / 18))
    assert [h[2] for h in history[:3]] == pytest.approx([1.5e-3, 3e-3, cosine_step_1], rel=1e-9)
    if dtype == "bf16":
        assert next(model.parameters()).dtype == torch.bfloat16
        inner = optimizer.chained_optimizers[0]
        assert inner.fp32_from_float16_groups[0][0].dtype == torch.float32  # fp32 main weights


def test_dist_checkpoint_resume_continues_bit_exactly(megatron_cpu_world, tmp_path):
    from megatron.core import dist_checkpointing

    batches = _batches(MICROBATCHES * 6)
    chunks = [batches[i : i + MICROBATCHES] for i in range(0, len(batches), MICROBATCHES)]
    model, optimizer, scheduler = _setup(megatron_cpu_world)
    for chunk in chunks[:3]:
        _step(model, optimizer, scheduler, chunk)
    state = {"model": model.module.sharded_state_dict()}
    state["optimizer"] = optimizer.sharded_state_dict(state["model"])
    dist_checkpointing.save(state, str(tmp_path))
    scheduler_state = scheduler.state_dict()
    rng_state = torch.get_rng_state()
    uninterrupted = [_step(model, optimizer, scheduler, chunk)[:2] for chunk in chunks[3:]]

    model, optimizer, scheduler = _setup(megatron_cpu_world)
    template = {"model": model.module.sharded_state_dict()}
    template["optimizer"] = optimizer.sharded_state_dict(template["model"], is_loading=True)
    loaded = dist_checkpointing.load(template, str(tmp_path))
    model.module.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(scheduler_state)
    torch.set_rng_state(rng_state)
    resumed = [_step(model, optimizer, scheduler, chunk)[:2] for chunk in chunks[3:]]
    assert resumed == uninterrupted
