"""Typed configuration of a LoongForge run.

Why dataclasses: a YAML file is validated against these classes field by field, so a misspelled key
fails with its file and key path instead of being silently ignored, and every option has one documented
default in one place. Component names (``model``, ``device``, ``data.dataset``, ...) stay plain strings
here; they are resolved through the plugin registries only when the run is built, so a config can be
loaded and checked without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from loongforge.config.sections import INTERNAL, OTHER_KEYS, ranged


@dataclass
class RunConfig:
    """Where a run writes and how it is seeded."""

    name: str = "run"
    #: Directory for checkpoints, metrics (metrics.jsonl), TensorBoard events and the resolved config.
    output_dir: str = "runs/run"
    #: Seed for model initialisation, data order and dropout; a resumed run restores RNG state instead.
    seed: int = 1234
    #: Trust the checkpoints this run reads (``model.load`` of a LoongForge checkpoint): ``pkg.module:attr`` names in
    #: their recorded config.yaml then import that module, which executes its code -- whatever the checkpoint's
    #: author put there -- so leave it off for checkpoints you did not make. ``train``/``check --trust-code`` set it;
    #: commands that read a checkpoint without a run config (``generate``, ``convert``, ``eval``, ``sample``,
    #: ``serve``) take ``--trust-code``. A checkpoint's own recorded value is never read, and names in the config you
    #: pass yourself always import (it is your file, like a script). See docs/reliability.md.
    trust_code: bool = False


@dataclass
class LoRAConfig:
    """LoRA (``model.lora``): ``W x + (alpha / rank) * B A x``, ``B`` starting at zero; other weights frozen."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    #: Which linear layers get an adapter, by module name: ``linear_qkv``, ``linear_proj`` (attention),
    #: ``linear_fc1``, ``linear_fc2`` (MLP), or a family's own (MLA's ``linear_q_up_proj``/``linear_kv_up_proj``,
    #: Gated DeltaNet's ``in_proj``/``out_proj``). null: every tensor-parallel linear of the attention blocks.
    targets: list[str] | None = None
    #: QLoRA-style memory saving: ``bf16`` builds the model -- so the frozen base weights and their matmuls -- in
    #: bf16 (half the bytes of fp32) while the adapters stay fp32 parameters computed in fp32; refused on a device
    #: without bf16. null: the base is in the run's precision like the adapters.
    base_dtype: str | None = None


@dataclass
class RecomputeConfig:
    """Activation recompute (``model.recompute``): trade compute for memory by re-running parts of the forward.

    ``full`` keeps only each layer's input and re-runs whole layers in backward; ``method`` picks which layers:
    ``uniform`` checkpoints every group of ``num_layers`` consecutive layers as one unit, ``block`` recomputes
    the first ``num_layers`` layers of each pipeline stage (the rest keep their activations). ``selective``
    re-runs only ``modules`` of every layer (``core_attn``: the attention softmax, whose ``seq^2`` intermediates
    dominate at long sequences; ``mlp``; ``moe``/``shared_experts`` for MoE models).
    """

    #: ``full`` or ``selective``.
    granularity: str = "full"
    #: ``uniform`` or ``block`` (full only; null = ``uniform``).
    method: str | None = None
    #: Layers per recompute unit (uniform) or recomputed layers per stage (block); full only, null = 1 / all.
    num_layers: int | None = None
    #: Submodules to recompute (selective only).
    modules: list[str] = field(default_factory=lambda: ["core_attn"])


@dataclass
class ModelConfig:
    """Which model to build: a registered flavor name plus optional field overrides."""

    #: A registered model name (``loongforge list models``), a Hugging Face id alias, or ``pkg.module:factory``;
    #: null only when ``model:`` gives parts alone (see :attr:`roles`) or when it is left out beside
    #: ``load: hf:DIR``: DIR's config.json then names the model (any architecture ``loongforge convert`` reads),
    #: written into the run's config as the nearest registered flavor plus overrides, and a ``data.tokenizer`` left
    #: unset becomes ``hf:DIR`` when DIR holds tokenizer.json. The default applies only to a config with no name,
    #: parts or ``hf:`` load.
    name: str | None = "llama-tiny"
    #: Flavor fields to override, e.g. ``{num_layers: 2}``.
    overrides: dict[str, Any] = field(default_factory=dict)
    #: Initial weights: ``hf:/path/to/hf/dir`` (a Hugging Face checkpoint directory) or the path of a LoongForge
    #: checkpoint (e.g. written by ``loongforge convert hf-to-mcore``); it must describe this model (given without
    #: ``name``, ``hf:DIR`` describes it, see :attr:`name`). Ignored when the run resumes from one of its own
    #: checkpoints (the resumed weights replace it).
    load: str | None = None
    #: Low-rank adapters on the chosen linear layers (see :class:`LoRAConfig`); null trains the full model.
    lora: LoRAConfig | None = None
    #: Freeze parameters whose names (TP=1/PP=1 names, e.g. ``embedding.*``, ``decoder.layers.0.*``) match any of
    #: these glob patterns; each pattern must match something.
    freeze: list[str] = field(default_factory=list)
    #: Activation recompute (see :class:`RecomputeConfig`); null keeps every activation.
    recompute: RecomputeConfig | None = None
    #: Parts of a composed model by role: every other key under ``model:`` (a registered name or an inline
    #: mapping of fields each). The roles are the resolved family's ``part_roles`` (a vision-language model's
    #: ``encoder`` / ``projector`` / ``foundation``), checked once the family is known. Given without ``name``,
    #: the parts name no model (``name`` is null) and the family with ``default_composition`` composes them;
    #: given with a ``name`` of a composed model, they replace its parts. Not a key itself.
    roles: dict[str, Any] = field(default_factory=dict, metadata={OTHER_KEYS: True})

    @property
    def parts(self) -> dict[str, Any]:
        """The composition parts the config sets, by role (a null role is unset: configs saved before parts were
        generic wrote ``encoder: null`` ... for every model)."""
        return {role: value for role, value in self.roles.items() if value is not None}


#: The keys ``model:`` takes besides part roles.
MODEL_KEYS: tuple[str, ...] = tuple(f.name for f in fields(ModelConfig) if not f.metadata.get(OTHER_KEYS))


@dataclass
class PlannerConfig:
    """Device facts and limits for ``parallel: auto`` (null: ask the device backend or use the defaults)."""

    #: Memory per device, e.g. ``80GiB`` (CPU: host memory / local processes).
    device_memory: str | None = None
    ranks_per_node: int | None = None
    #: Achieved dense throughput per device in TFLOP/s for the training precision.
    device_tflops: float | None = None
    #: Per-device collective bandwidth in GB/s inside a node and across nodes.
    intra_node_gbps: float | None = None
    inter_node_gbps: float | None = None
    #: Per-device copy rate to and from host memory in GB/s (activation offload's link; default: the backend's).
    host_gbps: float | None = None
    #: Share of device memory left free for fragmentation and the runtime.
    margin: float = 0.1
    #: A calibration file written by ``benchmarks/planner_calibration.py``.
    calibration: str | None = None
    #: Task-engine models: one training sample's shape in the model family's own terms (a Wan video's latent
    #: ``[frames, height, width]``), to plan for data that is not at hand; null: the shape of the config's data.
    sample_shape: list[int] | None = None


@dataclass
class ParallelConfig:
    """How the model is split across processes; ``dp`` is derived from the world size."""

    #: Parallel strategy name (``loongforge list strategies``).
    strategy: str = "megatron"
    #: Let the planner choose tp/pp/vpp/cp/ep/etp, sequence parallelism, the distributed optimizer, the
    #: micro-batch size and ``model.recompute`` for the run's world size (``parallel: auto`` is short for
    #: ``{auto: true}``); the sizes below are then ignored. See docs/planner.md.
    auto: bool = False
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    tp: int = 1
    pp: int = 1
    #: Virtual pipeline stages per pipeline rank (interleaved schedule); null is off. Needs pp > 1, layers
    #: divisible by pp*vpp and a number of micro-batches per step that is a multiple of pp.
    vpp: int | None = None
    #: Context parallelism: split every sequence over ``cp`` ranks (megatron's load-balanced causal chunks).
    #: Needs seq_length divisible by 2*cp. How attention sees the whole sequence is ``cp_mode``.
    cp: int = 1
    #: ``ulysses``: all-to-all over heads (whole sequences per head group; heads and query groups divisible by
    #: tp*cp); ``ring``: K/V blocks passed around the cp ranks (any head count); ``hybrid``: Ulysses inside
    #: sub-groups of ``cp_a2a_size`` ranks, a ring across them (heads and query groups divisible by
    #: tp*cp_a2a_size). See docs/parallelism.md. ``auto``: the planner chooses the mode and a2a size with the
    #: layout (``parallel: auto`` or ``loongforge plan --write``; a fixed layout must name one). See docs/planner.md.
    cp_mode: Literal["ulysses", "ring", "hybrid", "auto"] = "ulysses"
    #: ``cp_mode: hybrid`` only: ranks per Ulysses sub-group; divides cp, 1 < cp_a2a_size < cp.
    cp_a2a_size: int | None = None
    #: Dynamic context parallelism for packed rows (``data.pack``, cp > 1): a micro-batch none of whose sequences is
    #: longer than this many tokens is not split; its sequences are dealt whole to the cp ranks, which attend
    #: without exchanging anything. 0 (default): every micro-batch is split per sequence. See docs/long-context.md.
    dynamic_cp_threshold: int = 0
    #: Chunked pipeline (ChunkPipe-style): cut every sequence into this many equal chunks that go through the
    #: pipeline as micro-batches, each attending to the earlier chunks' kept K/V, so that a stage holds one chunk's
    #: activations rather than a sequence's; exact (the loss and gradients of the unchunked run) at the cost of one
    #: more forward. 1 (default): off. Needs seq_length divisible by it, cp=1, no vpp, no data.pack, a dense
    #: decoder with core's causal attention. ``auto``: the planner chooses the count with the layout (``parallel:
    #: auto`` or ``loongforge plan --write``), where memory or the pipeline's bubble needs it. See docs/long-context.md.
    seq_chunks: int | Literal["auto"] = 1
    #: Shard layer-norm/dropout activations over the tensor-parallel group (needs tp > 1).
    sequence_parallel: bool = False
    #: Shard optimizer state across data-parallel ranks (ZeRO-1).
    distributed_optimizer: bool = False
    #: Expert parallel size (MoE models): experts are split over ``ep`` ranks carved out of the data-parallel
    #: ranks; it must divide the number of experts and tp*dp/etp.
    ep: int = 1
    #: Expert tensor parallel size (MoE): how many ranks split each expert's matrices; null = tp. etp=1 with
    #: tp=2 keeps experts whole, so tp=2 + ep=2 fits in two processes.
    etp: int | None = None
    #: MoE token dispatcher: ``alltoall`` (send each token to the ranks of its experts) or ``allgather``
    #: (every rank gathers all tokens and keeps its experts' share).
    moe_dispatcher: str = "alltoall"
    #: Overlap the MoE token exchange (dispatch/combine all-to-alls) with compute; needs ep > 1 and the alltoall
    #: dispatcher. On a device with streams (CUDA) it is megatron-core's ``overlap_moe_expert_parallel_comm`` (bf16 or
    #: fp16; pp > 1 needs vpp); elsewhere (CPU) each layer's exchange is chunked per local expert (>= 2 per rank,
    #: etp=1) and each chunk travels while another expert computes. Bitwise equal to no overlap on CPU. See
    #: docs/long-context.md.
    moe_a2a_overlap: bool = False
    #: Torch-native strategies (``ddp``, ``zero1``, ``fsdp2``, ``hsdp``; task models such as diffusion DiTs):
    #: DDP gradient bucket size in MiB, static graph, and gradient compression on the wire (``bf16``/``fp16``).
    ddp_bucket_mb: float = 25.0
    ddp_static_graph: bool = False
    ddp_comm_hook: str | None = None
    #: ``hsdp``: ranks in each sharding group; the groups replicate each other.
    fsdp_shard_size: int | None = None


@dataclass
class DataConfig:
    """Training data: a registered dataset kind, its location, and the tokenizer."""

    #: Dataset kind (``loongforge list datasets``): ``shipped-corpus``, ``mmap`` (alias ``megatron``: Megatron-LM
    #: ``.bin``/``.idx``), ``text``, ``hf-datasets`` (local parquet/arrow/jsonl), ``sft``.
    dataset: str = "shipped-corpus"
    #: Path(s) the dataset kind reads: a prefix for ``mmap``, files for ``text``, files or ``save_to_disk`` folders
    #: for ``hf-datasets``; unused for ``shipped-corpus``.
    paths: list[str] = field(default_factory=list)
    #: ``byte`` (built in) or ``hf:/local/tokenizer/dir``.
    tokenizer: str = "byte"
    #: JSON field holding the text in .jsonl inputs (the column, for ``hf-datasets``).
    text_key: str = "text"
    #: How a ``.txt`` input splits into documents (each one ends with the tokenizer's end-of-text token):
    #: ``paragraph`` (text between blank lines), ``line`` (every non-blank line) or ``file`` (the whole file).
    #: Read by the kinds whose factory takes ``txt_split`` (``text``).
    txt_split: Literal["paragraph", "line", "file"] = "paragraph"
    seq_length: int = 256
    #: Fraction of samples (the tail of the token stream) held out for validation.
    valid_fraction: float = 0.0
    #: Chat datasets only: pack several conversations into each sequence (attention stays within each one).
    pack: bool = False


@dataclass
class OptimizerConfig:
    """AdamW hyper-parameters (megatron's optimizer implements them)."""

    name: str = "adamw"
    lr: float = 3.0e-4
    min_lr: float = 3.0e-5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1.0e-8
    #: Clip the global gradient norm to this value; 0 disables clipping.
    grad_clip: float = 1.0
    #: ``training.precision: fp16`` only (megatron's fp16 optimizer). A fixed loss scale; null scales
    #: dynamically: start at ``initial_loss_scale``, halve on an overflow (that step's update is skipped, and
    #: recorded as ``skipped`` with its ``loss_scale`` in metrics.jsonl) and double after ``loss_scale_window``
    #: steps without one, never below ``min_loss_scale``.
    loss_scale: float | None = None
    initial_loss_scale: float = 65536.0
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000


@dataclass
class SchedulerConfig:
    """Learning-rate schedule: linear warmup then decay to ``optimizer.min_lr``."""

    warmup_steps: int = 10
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    #: Steps over which lr decays; defaults to ``training.steps``.
    decay_steps: int | None = None


@dataclass
class OffloadConfig:
    """Activation offload (``training.offload_activations``): move what chosen decoder layers save for backward to
    host memory during the forward pass and copy it back, ahead of use, in the backward pass.

    Another way than recompute to trade for activation memory: recompute spends compute, offload spends
    host-device bandwidth (on a side stream, overlapped with the next layer's compute) and host memory; the
    numbers stay bit for bit the same. The storage under each saved tensor, when it holds at least ``min_bytes``
    (parameters excepted), is copied into a page-locked host buffer as it is saved; its device memory is released
    once the next offloaded layer has run its forward. When a layer's backward starts, the previous layer's tensors
    are prefetched to the device (:mod:`loongforge.train.activation_offload`). Megatron's own layer offloading
    needs Transformer Engine; this one works on every device backend. Not with ``training.compile`` nor full
    ``model.recompute`` (which keeps only each layer's input); selective recompute combines with it.
    """

    #: Decoder layers to offload, 0-based over the whole model (each pipeline stage offloads the ones it holds),
    #: ``all``, or ``auto``: the planner offloads the first k layers of each stage where memory needs it and
    #: nothing otherwise (``parallel: auto`` or ``loongforge plan --write``). See docs/planner.md.
    layers: Literal["all", "auto"] | list[int] = "all"
    #: Smaller saved storages stay on the device (a copy costs more than it frees); megatron's default is 1 MiB.
    min_bytes: int = ranged(1 << 20, low=0)


@dataclass
class TrainingConfig:
    """The loop: how many steps, batch sizes and numeric precision."""

    steps: int = 100
    micro_batch_size: int = 8
    #: Samples per optimizer step across all data-parallel ranks; a multiple of micro_batch_size * dp.
    #: Defaults to micro_batch_size * dp (no gradient accumulation).
    global_batch_size: int | None = None
    #: ``fp32``, ``bf16`` (fp32 master weights in the optimizer), or what the device adds (``fp8`` on cuda).
    precision: str = "fp32"
    #: Intra-op threads for CPU runs; null leaves torch's default.
    threads: int | None = None
    #: ``torch.compile`` for training: ``false`` (eager), ``regional`` (each transformer layer / DiT block / policy
    #: block compiled on its own: one compilation reused by every layer, so compile time stays short) or ``true``
    #: (the same blocks, plus the surrounding model where the engine can). Compile time is reported.
    compile: bool | Literal["regional"] = False
    #: Offload chosen layers' saved activations to host memory (see :class:`OffloadConfig`); null keeps them on
    #: the device.
    offload_activations: OffloadConfig | None = None
    #: After training, generate this many tokens from ``sample_prompt`` (0 disables).
    sample_tokens: int = 0
    sample_prompt: str = "The "
    #: ``pretrain`` (every token is a target), ``sft`` (chat data, loss on assistant tokens only; needs a chat
    #: dataset such as ``sft`` or ``shipped-chat``) or ``dpo`` (preference optimisation on chosen/rejected pairs,
    #: the ``dpo:`` section; needs a preference dataset such as ``preference`` or ``shipped-preference``).
    phase: str = "pretrain"
    #: How the megatron trainer averages the loss: ``micro_batch`` (each micro-batch's masked mean, then the mean
    #: over micro-batches and data-parallel ranks) or ``global_tokens`` (the sum over every target token of the
    #: global batch divided by their count, all-reduced over data-parallel ranks: megatron's per-token loss).
    #: ``global_tokens`` makes the gradient independent of which rank trains which sample, so ranks may hold
    #: different token counts (``dp-balance`` needs it). The reported loss is a per-token mean either way.
    loss_normalization: str = "micro_batch"
    #: What a bad step -- loss or gradient norm NaN or infinite, a loss spike (``spike_factor``) or a collapse
    #: (``collapse_steps``) -- does:
    #: ``stop`` ends the run with an error naming the step and the value (exit status 2) before anything is saved
    #: for that step or after it, so the newest checkpoint is the last healthy one; ``skip_step`` discards that
    #: step's update (weights, optimizer state and schedule stay as before it; the step still counts) and goes on
    #: with the next batch; ``rewind`` reloads the newest checkpoint and goes on from there with the batches after
    #: the bad one (the steps after that checkpoint are trained, and logged, again). Both recoveries give up (as
    #: ``stop``) after ``max_recoveries`` bad steps in one run. A bad step is never saved; metrics.jsonl marks it
    #: (``"bad": "nonfinite"``, ``"spike"`` or ``"collapse"``, and the ``"action"``) and a warning names it.
    on_nonfinite: Literal["stop", "skip_step", "rewind"] = "stop"
    #: A step whose loss exceeds this factor (> 1) times, and ``spike_min_increase`` above, the median loss of the
    #: previous ``spike_window`` healthy steps is a bad step too (handled by ``on_nonfinite``; a median at or below
    #: 0 never flags one); null turns spike detection off. The window starts empty in every run, resumed ones
    #: included, and detection starts at its third step. 20 is far above any healthy step-to-step noise.
    spike_factor: float | None = 20.0
    #: Steps the running median of ``spike_factor`` looks back over.
    spike_window: int = 20
    #: The least a spike rises above the median (in loss units), so that a loss near 0 (a memorised batch) does not
    #: count as a spike for a small absolute rise.
    spike_min_increase: float = 1.0
    #: A collapsed model is a bad step too (handled by ``on_nonfinite``): this many steps in a row with a gradient
    #: norm of exactly 0, or a loss that moves by at most 1e-6 of itself, while the learning rate is above 0. A
    #: checkpoint saved during such a streak is not healthy: ``rewind`` goes back to, and errors name, the newest
    #: healthy one. null turns collapse detection off.
    collapse_steps: int | None = 5
    #: Bad steps ``skip_step`` / ``rewind`` recover from in one run before the run stops as ``stop`` would.
    max_recoveries: int = 3


#: Values of :attr:`TrainingConfig.loss_normalization`.
LOSS_NORMALIZATIONS: tuple[str, ...] = ("micro_batch", "global_tokens")


#: ``checkpoint.resume`` values that scan the checkpoint directory for the newest checkpoint that verifies (besides
#: ``never``, any other value is the path of a checkpoint).
AUTO_RESUMES = ("auto", "restart")


@dataclass
class DPOConfig:
    """Preference optimisation (``training.phase: dpo``): the DPO family of losses on chosen/rejected pairs
    (:mod:`loongforge.train.preference`; docs/post-training.md). Read only in that phase: set with another, it is
    an error."""

    #: ``sigmoid`` (DPO; with ``label_smoothing``: conservative DPO), ``ipo``, ``hinge`` (SLiC) or ``simpo``
    #: (SimPO: no reference model, length-normalised log-probs, target margin ``gamma``).
    loss_type: Literal["sigmoid", "ipo", "hinge", "simpo"] = "sigmoid"
    #: Inverse temperature: how far the policy may move from the reference (larger: closer). SimPO's papers use 2-10.
    beta: float = 0.1
    #: ``sigmoid``/``simpo`` only: the share of pairs assumed to be labelled the wrong way round (cDPO), in [0, 0.5).
    label_smoothing: float = 0.0
    #: ``simpo`` only: the target reward margin (TRL's ``simpo_gamma``).
    gamma: float = 0.5
    #: Compare mean instead of summed log-probs over each response's tokens; null: true for ``ipo`` and ``simpo``
    #: (as TRL computes them), false for ``sigmoid`` and ``hinge``.
    length_normalization: bool | None = None
    #: Where the reference log-probs come from: ``frozen_copy`` (a frozen copy of the starting weights, kept beside
    #: the policy with its layout), ``adapters_off`` (``model.lora`` only: the policy itself with its adapters off,
    #: which is the starting model -- no second copy), ``none`` (reference-free: a zero reference; what ``simpo``
    #: uses) or ``auto``: ``none`` for ``simpo``, ``adapters_off`` under ``model.lora``, else ``frozen_copy``.
    reference: Literal["auto", "frozen_copy", "adapters_off", "none"] = "auto"
    #: Compute the reference log-probs of every training and validation pair once, before the first step (then
    #: the frozen copy is dropped and no step runs a reference forward); recomputed the same way on resume.
    precompute_reference: bool = False


@dataclass
class GRPOConfig:
    """Reinforcement learning with verifiable rewards (``training.phase: grpo``): group relative policy optimisation
    on prompts whose replies a reward checks (:mod:`loongforge.train.rl`; docs/post-training.md). Read only in that
    phase: set with another, it is an error. ``training.micro_batch_size`` and ``global_batch_size`` count prompts;
    each is sampled ``group_size`` times."""

    #: Replies sampled per prompt; their rewards are compared within the group (>= 2).
    group_size: int = 8
    #: Longest reply in tokens (a reply also ends at the tokenizer's end-of-text, or where its row of
    #: ``data.seq_length`` tokens is full).
    max_new_tokens: int = 32
    #: How replies are sampled: ``exact`` (drafted by the KV-cache generator, every token verified by a forward of
    #: the whole batch the trainer runs, so each sampled token and its log-prob are the trainer's bit for bit) or
    #: ``kv_cache`` (the KV-cache generator unverified, as an external engine: log-probs off in the last bits;
    #: ``rl/logprob_diff_max`` shows by how much).
    rollout: Literal["exact", "kv_cache"] = "exact"
    #: The reward every prompt's replies are scored with (a registered name -- ``loongforge list rewards`` -- or
    #: ``pkg.module:function``); null: each prompt line's own ``reward``.
    reward: str | None = None
    #: Lower and upper clip of the importance ratio (PPO's epsilon; a larger upper clip is DAPO's clip-higher).
    clip_low: float = 0.2
    clip_high: float = 0.2
    #: Weight of the per-token KL penalty to the reference model (the k3 estimator); 0: no reference model.
    kl_coeff: float = 0.0
    #: The reference of the KL term: ``frozen_copy`` of the starting weights, ``adapters_off`` (``model.lora``: the
    #: policy with its adapters off, no second copy) or ``auto`` (``adapters_off`` under LoRA, else a frozen copy).
    reference: Literal["auto", "frozen_copy", "adapters_off"] = "auto"
    #: How token losses become the step's loss: ``token_mean`` (every reply token of the step weighs the same; DAPO),
    #: ``sequence_mean`` (each reply's token mean, then the mean over replies; the GRPO paper) or
    #: ``sequence_sum_norm`` (token sums over replies x max_new_tokens; Dr. GRPO).
    loss_aggregation: Literal["token_mean", "sequence_mean", "sequence_sum_norm"] = "token_mean"
    #: Divide each group's centred rewards by their standard deviation (GRPO); false: centred only (Dr. GRPO).
    scale_advantages: bool = True
    #: Optimizer updates per step on the step's replies (mini-batches of its prompts); past the first, the policy
    #: has moved off the one that sampled and the clipped ratio does its work.
    updates_per_step: int = 1
    #: Truncated importance sampling: each token's loss is weighted by min(pi_old / pi_rollout, cap), which is 1
    #: wherever the rollout engine computed what the trainer computes (the built-in one, exactly).
    rollout_correction_cap: float = 2.0
    #: MoE: the experts each token was routed to while its reply was sampled are reused in every training forward
    #: of the step (routing replay), so a policy update cannot move a token to other experts mid-step.
    routing_replay: bool = False
    #: Sampled replies written to the trackers (a table) and ``rollouts.jsonl`` at each logging interval.
    log_samples: int = 4


@dataclass
class CheckpointConfig:
    """When and where checkpoints are saved, and whether a run resumes."""

    #: Directory for checkpoints; defaults to ``<run.output_dir>/checkpoints``.
    dir: str | None = None
    #: Save every N steps (0: only at the end).
    interval: int = 0
    #: Keep the newest N verified checkpoints (older ones are deleted after a successful save; one that fails
    #: verification is renamed step-N.corrupt, left in place and never counted). 0 keeps every checkpoint.
    keep_last: int = 2
    #: ``auto`` resumes from the newest valid checkpoint in ``dir`` if one exists (none: starts at step 0), and
    #: refuses to start (one line naming each) when ``dir`` holds checkpoints but none verifies; ``restart`` is
    #: ``auto`` that then starts again from step 0 (the rejected ones stay as ``step-N.corrupt``); ``never`` starts
    #: fresh; a path resumes from that checkpoint.
    resume: str = "auto"
    save_at_end: bool = True
    #: A resumed run compares the checkpoint's optimizer and schedule settings (lr, min_lr, warmup, decay, weight
    #: decay, betas, eps, clipping, global batch size) with this config and refuses a difference in one line
    #: listing the keys; ``true`` accepts the new values instead: the schedule is rebuilt from this config and
    #: continues at the resumed step.
    override_schedule: bool = False
    #: Write checkpoints in the background: the step that saves only copies the state to host memory, training
    #: goes on while the files are written and hashed, and the checkpoint becomes visible (``latest``) when they
    #: are complete. The files are byte-identical to a synchronous save.
    async_save: bool = False
    #: How a checkpoint is verified against its manifest when it is loaded: ``full`` hashes every file,
    #: ``sampled`` checks every file's size and hashes a sample of its blocks, ``none`` checks sizes only
    #: (for checkpoints too large to hash at every resume; corruption inside a file then goes unnoticed).
    verify: Literal["full", "sampled", "none"] = "full"
    #: On SIGTERM or SIGUSR1 (Slurm's pre-termination signal) save a checkpoint at the next step boundary and
    #: exit with status 3 (one rank's signal is enough: all ranks save that step); false leaves the signals'
    #: default actions.
    save_on_signal: bool = True
    #: Also write each checkpoint in Hugging Face format (``<checkpoint>/hf``: safetensors + config.json).
    save_hf: bool = False


@dataclass
class DistributedConfig:
    """How long the processes of a multi-process run wait for each other before the run is ended as hung."""

    #: Seconds every process group's collectives may wait (the default group's, megatron's and every group made
    #: later), and the deadline of the hang watchdog: a rank that finishes no step for this long looks up which rank
    #: stopped (each rank's heartbeat in the rendezvous store), names it in one line and exits with status
    #: :data:`~loongforge.parallel.distributed.HUNG_EXIT_STATUS`, so that ``--max-restarts``, Slurm and Kubernetes
    #: restart the job from its newest checkpoint. Must exceed the longest step, save or evaluation (and a resume's
    #: verification of the checkpoint, which the other ranks wait for). ``loongforge train --dist-timeout S`` sets it.
    timeout_s: int = 1800


@dataclass
class EvaluationConfig:
    """Validation during training: the loss on held-out data, logged beside the training metrics
    (:mod:`loongforge.train.loop`)."""

    #: Evaluate every N optimizer steps and after step ``training.steps``; 0 turns evaluation off. The numbers join
    #: that step's row in metrics.jsonl as ``val_loss`` (language models also ``val_ppl``, its exponential) and go
    #: to TensorBoard as ``val/loss`` (``val/ppl``) at that step.
    interval: int = 0
    #: Global batches (``training.global_batch_size`` samples each) per evaluation: the first N of the validation
    #: samples, in order, the same every time, so that evaluations are comparable across steps, layouts and resumed
    #: runs (fewer when the validation samples hold fewer; at least one global batch must fit).
    steps: int = 4
    #: Where the validation samples come from. Language models: empty takes the held-out split
    #: (``data.valid_fraction``, which must then be > 0); paths are read by the same dataset kind, tokenizer and
    #: ``data.seq_length`` as ``data.paths``. Task models read them in their own format (a Wan run: one written
    #: dataset or latent cache; a policy: one LeRobotDataset root); empty takes the task's held-out split.
    data: list[str] = field(default_factory=list)
    #: lm-evaluation-harness tasks scored on the weights at every evaluation (pretraining and SFT of a language model
    #: at pp=1, cp=1; ``pip install 'loongforge-core[eval]'``): task YAML paths or names lm-eval knows, as
    #: ``loongforge eval --tasks`` takes them. Each metric joins the row as ``val_<task>/<metric>`` (``val/...`` in
    #: the trackers), equal to ``loongforge eval`` of a checkpoint saved at that step.
    tasks: list[str] = field(default_factory=list)
    #: Documents per task at each evaluation (the first N; 0 = all).
    tasks_limit: int = 0


@dataclass
class LoggingConfig:
    """Progress display and metrics sinks."""

    #: Log metrics every N steps.
    interval: int = 10
    #: Experiment trackers that get the interval-averaged scalars, the resolved config (as hyper-parameters) and a
    #: run's pictures, on rank 0: any of ``tensorboard`` (``<output_dir>/tensorboard``), ``wandb``
    #: (``<output_dir>/wandb``), ``mlflow`` (``mlflow_uri``) and ``csv`` (``<output_dir>/metrics.csv``, one row per
    #: logging step). wandb and mlflow are optional extras: ``pip install 'loongforge-core[wandb]'`` / ``[mlflow]``.
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    #: ``false`` drops ``tensorboard`` from ``trackers`` (the switch older configs use); ``true`` changes nothing.
    tensorboard: bool = True
    #: The W&B project runs are logged to.
    wandb_project: str = "loongforge"
    #: W&B's mode: ``offline`` (the default: files only, ``wandb sync <output_dir>/wandb/offline-run-*`` uploads
    #: them later) or ``online`` (needs a login and the network).
    wandb_mode: Literal["offline", "online"] = "offline"
    #: MLflow tracking URI; null: a file store in the run, ``file:<output_dir>/mlruns`` (``mlflow ui
    #: --backend-store-uri`` that folder shows it). A server (``http://...``) needs the network.
    mlflow_uri: str | None = None
    #: The MLflow experiment runs are logged under.
    mlflow_experiment: str = "loongforge"
    jsonl: bool = True
    #: Show a live progress bar (disabled automatically when stdout is not a terminal).
    progress: bool = True


@dataclass
class LoongForgeConfig:
    """A whole run. Each section maps to a YAML top-level key of the same name."""

    run: RunConfig = field(default_factory=RunConfig)
    #: Device backend name or ``auto`` (``loongforge list devices``); ``--device`` and LOONGFORGE_DEVICE win.
    device: str = "auto"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    #: Preference optimisation options (``training.phase: dpo``).
    dpo: DPOConfig = field(default_factory=DPOConfig)
    #: Reinforcement learning options (``training.phase: grpo``).
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    #: The three sections below belong to plugins: kept here as the mappings the YAML gave, each is typed by a
    #: dataclass its plugin declares and checked before a run like core's sections
    #: (:mod:`loongforge.config.plugin_sections`).
    #: The device backend's own switches (e.g. on cuda: ``fp8_recipe``, ``cuda_graphs``, ``tp_comm_overlap``),
    #: passed to ``DeviceBackend.megatron_settings``; typed by the backend's ``options_type``.
    device_options: dict[str, Any] = field(default_factory=dict)
    #: Optimizations to switch on by registered name, each with its settings (typed by its ``options_type``).
    optimizations: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    #: Options of a task model (diffusion DiT, VLA policy), typed by the model family's ``task_options``.
    task: dict[str, Any] = field(default_factory=dict)
    #: Where this config was read from (set by the loader, used in error messages).
    source: str = field(default="<defaults>", metadata={INTERNAL: True})
    #: Whether this config's ``pkg.module:attr`` names may import: false for a checkpoint's recorded config that the
    #: user did not trust (:func:`loongforge.config.loader.load_checkpoint_config`), whose import paths are refused.
    code_trusted: bool = field(default=True, metadata={INTERNAL: True})
