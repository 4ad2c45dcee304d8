"""The training loop, once for every model: step cadence, lifecycle hooks, stopping, the learning-rate schedule,
metrics, progress, checkpoint cadence and the summary.

Kept short on purpose (cf. nanoGPT). What differs between a megatron decoder and a task model (a diffusion DiT, a
robot policy) is one optimizer step, saving and loading, and the parameter groups: the step engine's
(:mod:`loongforge.train.engines`). So a plugin sees the same hooks, metrics and tracker tags, and a scheduler
section gives the same learning rates, whichever engine trains.

Per step the loop does no file I/O: every step's metrics are buffered as a JSONL line (the exact loss, which the
resume tests compare bit for bit) and every ``logging.interval`` steps the sinks are flushed and the trackers
(``logging.trackers``: TensorBoard, W&B, MLflow, CSV) get the values averaged over the interval -- the mean of the
interval's JSONL values, except ``lr``, which is the logging step's own; before every checkpoint the sinks are
synced to disk, so the metrics of a saved step survive a crash.

The same ``train/*`` tags for every engine, so that runs of any model compare in one dashboard: ``loss``, ``lr``,
``grad_norm``, ``step_time`` and ``samples_per_s`` always; a model that reads tokens (the megatron engine: LLMs,
VLMs) adds ``tokens_per_s`` (``samples_per_s`` times ``data.seq_length``), which is what people compare language
models by, and ``tflops`` (model TFLOP/s per device) with ``mfu`` (model-FLOPs utilisation, a fraction of the
device's dense peak, where the backend knows one; :mod:`loongforge.train.throughput`); engine extras (``loss_scale``
with fp16, ``moe_aux_loss`` for MoE, ``mtp_loss`` with multi-token prediction) and plugins' ``step_metrics`` join
under their own names. Every number of a step's JSONL row is a tag; flags and notes (``skipped``, ``bad``,
``action``, ``checkpoint``) stay per-step, in the JSONL only.

Every step is judged (:mod:`loongforge.train.health`): a NaN or infinite loss or gradient norm, a loss spike or a
collapse makes a bad step, which is recorded in metrics.jsonl (``"bad"``, ``"action"``), never saved, and handled as
``training.on_nonfinite`` says: ``stop`` raises before anything else happens; ``skip_step`` goes on (the engine left
the update out); ``rewind`` reloads the newest healthy checkpoint (one not saved while a collapse was under way) and
goes on with the batches after the bad one. After a rewind the steps after that checkpoint are trained (and
recorded) again.

With ``evaluation.interval`` N > 0 the engine evaluates the weights after every N-th step and after step
``training.steps`` (:meth:`~loongforge.train.engines.base.StepEngine.evaluate`), on healthy steps only (a bad step's
weights are not the run's): its numbers join that step's row in metrics.jsonl as ``val_<name>`` (``val_loss``, and
``val_ppl`` for language models), go to the trackers as ``val/<name>`` at that step (never averaged), appear in the
progress output, and reach ``on_step_end``'s ``metrics``. Every random stream of the process is put back as it was
after an evaluation, which reads its own fixed batches: a run trains the same losses with evaluation on as off.

A preemption signal (:mod:`loongforge.train.preemption`) ends the loop at the next healthy step boundary with a
checkpoint of that step and :class:`~loongforge.errors.TrainingPreempted`. Torch-free: ``loongforge check``
imports :func:`validate_loop_settings`.
"""

from __future__ import annotations

import math
import time
from numbers import Real
from typing import TYPE_CHECKING, Any

from loongforge.checkpoint.layout import warn
from loongforge.config.schema import LoongForgeConfig
from loongforge.errors import ConfigError, TrainingDivergedError, TrainingPreempted
from loongforge.train.health import BadStep, StepHealth
from loongforge.train.throughput import StepSpeed
from loongforge.train.trackers import validate_trackers

if TYPE_CHECKING:
    from pathlib import Path

    from loongforge.parallel.distributed import Heartbeat
    from loongforge.train.engines.base import StepResult
    from loongforge.train.metrics import MetricsWriter
    from loongforge.train.preemption import PreemptionWatch
    from loongforge.train.progress import ProgressDisplay
    from loongforge.train.trainer import Trainer

#: Step metrics that are not averaged over a logging interval: the learning rate shown is the current step's.
_CURRENT = ("lr",)
#: Prefix of the evaluation's numbers in a step's row: the trackers have them under ``val/`` instead of ``train/``.
_VALIDATION = "val_"


def validate_loop_settings(config: LoongForgeConfig) -> None:
    """Refuse loop settings no run can use (and trackers it cannot open), in one line naming the file and key
    (``check`` and ``train`` alike)."""
    limits = (
        ("training.steps", config.training.steps, 1, ""),
        ("logging.interval", config.logging.interval, 1, ""),
        ("checkpoint.interval", config.checkpoint.interval, 0, " (0 saves only at the end)"),
        ("checkpoint.keep_last", config.checkpoint.keep_last, 0, " (0 keeps every checkpoint)"),
        ("training.spike_window", config.training.spike_window, 1, ""),
        ("training.max_recoveries", config.training.max_recoveries, 0, ""),
        ("evaluation.interval", config.evaluation.interval, 0, " (0 turns evaluation off)"),
        ("evaluation.steps", config.evaluation.steps, 1, ""),
        ("evaluation.tasks_limit", config.evaluation.tasks_limit, 0, " (0 scores every document)"),
        ("distributed.timeout_s", config.distributed.timeout_s, 1, ""),
    )
    for key, value, least, meaning in limits:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"{config.source}: {key} must be an integer >= {least}{meaning}, got {value!r}")
    factor = config.training.spike_factor
    if factor is not None and not (_is_number(factor) and math.isfinite(factor) and factor > 1):
        raise ConfigError(f"{config.source}: training.spike_factor must be a number > 1 (or null: no spike "
                          f"detection), got {factor!r}")
    rise = config.training.spike_min_increase
    if not (_is_number(rise) and math.isfinite(rise) and rise >= 0):
        raise ConfigError(f"{config.source}: training.spike_min_increase must be a number >= 0, got {rise!r}")
    streak = config.training.collapse_steps
    if streak is not None and (isinstance(streak, bool) or not isinstance(streak, int) or streak < 2):
        raise ConfigError(f"{config.source}: training.collapse_steps must be an integer >= 2 (or null: no collapse "
                          f"detection), got {streak!r}")
    validate_trackers(config)


def fit(trainer: Trainer, metrics: MetricsWriter, progress: ProgressDisplay,
        preemption: PreemptionWatch | None = None, heartbeat: Heartbeat | None = None) -> dict[str, Any]:
    """Step until ``training.steps`` (or until a plugin sets ``trainer.should_stop``), logging, checkpointing,
    judging each step and calling lifecycle hooks; return the summary. Raises
    :class:`~loongforge.errors.TrainingDivergedError` for a bad step it does not recover from and
    :class:`~loongforge.errors.TrainingPreempted` after saving at the boundary that follows a preemption signal.

    ``heartbeat`` (several processes: :class:`~loongforge.parallel.distributed.Heartbeat`) is told of every step
    boundary, and of the final save: one step, its evaluation and its save must each come within
    ``distributed.timeout_s`` of the boundary before, or the watchdog ends the run as hung."""
    config, host = trainer.config, trainer.host
    beat = heartbeat.beat if heartbeat is not None else _no_beat
    total, log_every, save_every = config.training.steps, config.logging.interval, config.checkpoint.interval
    eval_every = config.evaluation.interval
    health = StepHealth(config.training, watch_loss=trainer.engine.loss_tracks_progress)
    start_step, saved_step, preempted_by = trainer.step, None, None
    history: list[dict[str, Any]] = []
    unlogged: list[dict[str, Any]] = []
    host.on_train_start(trainer=trainer)
    speed = StepSpeed.of(trainer)
    try:
        while trainer.step < total and not trainer.should_stop:
            beat(trainer.step)  # the deadline of this step (and its evaluation and save)
            result, row = _step(trainer, health, speed)
            trainer.step += 1
            bad = result.bad or health.judge(result.loss, result.grad_norm, lr=row["lr"], step=trainer.step)
            if bad is not None:  # a background save in flight is the newest checkpoint to name or rewind to
                _complete_save(trainer, progress, wait=True)
            action, why = _judged(trainer, health, result, bad, row)
            validation = None
            if bad is None and eval_every and (trainer.step % eval_every == 0 or trainer.step == total):
                validation = _evaluate(trainer, metrics)
                row.update({f"{_VALIDATION}{name}": value for name, value in validation.items()})
            history.append(row)
            unlogged.append(row)
            metrics.record(trainer.step, row)
            logged = trainer.step % log_every == 0 or trainer.step == total or bad is not None
            shown = row
            if logged:
                shown, unlogged = _log(metrics, trainer.step, unlogged), []
                trainer.engine.log_records(trainer, trainer.step)
            progress.update(trainer.step, shown, logged=logged)
            if validation is not None:
                progress.evaluation(trainer.step, validation)
            if bad is not None and action == "stop":  # raised before any save: no checkpoint holds this step
                raise _diverged(trainer, bad, why)
            host.on_step_end(trainer=trainer, step=trainer.step, metrics=row)
            if bad is not None:  # recovered: never saved, and a preemption waits for a healthy boundary
                _recover(trainer, bad, action, health)
                continue
            _complete_save(trainer, progress, wait=False)  # a background save becomes visible once written
            if save_every and trainer.step % save_every == 0:
                saved_step = _save(trainer, metrics, progress, healthy=not health.suspect)
            preempted_by = preemption.requested() if preemption is not None else None
            if preempted_by is not None:
                break
        if unlogged:  # stopped between two logging steps: the partial interval still reaches the sinks
            _log(metrics, trainer.step, unlogged)
        beat(trainer.step)  # the final save's deadline
        if preempted_by is not None:
            if saved_step != trainer.step:
                _save(trainer, metrics, progress, healthy=not health.suspect)
            _complete_save(trainer, progress, wait=True)
            raise TrainingPreempted(f"preempted by {preempted_by} at step {trainer.step} of {total}: saved "
                                    f"{trainer.last_checkpoint}; the same command resumes from it")
        if config.checkpoint.save_at_end and trainer.step > start_step and saved_step != trainer.step:
            _save(trainer, metrics, progress, healthy=not health.suspect)
        _complete_save(trainer, progress, wait=True)
    finally:
        if heartbeat is not None:  # what follows (the after-training sample, the report) is no step
            heartbeat.stop()
        progress.close()
    return _summary(trainer, history, start_step, speed)


def _no_beat(step: int) -> None:
    """The heartbeat of a run of one process (nothing to watch for)."""


def _step(trainer: Trainer, health: StepHealth, speed: StepSpeed) -> tuple[StepResult, dict[str, Any]]:
    """One optimizer step (screened by ``health`` when bad updates must be left out) and its metrics (its speed in
    ``speed``'s units); the schedule moves on after every update the optimizer made."""
    engine = trainer.engine
    start = time.perf_counter()
    trainer.step_metrics = {}
    rates = _learning_rates(trainer)
    result = engine.train_step(health if health.screens_updates else None)
    if not result.skipped:
        trainer.scheduler.step(increment=engine.samples_per_step)
    step_time = time.perf_counter() - start
    row = {**result.extra, **trainer.step_metrics, "loss": result.loss, **rates, "grad_norm": result.grad_norm,
           **speed.metrics(1, step_time)}
    row.update(step_time=step_time, skipped=result.skipped)
    return result, row


def _learning_rates(trainer: Trainer) -> dict[str, float]:
    """The rates this step's update uses: ``lr``, the run's schedule (``optimizer.lr``'s curve, what every group
    without settings of its own follows), and ``lr/<name>`` for each named parameter group with its own
    (:mod:`loongforge.models.parameter_groups`, e.g. a model part's)."""
    rates = {"lr": trainer.scheduler.get_lr({})}
    rates.update({f"lr/{group['group_name']}": group["lr"] for group in trainer.engine.param_groups
                  if "group_name" in group})
    return rates


def _evaluate(trainer: Trainer, metrics: MetricsWriter) -> dict[str, float]:
    """The engine's validation numbers of this step's weights, logged to the trackers (``val/<name>``). The
    process's random streams (Python, NumPy, torch, the device's, megatron's trackers) are restored afterwards, so
    the next step draws exactly what it would have drawn without the evaluation."""
    from loongforge.checkpoint.rng import capture_rng_state, restore_rng_state

    streams = capture_rng_state(trainer.backend)
    try:
        values = trainer.engine.evaluate()
    finally:
        restore_rng_state(streams, trainer.backend)
    metrics.log(trainer.step, values, group="val")
    return values


def _judged(trainer: Trainer, health: StepHealth, result: StepResult, bad: BadStep | None,
            row: dict[str, Any]) -> tuple[str | None, str]:
    """A healthy step's loss joins the spike window; a bad one gets its action (and, for ``stop`` although the
    policy recovers, why) and both go into its metrics row."""
    if bad is None:
        health.accept(result.loss)
        return None, ""
    action, why = health.decide(discarded=result.bad is not None, can_rewind=trainer.healthy_checkpoint is not None)
    row.update(bad=bad.kind, action=action)
    if action == "rewind":
        row["checkpoint"] = str(trainer.healthy_checkpoint)
    return action, why


def _recover(trainer: Trainer, bad: BadStep, action: str, health: StepHealth) -> None:
    """Warn about a recovered bad step; for ``rewind``, reload the newest healthy checkpoint (weights, optimizer,
    schedule, RNG) but keep the data position, so that the batches after the bad one come next rather than the same
    ones."""
    step, used = trainer.step, f"recovery {health.bad_steps} of training.max_recoveries {health.max_recoveries}"
    if action == "skip_step":
        message = f"its update was left out ({used})"
    else:
        position = trainer.engine.data_position()
        path = trainer.healthy_checkpoint
        trainer.scheduler.num_steps = 0  # a load moves the schedule on by the checkpoint's count: count from zero
        trainer.engine.load(trainer, path)
        trainer.engine.seek_data(position)
        message = f"rewound to {path} (step {trainer.step}), going on with the batches after this one ({used})"
    if trainer.rank == 0:
        warn(f"step {step}: {bad.describe()}; {message} (training.on_nonfinite: {action})")


def _save(trainer: Trainer, metrics: MetricsWriter, progress: ProgressDisplay, *, healthy: bool) -> int:
    """Sync the metrics up to this step to disk, then save the checkpoint (a background save still pending is
    committed first); return the saved step. ``healthy``: no collapse was under way, so a rewind may come back
    here."""
    from loongforge.checkpoint.writer import named_write_errors  # imports torch (this module stays torch-free)

    _complete_save(trainer, progress, wait=True)
    trainer.saving_healthy = healthy  # the one save in flight: committed now, or by a later _complete_save
    with named_write_errors(trainer.checkpoints, trainer.step):  # a full disk: one line with the bytes needed
        metrics.sync()
        path = trainer.engine.save(trainer)  # None: written in the background (checkpoint.async_save)
    _saved(trainer, progress, path)
    return trainer.step


def _complete_save(trainer: Trainer, progress: ProgressDisplay, *, wait: bool) -> None:
    """Commit a background save once every rank has written it (``wait``: block until then)."""
    _saved(trainer, progress, trainer.engine.complete_save(trainer, wait=wait))


def _saved(trainer: Trainer, progress: ProgressDisplay, path: Path | None) -> None:
    """A committed checkpoint (``path``; ``None``: none now) is the newest one of the run."""
    if path is not None:
        trainer.last_checkpoint = path
        if trainer.saving_healthy:
            trainer.healthy_checkpoint = path
        progress.message(f"saved checkpoint {path}")


def _diverged(trainer: Trainer, bad: BadStep, why: str) -> TrainingDivergedError:
    """The one-line error for a bad step the run does not recover from, pointing at the checkpoint to resume from."""
    newest = trainer.healthy_checkpoint
    where = (f"the newest healthy checkpoint before it is {newest}" if newest
             else "no healthy checkpoint was saved before it")
    return TrainingDivergedError(f"step {trainer.step}: {bad.describe()} (training.on_nonfinite: "
                                 f"{trainer.config.training.on_nonfinite}{why}); {where}")


def _log(metrics: MetricsWriter, step: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Log the interval's averages to the trackers and flush the sinks; return the averages (for progress)."""
    averaged = _averaged(rows)
    metrics.log(step, {k: v for k, v in averaged.items() if not k.startswith(_VALIDATION)})
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


def _summary(trainer: Trainer, history: list[dict[str, Any]], start_step: int, speed: StepSpeed) -> dict[str, Any]:
    """Steps (reached, trained by this process, and ``training.steps``), this process's first and last loss,
    throughput (samples/s, tokens/s, TFLOP/s per device and MFU where known; the first step of a process includes
    one-off work -- allocations, lazy init, compilation -- so it is left out), the newest evaluation's numbers
    (``val_loss`` ...) and the newest checkpoint."""
    timed = history[1:] or history
    seconds = sum(m["step_time"] for m in timed)
    summary: dict[str, Any] = {
        "steps": trainer.step,
        "steps_this_run": trainer.step - start_step,
        "steps_total": trainer.config.training.steps,
        "first_loss": history[0]["loss"] if history else None,
        "final_loss": history[-1]["loss"] if history else None,
        **speed.metrics(len(timed), seconds),
    }
    evaluated = [row for row in history if f"{_VALIDATION}loss" in row]
    if evaluated:  # the newest evaluation of this run
        summary.update({key: value for key, value in evaluated[-1].items() if key.startswith(_VALIDATION)})
    summary["checkpoint_dir"] = str(trainer.last_checkpoint) if trainer.last_checkpoint else None
    return summary
