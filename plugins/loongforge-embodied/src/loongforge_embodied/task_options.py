"""The policy task's ``task:`` section as typed dataclasses (:attr:`PolicyFlavor.task_options` of every policy).

Torch-free, because the flavors name these classes and are registered (and listed) without torch; core validates a
config's ``task:`` against them before a run starts (unknown keys with did-you-mean, types, the checks in
``__post_init__``), and :class:`loongforge_embodied.train_task.PolicyTask` reads the typed values. Every default is
the one the task always had.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loongforge.config.sections import path_field, ranged
from loongforge.errors import ConfigError

#: Seeds are below this, as ``run.seed`` is (numpy's and torch's generators take them).
SEED_LIMIT = 2**31
#: The synthetic reach set is written by the run before it trains: at most this many episodes of this many frames.
MAX_EPISODES, MAX_LENGTH = 10_000, 10_000


@dataclass(frozen=True)
class SyntheticOptions:
    """``task.synthetic``: the size of the synthetic reach set written when ``task.data`` is null."""

    episodes: int = ranged(64, low=1, high=MAX_EPISODES)
    length: int = ranged(20, low=1, high=MAX_LENGTH)
    seed: int = ranged(0, low=0, high=SEED_LIMIT, high_open=True)


@dataclass(frozen=True)
class EvalOptions:
    """``task.eval``: held-out frames scored after training (``frames: 0`` skips it), Euler steps, noise seed."""

    frames: int = ranged(128, low=0)
    steps: int = ranged(10, low=1)
    seed: int = ranged(0, low=0, high=SEED_LIMIT, high_open=True)


@dataclass(frozen=True)
class PolicyTaskOptions:
    """``task:`` of a policy flavor (see :mod:`loongforge_embodied.train_task` for what each option does)."""

    #: A LeRobotDataset root (v2.1/v3.0), or an RLDS mixture spec (``*.yaml``, :mod:`.data.rlds_mixture`); null
    #: writes the synthetic reach set.
    data: str | None = path_field()
    synthetic: SyntheticOptions = field(default_factory=SyntheticOptions)
    #: The last episodes: never trained on, used by the evaluation.
    held_out_episodes: int = ranged(8, low=0)
    #: Action chunk length H.
    action_horizon: int = ranged(10, low=1)
    #: States and actions: quantiles (Pi0.5), mean_std, min_max or identity.
    normalization: str = "quantiles"
    #: Camera keys in order; null takes the dataset's first ``cameras`` of the flavor.
    cameras: list[str] | None = None
    eval: EvalOptions = field(default_factory=EvalOptions)
    #: Activation checkpointing of every layer.
    recompute: bool = False

    def __post_init__(self) -> None:
        from loongforge_embodied.data.normalize import MODES  # numpy: imported when a config is checked, not listed

        if self.normalization not in MODES:
            raise ConfigError(f"normalization '{self.normalization}' is unknown; choose one of {', '.join(MODES)}")

    def data_root(self, output_dir: Path | str) -> Path:
        """``data`` (set) as a LeRobotDataset root: the root itself, or the LeRobot set an RLDS mixture spec is
        written to (once) under ``output_dir/data``."""
        from loongforge_embodied.data.rlds_mixture import is_mixture_spec, materialise

        data = Path(self.data).expanduser()
        return materialise(data, Path(output_dir) / "data") if is_mixture_spec(data) else data

    def split(self, episodes: list[int], root: Path | str, source: str) -> tuple[list[int], list[int]]:
        """``episodes`` (a dataset's indices, in order) as (training, held-out): the last ``held_out_episodes``
        are held out, and at least one must be left to train on."""
        held = self.held_out_episodes
        if not 0 <= held < len(episodes):
            raise ConfigError(f"task.held_out_episodes in {source}: {held}, but {root} has {len(episodes)} episodes "
                              "(keep at least one for training)")
        return episodes[:len(episodes) - held], episodes[len(episodes) - held:]

    def camera_keys(self, wanted: int, available: list[str], root: Path | str, source: str,
                    depth: Sequence[str] = ()) -> list[str]:
        """The camera keys training reads, in order: ``cameras`` or the first ``wanted`` (the flavor's count) of
        ``available`` (the dataset's RGB cameras); a :class:`ConfigError` when they are not ``wanted`` of the
        dataset's, or name one of its ``depth`` maps, which the policies cannot read."""
        cameras = list(self.cameras or available[:wanted])
        for key in cameras:
            if key in depth:
                raise ConfigError(f"task.cameras in {source}: '{key}' of {root} is a depth map (is_depth_map in its "
                                  f"meta/info.json); the policies read RGB cameras only: {available}")
        if len(cameras) != wanted or set(cameras) - set(available):
            raise ConfigError(f"task.cameras in {source}: {cameras}; the flavor takes {wanted} of {root}'s cameras "
                              f"{available}")
        return cameras

    def validation_paths(self, paths: list[str], source: str) -> list[str]:
        """``evaluation.data`` as a policy run reads it -- one LeRobotDataset root, or none (the held-out episodes,
        of which there must be some); a :class:`ConfigError` otherwise."""
        if len(paths) > 1:
            raise ConfigError(f"{source}: evaluation.data names {len(paths)} paths; a policy run reads one "
                              "LeRobotDataset root")
        if not paths and not self.held_out_episodes:
            raise ConfigError(f"{source}: evaluation: task.held_out_episodes is 0, so no episode is held out; hold "
                              "some out or name a LeRobotDataset root in evaluation.data")
        return paths


@dataclass(frozen=True)
class ActionTokenizerOptions:
    """``task.action_tokenizer`` of a token policy (``pi0-fast-*``): fitted on the training episodes' action chunks
    when the run starts, or loaded from a directory ``loongforge fit-action-tokenizer --out`` (or a run) wrote."""

    #: A registered kind: ``fast`` (Pi0-FAST), ``uniform-bins`` (OpenVLA), ``quantile-bins``.
    kind: str = "fast"
    #: The kind's options (``fast``: scale, vocab_size, normalization, clip; bins: bins, range).
    options: dict[str, Any] = field(default_factory=dict)
    #: A saved tokenizer directory; when set, ``kind`` and ``options`` are not used.
    path: str | None = path_field()

    def __post_init__(self) -> None:
        from loongforge_embodied.action_tokens.base import make_options
        from loongforge_embodied.action_tokens.registry import tokenizer_kind

        make_options(self.kind, tokenizer_kind(self.kind, where="task.action_tokenizer.kind").options, self.options)


@dataclass(frozen=True)
class TokenPolicyTaskOptions(PolicyTaskOptions):
    """``task:`` of a token policy: the policy task's options and the action tokenizer."""

    action_tokenizer: ActionTokenizerOptions = field(default_factory=ActionTokenizerOptions)


@dataclass(frozen=True)
class KnowledgeInsulationOptions:
    """``task.knowledge_insulation`` of a Pi0.5 policy (``pi05-*`` with ``model.overrides.action_vocab`` > 0): the
    backbone learns from cross-entropy on the chunk's FAST tokens, the action expert from the flow loss, which is
    stopped at the backbone (Physical Intelligence's knowledge insulation; :mod:`loongforge_embodied.
    insulation_task`)."""

    #: The FAST tokenizer: fitted on the training chunks when the run starts, or ``{path: DIR}`` that
    #: ``loongforge fit-action-tokenizer --out`` (or a Pi0-FAST run) wrote; the same options as Pi0-FAST's.
    action_tokenizer: ActionTokenizerOptions = field(default_factory=ActionTokenizerOptions)
    #: The FAST loss's weight beside the flow loss (the step's loss is flow + fast_weight * fast).
    fast_weight: float = ranged(1.0, low=0.0, low_open=True)


@dataclass(frozen=True)
class Pi05TaskOptions(PolicyTaskOptions):
    """``task:`` of a Pi0.5 policy: the policy task's options and, when set, knowledge insulation."""

    knowledge_insulation: KnowledgeInsulationOptions | None = None


@dataclass(frozen=True)
class WorldActionTaskOptions(PolicyTaskOptions):
    """``task:`` of a world-action model (``wam-*``): the policy task's options, how far apart the predicted frames
    are, and the weights of the two flow-matching losses."""

    #: Dataset frames between the observed frame and the first predicted one, and between predicted frames.
    frame_stride: int = ranged(5, low=1)
    #: Weight of the future-frame latents' flow-matching loss.
    video_loss_weight: float = ranged(1.0, low=0.0)
    #: Weight of the action chunk's flow-matching loss.
    action_loss_weight: float = ranged(1.0, low=0.0)
