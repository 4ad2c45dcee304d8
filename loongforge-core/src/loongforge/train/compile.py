"""``training.compile``: the one place where training modules are handed to ``torch.compile``, for every engine.

Why regional: a decoder (or a DiT, or a policy) is a stack of identical blocks. Compiling each block on its own
with ``nn.Module.compile`` gives every block the same code object, and with dynamo's default of treating module
parameters as graph inputs (``inline_inbuilt_nn_modules``) one compiled graph -- and one compile time -- serves all
of them; a whole-model compile would instead trace every layer into one large graph, so its compile time grows with
the depth. ``nn.Module.compile`` compiles *in place*: the module keeps its identity, parameter names and
``state_dict`` keys (no ``_orig_mod.`` prefix), so checkpoints, converters, hooks, megatron's DDP buffers and
activation recompute see the same module as in eager mode.

Modes (:data:`CompileMode`, the values of ``training.compile``):

* ``False`` -- nothing is compiled.
* ``"regional"`` -- each of ``blocks`` is compiled.
* ``True`` -- the blocks, plus each of ``rest``: the modules around the blocks an engine can compile as well (the
  embedding, the final norm and output layer, a loss). ``rest`` must not contain the blocks.

Shapes are static by default (``dynamic=False``): training batches have fixed shapes, and a static graph is the
fast one; a shape change recompiles (bounded by dynamo's ``recompile_limit``), which :meth:`CompileReport.summary`
makes visible as ``compile_graphs``.

Compilation is lazy (it happens inside the first forward and, for the backward graph, the first backward), so the
time is read afterwards from dynamo's own accounting: :meth:`CompileReport.summary` after the first step gives
``compile_s``, the seconds torch spent compiling in this process since :func:`compile_blocks` returned. Caches:
inductor's FX graph cache and AOTAutograd's cache are on by default in torch 2.13
(``torch._inductor.config.fx_graph_cache``, ``torch._functorch.config.enable_autograd_cache``), kept under
``TORCHINDUCTOR_CACHE_DIR`` (default ``/tmp/torchinductor_<user>``), so a second run of the same model reuses the
compiled kernels and its ``compile_s`` drops to dynamo's tracing time. AOTAutograd's cache refuses a graph that
holds an autograd Function (traced as ``autograd_function_apply``); such a graph is re-traced and re-partitioned
in every process, so backends keep them out of the layers where they can (the CPU backend's linears are a
differentiable operator, and its tensor-parallel crossings vanish on one rank: tiny Llama's warm ``compile_s``
4.7 s -> 2.4 s).

Usage by an engine (the task engine's DiT/policy blocks alike)::

    report = compile_blocks(model.decoder.layers, config.training.compile,
                            rest=[model.embedding, model.output_layer])
    ...  # after the first step
    summary.update(report.summary())

A whole-model compile is ``compile_blocks([], True, rest=[model])``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from loongforge.errors import ConfigError

#: What ``training.compile`` may say.
CompileMode = bool | Literal["regional"]

#: dynamo's timing entries that add up to the compile time: the forward frame (tracing, AOTAutograd, inductor's
#: forward graph) and the backward graph, which inductor compiles lazily at the first backward.
_TIMED_PHASES = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")


def _dynamo_seconds() -> float:
    """Seconds dynamo has recorded for :data:`_TIMED_PHASES` in this process so far."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(sum(compilation_time_metrics.get(phase, ())) for phase in _TIMED_PHASES)


def _dynamo_graphs() -> int:
    """Frames dynamo has compiled in this process so far (a recompile counts again)."""
    from torch._dynamo.utils import counters

    return counters["frames"]["ok"]


@dataclass
class CompileReport:
    """What :func:`compile_blocks` compiled, and (read lazily, after a step ran) what it cost.

    ``mode`` is ``"off"``, ``"regional"`` or ``"full"``; ``modules`` names the compiled modules' classes with their
    counts (``{"TransformerLayer": 4, "LanguageModelEmbedding": 1}``). The baselines are dynamo's process-wide
    totals when the report was made, so what other code compiled before does not count.
    """

    mode: str
    modules: dict[str, int] = field(default_factory=dict)
    _seconds_before: float = 0.0
    _graphs_before: int = 0

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def compile_s(self) -> float:
        """Seconds torch spent compiling since the modules were handed over (0.0 when nothing was compiled)."""
        return round(_dynamo_seconds() - self._seconds_before, 3) if self.enabled else 0.0

    def graphs(self) -> int:
        """Frames compiled since then: 1 for a regional stack of identical blocks (more means a recompile or a
        second kind of block)."""
        return _dynamo_graphs() - self._graphs_before if self.enabled else 0

    def summary(self) -> dict[str, object]:
        """The run summary's entries: ``compile`` (the mode) and, when on, ``compile_s``, ``compile_graphs`` and
        ``compiled_modules``."""
        if not self.enabled:
            return {"compile": "off"}
        return {"compile": self.mode, "compile_s": self.compile_s(), "compile_graphs": self.graphs(),
                "compiled_modules": dict(self.modules)}


def _check_toolchain(modules: list[nn.Module]) -> None:
    """Refuse up front what would otherwise fail with a traceback inside the first step: inductor's CPU backend
    builds C++ kernels and needs a C++ compiler."""
    on_cpu = any(p.device.type == "cpu" for module in modules for p in module.parameters())
    if not on_cpu:
        return
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()
    except Exception as exc:  # inductor raises its own error types (and RuntimeError) when none is found
        raise ConfigError(f"training.compile needs a C++ compiler for CPU kernels (g++ or clang++; set CXX): "
                          f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None


def compile_blocks(blocks: Iterable[nn.Module], mode: CompileMode, *, rest: Iterable[nn.Module] = (),
                   dynamic: bool = False) -> CompileReport:
    """Compile ``blocks`` (``"regional"``), or ``blocks`` and ``rest`` (``True``), in place; ``False`` does
    nothing. Returns the :class:`CompileReport` to read the compile time from after the first step.

    ``blocks`` are the repeated layers (megatron's ``decoder.layers``, a DiT's blocks); ``rest`` the other
    modules worth compiling in ``True`` mode, disjoint from the blocks. Call it after the model is built and
    moved to its device and before the first forward; wrapping (megatron DDP, FSDP) may come before or after,
    as the compiled module is the same object.
    """
    if mode is False:
        return CompileReport("off")
    if mode is not True and mode != "regional":
        raise ConfigError(f"training.compile must be false, true or regional, got {mode!r}")
    targets = list(blocks) + (list(rest) if mode is True else [])
    if not targets:
        return CompileReport("off")
    _check_toolchain(targets)
    import torch._dynamo  # here, not at the top: importing dynamo costs ~70 MB of RSS a run without compile keeps

    # A ``warnings.warn`` inside a block is a graph break (megatron's RowParallelLinear warns on every call when
    # handed no tensor-parallel group); dynamo drops the call from the graph instead.
    torch._dynamo.config.ignore_logging_functions.add(warnings.warn)
    counts: dict[str, int] = {}
    for module in targets:
        module.compile(dynamic=dynamic)
        counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    return CompileReport("full" if mode is True else "regional", counts, _dynamo_seconds(), _dynamo_graphs())


__all__ = ["CompileMode", "CompileReport", "compile_blocks"]
