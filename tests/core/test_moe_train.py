"""MoE training in one process: per-expert token counts reach lifecycle hooks, the aux loss is logged, and
impossible expert layouts fail before any model is built."""

from __future__ import annotations

import pytest
from loongforge import hookimpl, load_config
from loongforge.config.schema import ParallelConfig, TrainingConfig
from loongforge.errors import ConfigError
from loongforge.models.moe import FLAVORS
from loongforge.parallel.megatron import MegatronStrategy

SEQ, MICRO, TOPK = 32, 2, 2


class ExpertTokens:
    """Records what an expert-placement plugin would read after each step."""

    def __init__(self):
        self.seen = []

    @hookimpl
    def loongforge_on_step_end(self, trainer, step, metrics):
        self.seen.append((trainer.expert_tokens, metrics["moe_aux_loss"]))


def test_expert_token_counts_reach_hooks(tmp_path, register_plugin):
    from loongforge.train.run import run_training

    recorder = register_plugin(ExpertTokens(), "expert-tokens")
    config = load_config(None, [
        f"run.output_dir={tmp_path / 'out'}", "model.name=mixtral-tiny", "model.overrides.num_layers=2",
        "model.overrides.hidden_size=64", "model.overrides.moe_ffn_hidden_size=96", f"data.seq_length={SEQ}",
        f"training.micro_batch_size={MICRO}", "training.global_batch_size=4", "training.steps=2",
        "training.threads=1", "logging.progress=false", "logging.tensorboard=false", "checkpoint.save_at_end=false",
    ])
    run_training(config)
    assert len(recorder.seen) == 2
    for counts, aux in recorder.seen:
        assert len(counts) == 2 and all(len(layer) == 4 for layer in counts)  # [layer][expert]
        # every token of the step's 4 sequences goes to exactly top-k experts in every layer
        assert [sum(layer) for layer in counts] == [4 * SEQ * TOPK] * 2, counts
        assert all(min(layer) > 0 for layer in counts)
        assert 0.9 < aux < 4.0  # switch load-balancing loss: 1 when balanced, num_experts when collapsed
    assert recorder.seen[0][0] != recorder.seen[1][0]  # counted per step, not accumulated


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
