"""``task.experts_resident: one``: of Wan 2.2 A14B's two experts, only the one serving the current noise level is on
the device; the other waits in host memory (page-locked where the device backend gives it) with its optimizer state
and its EMA average.

Why: each A14B expert is a 14B DiT. Both resident double the weights, AdamW's two moments and the fp32 average on the
device, although a sampling step or a training step (:func:`~loongforge_diffusion.wan.experts.choose_expert`) runs
one expert only.

How: :class:`ExpertResidency` keeps, per expert, one host buffer per tensor it moves (allocated once by the backend's
:meth:`~loongforge.devices.base.DeviceBackend.host_empty_strided`, reused at every swap) and a forward pre-hook on
each expert that makes it resident before it runs. A swap copies the outgoing expert's parameters, optimizer state
and EMA shadows into their host buffers and points each at its buffer, then copies the incoming expert's into fresh
device tensors; its parameters' gradients are dropped (the engine zeroes them before the next backward anyway).
Values are copied, never converted, so a run computes bit for bit what it computes with both resident. A swap
happens only when the served expert changes: once at the boundary while sampling (high noise first), and in training
only where one step's expert differs from the previous step's (``task.expert_window`` groups the steps so that this
is at most once per window). Buffers (the RoPE tables) are small and stay where they are.

Single process only: a data-parallel wrapper (DDP's buckets, FSDP's shards) holds views of the parameters that a swap
would leave behind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

#: ``(owner, key)`` slots a swap moves: a parameter (key ``None``: its ``.data``) or an entry of a dict of tensors
#: (an optimizer state, an EMA's shadows).
Slot = tuple[Any, Any]


class ExpertResidency:
    """Keeps one of ``experts`` (name -> module) on ``device``; see the module docstring.

    The experts may come from anywhere (built on the host): the first is moved onto the device, the others into
    host buffers, so the device never holds two.

    :param backend: the device backend whose ``host_empty_strided`` gives the host buffers.
    :param extra: ``extra(name)`` gives further per-expert tensors to move with it (its EMA shadows), a dict whose
        values are replaced in place, or ``None`` when it has none yet.
    """

    def __init__(self, experts: dict[str, nn.Module], backend: Any, device: torch.device, *,
                 extra: Callable[[str], dict[str, torch.Tensor] | None] = lambda _name: None) -> None:
        self.experts, self.backend, self.device, self.extra = experts, backend, torch.device(device), extra
        self.optimizer: torch.optim.Optimizer | None = None
        #: Per expert: its host buffers by slot key, allocated at its first swap out.
        self._host: dict[str, dict[Any, torch.Tensor]] = {name: {} for name in experts}
        #: Swaps done (each moves one expert out and the other in).
        self.swaps = 0
        for module in experts.values():  # buffers (RoPE tables) are small: on the device for good
            for holder in module.modules():
                for key, buffer in holder.named_buffers(recurse=False):
                    setattr(holder, key, buffer.to(self.device))
        first = next(iter(experts))
        self.resident = first
        for name in experts:
            if name != first:
                self._move_out(name)
            else:
                self._move_in(name)
        for name, module in experts.items():  # sampling, validation: whatever runs an expert makes it resident
            module.register_forward_pre_hook(lambda _module, _args, name=name: self.serve(name))

    def use_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Move ``optimizer``'s state of each expert's parameters with them from now on."""
        self.optimizer = optimizer

    def serve(self, name: str) -> None:
        """Make ``name`` the resident expert (nothing to do when it already is)."""
        if name == self.resident:
            return
        self._move_out(self.resident)
        self._move_in(name)
        self.resident = name
        self.swaps += 1

    def settle(self) -> None:
        """Put every tensor back where residency says it lives (after a checkpoint was loaded into the model and the
        optimizer: torch's loader gives the waiting expert's optimizer state fresh host tensors, not its buffers)."""
        for name in self.experts:
            if name != self.resident:
                self._move_out(name)

    def _slots(self, name: str) -> Iterator[tuple[Any, Slot, torch.Tensor]]:
        """``(key, slot, tensor)`` of everything that moves with expert ``name``."""
        state = self.optimizer.state if self.optimizer is not None else {}
        for index, param in enumerate(self.experts[name].parameters()):
            yield ("param", index), (param, None), param.data
            for key, value in state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    yield ("optimizer", index, key), (state[param], key), value
        extra = self.extra(name) or {}
        for key, value in extra.items():
            yield ("extra", key), (extra, key), value

    @torch.no_grad()
    def _move_out(self, name: str) -> None:
        buffers = self._host[name]
        for key, slot, tensor in list(self._slots(name)):
            host = buffers.get(key)
            if _same(host, tensor):
                continue  # already waiting there
            if host is None or host.shape != tensor.shape or host.dtype != tensor.dtype:
                host = buffers[key] = self.backend.host_empty_strided(tuple(tensor.shape), tuple(tensor.stride()),
                                                                      tensor.dtype)
            host.copy_(tensor)
            _point(slot, host)
        for param in self.experts[name].parameters():
            param.grad = None

    @torch.no_grad()
    def _move_in(self, name: str) -> None:
        buffers = self._host[name]
        for key, slot, tensor in list(self._slots(name)):
            home = self._home(key)
            if not _same(buffers.get(key), tensor) and tensor.device == home:
                continue  # already where it works (never moved, or created there since)
            placed = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype,
                                         device=home)
            placed.copy_(tensor)
            _point(slot, placed)

    def _home(self, key: Any) -> torch.device:
        """Where a tensor works: the device, but for AdamW's step count the host unless the optimizer is fused or
        capturable (torch's own placement, which its ``load_state_dict`` follows too)."""
        if key[0] == "optimizer" and key[2] == "step" and self.optimizer is not None:
            if not (self.optimizer.defaults.get("fused") or self.optimizer.defaults.get("capturable")):
                return torch.device("cpu")
        return self.device


def _same(host: torch.Tensor | None, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is ``host`` (by memory: ``param.data`` is a new tensor object at every access)."""
    return host is not None and host.data_ptr() == tensor.data_ptr() and host.device == tensor.device


def _point(slot: Slot, tensor: torch.Tensor) -> None:
    owner, key = slot
    if key is None:
        owner.data = tensor
    else:
        owner[key] = tensor
