"""The training loop: megatron's forward/backward schedule, the optimizer step, metrics and checkpoints.

Kept short on purpose (cf. nanoGPT): everything is built by :mod:`loongforge.train.run`; this class only
steps. The hot path does what a plain PyTorch loop does plus megatron's gradient finalisation: one
``.item()`` for the loss per step (the optimizer's grad-norm already synchronises), no per-step file I/O
(metrics are flushed every ``logging.interval`` steps) and collectives only when a group has > 1 rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from loongforge.checkpoint.saver import unwrap_model
from loongforge.config.schema import LoongForgeConfig
from loongforge.parallel import context
from loongforge.parallel.chunk_feeds import chunk_feeds
from loongforge.train.metrics import MetricsWriter
from loongforge.train.moe_stats import MoEStats
from loongforge.train.progress import ProgressDisplay

#: Values of ``training.loss_normalization`` (see :class:`loongforge.config.schema.TrainingConfig`).
LOSS_NORMALIZATIONS = ("micro_batch", "global_tokens")


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


class Trainer:
    """Owns the built run (model chunks, optimizer, scheduler, batches) and steps it to ``training.steps``.

    Attributes plugins may read in lifecycle hooks: ``config``, ``model`` (list of chunks), ``optimizer``,
    ``scheduler``, ``data`` (the batch iterator), ``backend``, ``step`` (completed steps), ``output_dir``,
    ``last_checkpoint``. Plugins may set ``should_stop`` to end training after the current step, and add numbers to
    ``step_metrics`` during a step to have them recorded with it. For MoE models,
    ``expert_tokens`` holds the last step's tokens routed to each expert, ``[layer][expert]`` over all ranks (see
    :mod:`loongforge.train.moe_stats`), and step metrics carry ``moe_aux_loss``.
    """

    def __init__(
        self,
        *,
        config: LoongForgeConfig,
        host: Any,
        backend: Any,
        model: list[Any],
        optimizer: Any,
        scheduler: Any,
        data: Any,
        num_microbatches: int,
        global_batch_size: int,
        save_checkpoint: Callable[[Trainer], Path],
        start_step: int = 0,
    ) -> None:
        self.config = config
        self.host = host
        self.backend = backend
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.data = data
        self.num_microbatches = num_microbatches
        self.global_batch_size = global_batch_size
        self.step = start_step
        self.output_dir = Path(config.run.output_dir)
        self.last_checkpoint: Path | None = None
        #: Set by a plugin (e.g. in ``on_step_end``) to end training after the current step.
        self.should_stop = False
        #: Numbers plugins add while a step runs (e.g. from the data-balancing hook), recorded with that step's
        #: metrics; emptied when the next step starts.
        self.step_metrics: dict[str, Any] = {}
        self._save = save_checkpoint
        self._forward_backward = get_forward_backward_func()
        self._tokens_per_step = global_batch_size * config.data.seq_length
        self._dp_group = parallel_state.get_data_parallel_group()
        self._dp_size = parallel_state.get_data_parallel_world_size()
        self._pp_group = parallel_state.get_pipeline_model_parallel_group()
        self._pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        self._last_stage = parallel_state.is_pipeline_last_stage()
        self._cp_group = parallel_state.get_context_parallel_group()
        self._cp_size = parallel_state.get_context_parallel_world_size()
        self._cp_rank = parallel_state.get_context_parallel_rank()
        self._per_token = config.training.loss_normalization == "global_tokens"
        # The token count is all-reduced over data- and context-parallel ranks together (finalize_model_grads does).
        self._token_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self._token_group_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        model_config = model[0].config
        self._moe = MoEStats(model, model_config) if getattr(model_config, "num_moe_experts", None) else None
        #: MoE: tokens per expert in the last step, ``[layer][expert]`` (None for dense models).
        self.expert_tokens: list[list[int]] | None = None
        #: Batch keys the model takes beside the text, as it declares them (``extra_inputs``: a VLM's pixels).
        self._extra_inputs: tuple[str, ...] = getattr(unwrap_model(model[0]), "extra_inputs", ())
        # The interleaved schedule wants one iterator per model chunk, all yielding the same micro-batches.
        self._data_iterator = chunk_feeds(data, len(model)) if len(model) > 1 else data

    # -- one step --------------------------------------------------------------------------------

    def _forward_step(self, data_iterator: Any, model: Any) -> tuple[torch.Tensor, Callable]:
        batch = next(data_iterator)
        if self._cp_size > 1:  # this rank's chunks of every sequence
            batch = context.split_for_rank(batch, self._cp_rank, self._cp_size)
        if self._per_token:  # local sums and counts; megatron normalises by the global count
            loss_func = partial(_token_sum_loss, batch["loss_mask"])
        elif self._cp_size > 1:  # the loss is the mean over all cp ranks' tokens
            loss_func = partial(context.global_mean_loss, self._cp_group, batch["loss_mask"])
        else:
            loss_func = partial(_masked_mean_loss, batch["loss_mask"])
        extra = {key: batch[key] for key in self._extra_inputs if key in batch}  # images, grids (VLMs)
        per_token_loss = model(
            batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"], **extra
        )
        return per_token_loss, loss_func

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

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over ``num_microbatches`` micro-batches; returns its metrics."""
        start = time.perf_counter()
        self.step_metrics = {}
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        reduced = self._forward_backward(
            forward_step_func=self._forward_step,
            data_iterator=self._data_iterator,
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=self.num_microbatches,
            seq_length=self.config.data.seq_length,
            micro_batch_size=self.config.training.micro_batch_size,
            forward_only=False,
        )
        lr = self.optimizer.param_groups[0]["lr"]
        update_successful, grad_norm, _ = self.optimizer.step()
        if update_successful:
            self.scheduler.step(increment=self.global_batch_size)
        loss = self._reduce_loss(reduced)
        extra: dict[str, Any] = {}
        if self._moe is not None:
            aux, self.expert_tokens = self._moe.collect(self.num_microbatches)
            if aux is not None:
                extra["moe_aux_loss"] = aux
        step_time = time.perf_counter() - start
        return {
            **extra,
            **self.step_metrics,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": self._tokens_per_step / step_time,
            "step_time": step_time,
            "skipped": not update_successful,
        }

    # -- the loop --------------------------------------------------------------------------------

    def fit(self, metrics: MetricsWriter, progress: ProgressDisplay) -> dict[str, Any]:
        """Step until ``training.steps`` (or a plugin sets ``should_stop``), logging, checkpointing and calling
        lifecycle hooks; return a summary."""
        total = self.config.training.steps
        log_interval = max(1, self.config.logging.interval)
        ckpt_interval = self.config.checkpoint.interval
        start_step = self.step
        history: list[dict[str, Any]] = []
        self.host.on_train_start(trainer=self)
        try:
            while self.step < total and not self.should_stop:
                step_metrics = self.train_step()
                self.step += 1
                history.append(step_metrics)
                logged = self.step % log_interval == 0 or self.step == total
                metrics.record(self.step, step_metrics)
                if logged:
                    metrics.log(self.step, step_metrics)
                progress.update(self.step, step_metrics, logged=logged)
                self.host.on_step_end(trainer=self, step=self.step, metrics=step_metrics)
                if ckpt_interval and self.step % ckpt_interval == 0:
                    self.last_checkpoint = self._save(self)
                    progress.message(f"saved checkpoint {self.last_checkpoint}")
            if (
                self.config.checkpoint.save_at_end
                and self.step > start_step
                and (not ckpt_interval or self.step % ckpt_interval)
            ):
                self.last_checkpoint = self._save(self)
        finally:
            progress.close()
        summary = self._summary(history, start_step)
        self.host.on_train_end(trainer=self, metrics=summary)
        return summary

    def _summary(self, history: list[dict[str, Any]], start_step: int) -> dict[str, Any]:
        # The first step of a process includes one-off work (allocations, lazy init): leave it out of throughput.
        timed = history[1:] or history
        seconds = sum(m["step_time"] for m in timed)
        return {
            "steps": self.step,
            "steps_this_run": self.step - start_step,
            "first_loss": history[0]["loss"] if history else None,
            "final_loss": history[-1]["loss"] if history else None,
            "tokens_per_s": len(timed) * self._tokens_per_step / seconds if seconds else 0.0,
            "checkpoint_dir": str(self.last_checkpoint) if self.last_checkpoint else None,
        }
