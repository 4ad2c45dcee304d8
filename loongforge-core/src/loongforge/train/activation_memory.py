"""Activation memory by model component: the bytes autograd keeps for the backward pass of one forward.

Why saved tensors: what a forward pass leaves alive until its backward is exactly what autograd saved for it (layer
inputs, attention outputs, norms' statistics, the logits the loss needs). Peak RSS on CPU also holds the libraries
and the allocator's free lists, and an accelerator's peak mixes in the optimizer step's temporaries, so neither
says how much of the peak the activations are, nor which part of the model holds them.

:class:`SavedActivations` is a context manager around a forward (and backward) pass. A
``torch.autograd.graph.saved_tensors_hooks`` pack hook sees every tensor autograd saves and hands it back unchanged
(nothing is copied or moved, so the step computes the same numbers); the hook adds the tensor's *storage* once,
so views of one buffer (the query, key and value split from one projection) and a table every layer saves (RoPE's
cos/sin) count once, as the allocator holds them. Parameters are left out: they are saved by reference and are
counted as ``parameters``. Each storage is charged to the top-level component whose forward is running when it is
first saved (the model's direct children: ``embedding``, ``decoder``, ``output_layer`` for megatron's GPT, a
vision tower for a VLM; a list of blocks counts as one component under its name); what the model computes outside
its children (the loss) is ``rest``.

It is meant for one step (the engine measures the first): the hooks cost a Python call per saved tensor. Tensors a
backward saves (double backward) and those saved outside any model's forward do not count.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import torch
from torch import nn

#: The component charged with what a model computes outside its direct children (the loss, for a GPT).
REST = "rest"


class SavedActivations:
    """Counts the bytes of the distinct storages autograd saves during the first forward of each of ``models``, by
    top-level component.

    ``models`` are the unwrapped model chunks (each chunk's direct children are its components; a component of the
    same name in two chunks, as with virtual pipeline stages, adds up). Only each chunk's first forward counts, so
    the figures are one micro-batch's whatever the schedule (a later micro-batch reuses the addresses the previous
    one's backward freed, which would hide them from the count). Read :meth:`mib` after the ``with`` block.
    """

    def __init__(self, models: Iterable[nn.Module]) -> None:
        self._models = list(models)
        self.bytes_by_component: dict[str, int] = {}
        self._seen: set[int] = set()
        self._finished: set[int] = set()
        self._running: list[tuple[int, str]] = []
        self._handles: list[Any] = []
        self._hooks: Any = None

    def __enter__(self) -> SavedActivations:
        self._seen = {p.untyped_storage().data_ptr() for model in self._models for p in model.parameters()}
        for index, model in enumerate(self._models):
            self._handles.append(model.register_forward_pre_hook(self._entered(index, REST)))
            self._handles.append(model.register_forward_hook(self._left_model(index)))
            for name, component in _components(model):
                self._handles.append(component.register_forward_pre_hook(self._entered(index, name)))
                self._handles.append(component.register_forward_hook(self._left))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._hooks.__exit__(kind, error, traceback)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._running.clear()

    def _entered(self, index: int, name: str) -> Any:
        def push(_module: nn.Module, _inputs: Any) -> None:
            self._running.append((index, name))

        return push

    def _left(self, _module: nn.Module, _inputs: Any, _output: Any) -> None:
        self._running.pop()

    def _left_model(self, index: int) -> Any:
        def pop(_module: nn.Module, _inputs: Any, _output: Any) -> None:
            self._running.pop()
            self._finished.add(index)

        return pop

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self._running or self._running[-1][0] in self._finished:
            return tensor
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self._seen and storage.nbytes() > 0:
            self._seen.add(pointer)
            component = self._running[-1][1]
            self.bytes_by_component[component] = self.bytes_by_component.get(component, 0) + storage.nbytes()
        return tensor

    def mib(self) -> dict[str, float]:
        """One micro-batch's saved activations per component in MiB, largest first."""
        ordered = sorted(self.bytes_by_component.items(), key=lambda item: -item[1])
        return {name: round(count / 2**20, 2) for name, count in ordered}


class FirstStepActivations:
    """What an engine keeps: :class:`SavedActivations` over ``models`` in the first step run through :meth:`step`,
    then nothing (the hooks cost a Python call per saved tensor). ``models`` None: never counted (compiled or
    sharded runs); :attr:`mib` stays None then, and until the first step has finished."""

    def __init__(self, models: Iterable[nn.Module] | None) -> None:
        self._models = None if models is None else list(models)
        #: One micro-batch's saved activations per component in MiB (:meth:`SavedActivations.mib`), or None.
        self.mib: dict[str, float] | None = None

    @contextmanager
    def step(self) -> Iterator[None]:
        """Around one step's forward and backward."""
        if self._models is None or self.mib is not None:
            yield
            return
        with SavedActivations(self._models) as saved:
            yield
        self.mib = saved.mib()


def _components(model: nn.Module) -> Iterable[tuple[str, nn.Module]]:
    """``(component name, module)`` for the direct children of ``model``; a container child (``ModuleList``,
    ``ModuleDict``: a stack of blocks, which the model iterates instead of calling) stands for its members."""
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            yield from ((name, member) for member in child.children())
        else:
            yield name, child


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


__all__ = ["REST", "FirstStepActivations", "SavedActivations"]
