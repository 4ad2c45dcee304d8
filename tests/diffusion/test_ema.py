"""EMA of parameters: exact arithmetic, warmup schedule, checkpoint round trip, sampling with the averages."""

from __future__ import annotations

import pytest
import torch
from loongforge.errors import LoongForgeError
from loongforge_diffusion.ema import EMA
from torch import nn


def _module(values: list[float], dtype=torch.float32) -> nn.Linear:
    """A 2 -> 1 linear whose weight and bias hold ``values`` (three numbers)."""
    module = nn.Linear(2, 1).to(dtype)
    _set(module, values)
    return module


@torch.no_grad()
def _set(module: nn.Linear, values: list[float]) -> None:
    module.weight.copy_(torch.tensor([values[:2]]))
    module.bias.copy_(torch.tensor(values[2:]))


def _flat(tensors) -> list[float]:
    return [x for t in tensors for x in t.flatten().tolist()]


def test_update_is_exactly_the_weighted_average():
    """Dyadic numbers and decay 0.75 make every step exact in float32, so the check is equality."""
    module = _module([1.0, -2.0, 0.5])
    ema = EMA(module, decay=0.75)
    expected = [1.0, -2.0, 0.5]
    for values in ([3.0, 2.0, -0.5], [0.25, -1.0, 4.0], [8.0, 0.125, 0.0]):
        _set(module, values)
        ema.update(module)
        expected = [0.75 * e + 0.25 * v for e, v in zip(expected, values, strict=True)]
    assert _flat(ema.shadow.values()) == expected
    assert ema.num_updates == 3


def test_warmup_follows_min_decay_and_one_plus_n_over_ten_plus_n():
    module = _module([0.0, 0.0, 0.0])
    ema = EMA(module, decay=0.9, warmup=True)
    expected = [0.0, 0.0, 0.0]
    decays = []
    for step in range(100):
        values = [float(step), -0.5 * step, 1.0]
        decays.append(ema.current_decay())
        _set(module, values)
        ema.update(module)
        expected = [decays[-1] * e + (1 - decays[-1]) * v for e, v in zip(expected, values, strict=True)]
    assert decays[:3] == [1 / 10, 2 / 11, 3 / 12]
    assert decays[79] == 80 / 89 < 0.9 and decays[80] == decays[-1] == 0.9  # (1+n)/(10+n) reaches 0.9 at n = 80
    assert max(abs(a - b) / max(abs(b), 1) for a, b in zip(_flat(ema.shadow.values()), expected, strict=True)) < 1e-6


def test_tracks_only_trainable_parameters_and_round_trips_through_state_dict():
    module = _module([1.0, 2.0, 3.0])
    module.bias.requires_grad_(False)
    ema = EMA(module, decay=0.5)
    assert list(ema.shadow) == ["weight"]
    _set(module, [5.0, 6.0, 7.0])
    ema.update(module)

    other = _module([0.0, 0.0, 0.0])
    other.bias.requires_grad_(False)
    restored = EMA(other, decay=0.1)
    restored.load_state_dict(ema.state_dict())
    assert (restored.decay, restored.warmup, restored.num_updates) == (0.5, False, 1)
    for copy in (ema, restored):
        _set(module, [-1.0, 1.0, 0.0])
        copy.update(module)
    assert torch.equal(restored.shadow["weight"], ema.shadow["weight"])
    assert restored.shadow["weight"].tolist() == [[1.0, 2.5]]  # 0.5 * (0.5 * [1, 2] + 0.5 * [5, 6]) + 0.5 * [-1, 1]

    with pytest.raises(LoongForgeError, match="has parameter 'bias'"):
        restored.load_state_dict({**ema.state_dict(), "shadow": {"bias": torch.zeros(1)}})
    with pytest.raises(LoongForgeError, match=r"saved 'weight' has shape \[2\]"):
        restored.load_state_dict({**ema.state_dict(), "shadow": {"weight": torch.zeros(2)}})


def test_swap_samples_with_the_averages_and_restores_bf16_weights_exactly():
    module = _module([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    ema = EMA(module, decay=0.999)
    _set(module, [1.5, 2.5, 3.5])
    ema.update(module)  # shadow = 0.999 * x + 0.001 * y: not representable in bf16
    training = [p.clone() for p in module.parameters()]
    with ema.swap(module) as swapped:
        assert swapped is module
        for param, shadow in zip(module.parameters(), ema.shadow.values(), strict=True):
            assert torch.equal(param, shadow.to(torch.bfloat16))
    assert all(torch.equal(p, t) for p, t in zip(module.parameters(), training, strict=True))
    assert ema.shadow["weight"].dtype == torch.float32
    assert abs(ema.shadow["weight"][0, 0].item() - 1.0005) < 1e-6

    ema.copy_to(module)
    assert torch.equal(module.bias, ema.shadow["bias"].to(torch.bfloat16))
