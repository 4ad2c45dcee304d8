"""``task.knowledge_insulation`` of a Pi0.5 policy: the backbone learns the action chunk as FAST tokens while the
action expert learns it by flow matching, and the flow loss never reaches the backbone (Physical Intelligence,
"Knowledge Insulating Vision-Language-Action Models", 2025).

Why: a VLM backbone trained through the flow loss of a freshly initialised action expert has its representations
pulled around by that expert's gradients, which makes training slower and forgets what the backbone knew; a
discrete next-token loss on the same actions gives the backbone an action objective of the kind it was pretrained
on. The policy (``pi05-*`` with ``model.overrides.action_vocab`` > 0, :mod:`~loongforge_embodied.policies.pi05`)
stops the expert's gradient at the backbone's keys and values and keeps the FAST tokens out of the expert's sight.

What the task adds to the flow-matching policy task (:class:`~loongforge_embodied.train_task.PolicyTask`): the FAST
tokenizer and each frame's ``[BOS, ids..., EOS]`` (:class:`~loongforge_embodied.token_task.ActionTokenTargets`, as
Pi0-FAST's task fits, loads and checkpoints them), and the step's loss ``flow + fast_weight * fast`` with the FAST
cross-entropy of :func:`~loongforge_embodied.policies.pi0_fast.action_token_loss`; both parts are recorded with
every step (``flow_loss``, ``fast_loss``). Acting is the flow policy's: Euler sampling of the expert, with no FAST
tokens in the sequence and none decoded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from loongforge_embodied.policies import flow_matching as fm
from loongforge_embodied.policies.pi0_fast import action_token_loss
from loongforge_embodied.token_task import ActionTokenTargets, action_targets
from loongforge_embodied.train_task import ACTION, PolicyFrames, PolicyTask


class KnowledgeInsulationTask(PolicyTask):
    """Flow matching for the expert plus FAST cross-entropy for the backbone; see the module docstring."""

    def __init__(self, flavor: Any, config: Any) -> None:
        super().__init__(flavor, config)
        self.flavor.check_insulation(self.source)
        options = self.options.knowledge_insulation
        self.fast_weight = options.fast_weight
        self.targets = ActionTokenTargets(self.flavor, options.action_tokenizer,
                                          "task.knowledge_insulation.action_tokenizer", source=self.source,
                                          output_dir=self.output_dir)
        #: The last loss's parts (detached), reported with the step.
        self.parts: dict[str, torch.Tensor] = {}

    def fit_targets(self, root: Path, episodes: list[int], frames: PolicyFrames) -> None:
        """Fit (or load) the FAST tokenizer on the training split."""
        self.targets.fit(root, episodes, frames, self.action_horizon)

    def training_item(self, frame: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The policy task's item plus ``action_ids``: the chunk's ``[BOS, FAST ids..., EOS]``, zero-padded."""
        return {**super().training_item(frame), "action_ids": self.targets.sequence(frame[ACTION])}

    def validation_loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor],
                        generators: list[torch.Generator]) -> torch.Tensor:
        """``flow + fast_weight * fast``: the flow-matching loss of the expert's velocity and the next-token
        cross-entropy of the backbone's logits over the FAST ids and EOS, from one forward."""
        inputs, x_t, t, target = self.flow_batch(batch, generators)
        sequence = batch["action_ids"]
        velocity, logits = model(inputs, x_t, t, sequence[:, :-1])
        flow = fm.masked_loss(velocity, target, batch["action_is_pad"], self.action_dim)
        fast = action_token_loss(logits, action_targets(sequence, logits.shape[1]))
        self.parts = {"flow_loss": flow.detach(), "fast_loss": fast.detach()}
        return flow + self.fast_weight * fast

    def step_metrics(self) -> dict[str, Any]:
        """The last step's ``flow_loss`` and ``fast_loss``."""
        return self.parts

    def state_dict(self) -> dict[str, Any]:
        """The policy task's state and the FAST tokenizer's files with ``max_tokens``."""
        return {**super().state_dict(), "action_tokenizer": self.targets.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.targets.load_state_dict(state.get("action_tokenizer"))
