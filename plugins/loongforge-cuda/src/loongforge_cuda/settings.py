"""The CUDA backend's megatron settings: precision (bf16, FP8 recipes), attention backend, CUDA graphs and
communication overlap, as one typed object the trainer passes into megatron's configs.

``resolve_settings`` is a pure function of the request and of what the GPU and libraries offer, so every
combination is tested on CPU; :meth:`loongforge_cuda.backend.CUDABackend.megatron_settings` gathers those
facts from the device and calls it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from loongforge.devices.base import MegatronSettings

from loongforge_cuda.capability import MIN_CAPABILITY, choose_fp8_recipe


@dataclass(frozen=True)
class CUDAOptions:
    """The config's ``device_options:`` on cuda (:attr:`CUDABackend.options_type`): keys and types are checked by
    core when the config is checked; :func:`resolve_settings` then checks them against the GPU and libraries."""

    #: auto (Transformer Engine when installed), te, local (megatron-core's own torch layers).
    layers: Literal["auto", "te", "local"] = "auto"
    #: megatron TransformerConfig.fp8: "hybrid" (e4m3 forward, e5m2 gradients) or "e4m3".
    fp8_format: Literal["hybrid", "e4m3"] = "hybrid"
    #: auto, delayed, tensorwise, blockwise, mxfp8 (:func:`loongforge_cuda.capability.choose_fp8_recipe`).
    fp8_recipe: str = "auto"
    #: Keep GEMM weights in FP8 (saves memory; TE decides which).
    fp8_param: bool = False
    #: megatron AttnBackend.
    attention: Literal["auto", "flash", "fused", "unfused", "local"] = "auto"
    #: False/"none", True/"local" (megatron's capture) or "transformer_engine".
    cuda_graphs: bool | Literal["none", "local", "transformer_engine"] = False
    #: Overlap TP communication with GEMMs (TE userbuffers; needs sequence parallel).
    tp_comm_overlap: bool = False
    #: DDP: reduce gradients while the backward pass runs.
    overlap_grad_reduce: bool = False
    #: DDP: all-gather parameters during the forward pass (distributed optimizer).
    overlap_param_gather: bool = False


#: Options ``megatron_settings`` accepts, with their defaults (the fields of :class:`CUDAOptions`).
OPTIONS: dict[str, Any] = {f.name: f.default for f in fields(CUDAOptions)}

_ATTENTION = ("auto", "flash", "fused", "unfused", "local")
_LAYERS = ("auto", "te", "local")
_GRAPH_IMPL = {
    False: "none", "none": "none", True: "local", "local": "local", "transformer_engine": "transformer_engine",
}


@dataclass(frozen=True)
class CUDAMegatronSettings(MegatronSettings):
    """Resolved CUDA settings; every field maps onto a megatron-core config field of the same meaning."""

    #: ``te`` (Transformer Engine layers) or ``local``; the backend's spec provider builds these.
    layers: str = "local"
    fp8: str | None = None
    fp8_recipe: str | None = None
    fp8_param: bool = False
    attention_backend: str = "auto"
    cuda_graph_impl: str = "none"
    tp_comm_overlap: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False

    def transformer_config_kwargs(self) -> dict[str, Any]:
        """``TransformerConfig`` keywords (``fp8*`` only for FP8 runs, so megatron's defaults stay untouched)."""
        from megatron.core.transformer.enums import AttnBackend

        kwargs: dict[str, Any] = {
            "attention_backend": AttnBackend[self.attention_backend],
            "cuda_graph_impl": self.cuda_graph_impl,
            "tp_comm_overlap": self.tp_comm_overlap,
        }
        if self.fp8 is not None:
            kwargs.update(fp8=self.fp8, fp8_recipe=self.fp8_recipe, fp8_param=self.fp8_param)
        return kwargs

    def ddp_config_kwargs(self) -> dict[str, Any]:
        """``DistributedDataParallelConfig`` keywords."""
        return {"overlap_grad_reduce": self.overlap_grad_reduce, "overlap_param_gather": self.overlap_param_gather}


def resolve_settings(
    precision: str,
    options: dict[str, Any],
    *,
    capability: tuple[int, int],
    te_recipes: frozenset[str],
    te: bool,
    flash_attn: bool,
) -> CUDAMegatronSettings:
    """Validate ``options`` for ``precision`` on a GPU of ``capability``; raise ``ValueError`` on a conflict.

    ``te_recipes`` are the FP8 recipe classes the installed Transformer Engine offers; ``te``/``flash_attn``
    say whether those packages are installed.
    """
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown cuda option(s) {', '.join(unknown)}; known: {', '.join(OPTIONS)}")
    opts = {**OPTIONS, **options}
    sm = f"{capability[0]}.{capability[1]}"
    if opts["layers"] not in _LAYERS:
        raise ValueError(f"layers must be one of {', '.join(_LAYERS)}, got '{opts['layers']}'")
    if opts["layers"] == "te" and not te:
        raise ValueError("layers 'te' needs Transformer Engine: pip install 'loongforge-cuda[te]'")
    te_layers = te and opts["layers"] != "local"
    needs_te = ("Transformer Engine layers (layers: local was asked for)" if te
                else "Transformer Engine: pip install 'loongforge-cuda[te]'")
    if precision not in ("fp32", "bf16", "fp16", "fp8"):
        raise ValueError(f"unknown precision '{precision}' for cuda; use fp32, bf16, fp16 or fp8")
    if precision in ("bf16", "fp8") and capability < MIN_CAPABILITY["bf16"]:
        raise ValueError(f"precision {precision} needs bf16 tensor cores (compute capability 8.0+); this GPU is {sm}")
    fp8_fields: dict[str, Any] = {}
    if precision == "fp8":
        if not te_layers:
            raise ValueError(f"precision fp8 needs {needs_te}")
        if opts["fp8_format"] not in ("hybrid", "e4m3"):
            raise ValueError(f"fp8_format must be hybrid or e4m3, got '{opts['fp8_format']}'")
        recipe = choose_fp8_recipe(str(opts["fp8_recipe"]), capability, te_recipes)
        fp8_fields = {"fp8": opts["fp8_format"], "fp8_recipe": recipe, "fp8_param": bool(opts["fp8_param"])}
    else:
        stray = [k for k in ("fp8_format", "fp8_recipe", "fp8_param") if k in options]
        if stray:
            raise ValueError(f"{', '.join(stray)} set but precision is {precision}; set precision: fp8")
    attention = opts["attention"]
    if attention not in _ATTENTION:
        raise ValueError(f"attention must be one of {', '.join(_ATTENTION)}, got '{attention}'")
    # megatron runs flash-attn and cuDNN fused attention through TE's DotProductAttention.
    if attention in ("flash", "fused") and not te_layers:
        raise ValueError(f"attention '{attention}' runs through {needs_te}")
    if attention == "flash" and not (flash_attn and capability >= MIN_CAPABILITY["flash_attn"]):
        raise ValueError(f"attention 'flash' needs flash-attn installed (pip install 'loongforge-cuda[flash]') "
                         f"and compute capability 8.0+ (this GPU is {sm})")
    graphs = opts["cuda_graphs"]
    if graphs not in _GRAPH_IMPL:
        raise ValueError(f"cuda_graphs must be true, false, 'local' or 'transformer_engine', got {graphs!r}")
    if _GRAPH_IMPL[graphs] == "transformer_engine" and not te_layers:
        raise ValueError(f"cuda_graphs 'transformer_engine' needs {needs_te}")
    if opts["tp_comm_overlap"] and not te_layers:
        raise ValueError(f"tp_comm_overlap uses userbuffers, which need {needs_te}")
    return CUDAMegatronSettings(
        params_dtype="bf16" if precision == "fp8" else precision,
        layers="te" if te_layers else "local",
        attention_backend=attention,
        cuda_graph_impl=_GRAPH_IMPL[graphs],
        tp_comm_overlap=bool(opts["tp_comm_overlap"]),
        overlap_grad_reduce=bool(opts["overlap_grad_reduce"]),
        overlap_param_gather=bool(opts["overlap_param_gather"]),
        **fp8_fields,
    )
