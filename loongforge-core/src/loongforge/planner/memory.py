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
Everything about the model comes from its family (:meth:`loongforge.models.family.ModelFamily.decoder_terms`: the
parameters, activations and FLOPs of a layer by part and how layouts split each), so a family with another layer
shape than core's grouped-query decoder states its own numbers; this module only splits them over a layout.

* ``activations`` -- what autograd keeps per layer and micro-batch (see :func:`layer_activation_elements`)
  times the layers of the stage times the micro-batches in flight (1F1B: ``pp - stage`` on stage
  ``stage``; interleaving adds ``(pp - 1) / (pp * vpp)``), plus embedding/loss terms on the end stages. Offloaded
  layers (``Workload.offloaded_layers`` or the candidate's ``offload_layers``) keep nothing on the device but a
  window (:func:`_offload_window`): the last offloaded layer's tensors, whose release waits for a next offloaded
  layer, and -- only when every layer after it is offloaded too -- the one its backward prefetches.
* ``backward_peak`` -- transient tensors while one layer runs backward: its re-run activations when it was
  recomputed, plus gradient workspace in units of one layer's full activations (``transient_layers``).
* context-parallel attention (``Candidate.cp_mode``): Ulysses gathers the whole sequence for ``1/cp`` of the heads,
  so its rank keeps as many attention elements as without cp for its ``1/cp`` of the tokens (the default count).
  A ring (and the ring level of ``hybrid``, over ``cp / cp_a2a_size`` members each holding ``cp_a2a_size`` ranks'
  tokens for ``1/cp_a2a_size`` of the heads) keeps its merged output in fp32 (an extra ``4 - e`` bytes per query
  element in 16-bit runs), and its backward holds, per pair of sequence chunks (``seq / 2cp`` tokens each), four
  fp32 score blocks per head (probabilities, their gradient, the difference and the score gradient) next to fp32
  copies of the queries, output gradient and query gradient, the K/V block held and the one in flight, and the
  K/V gradients held and shifted (:func:`ring_attention_bytes`) -- added to ``backward_peak``.
* the chunked pipeline (``Candidate.seq_chunks``): a pass holds one chunk's activations (``seq / seq_chunks``
  tokens), and 1F1B keeps as many chunks in flight as micro-batches otherwise; each layer of the stage keeps every
  micro-batch's recorded K/V and the fp32 K/V gradients of the earlier chunks, and its chunk attention's backward
  holds fp32 copies of the K/V so far with their gradients and a few score tiles (:func:`chunk_kv_bytes`).
* ``fixed`` -- a constant (calibrated) for everything else.
* one term per model part outside the decoder (``Workload.components``, e.g. a VLM's ``vision`` encoder and
  projector), on the first stage only: its weights, fp32 gradients, optimizer state (sharded by the
  distributed optimizer like the decoder's dense parameters) and its activations times the micro-batches in
  flight. The part's own ``param_count`` says whether tp splits it (a replicated encoder counts in full).

Core's decoder (``DecoderFlavor.decoder_terms``) counts its layer after Korthikanti et al. ("Reducing Activation
Recomputation in Large Transformer Models", 2022), adapted to our exact layers and counted against autograd's
saved tensors on the CPU build: RMSNorm keeps its input, its normalised input and the output the next linear saves
(``3h``); attention runs through SDPA (a flash kernel: no ``s^2`` score matrix, only a log-sum-exp per head); the
SwiGLU MLP keeps ``5 f`` (fc1 output ``2f``, SiLU output, product and the scaled copy); no dropout masks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from loongforge.config.chunk_settings import chunk_tile
from loongforge.models.sizing import DecoderTerms
from loongforge.planner.layouts import Candidate, decoder_terms

#: Embedding rows are padded to a multiple of lcm(128, tp) (models/decoder_model.py VOCAB_PAD_MULTIPLE).
VOCAB_PAD_MULTIPLE = 128
_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 2}


@dataclass(frozen=True)
class Workload:
    """What is trained: the model, the sequence length and the numeric precision."""

    #: The megatron decoder (``ModelFamily.decoder``; a plain LLM's flavor is its own).
    flavor: Any
    seq_length: int
    precision: str = "bf16"
    #: Which kernels run the layers (they save different tensors): ``local`` -- megatron's local modules
    #: with torch SDPA and RMSNorm (our CPU build, measured); ``te`` -- Transformer Engine's fused
    #: norm+linear, fused SwiGLU and RoPE and flash attention (the CUDA build).
    kernels: str = "te"
    #: Extra model parts (e.g. a VLM's vision encoder) a plugin accounts for; see :class:`ComponentModel`.
    components: tuple[Any, ...] = ()
    #: The model family whose slots size the model (a composed model around ``flavor``); ``None``: ``flavor``.
    family: Any = None
    #: Decoder layers (0-based) whose saved activations go to host memory (``training.offload_activations``).
    offloaded_layers: frozenset[int] = frozenset()

    @property
    def model(self) -> Any:
        """The family asked for :meth:`~loongforge.models.family.ModelFamily.decoder_terms` and the layout checks."""
        return self.family if self.family is not None else self.flavor

    def terms(self, kernels: str | None = None) -> DecoderTerms:
        """The model's decoder terms with this workload's kernels (or ``kernels``)."""
        return decoder_terms(self.model, kernels or self.kernels)

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
    own named ``name``, and its FLOPs to that stage's compute: ``flops_per_sample`` is what one sample costs the
    model (forward + backward, what MFU counts), ``rank_flops_per_sample`` what one rank of the first stage spends on
    it under a candidate (the whole of it where the part runs replicated on every tp rank; less where the part splits
    its work over them). A model family hands them to the planner from its ``planner_parts(config)`` slot
    (:class:`loongforge.models.family.ModelFamily`).
    """

    #: The memory term's name (``vision``).
    name: str
    #: One line for ``loongforge plan`` (what the part is and what it was sized for).
    description: str

    def param_count(self, candidate: Candidate) -> int: ...

    def activation_bytes(self, candidate: Candidate, tokens: int, workload: Workload) -> float: ...

    def flops_per_sample(self, workload: Workload) -> float: ...

    def rank_flops_per_sample(self, workload: Workload, candidate: Candidate) -> float: ...


def padded_vocab(vocab_size: int, tp: int) -> int:
    multiple = math.lcm(VOCAB_PAD_MULTIPLE, tp)
    return -(-vocab_size // multiple) * multiple


def layer_params(flavor: Any, tp: int, ep: int = 1, etp: int = 1) -> tuple[float, float]:
    """(dense, expert) parameters of one layer of the model family ``flavor`` on one rank."""
    return decoder_terms(flavor).layer_params(tp, ep, etp)


def stage_params(flavor: Any, cand: Candidate, stage: int) -> tuple[float, float]:
    """(dense, expert) parameters held by a rank of pipeline stage ``stage``."""
    terms = decoder_terms(flavor)
    dense, expert = terms.layer_params(cand.tp, cand.ep, cand.etp)
    layers = terms.num_layers / cand.pp
    dense, expert = dense * layers, expert * layers
    embedding = padded_vocab(terms.vocab_size, cand.tp) * terms.hidden_size / cand.tp
    if stage == 0:
        dense += embedding
    if stage == cand.pp - 1:
        dense += terms.hidden_size  # final norm
        if not (terms.tie_word_embeddings and cand.pp == 1):  # a tied output layer keeps a copy on the last stage
            dense += embedding
    return dense, expert


def layer_activation_elements(
    flavor: Any, cand: Candidate, modules: tuple[str, ...] = (), kernels: str = "local"
) -> dict[str, float]:
    """Elements autograd keeps per token for one layer on one rank, by part, with ``modules`` recomputed.

    Tensor-parallel parts are divided by tp; the norms' parts by tp only with sequence parallelism (as the
    family's :class:`~loongforge.models.sizing.ActivationPart` s say).
    """
    return decoder_terms(flavor, kernels).layer_activation_elements(cand.tp, cand.etp, cand.sequence_parallel,
                                                                     modules)


@dataclass
class MemoryEstimate:
    """Peak bytes of the worst pipeline stage, by term, and the worst stage's index."""

    terms: dict[str, float]
    stage: int
    per_stage: list[float] = field(default_factory=list)
    #: Offloaded activations the worst stage holds in host memory at the peak (not in ``total``: the device's
    #: peak; on the CPU backend host and device are one memory, so a measured CPU peak is ``total + host_bytes``).
    host_bytes: float = 0.0

    @property
    def total(self) -> float:
        return sum(self.terms.values())


def _in_flight(cand: Candidate, stage: int) -> float:
    """Micro-batches (or chunks of them, ``seq_chunks``) whose activations a rank of ``stage`` holds at once (1F1B,
    interleaved)."""
    if cand.pp == 1:
        return 1.0
    in_flight = min(cand.num_microbatches * cand.seq_chunks, cand.pp - stage)
    if cand.vpp > 1:
        in_flight *= 1 + (cand.pp - 1) / (cand.pp * cand.vpp)
    return in_flight


def ring_attention_bytes(workload: Workload, cand: Candidate) -> tuple[float, float]:
    """(extra bytes a ring keeps per layer and micro-batch, bytes its backward holds at once) on one rank; (0, 0)
    for Ulysses, cp=1 or a family that states no attention shape. See the module docstring."""
    terms, e = workload.terms(), workload.param_bytes
    if cand.cp == 1 or cand.cp_mode == "ulysses" or not terms.attention_heads:
        return 0.0, 0.0
    a2a = cand.cp_a2a_size if cand.cp_mode == "hybrid" and cand.cp_a2a_size else 1
    tokens = workload.seq_length * cand.micro_batch_size / cand.cp  # this rank's; a member holds a2a x as many
    split = cand.tp * a2a  # the heads of a ring member
    query = tokens * a2a * terms.query_width / split
    kv = tokens * a2a * terms.kv_width / split
    chunk = workload.seq_length / (2 * cand.cp)
    scores = cand.micro_batch_size * terms.attention_heads / split * chunk * chunk * 4
    kept = query * max(0, 4 - e)
    transient = 4 * scores + 3 * query * 4 + 2 * 2 * kv * e + 2 * 2 * kv * 4
    return kept, transient


def chunk_kv_bytes(workload: Workload, cand: Candidate) -> tuple[float, float]:
    """(bytes the chunked pipeline keeps on a rank of a stage, bytes one layer's chunk attention holds in its backward)
    for ``cand.seq_chunks`` chunks; (0, 0) unchunked or for a family that states no attention shape.

    Kept: the recorded K/V of every micro-batch of the step (the recording pass runs them all before the replay), in
    the activations' dtype, and the fp32 K/V gradients later chunks leave for earlier ones (up to all but one chunk of
    the micro-batch being replayed), for every layer of the stage. Transient: the chunk attention's fp32 copies of the
    keys and values of the sequence so far and their gradients, fp32 queries, output gradient and query gradient of
    the chunk, and four fp32 score tiles per head (:func:`~loongforge.config.chunk_settings.chunk_tile` tokens a side).
    """
    terms, e, chunks = workload.terms(), workload.param_bytes, cand.seq_chunks
    if chunks == 1 or not terms.attention_heads:
        return 0.0, 0.0
    layers = terms.num_layers // cand.pp
    sequence = workload.seq_length * cand.micro_batch_size
    kv = sequence * 2 * terms.kv_width / cand.tp  # K and V elements of one micro-batch and layer on this rank
    kept = layers * kv * (cand.num_microbatches * e + (chunks - 1) / chunks * 4)
    tile = chunk_tile(workload.seq_length // chunks)
    query = sequence / chunks * terms.query_width / cand.tp
    scores = cand.micro_batch_size * terms.attention_heads / cand.tp * tile * tile * 4
    return kept, 2 * kv * 4 + 3 * query * 4 + 4 * scores


def offloaded_bytes_per_layer(workload: Workload, cand: Candidate) -> float:
    """Bytes one layer keeps for backward per micro-batch with ``cand``'s recompute (what offloading it moves each
    way; full recompute does not combine with offload)."""
    terms = workload.terms()
    modules = cand.recompute.modules if cand.recompute.granularity == "selective" else ()
    tokens = workload.seq_length * cand.micro_batch_size / (cand.cp * cand.seq_chunks)
    elements = sum(terms.layer_activation_elements(cand.tp, cand.etp, cand.sequence_parallel, modules).values())
    ring_kept = 0.0 if "core_attn" in modules else ring_attention_bytes(workload, cand)[0]
    return elements * tokens * workload.param_bytes + ring_kept


def _stage_activations(workload: Workload, cand: Candidate, stage: int,
                       coeffs: Coefficients) -> tuple[float, float, float]:
    """(kept activations, backward transient, offloaded to host) in bytes for a rank of ``stage``."""
    terms, e = workload.terms(), workload.param_bytes
    tokens = workload.seq_length * cand.micro_batch_size / (cand.cp * cand.seq_chunks)  # what one pass holds
    norm_split = cand.tp if cand.sequence_parallel else 1

    def per_layer(modules: tuple[str, ...]) -> float:
        return sum(terms.layer_activation_elements(cand.tp, cand.etp, cand.sequence_parallel, modules).values())

    # RoPE keeps no per-layer tables: TE's fused kernel and the CPU build's one-pass RoPE
    # (loongforge.devices.megatron_cpu.rope) share one cos/sin pair across the layers of a forward pass.
    ring_kept, ring_transient = ring_attention_bytes(workload, cand)
    chunk_kept, chunk_transient = chunk_kv_bytes(workload, cand)
    full_layer = per_layer(()) * tokens * e + ring_kept
    rc = cand.recompute
    layers = terms.num_layers // cand.pp
    if rc.granularity == "selective":
        selective = per_layer(rc.modules) * tokens * e + (0.0 if "core_attn" in rc.modules else ring_kept)
        kept = selective * layers
    elif rc.granularity == "full":
        recomputed = min(rc.num_layers, layers // cand.vpp) * cand.vpp
        kept = recomputed * terms.hidden_size * tokens * e / norm_split + (layers - recomputed) * full_layer
    else:
        kept = layers * full_layer
    # Offloaded layers (never fully recomputed: train refuses the two together) leave the device, but a window.
    positions = _offloaded_in_stage(workload, cand, stage) if rc.granularity != "full" else []
    offloaded = len(positions)
    per_kept_layer = offloaded_bytes_per_layer(workload, cand) if offloaded else 0.0
    kept -= offloaded * per_kept_layer
    window = _offload_window(positions, layers) * per_kept_layer
    host = offloaded * per_kept_layer * _in_flight(cand, stage) * coeffs.activation_scale
    ends = 0.0
    vocab = padded_vocab(terms.vocab_size, cand.tp) / cand.tp
    if stage == 0:
        ends += tokens * 8  # token ids (int64), kept by the embedding's backward
    if stage == cand.pp - 1:
        # final norm, the logits (plus their fp32 copy in bf16 runs) and the loss mask; labels are int64
        ends += tokens * ((3 * terms.hidden_size + 1) / norm_split * e + vocab * (e + (4 if e < 4 else 0)) + 9)
    kept = ((kept + ends) * _in_flight(cand, stage) + window + chunk_kept) * coeffs.activation_scale
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
    transient = (rematerialized + workspace * full_layer + ring_transient + chunk_transient) * coeffs.activation_scale
    if stage == cand.pp - 1:
        transient = max(transient, tokens * vocab * 4)
    return kept, transient, host


def _offloaded_in_stage(workload: Workload, cand: Candidate, stage: int) -> list[int]:
    """Positions, in the forward order of a rank of pipeline stage ``stage`` (its chunks' layers one after another), of
    the offloaded layers it holds: the candidate's choice (:meth:`Candidate.offloaded_layers`), else
    ``workload.offloaded_layers`` (megatron gives virtual chunk ``c`` of stage ``s`` the layers of block
    ``c * pp + s``)."""
    per_chunk = workload.terms().num_layers // (cand.pp * cand.vpp)
    chosen = (cand.offloaded_layers(workload.terms().num_layers) if cand.offload_layers
              else workload.offloaded_layers)
    held = [(chunk * cand.pp + stage) * per_chunk + i for chunk in range(cand.vpp) for i in range(per_chunk)]
    return [position for position, layer in enumerate(held) if layer in chosen]


def _offload_window(positions: list[int], layers: int) -> int:
    """Offloaded layers whose tensors are on the device at the peak, next to the layers that are not offloaded.

    A layer's originals are released when the *next* offloaded layer finishes its forward, so the last one's stay:
    one layer at the end of the forward. In the backward, when that last offloaded layer ``j`` starts, it and the
    prefetched layer before it (if offloaded) are on the device, but the layers after ``j`` have already freed
    theirs: the window is two layers only when nothing after ``j`` was kept (everything offloaded to the end)."""
    if not positions:
        return 0
    last = positions[-1]
    kept_after = layers - 1 - last - sum(1 for p in positions if p > last)
    return max(1, 1 + (last - 1 in positions) - kept_after)


def estimate_memory(workload: Workload, cand: Candidate, coeffs: Coefficients | None = None) -> MemoryEstimate:
    """Predicted peak bytes of the most loaded rank of ``cand`` (see the module docstring for the terms)."""
    coeffs = coeffs or Coefficients()
    model, e = workload.terms(), workload.param_bytes
    per_stage, best = [], None
    for stage in range(cand.pp):
        dense, expert = stage_params(workload.model, cand, stage)
        params = dense + expert
        dense_shard = cand.dp * cand.cp if cand.distributed_optimizer else 1
        expert_shard = max(1, cand.dp * cand.cp * cand.tp // (cand.ep * cand.etp)) if cand.distributed_optimizer else 1
        state = 8 + (4 if e < 4 else 0)  # Adam m and v, fp32 master for 16-bit parameters
        kept, transient, host = _stage_activations(workload, cand, stage, coeffs)
        largest = padded_vocab(model.vocab_size, cand.tp) * model.hidden_size / cand.tp
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
            best = MemoryEstimate(terms=terms, stage=stage, host_bytes=host)
    assert best is not None
    best.per_stage = per_stage
    return best

