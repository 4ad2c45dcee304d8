"""Context parallelism, fast checks: layout validation, the per-rank sequence split, the chunk reordering.

The numerical proof (cp=2 equals one process over 10 training steps) is tests/core/test_parallel_cp.py.
"""

from __future__ import annotations

import re
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from loongforge.config.schema import ParallelConfig, TrainingConfig
from loongforge.devices.ulysses import natural_order
from loongforge.errors import ConfigError
from loongforge.models.llama import FLAVORS
from loongforge.parallel.context import split_for_rank
from loongforge.parallel.megatron import MegatronStrategy
from loongforge.parallel.torch_native import TorchNativeStrategy
from loongforge.planner.layouts import SearchSpace, enumerate_layouts

DEBUG = FLAVORS["llama-debug"]  # 4 heads, 2 query groups


def check(world: int, seq_length: int = 32, **parallel):
    layout = MegatronStrategy.validate(ParallelConfig(**parallel), world, "run.yaml")
    return layout, MegatronStrategy.check_model(layout, DEBUG, TrainingConfig(micro_batch_size=2), "run.yaml",
                                                seq_length=seq_length)


def test_cp_takes_ranks_from_data_parallelism():
    layout, batch_plan = check(4, cp=2)
    assert (layout.cp, layout.dp, layout.world_size) == (2, 2, 4)
    assert batch_plan.global_batch_size == 4  # micro-batch 2 x dp 2: cp ranks share samples


@pytest.mark.parametrize(
    "world,seq_length,parallel,message",
    [
        (4, 32, {"cp": 3}, "tp*pp*cp*dp must equal the 4 processes started; got tp=1, pp=1, cp=3"),
        (4, 32, {"cp": 4}, "tp*cp=1*4 must divide the model's attention heads (4) and query groups (2)"),
        (4, 32, {"tp": 2, "cp": 2}, "tp*cp=2*2 must divide the model's attention heads (4) and query groups (2)"),
        (2, 30, {"cp": 2}, "data.seq_length (30) must be a multiple of 2*cp = 4"),
        (2, 0, {"cp": 0}, "parallel.cp must be >= 1, got 0"),
        (4, 32, {"cp": 4, "cp_mode": "hybrid"},
         "parallel.cp_a2a_size must divide parallel.cp=4 with 1 < cp_a2a_size < cp for cp_mode hybrid, got None"),
        (4, 32, {"cp": 4, "cp_mode": "hybrid", "cp_a2a_size": 4}, "1 < cp_a2a_size < cp for cp_mode hybrid, got 4"),
        (4, 32, {"cp": 4, "cp_mode": "ring", "cp_a2a_size": 2},
         "parallel.cp_a2a_size is for parallel.cp_mode: hybrid, not 'ring'"),
        (8, 32, {"tp": 2, "cp": 4, "cp_mode": "hybrid", "cp_a2a_size": 2},
         "tp*cp_a2a_size=2*2 must divide the model's attention heads (4) and query groups (2)"),
    ],
)
def test_cp_layout_errors(world, seq_length, parallel, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check(world, seq_length, **parallel)


@pytest.mark.parametrize("parallel,head_split,described", [
    ({"cp": 4, "cp_mode": "ring"}, 1, "cp=4 ring"),  # 2 query groups over 4 ranks: only a ring can
    ({"tp": 2, "cp": 2, "cp_mode": "ring"}, 2, "cp=2 ring"),
    ({"cp": 4, "cp_mode": "hybrid", "cp_a2a_size": 2}, 2, "cp=4 hybrid a2a=2"),
    ({"cp": 2}, 2, "cp=2 ulysses"),
])
def test_cp_modes_split_heads_their_own_way(parallel, head_split, described):
    layout, _ = check(8 if parallel.get("tp") else 4, **parallel)
    assert (layout.head_split, layout.cp_description) == (head_split, described)
    assert layout.cp_comm_type == {"ulysses": "a2a", "ring": "p2p", "hybrid": "a2a+p2p"}[layout.cp_mode]


def test_planner_offers_cp_the_mode_can_split():
    """The planner keeps the config's cp_mode: Ulysses cannot split 2 query groups over cp=4, a ring can, and
    hybrid needs cp a multiple of its sub-group size, above it."""
    def cps(**mode):
        return {c.cp for c in enumerate_layouts(DEBUG, 4, 32, 4, SearchSpace(**mode), Counter()) if c.tp == 1}
    assert cps() == {1, 2}
    assert cps(cp_mode="ring") == {1, 2, 4}
    assert cps(cp_mode="hybrid", cp_a2a_size=2) == {1, 4}


def test_torch_native_strategies_refuse_cp_mode():
    with pytest.raises(ConfigError, match=re.escape("parallel.cp_mode ring / cp_a2a_size choose the megatron")):
        TorchNativeStrategy("ddp").validate(ParallelConfig(cp=2, cp_mode="ring"), 2, "run.yaml")


@pytest.mark.parametrize("comm,dropout,message", [
    ("p2p", 0.1, "attention dropout (0.1) is not supported with parallel.cp_mode ring"),
    ("a2a+p2p", 0.0, "cp_comm_type a2a+p2p needs megatron's hierarchical context-parallel groups"),
    ("ring", 0.0, "unknown cp_comm_type 'ring'"),
])
def test_local_attention_refuses_what_its_ring_cannot_do(comm, dropout, message):
    from loongforge.devices.sdpa_attention import SDPAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               context_parallel_size=2, attention_dropout=dropout)
    size_two = SimpleNamespace(size=lambda: 2)
    groups = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1), cp=size_two, hcp=None)
    with pytest.raises((ConfigError, ValueError), match=re.escape(message)):
        SDPAttention(config, 1, AttnMaskType.causal, "self", cp_comm_type=comm, pg_collection=groups)


def test_split_gives_each_rank_mirrored_chunks():
    """Rank i of cp keeps chunks i and 2*cp-1-i (megatron's load-balanced causal split), for every key."""
    seq = torch.arange(16).unsqueeze(0).repeat(2, 1)
    batch = {"tokens": seq, "labels": seq + 100, "loss_mask": torch.ones(2, 16), "position_ids": seq[:1]}
    parts = [split_for_rank(batch, rank, 2) for rank in range(2)]
    assert parts[0]["tokens"][0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert parts[1]["tokens"][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert parts[1]["labels"][1].tolist() == [104, 105, 106, 107, 108, 109, 110, 111]
    assert parts[0]["position_ids"].tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    with pytest.raises(ValueError, match="causal attention only"):
        split_for_rank({**batch, "attention_mask": torch.zeros(2, 1, 16, 16, dtype=torch.bool)}, 0, 2)


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_natural_order_undoes_the_split(cp):
    """Concatenating every rank's chunks (rank order, as the all-to-all gathers them) and indexing with
    ``natural_order`` gives the original sequence."""
    seq = torch.arange(12 * cp).unsqueeze(0)
    batch = {"tokens": seq, "labels": seq, "loss_mask": seq, "position_ids": seq}
    gathered = torch.cat([split_for_rank(batch, rank, cp)["tokens"][0] for rank in range(cp)])
    assert gathered[natural_order(12 * cp, cp)].tolist() == seq[0].tolist()


@pytest.mark.parametrize("overrides,refused", [
    (["parallel.pp=2"], False),  # stages exchange each micro-batch's shape (variable_seq_lengths)
    (["parallel.pp=2", "parallel.vpp=2"], True),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp_mode=ring"], True),
])
def test_packed_cp_layouts(overrides, refused):
    """Packed rows under cp (re-laid per sequence, lengths varying per micro-batch) go through a plain pipeline, not
    the interleaved one, and not with sequence parallelism."""
    from pathlib import Path

    from loongforge.config import load_config
    from loongforge.train.preflight import preflight

    config = load_config(Path(__file__).parents[2] / "configs" / "sft-tiny.yaml",
                         ["parallel.cp=2", "training.micro_batch_size=2", "training.global_batch_size=4", *overrides])
    if refused:
        with pytest.raises(ConfigError, match=re.escape("data.pack with parallel.cp > 1 (rows re-laid per sequence")):
            preflight(config, nproc=4, device="cpu")
    else:
        assert any("cp=2" in line for line in preflight(config, nproc=4, device="cpu"))
