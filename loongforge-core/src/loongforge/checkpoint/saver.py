"""Save and load a training checkpoint: model + optimizer via megatron ``dist_checkpointing``, the rest beside it.

Why these pieces:

* ``model_optim/`` uses megatron's ``dist_checkpointing`` on the *unwrapped* modules' ``sharded_state_dict``
  so a checkpoint written at one TP/PP layout loads at another. The optimizer state is stored per parameter
  beside the weights (:mod:`loongforge.checkpoint.optim_state`), so it reshards the same way, for the plain and
  the distributed optimizer alike.
* megatron's default ``torch_dist`` writer forks worker processes and starts a ``spawn`` multiprocessing
  manager, which breaks scripts without a ``__main__`` guard and costs seconds per save. We write the same
  format in-process (:mod:`loongforge.checkpoint.torch_dist`); megatron's default loader reads it.
* ``trainer-rankNNNNN.pt`` holds what differs per rank (RNG streams, the data position); ``trainer.json``
  what is shared (step, scheduler, plugin ``extra_state``), readable without torch.
* ``tokenizer/`` holds the run's tokenizer (:mod:`loongforge.checkpoint.carried_tokenizer`), so a checkpoint decodes
  as it trained wherever it is copied.

Every rank calls :func:`save_checkpoint` and :func:`load_checkpoint`. Each rank writes and hashes its own files;
rank 0 writes the shared files, merges the hashes into the manifest and commits
(:mod:`loongforge.checkpoint.writer`, which also runs background saves). Saves are made visible atomically by
:class:`loongforge.checkpoint.layout.CheckpointDir`.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import CheckpointingException

from loongforge.checkpoint.carried_tokenizer import carry_run_tokenizer
from loongforge.checkpoint.layout import CONFIG_YAML, METADATA_JSON, CheckpointDir, unchecked_content
from loongforge.checkpoint.manifest import CheckpointCorruptError, verify_manifest
from loongforge.checkpoint.optim_state import adam_step, load_optimizer_state, optimizer_sharded_state
from loongforge.checkpoint.state_files import load_plain, megatron_trainer_state, restore_checked, rng_state
from loongforge.checkpoint.torch_dist import InProcessTorchDistSaveStrategy
from loongforge.checkpoint.writer import CheckpointWriter, RankShare, save_torch
from loongforge.config.schema import AUTO_RESUMES
from loongforge.errors import LoongForgeError

MODEL_OPTIM = "model_optim"
TRAINER_JSON = "trainer.json"


def rank_file(rank: int) -> str:
    return f"trainer-rank{rank:05d}.pt"


@contextlib.contextmanager
def _quiet_deprecations():
    """Hide torch's ShardedTensor and megatron's ``load_state_dict`` FutureWarnings: library internals a user
    cannot act on, printed on every save and load."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def _model_key(index: int, count: int) -> str:
    return "model" if count == 1 else f"model{index}"


def _sharded_state(model_chunks: list[Any], optimizer: Any, *, is_loading: bool) -> dict[str, Any]:
    state = {
        _model_key(i, len(model_chunks)): unwrap_model(chunk).sharded_state_dict()
        for i, chunk in enumerate(model_chunks)
    }
    state["optimizer"] = optimizer_sharded_state(optimizer, model_chunks, state, is_loading=is_loading)
    return state


def unwrap_model(module: Any) -> Any:
    """The megatron module under DDP/Float16 wrappers (whose ``sharded_state_dict`` has the canonical keys)."""
    while hasattr(module, "module"):
        module = module.module
    return module


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def save_checkpoint(
    writer: CheckpointWriter,
    ckpt_dir: CheckpointDir,
    step: int,
    *,
    model_chunks: list[Any],
    optimizer: Any,
    scheduler: Any,
    rank_state: dict[str, Any],
    shared_state: dict[str, Any],
    config_yaml: str,
    metadata: dict[str, Any],
    on_save: Callable[[str, dict], None] | None = None,
) -> Path | None:
    """Save checkpoint ``step`` through ``writer``; return the ``step-N`` directory once it is committed, or ``None``
    while it is written in the background (``writer.complete`` commits it).

    ``rank_state`` (tensors/ints/tuples) goes to this rank's file; ``shared_state`` (JSON) and the plugin
    ``extra_state`` that ``on_save(tmp_path, extra_state)`` fills go to ``trainer.json`` from rank 0. Everything is
    taken now: a background save writes the model and optimizer from a host copy made here.
    """
    rank = _rank()
    optimizer_steps = adam_step(optimizer)
    tmp = writer.begin(ckpt_dir, step)
    (tmp / MODEL_OPTIM).mkdir(exist_ok=True)
    strategy = InProcessTorchDistSaveStrategy("torch_dist", 1, stage=writer.background)
    with _quiet_deprecations():
        request = dist_checkpointing.save(
            _sharded_state(model_chunks, optimizer, is_loading=False),
            str(tmp / MODEL_OPTIM),
            sharded_strategy=strategy,
            async_sharded_save=True,
        )
    save_torch(rank_state, tmp / rank_file(rank))  # a full disk is then ENOSPC, not 'unexpected pos'
    extra_state: dict[str, Any] = {}
    if on_save is not None:
        on_save(str(tmp), extra_state)
    if rank == 0:
        _write_json(
            tmp / TRAINER_JSON,
            {
                "step": step,
                "optimizer_steps": optimizer_steps,
                "scheduler": scheduler.state_dict(),
                "extra_state": extra_state,
                **shared_state,
            },
        )
        (tmp / CONFIG_YAML).write_text(config_yaml, encoding="utf-8")
        carry_run_tokenizer(config_yaml, tmp)  # tokenizer/: what generate and exports decode with
        _write_json(tmp / METADATA_JSON, metadata)

    def finalize() -> None:
        for finish in request.finalize_fns:  # DCP's .metadata, then megatron's metadata.json
            finish()

    own = [rank_file(rank), f"{MODEL_OPTIM}/{strategy.last_save.data_file}"]
    return writer.submit(RankShare(files=own, write=request.async_fn, finalize=finalize))


def choose_resume(ckpt_dir: CheckpointDir, resume: str, warn: Callable[[str], None]) -> Path | None:
    """The checkpoint to resume from, agreed by all ranks (rank 0 verifies; the result is broadcast).

    ``resume``: ``never``; ``auto`` (the newest valid checkpoint, falling back past corrupt ones with a warning; none
    when the directory holds no checkpoint -- but when it holds checkpoints and none verifies, a
    :class:`CheckpointCorruptError` naming each, rather than training again from step 0 over the run);
    ``restart`` (as ``auto``, except that then training starts again from step 0, the rejected checkpoints kept as
    ``step-N.corrupt``); or a checkpoint path, which must verify. Verification is ``ckpt_dir.verify``
    (``checkpoint.verify``); a large checkpoint's shows its progress
    (:data:`~loongforge.checkpoint.manifest.LARGE_CHECKPOINT_BYTES`).
    """
    if resume == "never":
        return None
    choice: list[Any] = [None]
    if _rank() == 0:
        try:
            if resume in AUTO_RESUMES:
                choice[0] = _newest_valid(ckpt_dir, resume, warn)
            else:
                verify_manifest(resume, mode=ckpt_dir.verify, progress=True)  # before training: shown when large
                for line in unchecked_content(Path(resume), ckpt_dir.verify):
                    warn(line)
                choice[0] = str(resume)
        except CheckpointCorruptError as exc:
            choice[0] = exc
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(choice, src=0)
    if isinstance(choice[0], Exception):
        raise CheckpointCorruptError(str(choice[0]))
    return Path(choice[0]) if choice[0] is not None else None


def _newest_valid(ckpt_dir: CheckpointDir, resume: str, warn: Callable[[str], None]) -> str | None:
    """``auto`` / ``restart``: the newest checkpoint that verifies (as a string), or ``None`` to start at step 0.

    Starting at step 0 in a directory that holds checkpoints would write the new run's saves over an old run that
    could not be resumed, so ``auto`` refuses it when any checkpoint failed verification -- now, or in an earlier
    run, which quarantined it -- in one line naming each; ``restart`` says to go ahead (with a warning)."""
    earlier = ckpt_dir.quarantined()
    path, problems = ckpt_dir.find_valid()
    if path is not None:
        for line in problems:
            warn(line)
        return str(path)
    rejected = [line.removeprefix(f"checkpoint {ckpt_dir.root}/") for line in problems]
    rejected += [f"{p.name} (quarantined by an earlier run)" for p in earlier]
    if not rejected:
        return None
    if resume == "restart":
        warn(f"no checkpoint in {ckpt_dir.root} verifies ({'; '.join(rejected)}); starting again from step 0 "
             "(checkpoint.resume: restart)")
        return None
    raise CheckpointCorruptError(
        f"checkpoint.resume: auto found checkpoints in {ckpt_dir.root} but none that verifies: {'; '.join(rejected)}. "
        "Refusing to train again from step 0 over them: repair or remove them, or set checkpoint.resume: restart "
        "(start again, keeping them as step-N.corrupt) or never"
    )


def _root_cause(exc: BaseException) -> str:
    """The first failing rank's own message from torch's per-rank ``CheckpointException`` wrapper."""
    failures = getattr(exc, "failures", None)
    if failures:
        exc = next(iter(failures.values()))[0]
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def read_trainer_json(path: Path) -> dict[str, Any]:
    """A checkpoint's shared trainer state (step, schedule, data position, recorded settings), torch-free; checked
    key by key (:mod:`loongforge.checkpoint.state_files`): a malformed file is one line naming it and the key."""
    return megatron_trainer_state(path / TRAINER_JSON)


def load_checkpoint(path: Path, *, model_chunks: list[Any], optimizer: Any, scheduler: Any | None) -> tuple[dict, dict]:
    """Load model, optimizer and scheduler state in place (``scheduler=None`` leaves the schedule as built: the
    caller moves it on itself); return ``(rank_state, shared_state)``.

    ``rank_state`` is ``{}`` when this rank has no file of its own (the checkpoint was written by more
    processes): weights and optimizer state reshard and the data position is global, but this rank's RNG
    streams cannot be restored. Nothing is unpickled before :func:`~loongforge.checkpoint.trust.check_dist_checkpoint`
    has found that reading ``model_optim/`` runs no code.
    """
    from loongforge.checkpoint.trust import check_dist_checkpoint

    check_dist_checkpoint(path / MODEL_OPTIM)
    try:
        with _quiet_deprecations():
            state = dist_checkpointing.load(
                _sharded_state(model_chunks, optimizer, is_loading=True), str(path / MODEL_OPTIM)
            )
    except (CheckpointingException, dcp.CheckpointException) as exc:
        raise LoongForgeError(
            f"checkpoint {path} does not fit this run's model or optimizer (was the model changed?): {_root_cause(exc)}"
        ) from exc
    for i, chunk in enumerate(model_chunks):
        unwrap_model(chunk).load_state_dict(state[_model_key(i, len(model_chunks))])
    shared = read_trainer_json(path)
    load_optimizer_state(optimizer, model_chunks, state["optimizer"], shared["optimizer_steps"])
    if scheduler is not None:
        restore_checked(lambda: scheduler.load_state_dict(shared["scheduler"]), path / TRAINER_JSON,
                        "the learning-rate schedule")
    own = path / rank_file(_rank())
    rank_state: dict[str, Any] = {}
    if own.is_file():  # every stream must be there before any is restored
        rank_state = {"rng": rng_state(load_plain(own, "this rank's random streams"), own, key="rng")}
    return rank_state, shared
