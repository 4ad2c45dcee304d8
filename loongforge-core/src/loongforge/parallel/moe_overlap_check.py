"""``parallel.moe_a2a_overlap`` checked before anything is built, and which overlap a device gets.

Two mechanisms sit behind the one option. A device with streams (``DeviceBackend.supports("streams")``: CUDA) gets
megatron-core's own ``overlap_moe_expert_parallel_comm``: its combined 1F1B schedule runs one micro-batch's dispatch
and combine all-to-alls on a communication stream while another micro-batch's forward or backward computes.
Megatron asserts its prerequisites only when the ``TransformerConfig`` is built (after the process groups); they are
checked here first so that ``loongforge check`` fails in one line. A device without streams (the CPU under gloo)
gets :class:`loongforge.parallel.moe_overlap.ExpertChunkedMoELayer`, whose exchange is split per local expert and
overlapped with the experts' compute. This module imports no torch: ``check`` and the planner read it.
"""

from __future__ import annotations

from typing import Any

from loongforge.errors import ConfigError

__all__ = ["MEGATRON", "EXPERT_CHUNKS", "check_moe_a2a_overlap", "megatron_overlap_kwargs", "moe_a2a_overlap_mode"]

#: megatron-core's stream-based overlap across micro-batches.
MEGATRON = "megatron"
#: LoongForge's per-local-expert chunked exchange, for devices without streams.
EXPERT_CHUNKS = "expert-chunks"


def moe_a2a_overlap_mode(layout: Any, backend: Any) -> str | None:
    """Which overlap ``layout`` gets on ``backend``: :data:`MEGATRON`, :data:`EXPERT_CHUNKS`, or None (off)."""
    if not layout.moe_a2a_overlap:
        return None
    return MEGATRON if backend.supports("streams") else EXPERT_CHUNKS


def megatron_overlap_kwargs(layout: Any, backend: Any) -> dict[str, bool]:
    """What the overlap adds to megatron's ``TransformerConfig`` on ``backend``: megatron's own switch on a device
    with streams, nothing elsewhere (the chunked layers are installed after the build)."""
    return {"overlap_moe_expert_parallel_comm": True} if moe_a2a_overlap_mode(layout, backend) == MEGATRON else {}


def check_moe_a2a_overlap(config: Any, layout: Any, decoder: Any, backend: Any) -> str | None:
    """The pre-flight of ``parallel.moe_a2a_overlap`` (``check`` and ``train``) for a validated ``layout`` of the
    model ``decoder`` on ``backend``; a one-line description for ``check``'s report, or None when it is off.

    Both mechanisms need the alltoall dispatcher and ep > 1 (:meth:`MegatronStrategy.validate` checks those). The
    megatron one also needs bf16/fp16, no full recompute and, with pp > 1, virtual pipeline stages; the chunked one
    needs at least two local experts per rank (the chunks), whole experts (etp = 1) and the MoE layer not re-run in
    backward (no full recompute, no selective ``moe`` recompute).
    """
    mode = moe_a2a_overlap_mode(layout, backend)
    if mode is None:
        return None
    where = f"{config.source}: parallel.moe_a2a_overlap"
    recompute = config.model.recompute
    full_recompute = recompute is not None and recompute.granularity == "full"
    if mode == MEGATRON:
        if config.training.precision not in ("bf16", "fp16"):
            raise ConfigError(f"{where} on {backend.name} is megatron-core's overlap, which needs training.precision "
                              f"bf16 or fp16, got {config.training.precision}")
        if full_recompute:
            raise ConfigError(f"{where} on {backend.name} does not combine with model.recompute granularity full "
                              "(megatron-core refuses it); use selective recompute")
        if layout.pp > 1 and not layout.vpp:
            raise ConfigError(f"{where} on {backend.name} with parallel.pp={layout.pp} needs parallel.vpp (megatron-"
                              "core's overlap runs in the interleaved schedule)")
        return (f"MoE all-to-all overlap: megatron-core's overlap_moe_expert_parallel_comm on {backend.name} "
                "(one micro-batch's exchange under another's compute)")
    experts = decoder.num_experts or 0
    local = experts // layout.ep
    if local < 2:
        raise ConfigError(f"{where} on {backend.name} overlaps the exchange of one local expert with another's "
                          f"compute, so it needs >= 2 experts per ep rank; the model's {experts} experts over "
                          f"ep={layout.ep} leave {local}")
    if (layout.etp or layout.tp) != 1:
        raise ConfigError(f"{where} on {backend.name} needs whole experts: set parallel.etp=1 (got "
                          f"{layout.etp or layout.tp})")
    if full_recompute or (recompute is not None and "moe" in recompute.modules):
        raise ConfigError(f"{where} on {backend.name} does not combine with recomputing the MoE layer "
                          "(model.recompute full, or selective with moe); drop moe from model.recompute.modules")
    return (f"MoE all-to-all overlap: exchanges chunked per local expert ({local} per rank) and overlapped with "
            f"the experts on {backend.name}")
