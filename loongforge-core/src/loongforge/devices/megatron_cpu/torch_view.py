"""A CPU view of ``torch`` that megatron-core modules see instead of the real module.

Why: megatron-core writes ``torch.cuda.current_device()``, ``device="cuda"`` literals,
``torch.cuda.Stream()``, ``torch.cuda.synchronize()`` and ``torch.autocast("cuda")`` throughout code that is
otherwise device-neutral. Rewriting each call site would mean copying dozens of megatron functions; a global
``TorchFunctionMode`` that rewrites devices covers them but slows every op (measured up to 1.8x). Instead we
rebind the name ``torch`` inside the specific megatron modules that contain such calls to a module object whose
attributes are the real torch's, except:

* ``cuda``: a namespace where device queries answer ``cpu``, synchronisation, streams, events and NVTX ranges
  are no-ops, and the device RNG is the CPU RNG (on CPU the "device" generator *is* the CPU generator);
* the tensor factories that take ``device=``: a ``"cuda"`` device is mapped to ``"cpu"``;
* ``autocast``: ``"cuda"`` autocast becomes CPU autocast.

Only modules that opt in see the view, so torch itself and all other code are untouched, and attribute access
costs nothing extra (the view's namespace is a copy of torch's; only misses fall through to ``__getattr__``).
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch

from loongforge.devices.base import NullStream

_FACTORIES = (
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "rand",
    "randn",
    "randint",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
)


def cpu_device(device: Any) -> Any:
    """Map a CUDA device spec (``"cuda"``, ``"cuda:0"``, ``torch.device("cuda")``, an int index) to ``"cpu"``.

    An int index means "the CUDA device with that ordinal" to torch, so it is mapped too.
    """
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return "cpu"
    return device


def _factory(fn: Any) -> Any:
    def on_cpu(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False  # pinning needs an accelerator
        return fn(*args, **kwargs)

    on_cpu.__name__ = fn.__name__
    on_cpu.__doc__ = f"torch.{fn.__name__} with CUDA devices mapped to CPU (see loongforge torch_view)."
    return on_cpu


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _cpu_manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


class _CudaOnCpu(types.SimpleNamespace):
    """``torch.cuda`` as megatron needs it on a CPU-only process; unknown attributes fall back to the real one."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


def _make_cuda_namespace() -> _CudaOnCpu:
    nvtx = types.SimpleNamespace(range_push=_noop, range_pop=_noop, mark=_noop, range=contextlib.nullcontext)
    return _CudaOnCpu(
        is_available=lambda: False,
        device_count=lambda: 1,  # the CPU is this process's one device (megatron computes rank % count)
        current_device=lambda: "cpu",
        set_device=_noop,
        synchronize=_noop,
        empty_cache=_noop,
        Stream=NullStream,
        Event=NullStream,
        stream=lambda s=None: contextlib.nullcontext(),
        current_stream=lambda device=None: NullStream(),
        default_stream=lambda device=None: NullStream(),
        get_rng_state=lambda device=None: torch.get_rng_state(),
        set_rng_state=lambda state, device=None: torch.set_rng_state(state),
        manual_seed=_cpu_manual_seed,
        manual_seed_all=_cpu_manual_seed,
        memory_allocated=lambda device=None: 0,
        max_memory_allocated=lambda device=None: 0,
        nvtx=nvtx,
        random=types.SimpleNamespace(
            get_rng_state=lambda device=None: torch.get_rng_state(),
            set_rng_state=lambda state, device=None: torch.set_rng_state(state),
        ),
    )


def _autocast(device_type: str = "cpu", *args: Any, **kwargs: Any) -> Any:
    return torch.autocast("cpu" if device_type == "cuda" else device_type, *args, **kwargs)


class TorchCpuView(types.ModuleType):
    """Module object standing in for ``torch`` inside selected megatron modules (see the module docstring)."""

    def __getattr__(self, name: str) -> Any:  # attributes added to torch after the view was built
        return getattr(torch, name)


def make_torch_cpu_view() -> TorchCpuView:
    """Build the view: a copy of torch's namespace with the CUDA-facing names replaced."""
    view = TorchCpuView("torch")
    view.__dict__.update({k: v for k, v in vars(torch).items() if k not in ("__name__", "__spec__", "__loader__")})
    view.cuda = _make_cuda_namespace()
    for name in _FACTORIES:
        setattr(view, name, _factory(getattr(torch, name)))
    view.autocast = _autocast
    return view


def install_torch_cpu_view(module: types.ModuleType, view: TorchCpuView) -> bool:
    """Rebind ``module.torch`` to ``view``; returns False when the module does not use the name ``torch``."""
    if getattr(module, "torch", None) is torch:
        module.torch = view
        return True
    return isinstance(getattr(module, "torch", None), TorchCpuView)
