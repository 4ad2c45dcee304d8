"""The megatron step engine: megatron-core's forward/backward schedule, gradient finalisation and optimizer step.

The hot path does what a plain PyTorch loop does plus megatron's gradient finalisation: one ``.item()`` for the
loss per step (the optimizer's grad-norm already synchronises), no file I/O and collectives only when a group has
> 1 rank. Everything is built by :mod:`loongforge.train.run`; this class only steps, checkpoints and samples.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from loongforge.checkpoint.saver import unwrap_model
from loongforge.config.schema import LoongForgeConfig
from loongforge.errors import ConfigError
from loongforge.parallel import context, sequence_pieces
from loongforge.parallel.chunk_feeds import chunk_feeds
from loongforge.parallel.packed_rows import CU_SEQLENS, attend_packed
from loongforge.parallel.sequence_chunks import SequenceChunk, chunk_mean_loss, chunk_passes, discard_output
from loongforge.train.activation_memory import FirstStepActivations
from loongforge.train.compile import CompileReport, compile_blocks
from loongforge.train.engines.base import StepEngine, StepResult
from loongforge.train.moe_stats import MoEStats
from loongforge.train.mtp_stats import collect_mtp_loss, discard_mtp_loss
from loongforge.train.optim import fuse_cpu_adamw

if TYPE_CHECKING:
    from loongforge.train.activation_offload import ActivationOffload
    from loongforge.train.batches import ValidationSet
    from loongforge.train.checkpointing import RunCheckpoints
    from loongforge.train.health import StepHealth
    from loongforge.train.trainer import Trainer

logger = logging.getLogger(__name__)

#: ``math.exp`` overflows above this; a larger validation loss has an infinite perplexity.
_LARGEST_EXP = 709.0


def _compile_targets(chunks: list[Any]) -> tuple[list[Any], list[Any]]:
    """``training.compile``'s modules in megatron's model chunks: every transformer layer (the blocks), and the
    modules around the decoder stacks (embedding, final norm, output layer: what ``true`` adds)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_layer import TransformerLayer

    modules = [module for chunk in chunks for module in chunk.modules()]
    layers = [module for module in modules if isinstance(module, TransformerLayer)]
    rest = []
    for model in (module for module in modules if isinstance(module, GPTModel)):
        if model.pre_process:
            rest.append(model.embedding)
        if model.post_process:  # the final norm is megatron's None where the stage has none
            rest += [part for part in (model.decoder.final_layernorm, model.output_layer) if part is not None]
    return layers, rest


def _foreign_attention(chunks: list[Any]) -> str | None:
    """The class name of the first core attention in ``chunks`` that is not core's local attention (SDPAttention),
    which alone reads core's ``packed_seq_params`` layouts; None when every one is."""
    from megatron.core.transformer.attention import Attention

    from loongforge.devices.sdpa_attention import SDPAttention

    for module in (m for chunk in chunks for m in chunk.modules() if isinstance(m, Attention)):
        if not isinstance(module.core_attention, SDPAttention):
            return type(module.core_attention).__name__
    return None


def _check_local_attention(chunks: list[Any], setting: str, way_out: str) -> None:
    """Packed rows under context parallelism and chunks of a sequence (``parallel.seq_chunks``) reach attention as
    ``packed_seq_params`` (:class:`~loongforge.parallel.sequence_pieces.SequencePieces`,
    :class:`~loongforge.parallel.sequence_chunks.SequenceChunk`), which core's local attention reads; another
    (Transformer Engine's) would attend within the wrong tokens, so it is refused in one line naming ``setting``."""
    if (foreign := _foreign_attention(chunks)) is not None:
        raise ConfigError(f"{setting} runs on core's local attention (SDPAttention), not {foreign}; {way_out}")


def _packed_rows_varlen(chunks: list[Any]) -> bool:
    """Whether packed rows (``data.pack``, cp = 1) are attended sequence by sequence (varlen,
    :mod:`loongforge.parallel.packed_rows`): when core's local attention runs every layer. Other attention (Transformer
    Engine's, a plugin's own) gets the dense block-diagonal mask, which gives the same numbers but
    costs ``seq_length**2`` per row; that is logged once."""
    if (foreign := _foreign_attention(chunks)) is None:
        return True
    logger.info("data.pack: %s does not take packed_seq_params; packed rows are attended through a dense "
                "block-diagonal mask (seq_length^2 per row)", foreign)
    return False


def _masked_mean_loss(loss_mask: torch.Tensor, per_token_loss: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Mean cross-entropy over the tokens ``loss_mask`` selects.

    The reported copy is cloned: megatron divides the returned loss by the micro-batch count *in place*.
    """
    mask = loss_mask.reshape(-1)
    loss = torch.sum(per_token_loss.float().reshape(-1) * mask) / mask.sum().clamp(min=1)
    return loss, {"loss": loss.detach().clone()}


def _token_sum_loss(loss_mask: torch.Tensor, per_token_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Summed cross-entropy over the tokens ``loss_mask`` selects, and how many they are (megatron's per-token loss).

    With ``calculate_per_token_loss`` the schedule adds up the counts of all micro-batches and
    ``finalize_model_grads`` all-reduces them over the data-parallel (and context-parallel) ranks and divides the
    summed gradients by the total, so every target token of the global batch weighs the same wherever it is trained.
    The report is ``[sum, count]``, summed over micro-batches and ranks before dividing.
    """
    mask = loss_mask.reshape(-1)
    total = torch.sum(per_token_loss.float().reshape(-1) * mask)
    count = mask.sum()
    return total, count.to(torch.int), {"loss": torch.stack([total.detach(), count.detach().float()]).double()}


class MegatronEngine(StepEngine):
    """Model chunks (megatron DDP), megatron's optimizer and the batch iterator, stepped by the schedule.

    ``extra_inputs`` are the batch keys the model's forward takes beside the text (a VLM's pixels); ``sample``
    writes the after-training text sample (``None`` when there is none); ``validation`` is what :meth:`evaluate`
    reads (``None`` while ``evaluation.interval`` is 0); ``flops_per_step`` is the model's FLOP count of one step
    (:func:`~loongforge.train.throughput.model_flops_per_step`); ``score_tasks(chunk)``, when given
    (``evaluation.tasks``), adds lm-eval's scores of the model to each evaluation; ``offload``, when given
    (``training.offload_activations``), is installed on the model's layers and adds its figures to each step's.
    """

    name: ClassVar[str] = "megatron"

    def __init__(self, *, config: LoongForgeConfig, model: list[Any], optimizer: Any, data: Any,
                 num_microbatches: int, global_batch_size: int, checkpoints: RunCheckpoints,
                 extra_inputs: tuple[str, ...], sample: Callable[[Any], str | None],
                 validation: ValidationSet | None = None, flops_per_step: float | None = None,
                 score_tasks: Callable[[Any], dict[str, float]] | None = None,
                 offload: ActivationOffload | None = None) -> None:
        self.config = config
        self.model = model
        self.optimizer = optimizer
        self.data = data
        self.num_microbatches = num_microbatches
        self.samples_per_step = global_batch_size
        self.tokens_per_step = global_batch_size * config.data.seq_length
        self.flops_per_step = flops_per_step
        self._checkpoints = checkpoints
        self._sample = sample
        self._extra_inputs = extra_inputs
        self._validation = validation
        self._score_tasks = score_tasks
        self.offload = offload
        self._forward_backward = get_forward_backward_func()
        self._dp_group = parallel_state.get_data_parallel_group()
        self._dp_rank = parallel_state.get_data_parallel_rank()
        self._dp_size = parallel_state.get_data_parallel_world_size()
        self._pp_group = parallel_state.get_pipeline_model_parallel_group()
        self._pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        self._last_stage = parallel_state.is_pipeline_last_stage()
        self._cp_group = parallel_state.get_context_parallel_group()
        self._cp_size = parallel_state.get_context_parallel_world_size()
        self._cp_rank = parallel_state.get_context_parallel_rank()
        self._world_size = dist.get_world_size()
        #: Packed micro-batches of this step that dynamic CP dealt whole (``parallel.dynamic_cp_threshold``).
        self._whole_micro_batches = 0
        self._per_token = config.training.loss_normalization == "global_tokens"
        # The token count is all-reduced over data- and context-parallel ranks together (finalize_model_grads does).
        self._token_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self._token_group_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        model_config = model[0].config
        self._moe = MoEStats(model, model_config) if model_config.num_moe_experts else None
        #: Multi-token-prediction blocks (DecoderSpec.mtp_block_spec): their loss reads the loss mask too.
        self._mtp_blocks = getattr(model_config, "mtp_num_layers", None) or 0
        #: Packed rows at cp = 1 go to attention as their sequence boundaries (varlen), else as a dense mask.
        self._varlen = bool(config.data.pack) and self._cp_size == 1 and _packed_rows_varlen(model)
        if config.data.pack and self._cp_size > 1:
            _check_local_attention(model, "data.pack with parallel.cp > 1", "set data.pack: false or parallel.cp: 1")
            # Rows re-laid per sequence vary in length between micro-batches: pipeline stages send each other the
            # shape before the activations (megatron's variable_seq_lengths; its interleaved schedule hung doing so
            # at pp=2 on gloo, so check_pack refuses vpp here).
            model_config.variable_seq_lengths = self._pp_size > 1
        #: ``parallel.seq_chunks``: chunks per sequence of the chunked pipeline (1: off).
        self._seq_chunks = config.parallel.seq_chunks
        if self._seq_chunks > 1:
            _check_local_attention(model, "parallel.seq_chunks", "set parallel.seq_chunks: 1")
            if extra_inputs:
                raise ConfigError(f"parallel.seq_chunks cuts text rows only; this model also reads {list(extra_inputs)}"
                                  "; set parallel.seq_chunks: 1")
        # The interleaved schedule wants one iterator per model chunk, all yielding the same micro-batches.
        self._data_iterator = self._feed(data)
        layers, around = _compile_targets(model)
        self.compiled: CompileReport = compile_blocks(layers, config.training.compile, rest=around)
        # One micro-batch's activations by component, counted in the first step; not under training.compile, where
        # the counting hooks would be part of what dynamo guards on and the blocks would compile again. Nor with
        # offload, whose hooks inside the layers hide their saved tensors from the count (it reports its own).
        self._activations = FirstStepActivations(
            None if self.compiled.enabled or offload else [unwrap_model(chunk) for chunk in model])

    # -- one step --------------------------------------------------------------------------------

    def _forward_step(self, data_iterator: Any, model: Any) -> tuple[torch.Tensor, Callable]:
        return self._forward(next(data_iterator), model, token_sums=self._per_token)

    def _validation_step(self, data_iterator: Any, model: Any) -> tuple[torch.Tensor, Callable]:
        return self._forward(next(data_iterator), model, token_sums=True)

    def _forward(self, batch: dict[str, Any], model: Any, *, token_sums: bool) -> tuple[torch.Tensor, Callable]:
        """The per-token loss of one micro-batch and the loss function the schedule applies to it
        (:meth:`_loss_func`)."""
        if self._cp_size > 1 and self.config.data.pack:  # this rank's pieces of every packed sequence
            batch = sequence_pieces.split_packed_for_rank(batch, self._cp_rank, self._cp_size,
                                                          self.config.parallel.dynamic_cp_threshold)
            self._whole_micro_batches += model.training and not batch["packed_seq_params"].split
        elif self._cp_size > 1:  # this rank's chunks of every sequence
            batch = context.split_for_rank(batch, self._cp_rank, self._cp_size)
        elif self.config.data.pack and CU_SEQLENS in batch:  # each packed sequence attended on its own
            batch = attend_packed(batch, varlen=self._varlen)
        return self._per_token_loss(batch, model), self._loss_func(batch, token_sums=token_sums)

    def _loss_func(self, batch: dict[str, Any], *, token_sums: bool) -> Callable:
        """What turns one micro-batch's per-token loss into the loss the schedule backpropagates and the numbers it
        reports (``token_sums``: summed with the token count, which :meth:`_reduce_token_loss` divides by over all
        micro-batches and ranks)."""
        if token_sums:  # local sums and counts; megatron normalises by the global count
            return partial(_token_sum_loss, batch["loss_mask"])
        if isinstance(chunk := batch.get("packed_seq_params"), SequenceChunk):  # over the whole micro-batch's tokens
            return partial(chunk_mean_loss, chunk, batch["loss_mask"])
        if self._cp_size > 1:  # the loss is the mean over all cp ranks' tokens
            return partial(context.global_mean_loss, self._cp_group, batch["loss_mask"])
        return partial(_masked_mean_loss, batch["loss_mask"])

    def _per_token_loss(self, batch: dict[str, Any], model: Any) -> torch.Tensor:
        """``model``'s cross-entropy of every label of ``batch`` (``[rows, seq]``; a tensor-parallel model computes
        it with megatron's vocab-parallel cross-entropy); the input of the next stage on earlier pipeline stages."""
        extra = {key: batch[key] for key in self._extra_inputs if key in batch}  # images, grids (VLMs)
        if self._mtp_blocks:
            extra["loss_mask"] = batch["loss_mask"]
        if "packed_seq_params" in batch:
            extra["packed_seq_params"] = batch["packed_seq_params"]
        return model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"],
                     **extra)

    def _schedule(self, step_func: Callable, feed: Any, num_microbatches: int, *, forward_only: bool,
                  model: list[Any] | None = None, seq_length: int | None = None) -> list[dict]:
        """megatron's forward(-backward) schedule of ``step_func`` over ``num_microbatches`` micro-batches of
        ``feed`` (``seq_length`` tokens long, by default ``data.seq_length``) through ``model`` (the policy's chunks
        by default); what the last stage's loss functions reported."""
        chunks = self.model if model is None else model
        return self._forward_backward(
            forward_step_func=step_func,
            data_iterator=feed,
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=num_microbatches,
            seq_length=seq_length or self.config.data.seq_length,
            micro_batch_size=self.rows_per_micro_batch,
            forward_only=forward_only,
        )

    def _forward_pass(self, step_func: Callable, micro_batches: list[dict[str, Any]],
                      chunks: list[Any] | None = None) -> list[dict]:
        """A forward-only pass of the schedule (:meth:`_forward_only`) of ``step_func`` over ``micro_batches``
        through ``chunks`` (the policy's by default): a reference model's or a recomputation's scores."""
        chunks = self.model if chunks is None else chunks
        with self._forward_only(chunks):
            return self._schedule(step_func, self._feed(iter(micro_batches)), len(micro_batches), forward_only=True,
                                  model=chunks)

    @property
    def rows_per_micro_batch(self) -> int:
        """Sequences in one micro-batch, the shape pipeline stages exchange: ``training.micro_batch_size``."""
        return self.config.training.micro_batch_size

    def _train_feed(self) -> Any:
        """Where this step's micro-batches come from: the run's iterator (one feed per chunk when interleaved)."""
        return self._data_iterator

    def _step_numbers(self, reduced: list[dict]) -> tuple[float, dict[str, float]]:
        """The step's loss (known on every rank) and what else it reports from the loss functions' outputs."""
        return self._reduce_loss(reduced), {}

    @contextlib.contextmanager
    def _forward_only(self, chunks: list[Any] | None = None) -> Iterator[None]:
        """A pass that only reads the model: eval mode, no gradient, and the MoE routers' and multi-token-prediction
        blocks' counts of it discarded (they belong to the next training step); modes restored afterwards."""
        chunks = self.model if chunks is None else chunks
        modes = [chunk.training for chunk in chunks]
        for chunk in chunks:
            chunk.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            for chunk, mode in zip(chunks, modes, strict=True):
                chunk.train(mode)
        if self._moe is not None:
            self._moe.discard()
        if self._mtp_blocks:
            discard_mtp_loss()

    def _reduce_loss(self, reduced: list[dict]) -> float:
        """This step's loss averaged over microbatches and data-parallel ranks, known on every rank."""
        if self._per_token:
            return self._reduce_token_loss(reduced)
        if self._last_stage:
            loss = torch.stack([r["loss"] for r in reduced]).mean()
        else:
            loss = torch.zeros((), dtype=torch.float32)
        if self._dp_size > 1:
            dist.all_reduce(loss, group=self._dp_group)
            loss /= self._dp_size
        if self._pp_size > 1:  # only the last stage computed it; the others contributed zero
            dist.all_reduce(loss, group=self._pp_group)
        return loss.item()

    def _reduce_token_loss(self, reduced: list[dict]) -> float:
        """``global_tokens``: the summed token loss over the summed token count of every micro-batch and rank."""
        if self._last_stage:
            totals = torch.stack([r["loss"] for r in reduced]).sum(0)
        else:
            totals = torch.zeros(2, dtype=torch.float64)
        if self._token_group_size > 1:
            dist.all_reduce(totals, group=self._token_group)
        if self._pp_size > 1:
            dist.all_reduce(totals, group=self._pp_group)
        return (totals[0] / totals[1].clamp(min=1)).item()

    def _gradient_sum(self) -> float:
        """The sum of every gradient in the megatron-DDP buffers over all ranks: finite exactly when every gradient
        is (one pass over the buffers, one all-reduce of one number).

        Over all ranks because each holds part of the truth: a tensor-/pipeline-parallel shard of the weights and,
        with the distributed optimizer, the reduced gradients of its own slice only."""
        total = torch.stack([buffer.grad_data.sum(dtype=torch.float32) for chunk in self.model
                             for buffer in chunk.buffers + chunk.expert_parallel_buffers]).sum()
        if self._world_size > 1:
            dist.all_reduce(total)
        return total.item()

    @contextlib.contextmanager
    def _saving(self) -> Iterator[None]:
        """Around a training schedule: the first one's activation count, and the activation offload's passes."""
        with self._activations.step(), self.offload.passes() if self.offload else contextlib.nullcontext():
            yield

    def train_step(self, screen: StepHealth | None = None) -> StepResult:
        """One optimizer step over ``num_microbatches`` micro-batches; with a ``screen``, none when it finds the
        step bad (decided before ``optimizer.step()``, which would apply a NaN gradient)."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        feed = self._train_feed()
        with self._saving():
            if self._seq_chunks > 1:
                reduced = self._chunked_schedule(feed)
            else:
                reduced = self._schedule(self._forward_step, feed, self.num_microbatches, forward_only=False)
        loss, numbers = self._step_numbers(reduced)
        bad = screen.screen(loss, self._gradient_sum) if screen is not None else None
        if bad is not None:  # left out: weights, Adam's moments and step count stay as they are
            return StepResult(loss=loss, grad_norm=None, skipped=True, extra={**numbers, **self._step_extra()},
                              bad=bad)
        update_successful, grad_norm, _ = self.optimizer.step()
        return StepResult(loss=loss, grad_norm=grad_norm, skipped=not update_successful,
                          extra={**numbers, **self._step_extra()})

    def _chunked_schedule(self, feed: Any) -> list[dict]:
        """``parallel.seq_chunks``: the step's micro-batches cut into chunks, a forward-only recording pass over them
        in order, then megatron's forward-backward schedule over each micro-batch's chunks last first
        (:mod:`loongforge.parallel.sequence_chunks`); what the replay's loss functions reported."""
        recording, replay = chunk_passes([next(feed) for _ in range(self.num_microbatches)], self._seq_chunks)
        length = self.config.data.seq_length // self._seq_chunks
        with torch.no_grad():
            self._schedule(self._record_step, iter(recording), len(recording), forward_only=True, seq_length=length)
        return self._schedule(self._forward_step, iter(replay), len(replay), forward_only=False, seq_length=length)

    def _record_step(self, data_iterator: Any, model: Any) -> tuple[torch.Tensor, Callable]:
        """One chunk of the recording pass: its forward keeps the chunk's K/V; its output is not needed."""
        return self._per_token_loss(next(data_iterator), model), discard_output

    def evaluate(self) -> dict[str, float]:
        """The mean cross-entropy per target token (``loss_mask``) over every token of the validation batches, and
        its exponential, the perplexity (``ppl``).

        Per token over all of them, whatever ``training.loss_normalization`` says: the number then depends on the
        rows only, not on how they are split into micro-batches or ranks, and ``exp`` of it is the perplexity. One
        forward-only pass of megatron's schedule over all ``batches x num_microbatches`` micro-batches, so
        tensor-, pipeline-, context- and data-parallel layouts evaluate as they train; the sums are reduced over
        the data- and context-parallel ranks (and the pipeline, whose last stage computed them)."""
        count = self._validation.batches * self.num_microbatches
        feed = self._validation_feed()
        with self._forward_only():
            reduced = self._schedule(self._validation_step, feed, count, forward_only=True)
        numbers = self._validation_numbers(reduced)
        if self._score_tasks is not None:  # evaluation.tasks: lm-eval's scores of the same weights
            numbers.update(self._score_tasks(self.model[0]))
        return numbers

    def _validation_micro_batches(self) -> Iterator[dict[str, Any]]:
        """This rank's micro-batches of one evaluation, in order."""
        return self._validation.micro_batches(self.config.training.micro_batch_size, self.num_microbatches,
                                              dp_rank=self._dp_rank, dp_size=self._dp_size)

    def _validation_feed(self) -> Any:
        """:meth:`_validation_micro_batches` as the schedule takes them (one feed per chunk when interleaved)."""
        return self._feed(self._validation_micro_batches())

    def _feed(self, micro_batches: Iterator[dict[str, Any]]) -> Any:
        """Micro-batches as the schedule takes them: one iterator, or one per chunk of an interleaved pipeline."""
        return chunk_feeds(micro_batches, len(self.model)) if len(self.model) > 1 else micro_batches

    def _validation_numbers(self, reduced: list[dict]) -> dict[str, float]:
        """The validation loss per target token and its perplexity."""
        loss = self._reduce_token_loss(reduced)
        return {"loss": loss, "ppl": math.exp(loss) if loss < _LARGEST_EXP else math.inf}

    def _step_extra(self) -> dict[str, Any]:
        """The step's MoE numbers (the auxiliary loss for the metrics, tokens per expert for ``expert_tokens``), the
        multi-token-prediction loss (``mtp_loss``), the activation offload's figures (``offload_*``), the training
        micro-batches dynamic CP did not split (``cp_whole_micro_batches``, this data-parallel rank's) and, with
        fp16's loss scaler, the scale the step ran with (it halves at an overflow, whose step is skipped)."""
        extra: dict[str, Any] = {}
        if self.config.training.precision == "fp16":
            extra["loss_scale"] = float(self.optimizer.get_loss_scale())
        if self._moe is not None:
            aux, self.expert_tokens = self._moe.collect(self.num_microbatches)
            if aux is not None:
                extra["moe_aux_loss"] = aux
        if self._mtp_blocks:
            extra["mtp_loss"] = collect_mtp_loss(self._mtp_blocks, self.num_microbatches)
        if self.offload is not None:
            extra.update(self.offload.take_metrics())
        if self.config.parallel.dynamic_cp_threshold and self._cp_size > 1:
            extra["cp_whole_micro_batches"], self._whole_micro_batches = self._whole_micro_batches, 0
        return extra

    # -- checkpoints and the end of the run -----------------------------------------------------------

    def save(self, trainer: Trainer) -> Path | None:
        return self._checkpoints.save(trainer)

    def complete_save(self, trainer: Trainer, *, wait: bool) -> Path | None:
        return self._checkpoints.complete_save(wait=wait)

    def load(self, trainer: Trainer, path: Path) -> None:
        self._checkpoints.load(trainer, path)
        fuse_cpu_adamw(self.optimizer)  # a checkpoint's parameter groups name the kernel they were saved with

    def data_position(self) -> dict[str, Any]:
        return self.data.state_dict()

    def seek_data(self, position: dict[str, Any]) -> None:
        self.data.load_state_dict(position)

    def finish(self, trainer: Trainer) -> dict[str, Any]:
        """The text sample, what ``training.compile`` compiled and cost, and this rank's memory by component."""
        return {"sample": self._sample(self.model), **self.compiled.summary(),
                "memory_mib": self._memory_mib(trainer), "activation_mib": dict(self._activations.mib or {})}

    def _memory_mib(self, trainer: Trainer) -> dict[str, float]:
        """This rank's memory by component, in MiB: ``parameters`` (the model's, in their dtype), ``gradients``
        (megatron DDP's gradient buffers), ``optimizer_state`` (Adam's moments and step counts), ``main_params``
        (the optimizer's fp32 copies of half-precision weights; 0 in fp32, where it updates the weights
        themselves), ``activations`` (one micro-batch's saved activations, counted in the first step of an eager
        run; by component in the summary's ``activation_mib``) and ``peak`` (the device backend's
        ``peak_allocated``: the allocator's peak on an accelerator; the process's peak RSS on CPU, which also holds
        the libraries)."""

        def mib(tensors: Any) -> float:
            return round(sum(t.numel() * t.element_size() for t in tensors) / 2**20, 2)

        model_params = [p for chunk in self.model for p in chunk.parameters()]
        own = {p.data_ptr() for p in model_params}
        activations = self._activations.mib
        return {
            "parameters": mib(model_params),
            "gradients": mib(buffer.grad_data for chunk in self.model
                             for buffer in chunk.buffers + chunk.expert_parallel_buffers),
            "optimizer_state": mib(t for _, state in self.optimizer.state.items() for t in state.values()
                                   if torch.is_tensor(t)),
            "main_params": mib(p for group in self.optimizer.param_groups for p in group["params"]
                               if p.data_ptr() not in own),
            **({} if activations is None else {"activations": round(sum(activations.values()), 2)}),
            "peak": round(trainer.backend.memory_stats()["peak_allocated"] / 2**20, 2),
        }
