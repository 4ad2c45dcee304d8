"""MoE training in one process: per-expert token counts reach lifecycle hooks, the logged aux loss is megatron's
load-balancing loss recomputed independently from the routers' inputs, and impossible expert layouts fail before
any model is built."""

from __future__ import annotations

import pytest
import torch
from loongforge import hookimpl, load_config
from loongforge.config.schema import ParallelConfig, TrainingConfig
from loongforge.errors import ConfigError
from loongforge.models.moe import FLAVORS
from loongforge.parallel.megatron import MegatronStrategy

SEQ, MICRO, GLOBAL, STEPS = 32, 2, 4, 2


class RouterWatch:
    """Records what an expert-placement plugin reads after each step, and recomputes the load-balancing loss of
    every router call from the router's input and weights (float64), without megatron's routing code.

    megatron's ``aux_loss`` (switch transformer) for one router call over T tokens routed to top-k of E experts:
    ``E * sum_i f_i * P_i`` with ``f_i`` = (tokens whose top-k includes expert i) / (T * k) and ``P_i`` = the mean
    over tokens of softmax(logits)_i; the logged value is that before ``moe_aux_loss_coeff``, averaged over layers
    and micro-batches.
    """

    def __init__(self):
        self.seen = []
        self._calls: list[tuple[int, float]] = []

    @hookimpl
    def loongforge_on_train_start(self, trainer):
        from megatron.core.transformer.moe.router import TopKRouter

        routers = [m for chunk in trainer.model for m in chunk.modules() if isinstance(m, TopKRouter)]
        assert routers
        for router in routers:
            router.register_forward_pre_hook(self._recompute)

    def _recompute(self, router, inputs):
        if not (router.training and torch.is_grad_enabled()):
            return
        hidden = inputs[0].detach().double().reshape(-1, router.weight.shape[1])
        logits = hidden @ router.weight.detach().double().t()
        if router.bias is not None:
            logits = logits + router.bias.detach().double()
        num_tokens, num_experts = logits.shape
        topk = router.topk
        probs = torch.softmax(logits, dim=-1)
        chosen = torch.zeros_like(probs).scatter(1, probs.topk(topk, dim=1).indices, 1.0)
        fraction = chosen.sum(dim=0) / (num_tokens * topk)
        mean_prob = probs.mean(dim=0)
        self._calls.append((router.layer_number, (num_experts * (fraction * mean_prob).sum()).item()))

    @hookimpl
    def loongforge_on_step_end(self, trainer, step, metrics):
        self.seen.append((trainer.expert_tokens, metrics["moe_aux_loss"], self._calls))
        self._calls = []


@pytest.mark.parametrize(("flavor", "layers", "experts", "topk"), [
    ("mixtral-tiny", 2, 4, 2),
    ("qwen3-moe-tiny", 2, 8, 4),
])
def test_aux_loss_and_expert_counts_reach_hooks(tmp_path, register_plugin, flavor, layers, experts, topk):
    from loongforge.train.run import run_training

    watch = register_plugin(RouterWatch(), "router-watch")
    config = load_config(None, [
        f"run.output_dir={tmp_path / 'out'}", f"model.name={flavor}", f"model.overrides.num_layers={layers}",
        "model.overrides.hidden_size=64", "model.overrides.moe_ffn_hidden_size=96", f"data.seq_length={SEQ}",
        f"training.micro_batch_size={MICRO}", f"training.global_batch_size={GLOBAL}", f"training.steps={STEPS}",
        "training.threads=1", "logging.progress=false", "logging.tensorboard=false", "checkpoint.save_at_end=false",
    ])
    run_training(config)
    assert len(watch.seen) == STEPS
    micro_batches = GLOBAL // MICRO
    for counts, aux, calls in watch.seen:
        assert len(counts) == layers and all(len(layer) == experts for layer in counts)  # [layer][expert]
        # every token of the step's sequences goes to exactly top-k experts in every layer
        assert [sum(layer) for layer in counts] == [GLOBAL * SEQ * topk] * layers, counts
        # one router call per layer per micro-batch, each over one micro-batch's tokens
        assert sorted(layer for layer, _ in calls) == sorted(list(range(1, layers + 1)) * micro_batches)
        expected = sum(value for _, value in calls) / len(calls)
        assert aux == pytest.approx(expected, rel=1e-6, abs=0), (aux, calls)
    assert watch.seen[0][0] != watch.seen[1][0]  # counted per step, not accumulated
    assert watch.seen[0][1] != watch.seen[1][1]


@pytest.mark.parametrize(("settings", "world", "flavor", "message"), [
    (dict(ep=3), 6, "mixtral-tiny", r"ep=3 must divide the model's 4 experts"),
    (dict(ep=2, tp=2, sequence_parallel=True), 2, "mixtral-tiny", r"etp\*ep\*pp must divide the 2 processes"),
    (dict(tp=2), 2, "mixtral-tiny", r"MoE model at tp=2 needs parallel.sequence_parallel"),
    (dict(moe_dispatcher="flex"), 2, "mixtral-tiny", r"moe_dispatcher must be one of alltoall, allgather"),
    (dict(ep=2), 2, None, r"ep=2 needs a mixture-of-experts model"),
])
def test_bad_expert_layouts_fail_with_the_reason(settings, world, flavor, message):
    from loongforge.models.llama import FLAVORS as DENSE

    model = FLAVORS[flavor] if flavor else DENSE["llama-debug"]
    with pytest.raises(ConfigError, match=message):
        layout = MegatronStrategy.validate(ParallelConfig(**settings), world)
        MegatronStrategy.check_model(layout, model, TrainingConfig(micro_batch_size=1))
