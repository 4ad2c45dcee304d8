"""Peak memory of one rank, in bytes, as a sum of named terms.

What is predicted: the peak of *live tensor bytes* a rank allocates while training (what
``torch.cuda.max_memory_allocated`` reports on a GPU, and what the CPU calibration measures through the
profiler's allocator events), excluding the runtime itself (CUDA context, communication buffers, the
caching allocator's slack), which the planner's safety margin and ``Coefficients.fixed_bytes`` cover.

Terms (``MemoryEstimate.terms``):

* ``weights`` -- this rank's parameters: attention and dense MLP split by tp, experts by ep and etp, norms
  and the router replicated; the (padded) embedding on the first stage, the output layer on the last.
* ``grads`` -- megatron DDP's contiguous gradient buffer: fp32 for fp32 and bf16 runs (bf16 reduces in fp32).
* ``optimizer`` -- Adam's two fp32 moments plus an fp32 master copy when parameters are bf16, divided over
  the data-parallel (x context-parallel) ranks with the distributed optimizer; expert parameters over the
  expert-data-parallel ranks.
* ``activations`` -- what autograd keeps per layer and micro-batch (see :func:`layer_activation_elements`)
  times the layers of the stage times the micro-batches in flight (1F1B: ``pp - stage`` on stage
  ``stage``; interleaving adds ``(pp - 1) / (pp * vpp)``), plus embedding/loss terms on the end stages.
* ``backward_peak`` -- transient tensors while one layer runs backward: its re-run activations when it was
  recomputed, plus gradient workspace in units of one layer's full activations (``transient_layers``).
* ``fixed`` -- a constant (calibrated) for everything else.
* one term per model part outside the decoder (``Workload.components``, e.g. a VLM's ``vision`` encoder and
  projector), on the first stage only: its weights, fp32 gradients, optimizer state (sharded by the
  distributed optimizer like the decoder's dense parameters) and its activations times the micro-batches in
  flight. The part's own ``param_count`` says whether tp splits it (a replicated encoder counts in full).

The per-layer counts follow Korthikanti et al. ("Reducing Activation Recomputation in Large Transformer
Models", 2022), adapted to our exact layers and counted against autograd's saved tensors on the CPU build:
RMSNorm keeps its input, its normalised input and the output the next linear saves (``3h``); attention
runs through SDPA (a flash kernel: no ``s^2`` score matrix, only a log-sum-exp per head); the SwiGLU MLP
keeps ``5 f`` (fc1 output ``2f``, SiLU output, product and the scaled copy); no dropout masks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from loongforge.planner.layouts import Candidate

#: Embedding rows are padded to a multiple of lcm(128, tp) (models/decoder_model.py VOCAB_PAD_MULTIPLE).
VOCAB_PAD_MULTIPLE = 128
_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}


@dataclass(frozen=True)
class Workload:
    """What is trained: the model, the sequence length and the numeric precision."""

    flavor: Any
    seq_length: int
    precision: str = "bf16"
    #: Which kernels run the layers (they save different tensors): ``local`` -- megatron's local modules
    #: with torch SDPA and RMSNorm (our CPU build, measured); ``te`` -- Transformer Engine's fused
    #: norm+linear, fused SwiGLU and RoPE and flash attention (the CUDA build).
    kernels: str = "te"
    #: Extra model parts (e.g. a VLM's vision encoder) a plugin accounts for; see :class:`ComponentModel`.
    components: tuple[Any, ...] = ()

    @property
    def param_bytes(self) -> int:
        """Bytes per parameter and per activation element (fp8 runs keep bf16 parameters)."""
        return _BYTES.get(self.precision, 4)


@dataclass(frozen=True)
class Coefficients:
    """The memory model's calibratable factors (see :mod:`loongforge.planner.calibrate`)."""

    #: Multiplies every activation term (allocator rounding, kernel workspaces the count misses).
    activation_scale: float = 1.0
    #: Backward gradient workspace, in units of one layer's full activations for one micro-batch.
    transient_layers: float = 0.25
    #: Extra backward workspace with sequence parallelism, in layers (the gathered activations and gradients
    #: of a layer; measured at ~1 layer on the CPU build).
    sp_transient_layers: float = 1.0
    #: Constant bytes per rank.
    fixed_bytes: float = 0.0


class ComponentModel(Protocol):
    """A model part outside the decoder that a plugin adds (a VLM's vision encoder and projector).

    The planner adds its memory to the first pipeline stage (where such parts are placed), as a term of its
    own named ``name``, and its FLOPs (``flops_per_sample``: forward + backward of one sample, not split by tp)
    to that stage's compute. A model family hands them to the planner from its ``planner_parts(config)`` slot
    (:class:`loongforge.models.family.ModelFamily`).
    """

    #: The memory term's name (``vision``).
    name: str
    #: One line for ``loongforge plan`` (what the part is and what it was sized for).
    description: str

    def param_count(self, candidate: Candidate) -> int: ...

    def activation_bytes(self, candidate: Candidate, tokens: int, workload: Workload) -> float: ...

    def flops_per_sample(self, workload: Workload) -> float: ...


def padded_vocab(vocab_size: int, tp: int) -> int:
    multiple = math.lcm(VOCAB_PAD_MULTIPLE, tp)
    return -(-vocab_size // multiple) * multiple


def _widths(flavor: Any) -> tuple[int, int, int, int, int, int]:
    d = flavor.kv_channels
    return (flavor.hidden_size, flavor.num_attention_heads * d, flavor.num_query_groups * d,
            flavor.num_attention_heads, flavor.num_query_groups, d)


def layer_params(flavor: Any, tp: int, ep: int = 1, etp: int = 1) -> tuple[float, float]:
    """(dense, expert) parameters of one layer on one rank."""
    h, q, kv, _, _, d = _widths(flavor)
    dense = (h * (q + 2 * kv) + q * h) / tp + 2 * h  # qkv, proj (split by tp); two norms (replicated)
    if flavor.add_qkv_bias:
        dense += (q + 2 * kv) / tp
    if flavor.qk_layernorm:
        dense += 2 * d
    if not flavor.num_experts:
        return dense + 3 * h * flavor.ffn_hidden_size / tp, 0.0
    dense += flavor.num_experts * h  # router
    dense += 3 * h * (flavor.moe_shared_expert_intermediate_size or 0) / tp
    expert = (flavor.num_experts / ep) * 3 * h * flavor.moe_ffn_hidden_size / etp
    return dense, expert


def stage_params(flavor: Any, cand: Candidate, stage: int) -> tuple[float, float]:
    """(dense, expert) parameters held by a rank of pipeline stage ``stage``."""
    dense, expert = layer_params(flavor, cand.tp, cand.ep, cand.etp)
    layers = flavor.num_layers / cand.pp
    dense, expert = dense * layers, expert * layers
    embedding = padded_vocab(flavor.vocab_size, cand.tp) * flavor.hidden_size / cand.tp
    if stage == 0:
        dense += embedding
    if stage == cand.pp - 1:
        dense += flavor.hidden_size  # final norm
        if not (flavor.tie_word_embeddings and cand.pp == 1):  # a tied output layer keeps a copy on the last stage
            dense += embedding
    return dense, expert


def layer_activation_elements(
    flavor: Any, cand: Candidate, modules: tuple[str, ...] = (), kernels: str = "local"
) -> dict[str, float]:
    """Elements autograd keeps per token for one layer on one rank, by part, with ``modules`` recomputed.

    Tensor-parallel parts are divided by tp; the norms' parts by tp only with sequence parallelism.
    """
    h, q, kv, n, g, _ = _widths(flavor)
    t = cand.tp
    norm_split = t if cand.sequence_parallel else 1
    local = kernels == "local"
    # Per norm: its input and output (saved by the following linear) and 1/row (TE's norm and the CPU build's
    # analytic RMSNorm backward, loongforge.devices.norm, alike).
    parts = {"norms": 2 * (2 * h + 1) / norm_split}
    # qkv output (kept whole by the V view), rotated q and k, attention output and log-sum-exp per head.
    attention = (q + 2 * kv) + q + kv + q + ("core_attn" not in modules) * n
    if flavor.qk_layernorm:
        attention += q + n + g  # the contiguous q the q-norm keeps, q/k norm statistics (1/row per head)
    parts["attention"] = attention / t
    # SwiGLU per expert-width f: fc1 output (2f) and fc2 input (f); the unfused one (local MoE experts) also
    # SiLU(x) and a copy. Dense SwiGLU is fused on every device (DecoderFlavor.fused_swiglu).
    glu = 5 if local else 3
    if flavor.num_experts:
        k = flavor.moe_router_topk
        parts["router"] = flavor.num_experts + 5 * k
        if "moe" not in modules:
            # Each token visits k experts: its permuted copy and 6 expert-width tensors per visit.
            parts["experts"] = k * (h + (glu + 1) * flavor.moe_ffn_hidden_size / cand.etp)
        shared = flavor.moe_shared_expert_intermediate_size or 0
        if shared and "shared_experts" not in modules and "moe" not in modules:
            parts["shared_expert"] = glu * shared / t
    elif "mlp" not in modules:
        parts["mlp"] = (3 if flavor.fused_swiglu else glu) * flavor.ffn_hidden_size / t
    return parts


@dataclass
class MemoryEstimate:
    """Peak bytes of the worst pipeline stage, by term, and the worst stage's index."""

    terms: dict[str, float]
    stage: int
    per_stage: list[float] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(self.terms.values())


def _in_flight(cand: Candidate, stage: int) -> float:
    """Micro-batches whose activations a rank of ``stage`` holds at once (1F1B, interleaved)."""
    if cand.pp == 1:
        return 1.0
    in_flight = min(cand.num_microbatches, cand.pp - stage)
    if cand.vpp > 1:
        in_flight *= 1 + (cand.pp - 1) / (cand.pp * cand.vpp)
    return in_flight


def _stage_activations(workload: Workload, cand: Candidate, stage: int, coeffs: Coefficients) -> tuple[float, float]:
    """(kept activations, backward transient) in bytes for a rank of ``stage``."""
    flavor, e = workload.flavor, workload.param_bytes
    tokens = workload.seq_length * cand.micro_batch_size / cand.cp
    norm_split = cand.tp if cand.sequence_parallel else 1
    kernels = workload.kernels
    # RoPE keeps no per-layer tables: TE's fused kernel and the CPU build's one-pass RoPE
    # (loongforge.devices.megatron_cpu.rope) share one cos/sin pair across the layers of a forward pass.
    full_layer = sum(layer_activation_elements(flavor, cand, (), kernels).values()) * tokens * e
    rc = cand.recompute
    layers = flavor.num_layers // cand.pp
    if rc.granularity == "selective":
        selective = sum(layer_activation_elements(flavor, cand, rc.modules, kernels).values()) * tokens * e
        kept = selective * layers
    elif rc.granularity == "full":
        recomputed = min(rc.num_layers, layers // cand.vpp) * cand.vpp
        kept = recomputed * flavor.hidden_size * tokens * e / norm_split + (layers - recomputed) * full_layer
    else:
        kept = layers * full_layer
    ends = 0.0
    vocab = padded_vocab(flavor.vocab_size, cand.tp) / cand.tp
    if stage == 0:
        ends += tokens * 8  # token ids (int64), kept by the embedding's backward
    if stage == cand.pp - 1:
        # final norm, the logits (plus their fp32 copy in bf16 runs) and the loss mask; labels are int64
        ends += tokens * ((3 * flavor.hidden_size + 1) / norm_split * e + vocab * (e + (4 if e < 4 else 0)) + 9)
    kept = (kept + ends) * _in_flight(cand, stage) * coeffs.activation_scale
    # Backward re-runs the recomputed part of one layer (all of it for full recompute) and needs gradient
    # workspace; the loss's backward materialises the logits' gradient (fp32).
    if rc.granularity == "full":
        # Layers are freed in reverse: when a recomputed layer re-runs, the later (kept) layers are gone, so
        # the re-run adds to the peak only when every layer of the rank is recomputed.
        rematerialized = full_layer if recomputed >= layers else 0.0
    elif rc.granularity == "selective":
        rematerialized = full_layer - selective
    else:
        rematerialized = 0.0
    workspace = coeffs.transient_layers + (coeffs.sp_transient_layers if cand.sequence_parallel else 0.0)
    transient = (rematerialized + workspace * full_layer) * coeffs.activation_scale
    if stage == cand.pp - 1:
        transient = max(transient, tokens * vocab * 4)
    return kept, transient


def estimate_memory(workload: Workload, cand: Candidate, coeffs: Coefficients | None = None) -> MemoryEstimate:
    """Predicted peak bytes of the most loaded rank of ``cand`` (see the module docstring for the terms)."""
    coeffs = coeffs or Coefficients()
    flavor, e = workload.flavor, workload.param_bytes
    per_stage, best = [], None
    for stage in range(cand.pp):
        dense, expert = stage_params(flavor, cand, stage)
        params = dense + expert
        dense_shard = cand.dp * cand.cp if cand.distributed_optimizer else 1
        expert_shard = max(1, cand.dp * cand.cp * cand.tp // (cand.ep * cand.etp)) if cand.distributed_optimizer else 1
        state = 8 + (4 if e < 4 else 0)  # Adam m and v, fp32 master for 16-bit parameters
        kept, transient = _stage_activations(workload, cand, stage, coeffs)
        largest = padded_vocab(flavor.vocab_size, cand.tp) * flavor.hidden_size / cand.tp
        terms = {
            "weights": params * e,
            "grads": params * 4,
            "optimizer": (dense / dense_shard + expert / expert_shard) * state,
            "activations": kept,
            # The optimizer step (after backward, activations freed) needs ~2 fp32 temporaries of a tensor.
            "backward_peak": max(transient, 2 * 4 * largest - kept),
            "fixed": coeffs.fixed_bytes,
        }
        for component in workload.components if stage == 0 else ():
            count = component.param_count(cand)
            tokens = workload.seq_length * cand.micro_batch_size / cand.cp
            act = component.activation_bytes(cand, int(tokens), workload) * _in_flight(cand, stage)
            terms[component.name] = (count * (e + 4) + count / dense_shard * state
                                     + act * coeffs.activation_scale)
        total = sum(terms.values())
        per_stage.append(total)
        if best is None or total > best.total:
            best = MemoryEstimate(terms=terms, stage=stage)
    assert best is not None
    best.per_stage = per_stage
    return best

