"""The training loop, once for every model: step cadence, lifecycle hooks, stopping, the learning-rate schedule,
metrics, progress, checkpoint cadence and the summary.

Kept short on purpose (cf. nanoGPT). What differs between a megatron decoder and a task model (a diffusion DiT, a
robot policy) is one optimizer step, saving and loading, and the parameter groups: the step engine's
(:mod:`loongforge.train.engines`). So a plugin sees the same hooks, metrics and TensorBoard tags, and a scheduler
section gives the same learning rates, whichever engine trains.

Per step the loop does no file I/O: every step's metrics are buffered as a JSONL line (the exact loss, which the
resume tests compare bit for bit) and every ``logging.interval`` steps the sinks are flushed and TensorBoard gets
the values averaged over the interval; before every checkpoint the sinks are synced to disk, so the metrics of a
saved step survive a crash. Every step's loss and gradient norm must be finite (``training.on_nonfinite``): a
diverged run stops with its bad step recorded and nothing saved from that step on. Torch-free: ``loongforge
check`` imports :func:`validate_loop_settings`.
"""

from __future__ import annotations

import math
import time
from numbers import Real
from typing import TYPE_CHECKING, Any

from loongforge.config.schema import LoongForgeConfig
from loongforge.errors import ConfigError, TrainingDivergedError

if TYPE_CHECKING:
    from loongforge.train.metrics import MetricsWriter
    from loongforge.train.progress import ProgressDisplay
    from loongforge.train.trainer import Trainer

#: Step metrics that are not averaged over a logging interval: the learning rate shown is the current step's.
_CURRENT = ("lr",)
#: Step metrics kept out of TensorBoard so that every engine writes the same tags there (throughput is
#: ``samples_per_s`` for all; an LLM's tokens/s is that times ``data.seq_length``, and stays in the JSONL).
_NOT_IN_TENSORBOARD = ("tokens_per_s",)


def validate_loop_settings(config: LoongForgeConfig) -> None:
    """Refuse loop settings no run can use, in one line naming the file and key (``check`` and ``train`` alike)."""
    limits = (
        ("training.steps", config.training.steps, 1, ""),
        ("logging.interval", config.logging.interval, 1, ""),
        ("checkpoint.interval", config.checkpoint.interval, 0, " (0 saves only at the end)"),
        ("checkpoint.keep_last", config.checkpoint.keep_last, 0, " (0 keeps every checkpoint)"),
    )
    for key, value, least, meaning in limits:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"{config.source}: {key} must be an integer >= {least}{meaning}, got {value!r}")


def fit(trainer: Trainer, metrics: MetricsWriter, progress: ProgressDisplay) -> dict[str, Any]:
    """Step until ``training.steps`` (or until a plugin sets ``trainer.should_stop``), logging, checkpointing and
    calling lifecycle hooks; return the summary."""
    config, host = trainer.config, trainer.host
    total, log_every, save_every = config.training.steps, config.logging.interval, config.checkpoint.interval
    start_step, saved_step = trainer.step, None
    history: list[dict[str, Any]] = []
    unlogged: list[dict[str, Any]] = []
    host.on_train_start(trainer=trainer)
    try:
        while trainer.step < total and not trainer.should_stop:
            row = _step(trainer)
            trainer.step += 1
            history.append(row)
            unlogged.append(row)
            metrics.record(trainer.step, row)
            diverged = _nonfinite(row)
            logged = trainer.step % log_every == 0 or trainer.step == total or diverged is not None
            shown = row
            if logged:
                shown, unlogged = _log(metrics, trainer.step, unlogged), []
            progress.update(trainer.step, shown, logged=logged)
            if diverged is not None:  # raised before any save: no checkpoint holds this step or a later one
                raise _diverged(trainer, diverged, row[diverged])
            host.on_step_end(trainer=trainer, step=trainer.step, metrics=row)
            if save_every and trainer.step % save_every == 0:
                saved_step = _save(trainer, metrics)
                progress.message(f"saved checkpoint {trainer.last_checkpoint}")
        if unlogged:  # stopped between two logging steps: the partial interval still reaches the sinks
            _log(metrics, trainer.step, unlogged)
        if config.checkpoint.save_at_end and trainer.step > start_step and saved_step != trainer.step:
            _save(trainer, metrics)
    finally:
        progress.close()
    return _summary(trainer, history, start_step)


def _step(trainer: Trainer) -> dict[str, Any]:
    """One optimizer step and its metrics; the schedule moves on after every update the optimizer made."""
    engine = trainer.engine
    start = time.perf_counter()
    trainer.step_metrics = {}
    lr = engine.param_groups[0]["lr"]
    result = engine.train_step()
    if not result.skipped:
        trainer.scheduler.step(increment=engine.samples_per_step)
    step_time = time.perf_counter() - start
    row = {**result.extra, **trainer.step_metrics, "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
           "samples_per_s": engine.samples_per_step / step_time}
    if engine.tokens_per_step is not None:
        row["tokens_per_s"] = engine.tokens_per_step / step_time
    row.update(step_time=step_time, skipped=result.skipped)
    return row


def _save(trainer: Trainer, metrics: MetricsWriter) -> int:
    """Sync the metrics up to this step to disk, then save the checkpoint; return the saved step."""
    metrics.sync()
    trainer.last_checkpoint = trainer.engine.save(trainer)
    return trainer.step


#: The step metrics that must be finite (``grad_norm`` is ``None`` when clipping is off or the update was skipped).
_MUST_BE_FINITE = ("loss", "grad_norm")


def _nonfinite(row: dict[str, Any]) -> str | None:
    """The first of :data:`_MUST_BE_FINITE` whose value in ``row`` is NaN or infinite, else ``None``."""
    return next((key for key in _MUST_BE_FINITE if row[key] is not None and not math.isfinite(row[key])), None)


def _diverged(trainer: Trainer, key: str, value: float) -> TrainingDivergedError:
    """The one-line error for ``training.on_nonfinite: stop``, pointing at the checkpoint to resume from."""
    newest = trainer.last_checkpoint
    where = f"the newest checkpoint before it is {newest}" if newest else "no checkpoint was saved before it"
    return TrainingDivergedError(f"step {trainer.step}: {key} is {value} (training.on_nonfinite: "
                                 f"{trainer.config.training.on_nonfinite}); {where}")


def _log(metrics: MetricsWriter, step: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Write the interval's averages to TensorBoard and flush the sinks; return the averages (for progress)."""
    averaged = _averaged(rows)
    metrics.log(step, {k: v for k, v in averaged.items() if k not in _NOT_IN_TENSORBOARD})
    return averaged


def _averaged(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The numbers of ``rows`` averaged key by key (the last row's for :data:`_CURRENT` keys and non-numbers)."""
    out = dict(rows[-1])
    for key, value in rows[-1].items():
        values = [row[key] for row in rows if _is_number(row.get(key))]
        if key not in _CURRENT and _is_number(value) and values:
            out[key] = sum(values) / len(values)
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _summary(trainer: Trainer, history: list[dict[str, Any]], start_step: int) -> dict[str, Any]:
    """Steps, first and last loss, throughput (the first step of a process includes one-off work -- allocations,
    lazy init -- so it is left out) and the newest checkpoint."""
    engine = trainer.engine
    timed = history[1:] or history
    seconds = sum(m["step_time"] for m in timed)
    summary: dict[str, Any] = {
        "steps": trainer.step,
        "steps_this_run": trainer.step - start_step,
        "first_loss": history[0]["loss"] if history else None,
        "final_loss": history[-1]["loss"] if history else None,
        "samples_per_s": len(timed) * engine.samples_per_step / seconds if seconds else 0.0,
    }
    if engine.tokens_per_step is not None:
        summary["tokens_per_s"] = len(timed) * engine.tokens_per_step / seconds if seconds else 0.0
    summary["checkpoint_dir"] = str(trainer.last_checkpoint) if trainer.last_checkpoint else None
    return summary
