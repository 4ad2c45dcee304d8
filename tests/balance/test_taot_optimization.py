"""The ``taot`` optimization: registered by the plugin, options validated, unsupported models refused.

That it really replicates inside a megatron MoE model is ``test_taot_layer``'s megatron check.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from loongforge.errors import ConfigError, LoongForgeError
from loongforge_balance.taot.layer import ReplicaSettings
from loongforge_balance.taot.megatron import why_not_replicable
from loongforge_balance.taot.optimization import TAOTOptimization

pytestmark = pytest.mark.needs_plugins


def test_registered_under_taot(plugin_host):
    factory = plugin_host.registry("optimization").load("taot", where="optimizations.taot")
    assert factory is TAOTOptimization


def test_options_become_settings(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert TAOTOptimization({}).settings == ReplicaSettings(spare_slots=1, topology_weight=0.5, ranks_per_node=4)
    assert TAOTOptimization({"spare_slots": 2, "topology_weight": 1, "ranks_per_node": 8}).settings == \
        ReplicaSettings(spare_slots=2, topology_weight=1.0, ranks_per_node=8)


@pytest.mark.parametrize("options,message", [
    ({"slots": 1}, "unknown key 'optimizations.taot.slots' (known keys here: spare_slots, topology_weight, "
                   "ranks_per_node)"),
    ({"spare_slots": 0}, "spare_slots must be >= 1"),
    ({"spare_slots": "2"}, "'optimizations.taot.spare_slots' must be an integer, got '2'"),
    ({"ranks_per_node": 0}, "ranks_per_node must be >= 1"),
    ({"topology_weight": -0.1}, r"topology_weight must be a number in \[0, 1\]"),
    ({"topology_weight": 1.5}, r"topology_weight must be a number in \[0, 1\], got 1.5"),
    ({"topology_weight": True}, "'optimizations.taot.topology_weight' must be a number, got True"),
])
def test_bad_options_are_config_errors(options, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TAOTOptimization(options)


def test_a_model_without_moe_layers_is_refused():
    with pytest.raises(LoongForgeError, match="the model has no megatron MoE layer"):
        TAOTOptimization({}).loongforge_modify_model([torch.nn.Linear(4, 4)], None)


def test_grouped_gemm_experts_are_refused_with_the_reason():
    layer = SimpleNamespace(experts=torch.nn.Module(), config=SimpleNamespace())
    assert "TAOT needs SequentialMLP (moe_grouped_gemm off)" in why_not_replicable(layer)
