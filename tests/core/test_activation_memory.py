"""``SavedActivations``: the bytes autograd saves for backward during a forward, by top-level component."""

from __future__ import annotations

import pytest
import torch
from loongforge.train.activation_memory import REST, SavedActivations
from torch import nn


class TwoLinears(nn.Module):
    """``first`` (saves its input), ``act`` (tanh saves its output, which ``second`` saves again as its input) and
    a loss in the root (``pow`` saves ``second``'s output)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.act = nn.Tanh()
        self.second = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.second(self.act(self.first(x))) ** 2).sum()


def test_each_saved_storage_counts_once_for_the_component_that_saved_it_first():
    torch.manual_seed(0)
    model, x = TwoLinears(), torch.randn(4, 16)
    with SavedActivations([model]) as saved:
        model(x).backward()
    # x (4 x 16 floats), tanh's output (4 x 32; second's saved input is the same storage), second's output
    # (4 x 8, saved by the root's pow); the weights (saved as transposed views) are parameters, not activations
    assert saved.bytes_by_component == {"first": 4 * 16 * 4, "act": 4 * 32 * 4, REST: 4 * 8 * 4}
    assert saved.mib() == {"act": round(512 / 2**20, 2), "first": round(256 / 2**20, 2), REST: 0.0}


def test_a_list_of_blocks_is_one_component():
    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Tanh(), nn.Sigmoid()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:  # iterated, never called itself
                x = block(x)
            return x.sum()

    with SavedActivations([Stack()]) as saved:
        Stack()(torch.randn(3, 5, requires_grad=True))  # another instance: nothing of it is hooked
    assert saved.bytes_by_component == {}
    model = Stack()
    with SavedActivations([model]) as saved:
        model(torch.randn(3, 5, requires_grad=True)).backward()
    # tanh and sigmoid each save their output
    assert saved.bytes_by_component == {"blocks": 2 * 3 * 5 * 4}


def test_only_the_first_forward_counts_and_the_numbers_are_unchanged():
    torch.manual_seed(0)
    model, x = TwoLinears(), torch.randn(4, 16)
    model(x).backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with SavedActivations([model]) as saved:
        model(x).backward()
        counted = dict(saved.bytes_by_component)
        model(2 * x).backward()  # a second micro-batch: new storages, but not counted
    assert saved.bytes_by_component == counted
    model.zero_grad()
    with SavedActivations([model]):
        model(x).backward()
    # the hooks hand the saved tensors back untouched: the gradients are bitwise the plain ones
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), reference, strict=True))


def test_hooks_are_removed_after_the_block():
    model, x = TwoLinears(), torch.randn(4, 16)
    with SavedActivations([model]) as saved:
        model(x)
    before = dict(saved.bytes_by_component)
    model(x).backward()
    assert saved.bytes_by_component == before
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert all(not child._forward_hooks and not child._forward_pre_hooks for child in model.children())


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny"])
def test_a_megatron_layer_saves_what_the_planner_counts(megatron_cpu_world, name):
    """One more layer of the CPU build saves the planner's ``local`` activation count per token (the planner's
    count is checked against live bytes in ``test_planner_memory``: two independent measures agree)."""
    from loongforge.models.decoder_model import build_model
    from loongforge.models.registration import all_flavors
    from loongforge.planner.layouts import Candidate
    from loongforge.planner.memory import layer_activation_elements

    flavor = all_flavors()[name]

    def decoder_bytes(layers: int) -> int:
        model = build_model(flavor.with_overrides(num_layers=layers), backend=megatron_cpu_world)
        tokens = torch.randint(0, 300, (2, 64))
        with SavedActivations([model]) as saved:
            model(tokens, torch.arange(64).expand(2, -1), None, labels=tokens).sum().backward()
        assert set(saved.bytes_by_component) >= {"decoder", "output_layer"}
        return saved.bytes_by_component["decoder"]

    per_layer = decoder_bytes(3) - decoder_bytes(2)
    elements = sum(layer_activation_elements(flavor, Candidate(1, 1, 1), (), "local").values())
    assert per_layer == pytest.approx(elements * 128 * 4, rel=0.005)


def test_an_engine_counts_its_first_step_only_and_nothing_when_told_not_to():
    from loongforge.train.activation_memory import FirstStepActivations

    model, x = TwoLinears(), torch.randn(4, 16)
    counted = FirstStepActivations([model])
    assert counted.mib is None  # before the first step
    with counted.step():
        model(x).backward()
    first = counted.mib
    assert first == {"act": round(512 / 2**20, 2), "first": round(256 / 2**20, 2), REST: 0.0}
    with counted.step():  # later steps: no hooks, the first figure stays
        model(torch.randn(40, 16)).backward()
        assert not model._forward_hooks
    assert counted.mib is first
    never = FirstStepActivations(None)  # compiled or sharded runs
    with never.step():
        model(x).backward()
        assert not model._forward_hooks
    assert never.mib is None
