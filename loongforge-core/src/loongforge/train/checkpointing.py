"""The run's side of checkpoints: what goes into one, and how a trainer is put back from one.

:mod:`loongforge.checkpoint` knows directories, manifests and megatron's formats; this module knows the
trainer: which RNG streams, which data position, which metadata (versions, device and why, layout) and
which lifecycle hooks are called around a save or a load.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

import loongforge
from loongforge.checkpoint.layout import CheckpointDir, warn
from loongforge.checkpoint.rng import capture_rng_state, restore_rng_state
from loongforge.checkpoint.saver import (
    TRAINER_JSON,
    choose_resume,
    load_checkpoint,
    rank_file,
    read_trainer_json,
    save_checkpoint,
)
from loongforge.checkpoint.state_files import restore_checked
from loongforge.checkpoint.writer import CheckpointWriter
from loongforge.config.loader import config_to_dict
from loongforge.config.schema import LoongForgeConfig
from loongforge.models.parameter_groups import ParameterGroup
from loongforge.train.resume_settings import SETTINGS_KEY, check_resume_settings, schedule_settings


def checkpoint_dir(config: LoongForgeConfig) -> CheckpointDir:
    """The run's checkpoint root: ``checkpoint.dir``, else ``<run.output_dir>/checkpoints`` (both engines),
    verifying as ``checkpoint.verify`` says."""
    return CheckpointDir(config.checkpoint.dir or Path(config.run.output_dir) / "checkpoints",
                         config.checkpoint.keep_last, verify=config.checkpoint.verify)


def resume_checkpoint(trainer: Any) -> Path | None:
    """Restore ``trainer`` through its engine from the checkpoint ``checkpoint.resume`` selects (``auto`` /
    ``never`` / a path, agreed by all ranks); ``None`` when there is none."""
    path = choose_resume(trainer.checkpoints, trainer.config.checkpoint.resume, warn)
    if path is not None:
        trainer.engine.load(trainer, path)
        trainer.last_checkpoint = trainer.healthy_checkpoint = path
    return path


def run_metadata(backend: Any, reason: str, layout: Any, world_size: int, model_name: str) -> dict[str, Any]:
    """What a checkpoint records about the run that wrote it (for humans and for later compatibility checks)."""
    from megatron.core import package_info

    return {
        "loongforge_version": loongforge.__version__,
        "megatron_core_version": package_info.__version__,
        "torch_version": torch.__version__,
        "device": backend.name,
        "device_reason": reason,
        "parallel": {
            "tp": layout.tp,
            "pp": layout.pp,
            "vpp": layout.vpp,
            "cp": layout.cp,
            "dp": layout.dp,
            "world_size": world_size,
            "sequence_parallel": layout.sequence_parallel,
            "distributed_optimizer": layout.distributed_optimizer,
        },
        "model": model_name,
    }


class RunCheckpoints:
    """Saves a megatron-engine trainer's complete state into ``directory`` and restores it from there."""

    def __init__(self, directory: CheckpointDir, config: LoongForgeConfig, host: Any, backend: Any,
                 metadata: dict[str, Any], groups: Sequence[ParameterGroup] = ()) -> None:
        self.dir = directory
        #: The model family's parameter groups, whose settings a resume must agree on.
        self.groups = tuple(groups)
        self.host = host
        self.backend = backend
        self.metadata = metadata
        self.config = config
        self.config_yaml = yaml.safe_dump(config_to_dict(config), sort_keys=False)
        self.writer = CheckpointWriter(background=config.checkpoint.async_save)

    def save(self, trainer: Any) -> Path | None:
        """Checkpoint ``trainer`` at its current step (all ranks call this); returns the new directory, or ``None``
        while it is written in the background (``checkpoint.async_save``; :meth:`complete_save` commits it)."""
        return save_checkpoint(
            self.writer,
            self.dir,
            trainer.step,
            model_chunks=trainer.model,
            optimizer=trainer.optimizer,
            scheduler=trainer.scheduler,
            rank_state={"rng": capture_rng_state(self.backend)},
            shared_state={"data": trainer.data.state_dict(),
                          SETTINGS_KEY: schedule_settings(self.config, trainer.engine.samples_per_step,
                                                          self.groups)},
            config_yaml=self.config_yaml,
            metadata={**self.metadata, "step": trainer.step, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
            on_save=lambda path, extra: self.host.on_checkpoint_save(trainer, path, extra),
        )

    def complete_save(self, *, wait: bool) -> Path | None:
        """Commit a background save once every rank wrote it (:meth:`CheckpointWriter.complete`)."""
        return self.writer.complete(wait=wait)

    def load(self, trainer: Any, path: Path) -> None:
        """Restore ``trainer`` from the checkpoint at ``path`` (all ranks call this); the optimizer and schedule
        settings must match the checkpoint's (:mod:`loongforge.train.resume_settings`), and with
        ``checkpoint.override_schedule`` the schedule built from this config continues at the resumed step."""
        recorded = read_trainer_json(path).get(SETTINGS_KEY)
        rebuild = check_resume_settings(recorded, self.config, trainer.engine.samples_per_step, path, self.groups)
        rank_state, shared = load_checkpoint(
            path, model_chunks=trainer.model, optimizer=trainer.optimizer,
            scheduler=None if rebuild else trainer.scheduler,
        )
        if rebuild:
            trainer.scheduler.step(increment=int(shared["scheduler"]["num_steps"]))
            warn(f"{path}: optimizer/schedule settings differ from the checkpoint's; continuing with this config's "
                 "(checkpoint.override_schedule)")
        restore_checked(lambda: trainer.data.load_state_dict(shared["data"]), path / TRAINER_JSON,
                        "the data position ('data')")
        trainer.step = int(shared["step"])
        if rank_state:
            own = path / rank_file(trainer.rank)
            restore_checked(lambda: restore_rng_state(rank_state["rng"], self.backend), own, "the random streams")
        else:
            warn(f"{path} was saved by fewer processes: this rank's RNG streams start fresh")
        self.host.on_checkpoint_load(trainer, str(path), shared.get("extra_state", {}))
