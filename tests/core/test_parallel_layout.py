"""Layout validation, the virtual-pipeline data feeds, weight slicing and the ``--nproc`` launcher (fast checks).

The numerical proof that layouts match one process is tests/core/test_parallel_parity.py.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from dataclasses import replace

import pytest
from loongforge.config.schema import ParallelConfig, TrainingConfig
from loongforge.errors import ConfigError
from loongforge.models.llama import FLAVORS
from loongforge.parallel.chunk_feeds import chunk_feeds
from loongforge.parallel.megatron import MegatronStrategy

DEBUG = FLAVORS["llama-debug"]  # 2 layers, 4 heads, 2 query groups


def plan(world: int, flavor=DEBUG, micro: int = 2, global_batch: int | None = None, **parallel):
    layout = MegatronStrategy.validate(ParallelConfig(**parallel), world, "run.yaml")
    training = TrainingConfig(micro_batch_size=micro, global_batch_size=global_batch)
    return layout, MegatronStrategy.check_model(layout, flavor, training, "run.yaml")


def test_world_size_must_be_a_multiple_of_tp_times_pp():
    with pytest.raises(ConfigError) as exc:
        plan(4, tp=3)
    assert str(exc.value) == (
        "run.yaml: tp*pp*cp*dp must equal the 4 processes started; got tp=3, pp=1, cp=1 (tp*pp*cp=3 does not divide 4)"
    )


@pytest.mark.parametrize(
    "world,kwargs,message",
    [
        (4, {"tp": 4}, "tp=4 must divide the model's attention heads (4) and query groups (2)"),
        (4, {"pp": 2, "vpp": 2}, "the model's 2 layers do not split into pp*vpp=2*2 = 4 equal stages"),
        (2, {"global_batch": 6}, "training.global_batch_size (6) must be a multiple of micro_batch_size*dp (2*2 = 4)"),
        (2, {"vpp": 2}, "parallel.vpp=2 needs parallel.pp > 1"),
        (2, {"tp": 1, "sequence_parallel": True}, "parallel.sequence_parallel needs parallel.tp > 1"),
    ],
)
def test_impossible_layouts_name_the_numbers(world, kwargs, message):
    with pytest.raises(ConfigError) as exc:
        plan(world, **kwargs)
    assert str(exc.value) == f"run.yaml: {message}"


def test_interleaved_pipeline_needs_micro_batches_in_multiples_of_pp():
    four_layers = replace(DEBUG, num_layers=4)
    with pytest.raises(ConfigError, match=r"micro-batches per step \(1 = global_batch_size 2 / "):
        plan(2, four_layers, global_batch=2, pp=2, vpp=2)
    layout, batches = plan(2, four_layers, global_batch=4, pp=2, vpp=2)
    assert (layout.tp, layout.pp, layout.vpp, layout.dp, layout.num_chunks) == (1, 2, 2, 1, 2)
    assert (batches.global_batch_size, batches.num_microbatches) == (4, 2)


def test_dp_is_derived_and_batch_split_into_micro_batches():
    layout, batches = plan(8, micro=2, global_batch=16, tp=2)
    assert (layout.dp, layout.vpp, batches.num_microbatches) == (4, None, 2)
    layout, batches = plan(2, micro=3)  # default global batch: one micro-batch per rank
    assert (layout.dp, batches.global_batch_size, batches.num_microbatches) == (2, 6, 1)


def test_chunk_feeds_give_every_chunk_each_item_and_read_the_source_once():
    source = iter(range(4))
    first, second = chunk_feeds(source, 2)
    # The interleaved schedule runs chunk 0 ahead of chunk 1 and back again.
    order = [next(first), next(first), next(second), next(first), next(second), next(second)]
    assert order == [0, 1, 0, 2, 1, 2]
    assert next(source) == 3  # exactly three items were read for six deliveries


def test_weight_slices_match_megatron_cpu_initialisation():
    """Our slicing of a full weight equals megatron's own, for strided (SwiGLU fc1) and plain partitions."""
    import torch
    from loongforge.parallel.init import full_shape, local_slice
    from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu

    full = torch.randn(8, 6)
    for stride, dim in ((2, 0), (1, 0), (1, 1)):
        for rank in range(2):
            shape = (4, 6) if dim == 0 else (8, 3)
            ours = torch.nn.Parameter(torch.empty(shape))
            _initialize_affine_weight_cpu(
                ours, 8, 6, shape[dim], dim, lambda w: w.copy_(full), stride=stride, rank=rank, world_size=2
            )
            assert full_shape(ours, 2) == (8, 6)
            assert torch.equal(local_slice(full, ours, rank, 2), ours.data)


def test_nproc_checks_the_layout_before_starting_processes(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model: {name: llama-debug}\n")
    done = subprocess.run(
        [sys.executable, "-m", "loongforge.cli", "train", str(config), "parallel.tp=3", "--nproc", "2"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: {config}: tp*pp*cp*dp must equal the 2 processes started; got tp=3, pp=1, cp=1 "
        "(tp*pp*cp=3 does not divide 2)"
    ]


@pytest.mark.parametrize(("overrides", "blocker"), [
    ({}, "attn_logit_softcapping"),  # gemma2-tiny soft-caps and windows: the first reason is named
    ({"attn_logit_softcapping": None}, "sliding_window"),
])
def test_context_parallel_refuses_decoders_whose_attention_needs_whole_sequences(overrides, blocker):
    from loongforge.models.gemma import FLAVORS as GEMMA
    from loongforge.planner.layouts import SearchSpace, enumerate_layouts

    flavor = replace(GEMMA["gemma2-tiny"], **overrides)
    with pytest.raises(ConfigError, match=rf"run.yaml: parallel.cp=2: the model's {blocker} is not supported"):
        MegatronStrategy.check_model(MegatronStrategy.validate(ParallelConfig(cp=2), 2, "run.yaml"), flavor,
                                     TrainingConfig(micro_batch_size=1), "run.yaml", seq_length=64)
    # the planner never proposes what check would refuse; without the blocker it does propose cp=2
    rejected: Counter = Counter()
    layouts = list(enumerate_layouts(flavor, 2, 64, 8, SearchSpace(), rejected))
    assert layouts and all(c.cp == 1 for c in layouts) and rejected[f"cp with {blocker}"] > 0
    plain = replace(flavor, attn_logit_softcapping=None, sliding_window=None, sliding_window_full_every=None)
    assert any(c.cp == 2 for c in enumerate_layouts(plain, 2, 64, 8, SearchSpace(), Counter()))
