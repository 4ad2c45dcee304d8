"""Activation offload (``training.offload_activations``): chosen decoder layers keep what they save for backward in
host memory instead of device memory, and get it back ahead of use.

Why our own and not megatron's: megatron-core's layer-level ``cpu_offloading`` is Transformer Engine's offload
context (``get_cpu_offload_context``, absent without TE), and its ``fine_grained_activation_offloading`` drives
``torch.cuda`` streams and events directly; neither runs on the CPU backend or a device plugin. This one is a
``torch.autograd.graph.saved_tensors_hooks`` pair entered around each chosen layer's forward, and every device
operation -- the side stream, events, page-locked host buffers -- goes through the device backend
(:class:`~loongforge.devices.base.DeviceBackend`), so it runs wherever the layers run.

How a step goes, for one forward call of a layer (a :class:`_LayerPass`):

* forward: the storage under each saved tensor, when it holds at least ``min_bytes`` (parameters and their views
  excepted: they stay alive anyway), is copied into a host buffer on the backend's copy stream (after the compute
  stream, so the copy reads finished values) -- once per storage, so views of one buffer move once and come back
  as views of one buffer, with their strides; the device original is held until the *next* offloaded layer has
  finished its forward, so the copy overlaps that layer's compute; then the compute stream waits for the copy and
  the original is dropped.
* backward: a hook on the layer's output gradient fires just before the layer's backward runs; it prefetches the
  layer's own tensors (a no-op when they are still on the device, as the last layer's are) and those of the layer
  before it, on the copy stream, so that the previous layer's copies overlap this layer's backward. Unpacking
  waits for the prefetch's event and hands the device copy to autograd; a tensor no prefetch reached is copied
  back there and then (counted as a late fetch).

Values are copied, never converted: the step computes bit for bit what it computes without offload. On the CPU
backend "host" and "device" are the same memory, so the copies free nothing there; the path still copies each
tensor to a separate buffer and back, so it is exercised and tested as it runs on an accelerator.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["ActivationOffload", "OffloadStats", "offload_targets"]


def offload_targets(chunks: Iterable[nn.Module], layers: frozenset[int]) -> list[nn.Module]:
    """The transformer layers of megatron model chunks (their language decoders) whose 0-based global index is in
    ``layers``; each pipeline stage finds the ones it holds (megatron numbers layers from 1 across stages)."""
    from megatron.core.models.gpt import GPTModel

    decoders = [module.decoder for chunk in chunks for module in chunk.modules() if isinstance(module, GPTModel)]
    return [layer for decoder in decoders for layer in decoder.layers if layer.layer_number - 1 in layers]


@dataclass
class OffloadStats:
    """What the offload did in one step (every micro-batch of it), in bytes."""

    #: Copied from the device to host memory (every offloaded storage, once).
    moved_bytes: int = 0
    #: Copied back (prefetched or fetched late); a tensor whose original was still on the device costs nothing.
    fetched_bytes: int = 0
    #: Bytes of offloadable storages (>= ``min_bytes`` in the chosen layers) on the device, now and at the step's
    #: peak: originals not yet released plus prefetched copies not yet used. Without offload, all of them stay
    #: until their backward, so ``moved_bytes`` per micro-batch is what the peak would hold.
    resident_bytes: int = 0
    peak_resident_bytes: int = 0
    #: Tensors unpacked before any prefetch reached them (copied back synchronously at the point of use).
    late_fetches: int = 0

    def hold(self, nbytes: int) -> None:
        self.resident_bytes += nbytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)


class _Saved:
    """One offloaded storage (the memory under one or more saved tensors: a fused projection's output and the query,
    key and value views of it move once), as the views autograd stores refer to it: its host copy (bytes) and, while
    there is one, its bytes on the device -- the original until released, or a prefetched copy (with the event that
    says the copy is done). The device bytes stay once unpacked (a node may read its saved tensors more than once)
    and go when autograd frees the nodes, which frees this."""

    __slots__ = ("__weakref__", "device", "host", "layer", "nbytes", "on", "ready", "stats")

    def __init__(self, original: torch.Tensor, host: torch.Tensor, layer: int, stats: OffloadStats) -> None:
        self.device: torch.Tensor | None = original
        self.host = host
        self.layer = layer
        self.nbytes = original.numel()
        self.on = original.device
        self.ready: Any = None
        self.stats = stats
        stats.hold(self.nbytes)

    def drop_device(self) -> None:
        """Forget the device bytes (their memory is free once nothing else holds it)."""
        if self.device is not None:
            self.device = None
            self.stats.resident_bytes -= self.nbytes

    def __del__(self) -> None:
        self.drop_device()


class _View:
    """A saved tensor as autograd stores it under offload: where in an offloaded storage it lies."""

    __slots__ = ("dtype", "offset", "saved", "size", "stride")

    def __init__(self, tensor: torch.Tensor, saved: _Saved) -> None:
        self.saved = saved
        self.dtype = tensor.dtype
        self.size = tuple(tensor.size())
        self.stride = tensor.stride()
        self.offset = tensor.storage_offset()

    def on_device(self) -> torch.Tensor:
        """The tensor again, over the device bytes: same dtype, shape, strides and offset, so kernels see the
        layout they saw in the forward (another layout may pick another algorithm, and other numbers)."""
        storage = self.saved.device.untyped_storage()
        return torch.empty(0, dtype=self.dtype, device=self.saved.on).set_(storage, self.offset, self.size,
                                                                            self.stride)


class _LayerPass:
    """What one forward call of one offloaded layer saved, and the layer pass before it in the same forward (whose
    tensors its backward prefetches). It refers to its :class:`_Saved` storages weakly: autograd owns them (through
    the views), so host buffers and device copies go when autograd frees the nodes that saved them."""

    def __init__(self, owner: ActivationOffload, layer: nn.Module, previous: _LayerPass | None) -> None:
        self.owner = owner
        self.layer_number = int(layer.layer_number)
        self.previous = previous
        self._saved: weakref.WeakValueDictionary[int, _Saved] = weakref.WeakValueDictionary()
        self.offloaded = owner.backend.event()
        self.released = False
        self._parameters = {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def pack(self, tensor: torch.Tensor) -> Any:
        """Offload ``tensor``'s storage when it qualifies (else keep the tensor as autograd would)."""
        owner = self.owner
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if (storage.nbytes() < owner.min_bytes or tensor.device.type != owner.backend.device_type
                or pointer in self._parameters):
            return tensor
        saved = self._saved.get(pointer)  # the originals are held, so an address is not reused within the pass
        if saved is None:
            original = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
            host = owner.backend.host_empty_strided((storage.nbytes(),), (1,), torch.uint8)
            owner.copy_stream.wait_stream(owner.backend.current_stream())
            with owner.copy_stream:
                host.copy_(original, non_blocking=True)
            saved = self._saved[pointer] = _Saved(original, host, self.layer_number, owner.stats)
            owner.stats.moved_bytes += saved.nbytes
            owner.note("offload", self.layer_number)
        return _View(tensor, saved)

    def forward_done(self) -> None:
        """Mark where this pass's copies end on the copy stream."""
        self.offloaded.record(self.owner.copy_stream)

    def release(self) -> None:
        """Drop the device originals once the copies are done (the compute stream waits for them first, so the
        memory is reused only after it has been read)."""
        if self.released:
            return
        self.released = True
        self.owner.backend.current_stream().wait_event(self.offloaded)
        for saved in list(self._saved.values()):
            if saved.ready is None:
                saved.drop_device()

    def backward_starts(self, _grad: torch.Tensor) -> None:
        """The output gradient hook: this layer's backward is next; bring its tensors and the previous layer's."""
        self.owner.note("backward", self.layer_number)
        self.prefetch()
        if self.previous is not None:
            self.previous.prefetch()

    def prefetch(self) -> None:
        """Copy this pass's storages that are only on the host back to the device, on the copy stream."""
        pending = [saved for saved in list(self._saved.values()) if saved.device is None]
        if not pending:
            return
        owner = self.owner
        owner.note("prefetch", self.layer_number)
        done = owner.fetch(pending)
        for saved in pending:
            saved.ready = done


class ActivationOffload:
    """Saved-tensor offload for ``layers`` (megatron transformer layers), installed as forward hooks on them.

    ``backend`` is the run's device backend (copy stream, events, host buffers); ``min_bytes`` the smallest storage
    worth moving. Wrap each schedule of forward and backward passes in :meth:`passes`; :meth:`take_metrics` reads
    (and restarts) the :class:`OffloadStats` of the passes since the last call: an optimizer step's.
    ``trace``, when a list, receives ``(event, layer_number)`` for every offload, backward start, prefetch and
    unpack of an offloaded tensor, in order (the tests check prefetches come before use).
    """

    def __init__(self, layers: Iterable[nn.Module], backend: Any, min_bytes: int, *,
                 trace: list[tuple[str, int]] | None = None) -> None:
        self.backend = backend
        self.min_bytes = min_bytes
        self.copy_stream = backend.stream()
        self.stats = OffloadStats()
        self.trace = trace
        self._running: list[tuple[_LayerPass, Any] | None] = []
        self._holding: _LayerPass | None = None
        self._last: _LayerPass | None = None
        self._handles = []
        for layer in layers:
            self._handles.append(layer.register_forward_pre_hook(self._enter))
            self._handles.append(layer.register_forward_hook(self._leave, always_call=True))
        self.num_layers = len(self._handles) // 2

    def remove(self) -> None:
        """Take the hooks off the layers."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @contextmanager
    def passes(self) -> Iterator[None]:
        """Around a schedule's forward and backward passes: no device original is held past them."""
        try:
            yield
        finally:
            if self._holding is not None:
                self._holding.release()
            self._holding = self._last = None

    def take_metrics(self) -> dict[str, float]:
        """The figures since the last call, for metrics.jsonl (bytes in MiB), and a fresh count."""
        stats, self.stats = self.stats, OffloadStats()
        return {"offload_moved_mib": _mib(stats.moved_bytes), "offload_fetched_mib": _mib(stats.fetched_bytes),
                "offload_peak_resident_mib": _mib(stats.peak_resident_bytes),
                "offload_late_fetches": stats.late_fetches}

    def note(self, event: str, layer_number: int) -> None:
        if self.trace is not None:
            self.trace.append((event, layer_number))

    def fetch(self, pending: list[_Saved]) -> Any:
        """Copy ``pending`` host buffers into new device tensors on the copy stream; the event that marks the end."""
        current = self.backend.current_stream()
        for saved in pending:  # allocated on the compute stream, which frees them after autograd's use
            saved.device = torch.empty(saved.nbytes, dtype=torch.uint8, device=saved.on)
            self.stats.fetched_bytes += saved.nbytes
            saved.stats.hold(saved.nbytes)
        self.copy_stream.wait_stream(current)
        with self.copy_stream:
            for saved in pending:
                saved.device.copy_(saved.host, non_blocking=True)
        done = self.backend.event()
        done.record(self.copy_stream)
        return done

    def _enter(self, layer: nn.Module, _inputs: Any) -> None:
        if not torch.is_grad_enabled():  # evaluation, or a forward that saves nothing
            self._running.append(None)
            return
        last = self._last
        previous = last if last is not None and last.layer_number < layer.layer_number else None
        layer_pass = _LayerPass(self, layer, previous)
        hooks = torch.autograd.graph.saved_tensors_hooks(layer_pass.pack, self._unpack)
        hooks.__enter__()
        self._running.append((layer_pass, hooks))

    def _leave(self, _layer: nn.Module, _inputs: Any, output: Any) -> None:
        entry = self._running.pop()
        if entry is None:
            return
        layer_pass, hooks = entry
        hooks.__exit__(None, None, None)
        layer_pass.forward_done()
        if self._holding is not None:  # the previous layer's copies had this layer's forward to finish in
            self._holding.release()
        self._holding = self._last = layer_pass
        gradient_target = _first_tensor_needing_grad(output)
        if gradient_target is not None:
            gradient_target.register_hook(layer_pass.backward_starts)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _View):
            return packed
        saved = packed.saved
        if saved.device is None:  # no prefetch reached it: fetch now
            self.stats.late_fetches += 1
            self.note("late", saved.layer)
            saved.ready = self.fetch([saved])
        if saved.ready is not None:
            self.backend.current_stream().wait_event(saved.ready)
        self.note("unpack", saved.layer)
        return packed.on_device()


def _first_tensor_needing_grad(output: Any) -> torch.Tensor | None:
    """The layer's hidden-state output (megatron layers return ``(hidden_states, context)``)."""
    for item in output if isinstance(output, tuple | list) else (output,):
        if isinstance(item, torch.Tensor) and item.requires_grad:
            return item
    return None


def _mib(nbytes: int) -> float:
    return round(nbytes / 2**20, 3)
