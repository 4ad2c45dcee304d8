"""Predicted time of one optimizer step, by named term.

* ``compute`` -- model FLOPs (``6 N`` per token for the parameters a token passes through, plus causal
  attention ``6 s q`` per token and layer, plus the forward again for recomputed parts) divided over the
  ranks and by the device's achieved throughput; parts outside the decoder (``Workload.components``) add
  their FLOPs per sample, undivided, to the first stage;
* ``bubble`` -- the 1F1B pipeline's idle share, ``(pp - 1) / (m * vpp)`` of the compute (``m`` counts the
  chunks of the chunked pipeline, ``parallel.seq_chunks``, whose recording pass adds a forward to ``compute``);
* ``tp_comm`` -- four all-reduces (or all-gather + reduce-scatter with sequence parallelism) of the layer
  activations per layer and micro-batch; ``cp_comm`` -- context-parallel attention's exchange
  (:func:`context_parallel_seconds`: Ulysses' four all-to-alls of q/k/v/out each way, the ring's ``r - 1`` K/V hops
  each way beyond the block compute they overlap plus its ``r`` K/V-gradient hops, hybrid both at their sizes);
  ``offload`` -- activation offload's host copies not hidden behind the compute of a layer
  (:func:`offload_seconds`);
  ``ep_comm`` -- the MoE dispatch/combine all-to-alls; ``pp_comm`` -- stage-boundary sends;
  ``dp_comm`` -- the gradient reduce-scatter and parameter all-gather (all-reduce without the distributed
  optimizer), not overlapped (our trainer reduces after backward);
* ``overhead`` -- a fixed cost per layer and micro-batch (kernel launches, Python), calibrated.

The FLOPs, widths and parameters are the model family's (:meth:`~loongforge.models.family.ModelFamily.decoder_terms`).

Each collective moves ring bytes ``2 (n - 1) / n x size`` (all-reduce) or ``(n - 1) / n x size`` over the
intra-node link when its group fits in a node (ranks are laid out tp, cp, ep innermost), else inter-node.
"""

from __future__ import annotations

from dataclasses import dataclass

from loongforge.planner.hardware import ClusterSpec
from loongforge.planner.layouts import Candidate
from loongforge.planner.memory import Workload, padded_vocab


@dataclass(frozen=True)
class TimeCoefficients:
    """Calibratable factors of the time model."""

    #: Multiplies the cluster's ``device_flops`` (calibration replaces it with a measured figure).
    flops_scale: float = 1.0
    #: Seconds per layer per micro-batch on top of the FLOPs (dispatch overhead; ~0 on large GPUs).
    overhead_per_layer: float = 0.0
    #: Multiplies all communication times.
    comm_scale: float = 1.0
    #: Output width (per rank) at which a matmul reaches half its peak rate (see :func:`flops_per_token`).
    narrow_width: float = 128.0


def flops_per_token(
    workload: Workload, cand: Candidate | None = None, narrow_width: float = 0.0
) -> tuple[float, float]:
    """(training FLOPs per token without recompute, extra forward FLOPs per token that recompute re-runs).

    With ``narrow_width`` > 0 each matmul's FLOPs are divided by its efficiency ``w / (w + narrow_width)``
    for its per-rank output width ``w`` (narrow matmuls, e.g. MoE experts split by etp, run far below peak);
    the result is then "peak-equivalent" FLOPs.
    """
    terms, seq = workload.terms(), workload.seq_length
    tp, etp = (cand.tp, cand.etp) if cand is not None else (1, 1)
    # per layer: the family's FLOP parts (core's decoder: the projections, the MLP or k experts with the router and
    # shared expert, causal QK^T and AV at 2 x (s/2) x q multiply-adds per token)
    per_layer_forward = terms.layer_forward_flops(seq, tp, etp, narrow_width)
    forward = terms.num_layers * per_layer_forward + terms.output_forward_flops(tp, narrow_width)
    total = 3 * forward
    extra = 0.0
    if cand is not None and cand.recompute.granularity != "none":
        rc = cand.recompute
        layers_per_chunk = terms.num_layers // (cand.pp * cand.vpp)
        if rc.granularity == "full":
            extra = terms.num_layers * min(rc.num_layers, layers_per_chunk) / layers_per_chunk * per_layer_forward
        else:  # the parts the recomputed modules re-run
            extra = terms.num_layers * terms.layer_forward_flops(seq, tp, etp, narrow_width, modules=rc.modules)
    if cand is not None and cand.seq_chunks > 1:  # the chunked pipeline's recording pass: one more forward
        extra += forward
    return total, extra


@dataclass
class TimeEstimate:
    terms: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.terms.values())


def ring_seconds(
    size: float, ranks: int, cluster: ClusterSpec, span: int, all_reduce: bool, coeffs: TimeCoefficients
) -> float:
    """Seconds for one collective of ``size`` bytes over ``ranks`` ranks whose group spans ``span`` ranks."""
    if ranks <= 1:
        return 0.0
    bandwidth = cluster.intra_node_bandwidth if span <= cluster.node_size else cluster.inter_node_bandwidth
    factor = 2 if all_reduce else 1
    return coeffs.comm_scale * (factor * (ranks - 1) / ranks * size / bandwidth + cluster.latency)


def _p2p(size: float, cluster: ClusterSpec, span: int, coeffs: TimeCoefficients) -> float:
    """Seconds for one point-to-point send of ``size`` bytes between ranks of a group spanning ``span`` ranks."""
    bandwidth = cluster.intra_node_bandwidth if span <= cluster.node_size else cluster.inter_node_bandwidth
    return coeffs.comm_scale * (size / bandwidth + cluster.latency)


def _attention_seconds(workload: Workload, cand: Candidate, cluster: ClusterSpec, coeffs: TimeCoefficients) -> float:
    """Forward seconds of one layer's core attention (the score and value products) for one micro-batch on a rank."""
    terms = workload.terms()
    per_token = terms.layer_forward_flops(workload.seq_length, cand.tp, cand.etp, modules=("core_attn",))
    tokens = workload.seq_length * cand.micro_batch_size / cand.cp
    return per_token * tokens / cand.tp / (cluster.device_flops * coeffs.flops_scale)


def context_parallel_seconds(workload: Workload, cand: Candidate, cluster: ClusterSpec,
                             coeffs: TimeCoefficients) -> float:
    """Exposed seconds of context-parallel attention's exchange for one layer and micro-batch, forward + backward.

    Ulysses over ``n`` ranks (all of cp, or ``cp_a2a_size`` for hybrid): four all-to-alls (q, k, v, out) forward and
    four back. A ring of ``r`` members (cp, or ``cp / cp_a2a_size``): each pass sends the K/V block ``r - 1`` times,
    each hop overlapping one ``1/r`` share of the attention compute (the backward's twice the forward's), so only
    what a hop takes beyond its share shows; the backward then passes the K/V gradients (fp32) ``r`` times, waited on.
    """
    if cand.cp == 1:
        return 0.0
    terms, e = workload.terms(), workload.param_bytes
    tokens = workload.seq_length * cand.micro_batch_size / cand.cp
    a2a = {"ulysses": cand.cp, "ring": 1, "hybrid": cand.cp_a2a_size or 1}[cand.cp_mode]
    ring = cand.cp // a2a
    exchanged = tokens * terms.context_parallel_width * e / cand.tp  # q, k, v and out of this rank's tokens
    seconds = 2 * ring_seconds(exchanged, a2a, cluster, cand.tp * a2a, False, coeffs)
    if ring > 1:
        kv = tokens * 2 * terms.kv_width / cand.tp  # a member's K/V block: the same bytes whatever a2a
        hop, share = _p2p(kv * e, cluster, cand.tp * cand.cp, coeffs), _attention_seconds(workload, cand, cluster,
                                                                                         coeffs) / ring
        seconds += (ring - 1) * (max(0.0, hop - share) + max(0.0, hop - 2 * share))
        seconds += ring * _p2p(kv * 4, cluster, cand.tp * cand.cp, coeffs)
    return seconds


def offload_seconds(workload: Workload, cand: Candidate, cluster: ClusterSpec, coeffs: TimeCoefficients) -> float:
    """Exposed seconds of activation offload per step on a rank: each offloaded layer's saved tensors go to host memory
    while the next layer runs forward and come back while the layer after it runs backward (twice the forward);
    what a copy takes beyond that compute shows, for every micro-batch."""
    from loongforge.planner.memory import offloaded_bytes_per_layer

    layers = _offloaded_count(workload, cand)
    if not layers:
        return 0.0
    copy = offloaded_bytes_per_layer(workload, cand) / cluster.host_bandwidth
    base, _extra = flops_per_token(workload, cand, coeffs.narrow_width)
    terms = workload.terms()
    tokens = workload.seq_length * cand.micro_batch_size / (cand.cp * cand.tp)
    forward = (base / 3 - terms.output_forward_flops(cand.tp, coeffs.narrow_width)) / terms.num_layers * tokens / (
        cluster.device_flops * coeffs.flops_scale)
    return cand.num_microbatches * layers * (max(0.0, copy - forward) + max(0.0, copy - 2 * forward))


def _offloaded_count(workload: Workload, cand: Candidate) -> int:
    """Offloaded layers on the busiest stage (the candidate's choice, else the workload's, spread over the stages)."""
    per_chunk = workload.terms().num_layers // (cand.pp * cand.vpp)
    if cand.offload_layers:
        return min(cand.offload_layers, per_chunk) * cand.vpp
    return -(-len(workload.offloaded_layers) // cand.pp)


def estimate_time(
    workload: Workload, cand: Candidate, cluster: ClusterSpec, coeffs: TimeCoefficients | None = None
) -> TimeEstimate:
    """Predicted seconds of one step of ``cand`` on ``cluster``."""
    coeffs = coeffs or TimeCoefficients()
    f, e = workload.terms(), workload.param_bytes
    m = cand.num_microbatches
    passes_m = m * cand.seq_chunks  # what the schedule runs as micro-batches: chunks of them when chunked
    tokens_step = cand.micro_batch_size * m * cand.dp * workload.seq_length
    base, extra = flops_per_token(workload, cand, coeffs.narrow_width)
    # The slowest stage sets the pace: the last one also runs the output layer (its 6 V h FLOPs per token).
    logits = 6 * f.vocab_size * f.hidden_size * (1 + coeffs.narrow_width * cand.tp / f.vocab_size)
    layer_share = (base - logits + extra) / cand.pp
    tokens_rank = tokens_step / (cand.dp * cand.tp * cand.cp)
    # Parts outside the decoder (a VLM's vision encoder) run on the first stage for each sample of the rank's
    # data-parallel share, each rank's part of that work as the part says (whole where it is replicated over tp).
    parts = sum(c.rank_flops_per_sample(workload, cand) for c in workload.components) * cand.micro_batch_size * m
    if cand.pp > 1:
        slowest = max(layer_share * tokens_rank + parts, (layer_share + logits) * tokens_rank)
    else:
        slowest = (base + extra) * tokens_rank + parts
    compute = slowest / (cluster.device_flops * coeffs.flops_scale)
    layers = f.num_layers / cand.pp  # per rank
    tokens_mb = workload.seq_length * cand.micro_batch_size / cand.cp
    act = tokens_mb * f.hidden_size * e
    full_rc = cand.recompute.granularity == "full"
    rc_fraction = min(cand.recompute.num_layers, f.num_layers // (cand.pp * cand.vpp)) / (
        f.num_layers // (cand.pp * cand.vpp)) if full_rc else 0.0
    terms = {"compute": compute, "bubble": compute * (cand.pp - 1) / (passes_m * cand.vpp)}
    if cand.pp > 1:  # time beyond the average stage's share is the imbalance of the slowest stage
        balanced = ((base + extra) * tokens_rank + parts) / cand.pp / (cluster.device_flops * coeffs.flops_scale)
        terms["compute"], terms["stage_imbalance"] = balanced, compute - balanced
    tp_span = cand.tp
    per_layer_tp = 4 * ring_seconds(act, cand.tp, cluster, tp_span, True, coeffs)
    recorded = 1 / 2 if cand.seq_chunks > 1 else 0.0  # the chunked pipeline's recording pass: forward exchanges
    terms["tp_comm"] = per_layer_tp * layers * m * (1 + rc_fraction / 2 + recorded)
    terms["cp_comm"] = context_parallel_seconds(workload, cand, cluster, coeffs) * layers * m
    terms["offload"] = offload_seconds(workload, cand, cluster, coeffs)
    if f.num_experts:
        a2a = tokens_mb * f.moe_router_topk * f.hidden_size * e / (cand.tp if cand.sequence_parallel else 1)
        terms["ep_comm"] = 4 * ring_seconds(a2a, cand.ep, cluster, cand.ep * cand.etp, False, coeffs) * layers * m
    stage_bytes = act / (cand.tp if cand.sequence_parallel else 1) / cand.seq_chunks
    pp_span = cand.tp * cand.cp * cand.dp * cand.pp
    sends = 2 * passes_m * cand.vpp + (passes_m if cand.seq_chunks > 1 else 0)  # the recording pass sends forward
    terms["pp_comm"] = sends * ring_seconds(stage_bytes, 2, cluster, pp_span, False, coeffs) if cand.pp > 1 else 0
    dense, expert = f.layer_params(cand.tp, cand.ep, cand.etp)
    params = (dense + expert) * layers + padded_vocab(f.vocab_size, cand.tp) * f.hidden_size / cand.tp
    params += sum(c.param_count(cand) for c in workload.components)  # reduced by the first stage's ranks
    dp_ranks, dp_span = cand.dp * cand.cp, cand.world_size
    if cand.distributed_optimizer:
        terms["dp_comm"] = (ring_seconds(params * 4, dp_ranks, cluster, dp_span, False, coeffs)
                            + ring_seconds(params * e, dp_ranks, cluster, dp_span, False, coeffs))
    else:
        terms["dp_comm"] = ring_seconds(params * 4, dp_ranks, cluster, dp_span, True, coeffs)
    forwards = 1 + rc_fraction / 3 + (1 / 3 if cand.seq_chunks > 1 else 0.0)  # recompute and recording re-run
    passes = layers * passes_m * forwards * (1 + (cand.pp - 1) / (passes_m * cand.vpp))
    terms["overhead"] = coeffs.overhead_per_layer * passes
    return TimeEstimate(terms=terms)
