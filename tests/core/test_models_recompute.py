"""Activation recompute (``model.recompute``) changes memory, never numbers.

Each case builds the same 4-layer ``llama-debug`` (weights drawn per parameter name, so identical) with and
without recompute and runs one forward+backward in fp32: loss and every gradient must match. Memory is
measured deterministically as the bytes of distinct tensor storages autograd saves for backward
(``saved_tensors_hooks``), parameters excluded: what a forward holds on to until its backward.
"""

from __future__ import annotations

import pytest
import torch
from loongforge.config.schema import RecomputeConfig  # noqa: E402
from loongforge.errors import ConfigError  # noqa: E402
from loongforge.models.decoder_model import build_model  # noqa: E402
from loongforge.models.llama import FLAVORS  # noqa: E402
from loongforge.models.recompute import recompute_kwargs  # noqa: E402
from loongforge.parallel.init import initialize_layout_independent  # noqa: E402
from test_parallel_parity import STEPS, assert_parity, reference, root, train  # noqa: F401 (fixtures)

FLAVOR = FLAVORS["llama-debug"].with_overrides(num_layers=4)
SEQ, BATCH = 128, 4


def _forward_backward(backend, recompute):
    """(loss, {name: grad}, saved activation bytes) of one forward+backward."""
    model = build_model(FLAVOR, backend=backend, extra_config=recompute_kwargs(recompute, FLAVOR.num_layers))
    initialize_layout_independent([model], seed=3)
    model.train()
    gen = torch.Generator().manual_seed(0)
    sample = torch.randint(0, FLAVOR.vocab_size, (BATCH, SEQ + 1), generator=gen)
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(sample[:, :-1], positions, None, labels=sample[:, 1:]).mean()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.item(), grads, sum(saved.values())


@pytest.fixture(scope="module")
def baseline(megatron_cpu_world):
    return _forward_backward(megatron_cpu_world, None)


CASES = {
    "full-uniform-1": RecomputeConfig(granularity="full"),
    "full-uniform-2": RecomputeConfig(granularity="full", method="uniform", num_layers=2),
    "full-block-2": RecomputeConfig(granularity="full", method="block", num_layers=2),
    "selective-core-attn": RecomputeConfig(granularity="selective"),
    "selective-mlp": RecomputeConfig(granularity="selective", modules=["core_attn", "mlp"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_recompute_keeps_loss_and_grads(megatron_cpu_world, baseline, name):
    loss, grads, saved = _forward_backward(megatron_cpu_world, CASES[name])
    base_loss, base_grads, base_saved = baseline
    assert loss == pytest.approx(base_loss, rel=1e-6, abs=0)
    assert grads.keys() == base_grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grad, base_grads[key], rtol=1e-6, atol=1e-7, msg=key)
    assert saved < base_saved, f"{name}: recompute saved {saved} bytes, not fewer than {base_saved}"


def test_full_recompute_saves_most_activation_memory(megatron_cpu_world, baseline):
    """Full recompute of every layer keeps only layer inputs (+ the output head): far below a third."""
    _, _, saved = _forward_backward(megatron_cpu_world, CASES["full-uniform-1"])
    base_saved = baseline[2]
    assert saved < base_saved / 3, (saved, base_saved)


@pytest.mark.parametrize(
    ("recompute", "message"),
    [
        (RecomputeConfig(granularity="partial"), "granularity must be one of full, selective"),
        (RecomputeConfig(granularity="full", method="every"), "method must be one of uniform, block"),
        (RecomputeConfig(granularity="full", num_layers=5), "between 1 and the 4 layers"),
        (RecomputeConfig(granularity="selective", num_layers=1), "apply to granularity full only"),
        (RecomputeConfig(granularity="selective", modules=["layernorm"]), "modules must name some of"),
    ],
)
def test_bad_recompute_settings_name_the_key(recompute, message):
    with pytest.raises(ConfigError, match=message):
        recompute_kwargs(recompute, 4, "run.yaml")


def test_recompute_kwargs_for_megatron():
    assert recompute_kwargs(None, 4) == {}
    assert recompute_kwargs(RecomputeConfig(granularity="full", method="block"), 4) == {
        "recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 4}
    assert recompute_kwargs(RecomputeConfig(granularity="selective"), 4) == {
        "recompute_granularity": "selective", "recompute_modules": ["core_attn"]}


def test_recompute_is_read_from_the_config():
    from loongforge.config.loader import load_config

    config = load_config(None, ["model.recompute.granularity=full", "model.recompute.method=block",
                                "model.recompute.num_layers=2"])
    assert config.model.recompute == RecomputeConfig(granularity="full", method="block", num_layers=2)
    assert load_config(None, []).model.recompute is None


@pytest.mark.slow
def test_cli_run_with_recompute_matches_the_run_without(root, reference):  # noqa: F811
    """Through ``loongforge train``: the config reaches the model, and 10 training steps are unchanged."""
    rows, stdout = train(root, "full-recompute", "model.recompute.granularity=full", "model.recompute.num_layers=2")
    assert "activation recompute: RecomputeConfig(granularity='full', method=None, num_layers=2" in stdout
    assert_parity(rows, reference, range(1, STEPS + 1), rtol=1e-6)
