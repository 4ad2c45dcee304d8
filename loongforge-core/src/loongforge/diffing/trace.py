"""One batch through a model with a hook on every module: what each module computed, each parameter's value and
gradient, in the order the forward pass reached them.

Why hooks on modules rather than a comparison of the logits alone: two models that part in layer 3 of 40 give
logits that differ everywhere; the first module whose output differs is where to look. A module called more than
once in one forward pass (a shared norm, a rotary table) is recorded per call (``name#2``, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Trace:
    """What one model computed on one batch: ``outputs`` (module name -> its first output tensor, in forward order),
    ``params`` and ``grads`` (parameter name -> tensor) and the mean loss."""

    params: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    loss: float = float("nan")


def _first_tensor(output: Any) -> torch.Tensor | None:
    """A module's output tensor: itself, or the first tensor of a tuple/list. Megatron's linears and blocks return
    ``(output, bias)`` with the bias left for a later fused add; what such a module computes is their sum, which
    is what another implementation's module returns."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        first = next((item for item in output if isinstance(item, torch.Tensor)), None)
        if (first is not None and len(output) == 2 and output[0] is first and isinstance(output[1], torch.Tensor)
                and output[1].dim() == 1 and output[1].shape[0] == first.shape[-1]):
            return first + output[1]
        return first
    return None


def trace_model(model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor,
                **inputs: Any) -> Trace:
    """Run ``model`` (a megatron language model) forward on ``tokens`` with ``labels`` and any other ``inputs`` the
    model takes (a VLM's images) -- the training forward, which returns the per-token loss -- and backward from its
    mean; record every module's output and every parameter's value and gradient (fp32 copies on the CPU)."""
    model.train()
    return trace_loss(model, lambda: model(tokens, positions, None, labels=labels, **inputs).float().mean())


def trace_loss(model: torch.nn.Module, compute_loss: Callable[[], torch.Tensor]) -> Trace:
    """``compute_loss()`` (a scalar computed by ``model``) and its backward pass, with every module's first output
    and every parameter's value and gradient recorded in the order the model reached them (fp32 copies on the
    CPU): how any model is traced, whatever its forward signature."""
    trace = Trace(params={name: p.detach().float().cpu().clone() for name, p in model.named_parameters()})
    calls: dict[str, int] = {}

    def record(name: str):
        def hook(module: Any, args: Any, output: Any) -> None:
            tensor = _first_tensor(output)
            if tensor is None:
                return
            calls[name] = calls.get(name, 0) + 1
            key = name if calls[name] == 1 else f"{name}#{calls[name]}"
            if tensor.is_complex():  # a rotary table kept as complex numbers: both parts count
                tensor = torch.view_as_real(tensor)
            trace.outputs[key] = tensor.detach().float().cpu().clone()
        return hook

    handles = [module.register_forward_hook(record(name)) for name, module in model.named_modules() if name]
    try:
        model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            loss = compute_loss().float()
            loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    trace.loss = loss.item()
    trace.grads = {name: p.grad.detach().float().cpu().clone() for name, p in model.named_parameters()
                   if p.grad is not None}
    return trace
