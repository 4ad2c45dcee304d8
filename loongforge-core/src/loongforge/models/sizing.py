"""What a model family states about its own shape, for the layout planner, the FLOP counts and the layout pre-flight.

Why data from the family: core once read ``DecoderFlavor`` fields (heads, query groups, ``kv_channels``, the MLP
width) wherever it sized a model, so a family with another layer shape -- Multi-Latent Attention's low-rank
projections and unequal query/key and value head widths, a hybrid of linear and full attention -- got silently
wrong parameters, FLOPs and memory. Here a family *states* them (:meth:`ModelFamily.decoder_terms` returns a
:class:`DecoderTerms`; :meth:`ModelFamily.check_layout` returns :class:`LayoutProblem` s) and core only does the
arithmetic of splitting them over a layout. Torch-free, like the flavors.

A :class:`DecoderTerms` describes one *average* decoder layer (models whose layers differ -- dense first layers, a
mix of attention kinds -- average each part over ``num_layers``) by named parts, each saying how a parallel
layout divides it: ``"tp"`` over the tensor-parallel ranks, ``"sp"`` over them only with sequence parallelism,
``"etp"`` over the expert-tensor-parallel ranks, ``"expert"`` over ``ep`` and then ``etp`` (routed experts'
weights), ``"none"`` whole on every rank. Parts that a selective recompute drops name the megatron modules that
re-run them (``recomputed_by``: ``core_attn``, ``mlp``, ``moe``, ``shared_experts`` ...). Embedding, final norm and
output layer follow from ``hidden_size`` and ``vocab_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from loongforge.errors import ConfigError

if TYPE_CHECKING:
    from loongforge.parallel.megatron import Layout

#: How each kind of part may be divided over ranks (see the module docstring).
PARAM_SPLITS: tuple[str, ...] = ("tp", "expert", "none")
ACTIVATION_SPLITS: tuple[str, ...] = ("tp", "sp", "etp", "none")
FLOP_SPLITS: tuple[str, ...] = ("tp", "etp", "none")

#: Selective-recompute module sets the planner tries, cheapest first (megatron module names, models/recompute.py).
SELECTIVE_CHOICES_DENSE: tuple[tuple[str, ...], ...] = (("core_attn",), ("mlp",), ("core_attn", "mlp"))
SELECTIVE_CHOICES_MOE: tuple[tuple[str, ...], ...] = (("core_attn",), ("moe",), ("core_attn", "moe"))


@dataclass(frozen=True)
class ParamPart:
    """Parameters of one part of a layer (all of them, before any split)."""

    name: str
    count: float
    #: ``"tp"`` (projections, a dense MLP), ``"none"`` (norms, a router) or ``"expert"`` (routed experts).
    split: str = "tp"


@dataclass(frozen=True)
class ActivationPart:
    """Elements autograd keeps per token for one part of a layer until its backward (before any split)."""

    name: str
    elements: float
    #: ``"tp"``, ``"sp"`` (norm inputs and outputs: split only with sequence parallelism), ``"etp"`` or ``"none"``.
    split: str = "tp"
    #: Selective-recompute modules that drop this part (it is re-run in backward instead).
    recomputed_by: tuple[str, ...] = ()


@dataclass(frozen=True)
class FlopPart:
    """Forward FLOPs per token (2 per multiply-add) of one group of products in a layer, for the whole layer."""

    name: str
    flops: float
    #: Output width of the group's matmuls before splitting: the planner slows matmuls that are narrow per rank.
    #: ``None``: not scaled (attention's products, a router).
    width: float | None = None
    #: What divides ``width`` per rank: ``"tp"``, ``"etp"`` or ``"none"``.
    split: str = "tp"
    #: ``flops`` is per token *and* per sequence position: multiplied by the sequence length (causal attention's
    #: score and value products: ``(qk_width + v_width)`` per position, a token seeing half the sequence on average).
    per_position: bool = False
    #: Selective-recompute modules that re-run this part in backward.
    recomputed_by: tuple[str, ...] = ()


@dataclass(frozen=True)
class DecoderTerms:
    """A megatron decoder as the planner, the ``tflops``/``mfu`` metrics and ``loongforge plan`` size it."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    #: One (average) layer's parameters, activations per token and forward FLOPs per token, by part.
    params: tuple[ParamPart, ...]
    activations: tuple[ActivationPart, ...]
    flops: tuple[FlopPart, ...]
    #: The output layer shares the embedding's weights (a pipeline's last stage still holds a copy).
    tie_word_embeddings: bool = False
    #: Routed experts per layer (``None``: dense), which expert-parallel sizes divide, and how many a token visits.
    num_experts: int | None = None
    moe_router_topk: int = 0
    #: Elements per token and layer that context-parallel attention exchanges (queries, keys, values and their
    #: gradients: ``2 q + 2 kv`` for grouped-query attention).
    context_parallel_width: float = 0.0
    #: Query heads and the per-token query and key/value widths of attention (all heads, before any split): a
    #: ring materialises a score block per query head and pair of sequence chunks, and moves K/V blocks (0: the
    #: family states none; the planner then sizes context-parallel modes alike).
    attention_heads: int = 0
    query_width: float = 0.0
    kv_width: float = 0.0
    #: The selective-recompute module sets the planner may choose, cheapest first (empty: none, only full recompute).
    selective_recompute: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.num_layers <= 0 or self.hidden_size <= 0 or self.vocab_size <= 0:
            raise ConfigError(f"decoder terms: num_layers, hidden_size and vocab_size must be positive, got "
                              f"{self.num_layers}, {self.hidden_size}, {self.vocab_size}")
        for kind, parts, allowed in (("parameter", self.params, PARAM_SPLITS),
                                     ("activation", self.activations, ACTIVATION_SPLITS),
                                     ("FLOP", self.flops, FLOP_SPLITS)):
            for part in parts:
                if part.split not in allowed:
                    raise ConfigError(f"decoder terms: {kind} part '{part.name}' has split {part.split!r}; "
                                      f"known: {', '.join(allowed)}")

    # -- the arithmetic core does with them ------------------------------------------------------------------

    def layer_params(self, tp: int = 1, ep: int = 1, etp: int = 1) -> tuple[float, float]:
        """(dense, expert) parameters of one layer on one rank."""
        split = sum(p.count for p in self.params if p.split == "tp")
        whole = sum(p.count for p in self.params if p.split == "none")
        expert = sum(p.count for p in self.params if p.split == "expert")
        return split / tp + whole, expert / ep / etp

    def layer_activation_elements(self, tp: int = 1, etp: int = 1, sequence_parallel: bool = False,
                                  modules: tuple[str, ...] = ()) -> dict[str, float]:
        """Elements kept per token for one layer on one rank, by part name, with ``modules`` recomputed."""
        divisors = {"tp": tp, "sp": tp if sequence_parallel else 1, "etp": etp, "none": 1}
        out: dict[str, float] = {}
        for part in self.activations:
            if set(part.recomputed_by) & set(modules):
                continue
            out[part.name] = out.get(part.name, 0.0) + part.elements / divisors[part.split]
        return out

    def layer_forward_flops(self, seq_length: int, tp: int = 1, etp: int = 1, narrow_width: float = 0.0,
                            modules: tuple[str, ...] | None = None) -> float:
        """Forward FLOPs per token of one layer (``modules`` given: only the parts they re-run), each matmul group
        divided by its efficiency ``w / (w + narrow_width)`` at its per-rank width ``w`` when ``narrow_width`` > 0."""
        divisors = {"tp": tp, "etp": etp, "none": 1}
        total = 0.0
        for part in self.flops:
            if modules is not None and not set(part.recomputed_by) & set(modules):
                continue
            flops = part.flops * seq_length if part.per_position else part.flops
            if narrow_width and part.width:
                width = part.width / divisors[part.split]
                flops = flops * (width + narrow_width) / width
            total += flops
        return total

    def output_forward_flops(self, tp: int = 1, narrow_width: float = 0.0) -> float:
        """Forward FLOPs per token of the output layer (``2 V h``), slowed like a matmul of width ``V / tp``."""
        flops = 2 * self.vocab_size * self.hidden_size
        width = self.vocab_size / tp
        return flops * (width + narrow_width) / width if narrow_width else flops

    def training_flops_per_token(self, seq_length: int) -> float:
        """Forward and backward FLOPs per trained token without recompute (``3 x`` the forward)."""
        return 3 * (self.num_layers * self.layer_forward_flops(seq_length) + self.output_forward_flops())


@dataclass(frozen=True)
class LayoutProblem:
    """One reason a parallel layout cannot run a model (:meth:`ModelFamily.check_layout`)."""

    #: One line with the numbers; ``loongforge check`` and ``train`` print it after the config file's name.
    message: str
    #: What ``loongforge plan`` counts rejected layouts by (no numbers); empty: the message.
    reason: str = ""

    @property
    def key(self) -> str:
        return self.reason or self.message


def expert_tp(layout: Layout) -> int:
    """The layout's expert tensor-parallel size (megatron's default: ``tp``)."""
    return layout.etp if layout.etp is not None else layout.tp
