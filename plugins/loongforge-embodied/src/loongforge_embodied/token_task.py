"""``loongforge train`` for autoregressive (action-token) policies: the policy task's data path, normaliser, acting API
and held-out evaluation (:class:`~loongforge_embodied.train_task.PolicyTask`), with next-token cross-entropy on
action tokens in place of flow matching.

The action tokenizer (``task.action_tokenizer``) is fitted when training starts on every ``action_horizon`` window
of the training episodes' raw actions (:func:`~loongforge_embodied.action_tokens.chunks.action_chunks`), or loaded
from ``task.action_tokenizer.path``. Each frame's target is its recorded chunk (steps past the episode's end repeat
its last action, as the dataset pads them) encoded as ``[BOS, ids..., EOS]`` and padded to the longest sequence of
the training split; the loss covers those ids and EOS (:func:`~loongforge_embodied.policies.pi0_fast.
action_token_loss`). Acting decodes greedily (``act``'s ``steps`` and ``seed`` do not apply) and the tokenizer turns
the ids into a chunk in the dataset's units, filling a malformed sequence as its kind documents.

The tokenizer travels with every checkpoint: its files are part of the task's state (``state.pt``), so
``load_task_model`` -- hence ``loongforge eval`` and ``serve`` -- decodes with the one the policy was trained on; a
fitted one is also written to ``<run.output_dir>/action_tokenizer/`` (a directory ``task.action_tokenizer.path``
accepts).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from loongforge.errors import ConfigError

from loongforge_embodied.action_tokens.base import ActionTokenizer, ActionTokenizerError
from loongforge_embodied.action_tokens.chunks import action_chunks
from loongforge_embodied.action_tokens.registry import (
    fit_action_tokenizer,
    load_action_tokenizer,
    tokenizer_files,
    tokenizer_from_files,
)
from loongforge_embodied.policies.pi0_fast import IGNORE, ActionIds, action_token_loss
from loongforge_embodied.task_options import ActionTokenizerOptions
from loongforge_embodied.train_task import ACTION, NOT_INPUTS, PolicyFrames, PolicyTask

#: Where a run writes the tokenizer it fitted, under ``run.output_dir``.
TOKENIZER_DIR = "action_tokenizer"


class ActionTokenTargets:
    """The action-token targets of a task: the tokenizer (fitted on the training split's chunks or loaded, see the
    module docstring), ``max_tokens`` (the longest id sequence of the training split) and each frame's ``[BOS,
    ids..., EOS]``. Shared by the token policy's task and Pi0.5's knowledge insulation, which name their tokenizer
    option ``key`` (``task.action_tokenizer``, ``task.knowledge_insulation.action_tokenizer``)."""

    def __init__(self, flavor: Any, spec: ActionTokenizerOptions, key: str, *, source: str, output_dir: Path) -> None:
        self.flavor, self.spec, self.key, self.source, self.output_dir = flavor, spec, key, source, output_dir
        self.ids = ActionIds(flavor)
        self.tokenizer: ActionTokenizer | None = None
        self.max_tokens = 0

    def fit(self, root: Path, episodes: list[int], frames: PolicyFrames, horizon: int) -> None:
        """Fit (or load) the tokenizer, check it fits the flavor and the data, and measure the longest sequence."""
        spec = self.spec
        if spec.path is not None:
            tokenizer = load_action_tokenizer(Path(spec.path).expanduser())
            where = f"{self.key}.path {spec.path} in {self.source}"
        else:
            chunks = action_chunks(root, horizon, episodes=episodes)
            if not len(chunks):
                raise ConfigError(f"{self.source}: no training episode of {root} is {horizon} frames long "
                                  "(task.action_horizon); the action tokenizer has nothing to fit on")
            tokenizer = fit_action_tokenizer(spec.kind, chunks, **spec.options)
            where = f"{self.key} in {self.source}"
            if _is_main_process():
                tokenizer.save(self.output_dir / TOKENIZER_DIR)
        self.flavor.check_vocab(tokenizer.vocab_size, where)
        if tokenizer.action_dim != frames.action_dim:
            raise ConfigError(f"{where}: the tokenizer takes {tokenizer.action_dim} action dimensions, {root} has "
                              f"{frames.action_dim}")
        try:
            self.max_tokens = max(len(tokenizer.encode(chunk)) for chunk in frames.raw_actions.double().numpy())
        except ActionTokenizerError as err:
            raise ConfigError(f"{where}: {err}") from None
        self.tokenizer = tokenizer

    def sequence(self, chunk: np.ndarray) -> torch.Tensor:
        """(max_tokens + 2,) ``[BOS, ids..., EOS]`` of a raw action chunk, zero-padded (a validation chunk longer
        than the training split's longest is cut)."""
        return self.ids.sequence(self.tokenizer.encode(np.asarray(chunk, dtype=np.float64)), self.max_tokens)

    def state_dict(self) -> dict[str, Any] | None:
        """The tokenizer's files and ``max_tokens`` (plain strings and ints); ``None`` before it is fitted."""
        if self.tokenizer is None:
            return None
        return {"files": tokenizer_files(self.tokenizer), "max_tokens": self.max_tokens}

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        if saved is not None:
            self.tokenizer = tokenizer_from_files(saved["files"], where=f"{self.source}: the checkpoint's state")
            self.max_tokens = int(saved["max_tokens"])


class TokenPolicyTask(PolicyTask):
    """Cross-entropy training of a token policy (``Pi0FastPolicy``) and greedy acting; see the module docstring.

    Beside the policy task's state it holds the action-token targets (:class:`ActionTokenTargets`: the tokenizer and
    ``max_tokens``, the most ids acting generates)."""

    def __init__(self, flavor: Any, config: Any) -> None:
        super().__init__(flavor, config)
        self.targets = ActionTokenTargets(self.flavor, self.options.action_tokenizer, "task.action_tokenizer",
                                          source=self.source, output_dir=self.output_dir)
        self.ids = self.targets.ids

    @property
    def tokenizer(self) -> ActionTokenizer | None:
        return self.targets.tokenizer

    @property
    def max_tokens(self) -> int:
        return self.targets.max_tokens

    # -- data ------------------------------------------------------------------------------------------------
    def fit_targets(self, root: Path, episodes: list[int], frames: PolicyFrames) -> None:
        """Fit (or load) the tokenizer (:meth:`ActionTokenTargets.fit`)."""
        self.targets.fit(root, episodes, frames, self.action_horizon)

    def training_item(self, frame: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The policy task's item plus ``action_ids`` (max_tokens + 2,): ``[BOS, ids..., EOS]``, zero-padded (a
        validation chunk longer than the training split's longest is cut)."""
        return {**super().training_item(frame), "action_ids": self.targets.sequence(frame[ACTION])}

    # -- training --------------------------------------------------------------------------------------------
    def validation_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor],
                        generators: list[torch.Generator]) -> torch.Tensor:
        """Next-token cross-entropy on the action ids and EOS (no random draws: ``generators`` are not used)."""
        sequence = batch["action_ids"]
        inputs = {key: value for key, value in batch.items() if key not in NOT_INPUTS}
        logits = model(inputs, sequence[:, :-1])
        return action_token_loss(logits, action_targets(sequence, logits.shape[1]))

    def state_dict(self) -> dict[str, Any]:
        """The policy task's state and the tokenizer's files with ``max_tokens`` (plain strings and ints)."""
        state = super().state_dict()
        if self.tokenizer is not None:
            state["action_tokenizer"] = self.targets.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.targets.load_state_dict(state.get("action_tokenizer"))

    # -- acting ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def act(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], *, steps: int = 10,
            seed: int | Sequence[int] = 0) -> np.ndarray:
        """(B, H, action_dim) chunks in the dataset's units: greedy ids (KV-cached) decoded by the tokenizer.
        Decoding is deterministic, so ``steps`` and ``seed`` (the flow policies' sampling) do not apply."""
        if self.tokenizer is None:
            raise ConfigError("the token policy task has no action tokenizer yet: call build_dataset(), or load the "
                              "task from a checkpoint (loongforge.train.task_checkpoint.load_task_model)")
        device = next(model.parameters()).device
        rows = model.generate({key: value.to(device) for key, value in inputs.items()}, self.max_tokens)
        return np.stack([self.tokenizer.decode(row, self.action_horizon) for row in rows])


def action_targets(sequence: torch.Tensor, positions: int) -> torch.Tensor:
    """(B, positions) next-token targets of logits over [prefix, sequence[:, :-1]]: :data:`IGNORE` on the prefix and
    on padding, the following id of ``sequence`` (B, S + 1) on the action positions."""
    following = sequence[:, 1:]
    prefix = sequence.new_full((sequence.shape[0], positions - following.shape[1]), IGNORE)
    return torch.cat([prefix, following.masked_fill(following == 0, IGNORE)], dim=1)


def _is_main_process() -> bool:
    """Rank 0, or a run without a process group: the one that writes the fitted tokenizer's directory."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0
