"""What a task-engine family states about its model and one training sample, for the layout planner.

Why a separate statement from :class:`~loongforge.models.sizing.DecoderTerms`: a task model (a diffusion
transformer, a policy) is trained by torch-native strategies -- DDP, ZeRO-1, FSDP2, HSDP, with the task's own
context and tensor parallelism (:mod:`loongforge.parallel.torch_native`) -- not by megatron's pipeline of decoder
layers, and its memory is dominated by different things: a DiT's sequence is a whole video (tens of thousands of
tokens per sample), its per-token activations depend on the compute dtype (norms and residuals kept in fp32), and a
mixture of two experts (Wan 2.2 A14B) holds two models but trains one per step. The family states these numbers
(:meth:`loongforge.models.family.ModelFamily.task_terms`); the planner (:mod:`loongforge.planner.task_planner`) only
splits them over a layout. Torch-free, like the flavors.

Activations are stated in *bytes per token of one block* for each compute dtype, split into what tensor
parallelism divides (heads, FFN columns) and what every tp rank keeps whole (norm inputs, residuals, the inputs of
column-parallel projections); context parallelism (Ulysses) divides every per-token term. What is saved per sample
rather than per token (a cross-attention's keys and values of the text context) is stated per sample.
"""

from __future__ import annotations

from dataclasses import dataclass

from loongforge.errors import ConfigError

#: Compute dtypes a task model's activations are stated for: ``fp32``, and ``bf16`` (FSDP2/HSDP mixed precision).
COMPUTE_DTYPES: tuple[str, ...] = ("fp32", "bf16")


@dataclass(frozen=True)
class BlockActivations:
    """Bytes autograd keeps for one block's backward, in one compute dtype (measured against saved tensors)."""

    #: Per token, whole on every tensor-parallel rank.
    replicated_per_token: float
    #: Per token, divided by tensor parallelism.
    split_per_token: float
    #: Per sample (independent of the token count: a cross-attention's context keys and values), divided by tp.
    split_per_sample: float = 0.0
    #: Per token, what the model keeps outside its blocks (embeddings, head, shared tables), whole on every rank.
    outside_per_token: float = 0.0
    #: Per token, what a recomputed block keeps until its backward (its input).
    recompute_per_token: float = 0.0
    #: Per token, transient gradients while a block runs backward (without recompute: the peak's excess over the
    #: saved tensors), whole on every tensor-parallel rank.
    backward_per_token: float = 0.0


@dataclass(frozen=True)
class TaskTerms:
    """One task model's parameters, FLOPs and activations for one training sample (see the module docstring).

    ``models``/``models_per_step``: a mixture of models of one shape, each step training some (Wan 2.2 A14B: two
    experts, one per step); every model's weights and optimizer state are held, gradients only for those trained.
    """

    #: Repeated blocks (FSDP2's units; recompute's granularity).
    blocks: int
    #: Parameters of one block that tensor parallelism divides.
    block_split_params: float
    #: Parameters of one block every tensor-parallel rank holds whole (norms, modulation tables).
    block_replicated_params: float
    #: Parameters outside the blocks (embeddings, head), whole on every tensor-parallel rank.
    outside_params: float
    #: Tokens the blocks run over per sample (a video's patches).
    tokens: int
    #: Attention heads: tensor x context parallel sizes must divide them (heads are split, then exchanged).
    heads: int
    #: Width of the activations that tensor parallelism all-reduces and Ulysses exchanges (the hidden size).
    hidden: int
    #: Forward FLOPs of one sample through the blocks (projections, attention) and outside them.
    block_forward_flops: float
    outside_forward_flops: float
    #: Activations by compute dtype (every dtype of :data:`COMPUTE_DTYPES`).
    activations: dict[str, BlockActivations]
    models: int = 1
    models_per_step: int = 1
    #: Whether the family's task splits sequences over ranks (``parallel.cp``) and weights (``parallel.tp``).
    context_parallel: bool = False
    tensor_parallel: bool = False
    #: The multi-process strategies this run can take (the task's options may rule some out: an EMA of sharded
    #: parameters), of ``ddp``, ``zero1``, ``fsdp2``, ``hsdp``; one process runs unwrapped whatever they are.
    strategies: tuple[str, ...] = ("ddp", "zero1", "fsdp2", "hsdp")
    #: One line each on what the config rules out and why, printed with the plan.
    notes: tuple[str, ...] = ()
    #: Other sizes tensor parallelism must divide (an FFN's width).
    tp_divides: tuple[int, ...] = ()
    #: The dotted config key that turns on per-block recompute (``task.recompute``); ``None``: the task has none.
    recompute_option: str | None = None
    #: One line naming the sample the sizes are for (``21x60x104 latents, 32760 tokens``), for the report.
    sample: str = ""

    def __post_init__(self) -> None:
        missing = [dtype for dtype in COMPUTE_DTYPES if dtype not in self.activations]
        if missing:
            raise ConfigError(f"task sizes: activations must be stated for {', '.join(missing)}")
        if min(self.blocks, self.tokens, self.heads, self.hidden, self.models, self.models_per_step) < 1:
            raise ConfigError("task sizes: blocks, tokens, heads, hidden and models must be positive")
        if self.models_per_step > self.models:
            raise ConfigError(f"task sizes: models_per_step ({self.models_per_step}) exceeds models ({self.models})")

    @property
    def block_params(self) -> float:
        return self.block_split_params + self.block_replicated_params

    @property
    def model_params(self) -> float:
        """Parameters of one model (one expert)."""
        return self.blocks * self.block_params + self.outside_params
